"""``gpupool top``: a live per-job and per-GPU view of the pool.

Jobs: state, step rate, phase breakdown (a proportion bar: D data, F forward, B backward,
O optimizer, C checkpoint, . other), memory peak against quota, GPU utilisation, GPU-hours and
cost. GPUs: memory and compute granted, measured use and the jobs on each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from gpupool_sdk.cli.common import (
    endpoints_option,
    etcd_security_options,
    prefix_option,
    resolve_endpoints,
    watch_loop,
    watch_option,
)
from gpupool_sdk.cli.output import (
    READING_COLUMNS,
    TableSpec,
    emit_document,
    is_terminal,
    no_headers_option,
    output_option,
    print_sections,
    reading_cells,
)
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import format_size
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.security import EtcdSecurity
from gpupool_sdk.telemetry.pricing import CATALOG_PRICES_ENV, PRICES_ENV, PriceTable
from gpupool_sdk.telemetry.report import phase_bar, top_report
from gpupool_sdk.telemetry.view import PoolView, load_view


def timeout_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--timeout",
        "timeout_s",
        type=click.FloatRange(min=0.1),
        default=5.0,
        show_default=True,
        help="Seconds to keep trying to reach etcd before giving up (exit code 3).",
    )(f)


def prices_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--prices",
        "prices_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="JSON price overrides (default $GPUPOOL_PRICES, then the prices the leading coordinator "
             "publishes from its policy file's [prices], then the GPU catalog's list prices).",
    )(f)


def load_prices(path: Path | None) -> PriceTable | None:
    """The price table given here (``--prices``, ``$GPUPOOL_PRICES``, ``$GPUPOOL_GPU_PRICES``), None if
    none is: the report then prices with the leader's published table (:meth:`PoolView.price_table`).

    A bad file is reported as a usage error naming the file.
    """
    if path is None and not os.environ.get(PRICES_ENV) and not os.environ.get(CATALOG_PRICES_ENV):
        return None
    try:
        return PriceTable.load(path)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--prices / $GPUPOOL_PRICES") from None


@contextmanager
def open_store(
    endpoints: str | None, prefix: str | None, timeout_s: float, security: EtcdSecurity | None = None
) -> Iterator[Any]:
    """An EtcdStore for a reporting command (closed on exit); bad settings are usage errors."""
    from gpupool_sdk.store.etcd_store import EtcdStore

    try:
        store = EtcdStore(
            resolve_endpoints(endpoints), keyspace=Keyspace.from_env(prefix), timeout_s=timeout_s, security=security
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        yield store
    finally:
        store.close()


def report_errors(errors: list[str] | tuple[str, ...]) -> None:
    """Print skipped malformed values on stderr (they never stop a report)."""
    if errors:
        click.echo(f"warning: skipped {len(errors)} malformed value(s):", err=True)
        for e in errors:
            click.echo(f"  {e}", err=True)


def report_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options of a reporting command (``top``, ``metrics report``): where the pool is, how to show it."""
    options = (
        endpoints_option, etcd_security_options, prefix_option, output_option, no_headers_option, watch_option,
        prices_option, timeout_option,
    )
    for option in reversed(options):
        f = option(f)
    return f


Sections = list[TableSpec | str]


