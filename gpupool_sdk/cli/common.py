"""Options and output helpers shared by every ``gpupool`` command.

Exit codes scripts can rely on: 0 success, 1 operation failed (e.g. a fenced write lost),
2 bad usage or input, 3 etcd unreachable (one-shot commands; under ``-w`` it is retried), 4 not found.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpupool_sdk.errors import ConfigError, StoreUnavailableError
from gpupool_sdk.store.endpoints import ENDPOINTS_ENV, env_endpoints
from gpupool_sdk.store.security import (
    CACERT_ENV,
    CERT_ENV,
    KEY_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USER_ENV,
    EtcdSecurity,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_FOUND = 4

#: Longest wait between two reads of a watching command while etcd stays unreachable (the wait
#: starts at the watch interval and doubles; a longer watch interval is kept as it is).
WATCH_RETRY_MAX_S = 30.0

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Indirection so tests can interrupt the watch loop without patching the time module for everyone.
_sleep = time.sleep


def resolve_endpoints(endpoints: str | None) -> str:
    """``--endpoints`` if given, else ``$GPUPOOL_ENDPOINTS``, else ``$ETCDCTL_ENDPOINTS``, else ``127.0.0.1:2379``."""
    return endpoints or env_endpoints()


def endpoints_option(f: F) -> F:
    return click.option(
        "--endpoints",
        envvar=ENDPOINTS_ENV,
        default=None,
        show_envvar=True,
        help="etcd endpoints, comma separated host:port, or https://host:port for TLS (default 127.0.0.1:2379).",
    )(f)


def etcd_security_options(f: F) -> F:
    """Add ``--etcd-cacert``, ``--etcd-cert``, ``--etcd-key``, ``--etcd-user``, ``--etcd-password-file``.

    The command receives them as one ``security: EtcdSecurity`` keyword argument, resolved flag
    first, then ``GPUPOOL_ETCD_*``, then ``ETCDCTL_*`` (see :mod:`gpupool_sdk.store.security`).
    The password is never a flag value (``ps`` would show it): a file, or an environment variable.
    A bad setting (missing file, certificate without key...) is a usage error (exit 2).
    """

    @functools.wraps(f)
    def wrapper(
        *args: Any,
        etcd_cacert: str | None,
        etcd_cert: str | None,
        etcd_key: str | None,
        etcd_user: str | None,
        etcd_password_file: str | None,
        **kwargs: Any,
    ) -> Any:
        try:
            security = EtcdSecurity.resolve(
                cacert=etcd_cacert, cert=etcd_cert, key=etcd_key, user=etcd_user, password_file=etcd_password_file
            )
            security.load()  # check the files now: exit 2 naming the flag, before any connection
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        return f(*args, security=security, **kwargs)

    options = (
        click.option("--etcd-cacert", metavar="PATH", default=None,
                     help=f"CA bundle that signed etcd's certificate; turns TLS on (env {CACERT_ENV}, ETCDCTL_CACERT; "
                     "an https:// endpoint without it uses the system roots)."),
        click.option("--etcd-cert", metavar="PATH", default=None,
                     help=f"Client certificate for etcd's --client-cert-auth (env {CERT_ENV}, ETCDCTL_CERT)."),
        click.option("--etcd-key", metavar="PATH", default=None,
                     help=f"Private key of --etcd-cert (env {KEY_ENV}, ETCDCTL_KEY)."),
        click.option("--etcd-user", metavar="NAME", default=None,
                     help=f"etcd user when auth is enabled (env {USER_ENV}, ETCDCTL_USER as user:password); "
                     f"the password comes from --etcd-password-file or env {PASSWORD_ENV}."),
        click.option("--etcd-password-file", metavar="PATH", default=None,
                     help=f"File whose first line is the etcd user's password (env {PASSWORD_FILE_ENV})."),
    )  # fmt: skip
    out: Any = wrapper
    for option in reversed(options):
        out = option(out)
    return out  # type: ignore[no-any-return]


def prefix_option(f: F) -> F:
    return click.option(
        "--prefix",
        envvar="GPUPOOL_PREFIX",
        default=None,
        show_envvar=True,
        help="Key prefix of the pool in etcd (default /gpupool/v1).",
    )(f)


def output_option(f: F) -> F:
    return click.option(
        "-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True, help="Output format."
    )(f)


def _positive_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    # NaN and infinity pass a plain "> 0" test but make time.sleep raise; refuse them here, as usage errors.
    if value is not None and not 0 < value < math.inf:
        raise click.BadParameter(f"must be a finite number of seconds > 0, got {value}")
    return value


def watch_option(f: F) -> F:
    return click.option(
        "-w",
        "--watch",
        "watch_s",
        type=float,
        default=None,
        metavar="SECONDS",
        callback=_positive_seconds,
        help="Refresh every SECONDS until Ctrl-C (an unreachable etcd is shown and retried).",
    )(f)


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def unreachable(endpoints: str | None, exc: Exception) -> NoReturn:
    """Report an unreachable etcd (the message names the endpoints) and exit with code 3.

    ``sys.exit`` rather than ``ctx.exit``: the ``gpupool`` entry point runs click with
    ``standalone_mode=False``, where ``ctx.exit`` codes would be returned, not used.
    """
    click.echo(f"error: etcd unreachable: {_naming_endpoints(endpoints, exc)}", err=True)
    sys.exit(EXIT_UNREACHABLE)


def _naming_endpoints(endpoints: str | None, exc: BaseException) -> str:
    msg = str(exc)
    where = resolve_endpoints(endpoints)
    return msg if where in msg else f"{where}: {msg}"


def wait_for_etcd(who: str, endpoints: str | None, probe: Callable[[], T], window_s: float) -> T:
    """``probe()`` until it reaches etcd, for up to ``window_s`` seconds: a daemon's first contact.

    A daemon (``gpupool coordinator``, ``gpupool agent``) often starts beside etcd (a pod, a
    systemd unit, a loaded machine where a TLS handshake times out): one failed call is no reason
    to exit. Each failure is reported on stderr (naming the endpoint) and retried (tenacity), the
    wait doubling from 0.2 s up to 5 s; once ``window_s`` has passed the last failure propagates
    (the caller exits 3).

    Args:
        who: the command, for the messages.
        endpoints: the ``--endpoints`` option (named in the messages).
        probe: a cheap etcd call; raises ``StoreUnavailableError`` when etcd cannot be reached.
        window_s: how long to keep trying.

    Returns:
        What ``probe`` returned.

    Example:
        >>> wait_for_etcd("agent", None, lambda: 7, 1.0)
        7
    """
    start = time.monotonic()

    def report(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        pause = state.next_action.sleep if state.next_action is not None else 0.0
        left = max(0.0, window_s - (time.monotonic() - start))
        click.echo(
            f"{who}: etcd unreachable: {_naming_endpoints(endpoints, exc or Exception())}; retrying in {pause:.1f}s "
            f"(giving up in {left:.0f}s)",
            err=True,
        )

    retrying = Retrying(
        stop=stop_after_delay(max(0.0, window_s)),
        wait=wait_exponential(multiplier=0.2, max=5.0),
        retry=retry_if_exception_type(StoreUnavailableError),
        before_sleep=report,
        reraise=True,
    )
    return retrying(probe)


def watch_loop(
    endpoints: str | None,
    watch_s: float | None,
    read: Callable[[], T],
    show: Callable[[T, bool], None],
) -> None:
    """``read()`` and ``show(value, watching)`` once, or every ``watch_s`` seconds until Ctrl-C.

    Without ``watch_s`` (a one-shot command) an unreachable etcd exits with code 3. When
    watching, an unreachable etcd never ends the command: each failed read is reported on
    stderr and retried, the wait doubling from ``watch_s`` up to
    ``max(watch_s, WATCH_RETRY_MAX_S)``; the first good read goes back to ``watch_s``.

    Args:
        endpoints: the ``--endpoints`` option (named in the messages).
        watch_s: the ``-w/--watch`` option: seconds between reads, or None for one read.
        read: reads the pool; raises ``StoreUnavailableError`` when etcd cannot be reached.
        show: prints what ``read`` returned; ``watching`` is True under ``-w``.
    """
    try:
        if watch_s is None:
            try:
                value = read()
            except StoreUnavailableError as exc:
                unreachable(endpoints, exc)
            show(value, False)
            return
        wait = watch_s
        while True:
            try:
                value = read()
            except StoreUnavailableError as exc:
                click.echo(
                    f"error: etcd unreachable: {_naming_endpoints(endpoints, exc)}; "
                    f"retrying in {wait:g}s (Ctrl-C to stop)",
                    err=True,
                )
                _sleep(wait)
                wait = min(2 * wait, max(watch_s, WATCH_RETRY_MAX_S))
                continue
            show(value, True)
            wait = watch_s
            _sleep(watch_s)
    except KeyboardInterrupt:
        return
