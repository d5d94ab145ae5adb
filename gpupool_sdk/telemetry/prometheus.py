"""Prometheus metrics: a pool-wide exporter read from etcd, and a small job-side exporter.

:class:`PoolMetricsCollector` builds every metric from a fresh :class:`~gpupool_sdk.telemetry.view.PoolView`
on each scrape (no state of its own, so any number of exporters may run, and a coordinator
failover changes nothing). :func:`serve_metrics` runs it behind an HTTP endpoint on a thread.

:class:`JobMetrics` is what a training process exposes when the user passes a metrics port to
the Lightning callback: the latest :class:`~gpupool_sdk.telemetry.summary.TelemetrySummary` of
that one job, without any etcd access.

Metric names follow ``gpupool_<thing>_<unit>``; the full list is in ``docs/telemetry.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import QoS
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.report import gpu_rows
from gpupool_sdk.telemetry.summary import PHASES, TelemetrySummary
from gpupool_sdk.telemetry.usage import hourly_cost, slice_share
from gpupool_sdk.telemetry.view import PoolView, load_view

log = logging.getLogger(__name__)


def _job_metrics(summaries: list[TelemetrySummary]) -> Iterator[Metric]:
    """Per-job telemetry gauges, shared by the pool exporter and the job-side exporter."""
    phase_s = GaugeMetricFamily(
        "gpupool_job_phase_seconds", "Per-step average seconds spent in each training phase.", labels=["job", "phase"]
    )
    phase_r = GaugeMetricFamily(
        "gpupool_job_phase_ratio", "Share of step time spent in each training phase (0-1).", labels=["job", "phase"]
    )
    rate = GaugeMetricFamily("gpupool_job_steps_per_second", "Training steps per second.", labels=["job"])
    step = GaugeMetricFamily("gpupool_job_step", "Global training step at the last publication.", labels=["job"])
    peak = GaugeMetricFamily(
        "gpupool_job_memory_peak_bytes", "Recent per-slice device memory peak of the job.", labels=["job"]
    )
    peak_phase = GaugeMetricFamily(
        "gpupool_job_phase_memory_peak_bytes", "Per-slice memory peak reached in each phase.", labels=["job", "phase"]
    )
    util = GaugeMetricFamily(
        "gpupool_job_gpu_utilization_ratio", "Mean GPU (SM) utilisation of the job's slices (0-1).", labels=["job"]
    )
    s_util = GaugeMetricFamily(
        "gpupool_slice_utilization_ratio", "GPU (SM) utilisation of one slice of a job (0-1).", labels=["job", "gpu"]
    )
    s_mem = GaugeMetricFamily(
        "gpupool_slice_memory_used_bytes", "Device memory a job uses on one slice.", labels=["job", "gpu"]
    )
    age = GaugeMetricFamily(
        "gpupool_job_telemetry_timestamp_seconds", "Wall-clock time the job last published telemetry.", labels=["job"]
    )
    for t in summaries:
        for p in PHASES:
            phase_s.add_metric([t.job, p], t.phase_seconds.get(p, 0.0))
            phase_r.add_metric([t.job, p], t.phase_fraction.get(p, 0.0))
        for p, v in sorted(t.memory_peak_by_phase.items()):
            peak_phase.add_metric([t.job, p], v)
        rate.add_metric([t.job], t.steps_per_s)
        step.add_metric([t.job], t.step)
        if t.memory_peak_bytes is not None:
            peak.add_metric([t.job], t.memory_peak_bytes)
        if t.gpu_util is not None:
            util.add_metric([t.job], t.gpu_util)
        for s in t.slices:
            if s.util is not None:
                s_util.add_metric([t.job, s.gpu_uuid], s.util)
            if s.memory_used_bytes is not None:
                s_mem.add_metric([t.job, s.gpu_uuid], s.memory_used_bytes)
        age.add_metric([t.job], t.published_at)
    yield from (phase_s, phase_r, rate, step, peak, peak_phase, util, s_util, s_mem, age)


def pool_metrics(view: PoolView, prices: PriceTable) -> Iterator[Metric]:
    """Every pool metric for one view (pure: the view in, metric families out)."""
    gpus = GaugeMetricFamily("gpupool_gpus", "GPUs published by node agents.", labels=["node", "model", "health"])
    counts = Counter(
        (g.node, g.model, "healthy" if g.healthy else "unhealthy") for g in view.gpus.values()
    )
    for labels, n in sorted(counts.items()):
        gpus.add_metric(list(labels), n)
    yield gpus

    cordoned = GaugeMetricFamily("gpupool_gpu_cordoned", "1 when an operator cordoned the GPU.", labels=["node", "gpu"])
    mem = GaugeMetricFamily("gpupool_gpu_memory_bytes", "Physical device memory of the GPU.", labels=["node", "gpu"])
    mem_alloc = GaugeMetricFamily(
        "gpupool_gpu_memory_allocated_bytes", "Memory granted to slices on the GPU.", labels=["node", "gpu"]
    )
    comp_alloc = GaugeMetricFamily(
        "gpupool_gpu_compute_allocated_ratio", "Compute share granted to slices on the GPU (0-1).", labels=["node", "gpu"]
    )
    slices = GaugeMetricFamily("gpupool_gpu_slices", "Slices granted on the GPU.", labels=["node", "gpu"])
    by_gpu: dict[str, list[Any]] = {}
    for a in view.allocations:
        acc = by_gpu.setdefault(a.gpu_uuid, [0, 0.0, 0])
        acc[0] += a.memory_bytes
        acc[1] += 1.0 if a.mode is QoS.EXCLUSIVE else a.compute_share
        acc[2] += 1
    for uuid, g in sorted(view.gpus.items()):
        m, c, n = by_gpu.get(uuid, [0, 0.0, 0])
        mem.add_metric([g.node, uuid], g.memory_bytes)
        mem_alloc.add_metric([g.node, uuid], m)
        comp_alloc.add_metric([g.node, uuid], min(1.0, c))
        slices.add_metric([g.node, uuid], n)
        cordoned.add_metric([g.node, uuid], 1.0 if uuid in view.cordoned else 0.0)
    yield from (mem, mem_alloc, comp_alloc, slices, cordoned)

    g_util = GaugeMetricFamily(
        "gpupool_gpu_utilization_ratio",
        "Highest SM utilisation the GPU's jobs report on it (0-1; device-wide when NVML has no per-process samples).",
        labels=["node", "gpu"],
    )
    g_used = GaugeMetricFamily(
        "gpupool_gpu_memory_used_bytes", "Device memory the GPU's jobs report using on it.", labels=["node", "gpu"]
    )
    for row in gpu_rows(view):
        if row["util"] is not None:
            g_util.add_metric([row["node"], row["gpu"]], row["util"])
        if row["memory_used_bytes"] is not None:
            g_used.add_metric([row["node"], row["gpu"]], row["memory_used_bytes"])
    yield from (g_util, g_used)

    jobs = GaugeMetricFamily("gpupool_jobs", "Live jobs by state and QoS class.", labels=["state", "qos"])
    job_counts = Counter(
        (view.statuses[j].state.value if j in view.statuses else "UNKNOWN", spec.qos_class.value)
        for j, spec in view.specs.items()
    )
    for job_labels, n in sorted(job_counts.items()):
        jobs.add_metric(list(job_labels), n)
    yield jobs

    yield from _job_metrics([view.telemetry[j] for j in sorted(view.telemetry)])

    job_slices = GaugeMetricFamily("gpupool_job_slices", "Slices a job holds now.", labels=["job"])
    share = GaugeMetricFamily(
        "gpupool_job_gpu_share_ratio", "GPUs' worth a job is charged for now (sum of slice shares).", labels=["job"]
    )
    rate = GaugeMetricFamily(
        "gpupool_job_cost_usd_per_hour", "What a job's current slices cost per hour.", labels=["job", "owner"]
    )
    jobs_with_slices = sorted({a.job for a in view.allocations})
    for j in jobs_with_slices:
        allocs = view.allocations_of(j)
        owner = _owner(view, j)
        job_slices.add_metric([j], len(allocs))
        share.add_metric([j], sum(slice_share(a, view.gpus.get(a.gpu_uuid)) for a in allocs))
        rate.add_metric([j, owner], hourly_cost(allocs, view.gpus, prices))
    yield from (job_slices, share, rate)

    gpu_s = CounterMetricFamily(
        "gpupool_job_gpu_seconds", "GPU-seconds consumed (slice-seconds weighted by compute share).", labels=["job", "qos"]
    )
    cost = CounterMetricFamily("gpupool_job_cost_usd", "Accumulated cost of a job in USD.", labels=["job", "owner"])
    mem_s = CounterMetricFamily(
        "gpupool_job_memory_gib_seconds", "Granted memory (GiB) integrated over time.", labels=["job"]
    )
    for j, u in sorted(view.usage.items()):
        gpu_s.add_metric([j, u.qos.value], u.gpu_seconds)
        cost.add_metric([j, u.owner], u.cost_usd)
        mem_s.add_metric([j], u.memory_gib_seconds)
    yield from (gpu_s, cost, mem_s)

    term = GaugeMetricFamily("gpupool_leader_term", "Term of the current coordinator leader (0: no leader).")
    term.add_metric([], view.leader.term if view.leader else 0)
    yield term
    bad = GaugeMetricFamily(
        "gpupool_malformed_values", "Values under the pool prefix that do not parse (see gpupool top)."
    )
    bad.add_metric([], len(view.errors))
    yield bad


def _owner(view: PoolView, job: str) -> str:
    spec = view.specs.get(job)
    if spec is not None:
        return spec.owner
    u = view.usage.get(job)
    return u.owner if u is not None else ""


class PoolMetricsCollector(Collector):
    """A Prometheus collector that reads the pool on every scrape.

    Args:
        source: returns a fresh :class:`PoolView` (e.g. ``lambda: load_view(store)``).
        prices: the price table for the current cost rate.
        min_interval_s: scrapes closer together than this reuse the previous view, so an
            aggressive scraper cannot hammer etcd.

    When ``source`` fails (etcd unreachable), the scrape still answers, with ``gpupool_store_up 0``.

    Example:
        >>> from prometheus_client import CollectorRegistry, generate_latest
        >>> reg = CollectorRegistry()
        >>> reg.register(PoolMetricsCollector(lambda: PoolView(now=0.0)))
        >>> b"gpupool_leader_term 0.0" in generate_latest(reg)
        True
    """

    def __init__(
        self,
        source: Callable[[], PoolView],
        prices: PriceTable | None = None,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_interval_s < 0:
            raise ConfigError("min_interval_s", f"must be >= 0 seconds, got {min_interval_s}")
        self._source = source
        self._prices = prices if prices is not None else PriceTable()
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._cached: tuple[float, PoolView] | None = None
        self._lock = threading.Lock()

    def _view(self) -> PoolView:
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < self._min_interval_s:
                return self._cached[1]
            view = self._source()
            self._cached = (now, view)
            return view

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gpupool_store_up", "1 when the exporter could read etcd on this scrape.")
        try:
            view = self._view()
        except GpupoolError as exc:
            log.warning("metrics scrape could not read the pool: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from pool_metrics(view, self._prices)


@dataclass
class MetricsServer:
    """A running HTTP exporter; :meth:`close` stops it."""

    server: Any
    thread: threading.Thread
    registry: CollectorRegistry

    @property
    def port(self) -> int:
        """The port it listens on (useful when started with port 0)."""
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def _serve(registry: CollectorRegistry, port: int, addr: str) -> MetricsServer:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("port", f"must be a TCP port 0-65535 (0 picks a free one), got {port!r}")
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError("port", f"cannot listen on {addr}:{port} ({exc.strerror}); pick another --port") from None
    return MetricsServer(server, thread, registry)


def serve_metrics(
    store: Any,
    port: int,
    addr: str = "0.0.0.0",
    prices: PriceTable | None = None,
    min_interval_s: float = 1.0,
    extra_collectors: Iterable[Collector] = (),
) -> MetricsServer:
    """Serve the pool metrics read from ``store`` at ``http://addr:port/metrics`` on a daemon thread.

    Args:
        store: an :class:`~gpupool_sdk.store.EtcdStore` (read with one range request per scrape).
        port: TCP port (0 picks a free one; see :attr:`MetricsServer.port`).
        addr: address to bind.
        prices: price table (default: ``PriceTable.load()``, i.e. ``$GPUPOOL_PRICES`` and the catalog).
        min_interval_s: minimum seconds between two etcd reads.
        extra_collectors: more collectors to serve on the same endpoint (e.g. the coordinator's
            own cycle counters).

    Raises:
        ConfigError: the port is invalid or taken.

    Example:
        >>> srv = serve_metrics(store, port=9400)        # doctest: +SKIP
        >>> srv.close()                                  # doctest: +SKIP
    """
    registry = CollectorRegistry()
    registry.register(
        PoolMetricsCollector(
            lambda: load_view(store), prices if prices is not None else PriceTable.load(), min_interval_s
        )
    )
    for c in extra_collectors:
        registry.register(c)
    return _serve(registry, port, addr)


class JobMetrics(Collector):
    """Job-side exporter: the latest telemetry summary of one training process.

    The training loop's telemetry thread calls :meth:`update`; scrapes read the last summary.
    Nothing here touches etcd or runs on the training thread's hot path.

    Example:
        >>> m = JobMetrics()
        >>> m.update(TelemetrySummary.build("bert", step=1, steps_per_s=2.0, window_s=10,
        ...                                 phase_seconds={"forward": 0.2}, published_at=0.0))
        >>> srv = m.serve(port=0)
        >>> srv.close()
    """

    def __init__(self) -> None:
        self._latest: TelemetrySummary | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def update(self, summary: TelemetrySummary) -> None:
        """Replace the exposed summary (thread-safe: one reference swap)."""
        self._latest = summary

    def collect(self) -> Iterator[Metric]:
        latest = self._latest
        yield from _job_metrics([latest] if latest is not None else [])

    def serve(self, port: int, addr: str = "0.0.0.0") -> MetricsServer:
        """Expose ``/metrics`` on ``addr:port`` on a daemon thread."""
        return _serve(self.registry, port, addr)