def show_report(
    endpoints: str | None,
    prefix: str | None,
    timeout_s: float,
    watch_s: float | None,
    output: str,
    build: Callable[[PoolView], dict[str, Any]],
    sections: Callable[[dict[str, Any]], Sections],
    security: EtcdSecurity | None = None,
    no_headers: bool = False,
) -> None:
    """Read the pool, ``build`` the report document and print it (tables, JSON or YAML), once or under ``-w``.

    Tables go through :func:`~gpupool_sdk.cli.output.print_sections`, as ``gpupool status``'s do:
    rich tables on a terminal, plain aligned columns in a pipe or a file, ``-o wide`` adds the
    wide-only columns, ``--no-headers`` drops header rows and titles.

    Malformed values are reported on stderr; an unreachable etcd is handled by
    :func:`~gpupool_sdk.cli.common.watch_loop` (exit 3 once, retried while watching).
    """
    console = Console(highlight=False) if is_terminal() else None
    shown = [0]

    def show(view: PoolView, watching: bool) -> None:
        doc = build(view)
        if output in ("json", "yaml"):
            emit_document(doc, output, watching)  # under -w: one JSON object per line
        else:
            if watching and console is not None:
                console.clear()
            elif shown[0]:
                click.echo("")  # a blank line between two refreshes in a pipe
            shown[0] += 1
            print_sections(sections(doc), wide=output == "wide", no_headers=no_headers, console=console)
        report_errors(view.errors)

    with open_store(endpoints, prefix, timeout_s, security) as store:
        watch_loop(endpoints, watch_s, lambda: load_view(store), show)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _size(x: int | None) -> str:
    return "-" if x is None else format_size(x)


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def top_sections(doc: dict[str, Any]) -> Sections:
    """The ``top`` document as a line and two tables (jobs, GPUs).

    Wide-only columns (``-o wide``): the jobs' owner, priority, step and telemetry age; the GPUs'
    UUID, health reasons and the agent's device readings other than ``DEV UTIL`` (memory
    bandwidth, device memory used, PCIe and NVLink TX/RX, temperature, power).
    """
    leader = doc["leader"]
    head = f"leader: {leader['id']} (term {leader['term']})" if leader else "leader: none"
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["at"]))
    jobs = TableSpec(
        ["JOB", "STATE", "QOS", "OWNER", "PRIO", "SLICES", "STEP", "STEP/S", "PHASES D F B O C", "MEM PEAK/QUOTA",
         "UTIL", "TELEMETRY AGE", "GPU-H", "COST $", "$/H"],
        [], "jobs (phases: D data, F forward, B backward, O optimizer, C checkpoint, . other)",
        wide=frozenset({"OWNER", "PRIO", "STEP", "TELEMETRY AGE"}),
    )
    for r in doc["jobs"]:
        bar = f"[{phase_bar(r['phase_fraction'])}] {r['dominant_phase'] or ''}" if r["phase_fraction"] else "-"
        jobs.rows.append([
            r["job"],
            r["state"],
            r["qos"] or "-",
            r["owner"] or "-",
            "-" if r["priority"] is None else str(r["priority"]),
            str(r["slices"]),
            "-" if r["step"] is None else str(r["step"]),
            _num(r["steps_per_s"]),
            bar.rstrip(),
            f"{_size(r['memory_peak_bytes'])}/{_size(r['memory_quota_bytes'])}",
            _pct(r["gpu_util"]),
            _num(r["telemetry_age_s"], "{:.0f}s"),
            _num(r["gpu_seconds"] / 3600.0),
            _num(r["cost_usd"]),
            _num(r["cost_usd_per_hour"]),
        ])
    gpus = TableSpec(
        ["GPU", "UUID", "MODEL", "HEALTH", "MEM ALLOC/TOTAL", "MEM USED", "COMPUTE", "UTIL", *READING_COLUMNS, "JOBS",
         "HEALTH REASONS"],
        [], "gpus (MEM USED, UTIL: the jobs' own figures; DEV ...: the agent's reading of the whole device)",
        wide=frozenset({"UUID", "HEALTH REASONS", *READING_COLUMNS[1:]}),
    )
    for g in doc["gpus"]:
        health = "ok" if g["healthy"] else "UNHEALTHY"
        if g["cordoned"]:
            health += ",cordoned"
        gpus.rows.append([
            f"{g['node']}/{g['index']}",
            g["gpu"],
            g["model"],
            health,
            f"{_size(g['memory_allocated_bytes'])}/{_size(g['memory_bytes'])}",
            _size(g["memory_used_bytes"]),
            _pct(g["compute_allocated"]),
            _pct(g["util"]),
            *reading_cells(g["readings"]),
            ",".join(g["jobs"]) or "-",
            "; ".join(g["health_reasons"]) or "-",
        ])
    return [
        f"{head}   revision {doc['revision']}   {at}",
        jobs if doc["jobs"] else "no jobs",
        gpus if doc["gpus"] else "no GPUs: start `gpupool agent` on each GPU machine",
    ]


@click.command("top")
@report_options
def top(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    output: str,
    no_headers: bool,
    watch_s: float | None,
    prices_path: Path | None,
    timeout_s: float,
) -> None:
    """Live per-job and per-GPU utilisation, memory, cost.

    On a terminal the tables have borders; piped or redirected they are plain aligned columns.

    \b
    Examples:
        gpupool top                 # one table of jobs, one of GPUs
        gpupool top -w 2            # refresh every 2 s until Ctrl-C (an unreachable etcd is retried)
        gpupool top -o wide         # more columns (owner, priority, step, telemetry age, GPU UUID...)
        gpupool top --no-headers    # rows only, for grep and awk
        gpupool top -o json         # the same as JSON (or -o yaml), for scripts
        gpupool top -w 5 -o json    # one JSON object per line every 5 s
    """
    prices = load_prices(prices_path)
    show_report(
        endpoints, prefix, timeout_s, watch_s, output, lambda view: top_report(view, view.price_table(prices)), top_sections,
        security=security, no_headers=no_headers,
    )
