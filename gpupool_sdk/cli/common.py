"""Options and output helpers shared by every ``gpupool`` command.

Exit codes scripts can rely on: 0 success, 1 operation failed (e.g. a fenced write lost),
2 bad usage or input, 3 etcd unreachable, 4 not found.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

ENDPOINTS_ENV = "GPUPOOL_ENDPOINTS"
DEFAULT_ENDPOINTS = "127.0.0.1:2379"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_FOUND = 4

F = TypeVar("F", bound=Callable[..., Any])


def resolve_endpoints(endpoints: str | None) -> str:
    """``--endpoints`` if given, else ``$GPUPOOL_ENDPOINTS``, else ``127.0.0.1:2379``."""
    return endpoints or os.environ.get(ENDPOINTS_ENV) or DEFAULT_ENDPOINTS


def endpoints_option(f: F) -> F:
    return click.option(
        "--endpoints",
        envvar=ENDPOINTS_ENV,
        default=None,
        show_envvar=True,
        help="etcd endpoints, comma separated host:port (default 127.0.0.1:2379).",
    )(f)


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
        help="Refresh every SECONDS until Ctrl-C.",
    )(f)


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
