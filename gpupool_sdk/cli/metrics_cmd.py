"""``gpupool metrics``: the Prometheus exporter and the cost and right-sizing report.

* ``gpupool metrics serve --port 9400``: a standalone exporter reading etcd on each scrape.
* ``gpupool metrics report [-o table|wide|json|yaml] [--no-headers]``: cost by job and owner, plus advice.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import click

from gpupool_sdk.cli.common import endpoints_option, etcd_security_options, prefix_option, unreachable
from gpupool_sdk.cli.output import TableSpec
from gpupool_sdk.cli.top_cmd import (
    Sections,
    load_prices,
    open_store,
    prices_option,
    report_options,
    show_report,
    timeout_option,
)
from gpupool_sdk.errors import ConfigError, StoreUnavailableError
from gpupool_sdk.store.security import EtcdSecurity
from gpupool_sdk.telemetry.pricing import catalog_offers
from gpupool_sdk.telemetry.prometheus import serve_metrics
from gpupool_sdk.telemetry.report import cost_report


@click.group("metrics")
def metrics() -> None:
    """Prometheus exporter and cost / right-sizing report."""


@metrics.command("serve")
@endpoints_option
@etcd_security_options
@prefix_option
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True, help="HTTP port (0: any free).")
@click.option("--addr", default="0.0.0.0", show_default=True, envvar="GPUPOOL_METRICS_ADDR", show_envvar=True,
              help="Address to listen on (127.0.0.1: this machine only).")
@click.option(
    "--finished-ttl",
    "finished_ttl_s",
    type=click.FloatRange(min=0.0),
    default=900.0,
    show_default=True,
    help="Seconds a finished job's usage counters stay exported after it was last charged.",
)
@click.option(
    "--min-interval",
    "min_interval_s",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="Minimum seconds between two etcd reads (scrapes in between reuse the last read).",
)
@prices_option
@timeout_option
def serve(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    port: int,
    addr: str,
    finished_ttl_s: float,
    min_interval_s: float,
    prices_path: Path | None,
    timeout_s: float,
) -> None:
    """Serve pool metrics at http://ADDR:PORT/metrics until Ctrl-C or SIGTERM.

    \b
    Example:
        gpupool metrics serve --port 9400
        curl -s localhost:9400/metrics | grep gpupool_job_cost_usd_total
    """
    prices = load_prices(prices_path)
    with open_store(endpoints, prefix, timeout_s, security) as store:
        try:
            store.revision()  # fail fast (exit 3) when etcd is not there at start
        except StoreUnavailableError as exc:
            unreachable(endpoints, exc)
        try:
            server = serve_metrics(
                store, port, addr=addr, prices=prices, min_interval_s=min_interval_s, finished_ttl_s=finished_ttl_s
            )
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--port") from None
        stop = threading.Event()

        def _on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            click.echo(f"serving gpupool metrics on http://{addr}:{server.port}/metrics (etcd {store.endpoint})")
            stop.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            server.close()


def report_sections(doc: dict[str, Any]) -> Sections:
    """The cost report as tables and lines: cost by job, cost by owner, the totals, advice.

    Wide-only column (``-o wide``): the job's GPU-hours by model.
    """
    jobs = TableSpec(["JOB", "OWNER", "QOS", "GPU-H", "GPU-H BY MODEL", "MEM GiB-H", "COST $", "$/H NOW", "LIVE"], [],
                     "cost by job", wide=frozenset({"GPU-H BY MODEL"}))
    for j in doc["jobs"]:
        by_model = ",".join(f"{m}={s / 3600.0:.2f}" for m, s in sorted(j["gpu_seconds_by_model"].items()))
        jobs.rows.append([
            j["job"],
            j["owner"] or "-",
            j["qos"],
            f"{j['gpu_hours']:.2f}",
            by_model or "-",
            f"{j['memory_gib_hours']:.1f}",
            f"{j['cost_usd']:.2f}",
            f"{j['cost_usd_per_hour']:.2f}",
            "yes" if j["live"] else "no",
        ])
    owners = TableSpec(["OWNER", "JOBS", "GPU-H", "COST $"], [], "cost by owner")
    for o in doc["owners"]:
        owners.rows.append([o["owner"] or "-", str(o["jobs"]), f"{o['gpu_hours']:.2f}", f"{o['cost_usd']:.2f}"])
    advice = TableSpec(["JOB", "KIND", "SAVING $/H", "ADVICE"], [], "advice")
    for a in doc["advice"]:
        advice.rows.append([a["job"], a["kind"], f"{a['saving_usd_per_hour']:.2f}", a["message"]])
    return [
        jobs if doc["jobs"] else "cost by job: no usage recorded",
        owners if doc["owners"] else "cost by owner: none",
        f"total ${doc['total_cost_usd']:.2f}; current rate ${doc['cost_usd_per_hour']:.2f}/h; "
        f"advice could save about ${doc['saving_usd_per_hour']:.2f}/h",
        advice if doc["advice"] else "advice: none",
    ]


@metrics.command("report")
@report_options
def report(
    endpoints: str | None,
    security: EtcdSecurity,
    prefix: str | None,
    output: str,
    no_headers: bool,
    watch_s: float | None,
    prices_path: Path | None,
    timeout_s: float,
) -> None:
    """Cost by job and owner, and right-sizing advice.

    On a terminal the tables have borders; piped or redirected they are plain aligned columns.

    \b
    Examples:
        gpupool metrics report
        gpupool metrics report -o json | jq '.advice[] | select(.saving_usd_per_hour > 1)'
    """
    prices = load_prices(prices_path)
    offers = catalog_offers()
    show_report(
        endpoints,
        prefix,
        timeout_s,
        watch_s,
        output,
        lambda view: cost_report(view, view.price_table(prices), offers),
        report_sections,
        security=security,
        no_headers=no_headers,
    )
