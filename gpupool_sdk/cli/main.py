"""The ``gpupool`` command line: one group, one module per family of commands."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from gpupool_sdk.cli.common import EXIT_UNREACHABLE, EXIT_USAGE
from gpupool_sdk.errors import ConfigError, GpupoolError, StoreUnavailableError

# (module, attribute) of every command; each module owns its command family.
_COMMANDS: tuple[tuple[str, str], ...] = (
    ("gpupool_sdk.cli.etcd_cmd", "etcd"),
    ("gpupool_sdk.cli.agent_cmd", "agent"),
    ("gpupool_sdk.cli.coordinator_cmd", "coordinator"),
    ("gpupool_sdk.cli.status_cmd", "status"),
    ("gpupool_sdk.cli.place_cmd", "place"),
    ("gpupool_sdk.cli.ops_cmd", "cordon"),
    ("gpupool_sdk.cli.ops_cmd", "uncordon"),
    ("gpupool_sdk.cli.ops_cmd", "drain"),
    ("gpupool_sdk.cli.ops_cmd", "undrain"),
    ("gpupool_sdk.cli.top_cmd", "top"),
    ("gpupool_sdk.cli.run_cmd", "run"),
    ("gpupool_sdk.cli.simulate_cmd", "simulate"),
    ("gpupool_sdk.cli.metrics_cmd", "metrics"),
    ("gpupool_sdk.cli.job_cmd", "job"),
    ("gpupool_sdk.cli.mig_cmd", "mig"),
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpupool-sdk")
def cli() -> None:
    """gpupool: an elastic GPU pool for deep-learning training, coordinated through etcd."""


for _module, _attr in _COMMANDS:
    try:
        _mod = importlib.import_module(_module)
    except ModuleNotFoundError as _exc:
        # Only a command module that does not exist is skipped; a broken import inside one is a bug.
        if _exc.name != _module:
            raise
        continue
    cli.add_command(getattr(_mod, _attr))


#: Entry-point group through which other distributions add commands (``gpupool-lightning`` adds
#: ``demo``), so that the core stays free of torch and Lightning.
PLUGIN_GROUP = "gpupool.commands"

#: Commands that live in another distribution, and the install line that brings them.
_PLUGIN_HINTS = {"demo": "pip install gpupool-lightning  (from this repository: pip install -e integrations/lightning)"}


class _PluginCommand(click.Command):
    """A command of another distribution, imported only when it runs.

    Loading ``gpupool demo`` imports Lightning and torch (seconds); every other command, ``--help``
    included, must not pay for that.
    """

    def __init__(self, ep: Any) -> None:
        dist = getattr(getattr(ep, "dist", None), "name", None) or ep.value.split(".", 1)[0]
        super().__init__(ep.name, help=f"(from {dist}; `gpupool {ep.name} --help` for details)",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                         add_help_option=False)
        self._ep = ep
        self._real: click.Command | None = None

    def real(self) -> click.Command:
        if self._real is None:
            self._real = self._ep.load()
        return self._real

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        return self.real().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        return ctx.command.invoke(ctx)


def _load_plugins() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name in cli.commands:
            continue
        cli.add_command(_PluginCommand(ep), ep.name)
    for name, install in _PLUGIN_HINTS.items():
        if name not in cli.commands:
            cli.add_command(_missing_plugin(name, install))


def _missing_plugin(name: str, install: str) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   add_help_option=False)
    def missing() -> None:
        raise click.UsageError(f"`gpupool {name}` comes with another package that is not installed: {install}")

    missing.help = f"(not installed: {install})"
    return missing


_load_plugins()


def main() -> None:
    """Entry point of the ``gpupool`` console script; maps typed errors to exit codes."""
    try:
        # standalone_mode=False returns ctx.exit(n)'s code instead of exiting: pass it on.
        rc = cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except StoreUnavailableError as exc:
        click.echo(f"error: etcd unreachable: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except GpupoolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
