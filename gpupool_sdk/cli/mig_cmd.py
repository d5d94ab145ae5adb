"""``gpupool mig``: the operator's MIG actions on this machine's GPUs, through NVML.

::

    gpupool mig list [-o json]                         # MIG mode, offered profiles, instances per GPU
    gpupool mig enable --gpu 0                         # MIG mode on (root; may need a GPU reset)
    gpupool mig create --gpu 0 --profile 3g.40gb [--count 2]
    gpupool mig destroy --gpu 0 [--profile 3g.40gb]    # every instance (of that profile)
    gpupool mig disable --gpu 0

The pool never creates or destroys MIG instances by itself. After a change, the node agent
publishes the GPU's instances (each a GPU of its own, ``MIG-...`` UUID) at its next refresh, and
jobs with ``mig_profile`` set can be placed on them. Destroy instances only once no job holds
them (``gpupool cordon MIG-...`` first, then wait for their jobs to leave).

Exit codes: 0 done, 1 NVML refused (message says why), 2 bad input or no NVIDIA GPU / NVML here.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from gpupool_sdk.cli.common import EXIT_FAILED, EXIT_USAGE, echo_json, output_option
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory import mig_admin


def load_nvml() -> Any:
    """The NVML module, initialised (tests replace this function with one returning a fake)."""
    nv = importlib.import_module("pynvml")
    nv.nvmlInit()
    return nv


@contextmanager
def _nvml() -> Iterator[Any]:
    try:
        nv = load_nvml()
    except Exception as exc:  # noqa: BLE001 - ImportError or any NVMLError: no usable NVML here
        click.echo(f"gpupool mig: NVML is not usable on this machine ({exc}); run it on the GPU node, as root", err=True)
        sys.exit(EXIT_USAGE)
    try:
        yield nv
    except ConfigError as exc:
        click.echo(f"gpupool mig: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except mig_admin.MigAdminError as exc:
        click.echo(f"gpupool mig: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    finally:
        with contextlib.suppress(Exception):  # shutting down a broken NVML is best effort
            nv.nvmlShutdown()


_gpu_option = click.option("--gpu", "gpu", type=int, required=True, help="GPU index on this machine (nvidia-smi -L).")


@click.group("mig")
def mig() -> None:
    """Create and destroy MIG instances on this machine's GPUs (operator action, needs root)."""


@mig.command("list")
@output_option
def list_cmd(output: str) -> None:
    """Show each GPU's MIG mode, the profiles it offers and its instances."""
    with _nvml() as nv:
        states = mig_admin.list_gpus(nv)
    if output == "json":
        echo_json({"gpus": [s.to_dict() for s in states]})
        return
    for s in states:
        mode = "n/a" if s.mig_current is None else ("on" if s.mig_current else "off")
        if s.mig_pending is not None and s.mig_pending != s.mig_current:
            mode += f" (pending {'on' if s.mig_pending else 'off'}: reset the GPU)"
        click.echo(f"GPU {s.index} {s.name} {s.uuid}  MIG {mode}")
        for profile, uuid in s.instances:
            click.echo(f"  {profile:<12} {uuid}")
        if s.profiles:
            click.echo(f"  profiles: {', '.join(s.profiles)}")


@mig.command("enable")
@_gpu_option
def enable_cmd(gpu: int) -> None:
    """Turn MIG mode on for one GPU."""
    with _nvml() as nv:
        now = mig_admin.set_mig_mode(nv, gpu, True)
    click.echo(f"GPU {gpu}: MIG mode " + ("on" if now else f"on after a GPU reset (nvidia-smi -r -i {gpu})"))


@mig.command("disable")
@_gpu_option
def disable_cmd(gpu: int) -> None:
    """Turn MIG mode off for one GPU (destroy its instances first)."""
    with _nvml() as nv:
        now = mig_admin.set_mig_mode(nv, gpu, False)
    click.echo(f"GPU {gpu}: MIG mode " + ("off" if now else f"off after a GPU reset (nvidia-smi -r -i {gpu})"))


@mig.command("create")
@_gpu_option
@click.option("--profile", required=True, help="GPU-instance profile, e.g. 3g.40gb (see `gpupool mig list`).")
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True, help="How many instances.")
def create_cmd(gpu: int, profile: str, count: int) -> None:
    """Create MIG instances (each with one compute instance covering it)."""
    with _nvml() as nv:
        made = mig_admin.create_instances(nv, gpu, profile, count)
    click.echo(f"GPU {gpu}: created {len(made)} x {made[0]}; the agent publishes them at its next refresh")


@mig.command("destroy")
@_gpu_option
@click.option("--profile", default=None, help="Only instances of this profile (default: all).")
def destroy_cmd(gpu: int, profile: str | None) -> None:
    """Destroy MIG instances of one GPU (no job may be using them)."""
    with _nvml() as nv:
        n = mig_admin.destroy_instances(nv, gpu, profile)
    click.echo(f"GPU {gpu}: destroyed {n} instance(s)")
