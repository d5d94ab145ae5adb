"""Prometheus metrics: a pool-wide exporter read from etcd, and a small job-side exporter.

:class:`PoolMetricsCollector` builds every metric from a fresh :class:`~gpupool_sdk.telemetry.view.PoolView`
on each scrape (no state of its own, so any number of exporters may run, and a coordinator
failover changes nothing). :func:`serve_metrics` runs it behind an HTTP endpoint on a thread.

:class:`JobMetrics` is what a training process exposes when the user passes a metrics port to
the Lightning callback: the latest :class:`~gpupool_sdk.telemetry.summary.TelemetrySummary` of
that one job, without any etcd access.

Metric names follow ``gpupool_<thing>_<unit>`` in base units (seconds, bytes, ratios 0-1);
GPU series carry dcgm-exporter's labels (``UUID``, ``gpu`` = index, ``Hostname``, ``modelName``)
so they join DCGM's with ``on(UUID)``; a training job is labelled ``job_name`` (Prometheus owns
``job``). The full list is in ``docs/metrics.md``.
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
from gpupool_sdk.resources import GiB, QoS
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.report import gpu_rows
from gpupool_sdk.telemetry.summary import PHASES, TelemetrySummary
from gpupool_sdk.telemetry.usage import hourly_cost, slice_share
from gpupool_sdk.telemetry.view import PoolView, load_view

log = logging.getLogger(__name__)


#: Label names of a GPU, the same as dcgm-exporter's, so ``on(UUID)`` joins without ``label_replace``:
#: ``UUID`` (NVML UUID), ``gpu`` (the device index on its node), ``Hostname`` (the agent's host
#: name, the node name when unknown), ``modelName``; plus ``node``, the pool's node name.
GPU_LABELS: tuple[str, ...] = ("node", "Hostname", "UUID", "gpu", "modelName")

#: Series of a finished job (its ``usage/{job}`` record outlives it) are exported this long after
#: the job was last charged, then dropped, so that finished jobs do not accumulate series forever.
DEFAULT_FINISHED_TTL_S = 900.0

#: Training job names are exported as ``job_name``: Prometheus itself sets ``job`` (the scrape job).
JOB_LABEL = "job_name"


def _job_metrics(summaries: list[TelemetrySummary]) -> Iterator[Metric]:
    """Per-job telemetry gauges, shared by the pool exporter and the job-side exporter."""
    jl = JOB_LABEL
    phase_s = GaugeMetricFamily(
        "gpupool_job_phase_seconds", "Per-step average seconds spent in each training phase.", labels=[jl, "phase"]
    )
    phase_r = GaugeMetricFamily(
        "gpupool_job_phase_ratio", "Share of step time spent in each training phase (0-1).", labels=[jl, "phase"]
    )
    rate = GaugeMetricFamily("gpupool_job_steps_per_second", "Training steps per second.", labels=[jl])
    step = GaugeMetricFamily("gpupool_job_step", "Global training step at the last publication.", labels=[jl])
    peak = GaugeMetricFamily(
        "gpupool_job_memory_peak_bytes", "Recent per-slice device memory peak of the job.", labels=[jl]
    )
    peak_phase = GaugeMetricFamily(
        "gpupool_job_phase_memory_peak_bytes", "Per-slice memory peak reached in each phase.", labels=[jl, "phase"]
    )
    util = GaugeMetricFamily(
        "gpupool_job_gpu_utilization_ratio", "Mean GPU (SM) utilisation of the job's slices (0-1).", labels=[jl]
    )
    s_util = GaugeMetricFamily(
        "gpupool_slice_utilization_ratio", "GPU (SM) utilisation of one slice of a job (0-1).", labels=[jl, "UUID"]
    )
    s_mem = GaugeMetricFamily(
        "gpupool_slice_memory_used_bytes", "Device memory a job uses on one slice.", labels=[jl, "UUID"]
    )
    age = GaugeMetricFamily(
        "gpupool_job_telemetry_timestamp_seconds", "Wall-clock time the job last published telemetry.", labels=[jl]
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


def gpu_label_values(gpu: Any, hostname: str | None) -> list[str]:
    """Values of :data:`GPU_LABELS` for one GPU (``hostname`` None or empty: the node name)."""
    return [gpu.node, hostname or gpu.node, gpu.uuid, str(gpu.index), gpu.model]


def _live_jobs(view: PoolView) -> set[str]:
    return set(view.specs) | set(view.statuses) | {a.job for a in view.allocations} | set(view.telemetry)


def pool_metrics(
    view: PoolView, prices: PriceTable, finished_ttl_s: float = DEFAULT_FINISHED_TTL_S
) -> Iterator[Metric]:
    """Every pool metric for one view (pure: the view in, metric families out).

    Args:
        view: the pool at one revision.
        prices: for the current cost rate.
        finished_ttl_s: a finished job's usage counters are exported this long after it was last
            charged (``usage/{job}.last_seen``), then left out.
    """
    jl = JOB_LABEL
    hostnames = {name: n.hostname for name, n in view.nodes.items()}
    gpus = GaugeMetricFamily("gpupool_gpus", "GPUs published by node agents.", labels=["node", "model", "health"])
    counts = Counter(
        (g.node, g.model, "healthy" if g.healthy else "unhealthy") for g in view.gpus.values()
    )
    for labels, n in sorted(counts.items()):
        gpus.add_metric(list(labels), n)
    yield gpus

    node_info = GaugeMetricFamily(
        "gpupool_node_info", "1 for every node whose agent is publishing (its key lives on the agent's lease).",
        labels=["node", "Hostname", "backend"],
    )
    for name, rec in sorted(view.nodes.items()):
        node_info.add_metric([name, rec.hostname or name, rec.backend], 1)
    yield node_info

    gl = list(GPU_LABELS)
    cordoned = GaugeMetricFamily("gpupool_gpu_cordoned", "1 when an operator cordoned the GPU.", labels=gl)
    healthy = GaugeMetricFamily("gpupool_gpu_healthy", "1 when the agent judges the GPU healthy, else 0.", labels=gl)
    mem = GaugeMetricFamily("gpupool_gpu_memory_bytes", "Physical device memory of the GPU.", labels=gl)
    mem_alloc = GaugeMetricFamily(
        "gpupool_gpu_memory_allocated_bytes", "Memory granted to slices on the GPU.", labels=gl
    )
    comp_alloc = GaugeMetricFamily(
        "gpupool_gpu_compute_allocated_ratio", "Compute share granted to slices on the GPU (0-1).", labels=gl
    )
    slices = GaugeMetricFamily("gpupool_gpu_slices", "Slices granted on the GPU.", labels=gl)
    by_gpu: dict[str, list[Any]] = {}
    for a in view.allocations:
        acc = by_gpu.setdefault(a.gpu_uuid, [0, 0.0, 0])
        acc[0] += a.memory_bytes
        acc[1] += 1.0 if a.mode is QoS.EXCLUSIVE else a.compute_share
        acc[2] += 1
    for uuid, g in sorted(view.gpus.items()):
        m, c, n = by_gpu.get(uuid, [0, 0.0, 0])
        lv = gpu_label_values(g, hostnames.get(g.node))
        mem.add_metric(lv, g.memory_bytes)
        mem_alloc.add_metric(lv, m)
        comp_alloc.add_metric(lv, min(1.0, c))
        slices.add_metric(lv, n)
        cordoned.add_metric(lv, 1.0 if uuid in view.cordoned else 0.0)
        healthy.add_metric(lv, 1.0 if g.healthy else 0.0)
    yield from (mem, mem_alloc, comp_alloc, slices, cordoned, healthy)

    g_util = GaugeMetricFamily(
        "gpupool_gpu_utilization_ratio",
        "Highest SM utilisation the GPU's jobs report on it (0-1; device-wide when NVML has no per-process samples).",
        labels=gl,
    )
    g_used = GaugeMetricFamily(
        "gpupool_gpu_memory_used_bytes", "Device memory the GPU's jobs report using on it.", labels=gl
    )
    for row in gpu_rows(view):
        rg = view.gpus[row["gpu"]]
        lv = gpu_label_values(rg, hostnames.get(rg.node))
        if row["util"] is not None:
            g_util.add_metric(lv, row["util"])
        if row["memory_used_bytes"] is not None:
            g_used.add_metric(lv, row["memory_used_bytes"])
    yield from (g_util, g_used)

    s_alloc = GaugeMetricFamily(
        "gpupool_slice_memory_allocated_bytes", "Memory granted to one slice of a job on a GPU.", labels=[jl, *gl]
    )
    s_share = GaugeMetricFamily(
        "gpupool_slice_compute_share_ratio", "Compute share granted to one slice of a job (0-1; exclusive: 1).",
        labels=[jl, *gl],
    )
    for a in sorted(view.allocations, key=lambda a: (a.job, a.node, a.gpu_index, a.gpu_uuid)):
        ag = view.gpus.get(a.gpu_uuid)
        lv = (
            gpu_label_values(ag, hostnames.get(ag.node))
            if ag is not None
            else [a.node, hostnames.get(a.node) or a.node, a.gpu_uuid, str(a.gpu_index), ""]
        )
        s_alloc.add_metric([a.job, *lv], a.memory_bytes)
        s_share.add_metric([a.job, *lv], 1.0 if a.mode is QoS.EXCLUSIVE else a.compute_share)
    yield from (s_alloc, s_share)

    jobs = GaugeMetricFamily("gpupool_jobs", "Live jobs by state and QoS class.", labels=["state", "qos"])
    job_counts = Counter(
        (view.statuses[j].state.value if j in view.statuses else "UNKNOWN", spec.qos_class.value)
        for j, spec in view.specs.items()
    )
    for job_labels, n in sorted(job_counts.items()):
        jobs.add_metric(list(job_labels), n)
    yield jobs

    pending = GaugeMetricFamily("gpupool_pending_jobs", "Jobs waiting for slices (PENDING), by QoS class.", labels=["qos"])
    pending_s = GaugeMetricFamily(
        "gpupool_job_pending_seconds", "Seconds a PENDING job has waited since it was queued.", labels=[jl, "qos"]
    )
    info = GaugeMetricFamily(
        "gpupool_job_info", "1 per live job, with its state, QoS class, priority and owner.",
        labels=[jl, "state", "qos", "priority", "owner"],
    )
    by_qos = Counter({q.value: 0 for q in QoS})
    for j, spec in sorted(view.specs.items()):
        st = view.statuses.get(j)
        state = st.state.value if st is not None else "UNKNOWN"
        info.add_metric([j, state, spec.qos_class.value, str(spec.priority), spec.owner], 1)
        if st is None or st.state.value == "PENDING":
            by_qos[spec.qos_class.value] += 1
            if st is not None and st.queued_at:
                pending_s.add_metric([j, spec.qos_class.value], max(0.0, view.now - st.queued_at))
    for q, n in sorted(by_qos.items()):
        pending.add_metric([q], n)
    yield from (pending, pending_s, info)

    yield from _job_metrics([view.telemetry[j] for j in sorted(view.telemetry)])

    job_slices = GaugeMetricFamily("gpupool_job_slices", "Slices a job holds now.", labels=[jl])
    share = GaugeMetricFamily(
        "gpupool_job_gpu_share_ratio", "GPUs' worth a job is charged for now (sum of slice shares).", labels=[jl]
    )
    rate = GaugeMetricFamily(
        "gpupool_job_cost_usd_per_second", "What a job's current slices cost per second (USD).", labels=[jl, "owner"]
    )
    jobs_with_slices = sorted({a.job for a in view.allocations})
    for j in jobs_with_slices:
        allocs = view.allocations_of(j)
        owner = _owner(view, j)
        job_slices.add_metric([j], len(allocs))
        share.add_metric([j], sum(slice_share(a, view.gpus.get(a.gpu_uuid)) for a in allocs))
        rate.add_metric([j, owner], hourly_cost(allocs, view.gpus, prices) / 3600.0)
    yield from (job_slices, share, rate)

    gpu_s = CounterMetricFamily(
        "gpupool_job_gpu_seconds", "GPU-seconds consumed (slice-seconds weighted by compute share).", labels=[jl, "qos"]
    )
    cost = CounterMetricFamily("gpupool_job_cost_usd", "Accumulated cost of a job in USD.", labels=[jl, "owner"])
    mem_s = CounterMetricFamily(
        "gpupool_job_memory_byte_seconds", "Granted memory (bytes) integrated over time.", labels=[jl]
    )
    live = _live_jobs(view)
    for j, u in sorted(view.usage.items()):
        if j not in live and view.now - u.last_seen > finished_ttl_s:
            continue  # finished long enough ago: let its series go stale
        gpu_s.add_metric([j, u.qos.value], u.gpu_seconds)
        cost.add_metric([j, u.owner], u.cost_usd)
        mem_s.add_metric([j], u.memory_gib_seconds * GiB)
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
        prices: the price table for the current cost rate (None: :meth:`PoolView.price_table`, the
            leader's published table or the catalog).
        min_interval_s: scrapes closer together than this reuse the previous view, so an
            aggressive scraper cannot hammer etcd.
        clock: monotonic clock for ``min_interval_s`` (tests pass a fake).
        finished_ttl_s: how long a finished job's usage counters stay exported.

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
        finished_ttl_s: float = DEFAULT_FINISHED_TTL_S,
    ) -> None:
        if min_interval_s < 0:
            raise ConfigError("min_interval_s", f"must be >= 0 seconds, got {min_interval_s}")
        if not finished_ttl_s >= 0:
            raise ConfigError("finished_ttl_s", f"must be >= 0 seconds, got {finished_ttl_s}")
        self._finished_ttl_s = finished_ttl_s
        self._source = source
        self._prices = prices  # None: the leader's published table, else the catalog (PoolView.price_table)
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
        yield from pool_metrics(view, view.price_table(self._prices), self._finished_ttl_s)


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
        """Stop serving and release the port."""
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
    addr: str,
    prices: PriceTable | None = None,
    min_interval_s: float = 1.0,
    extra_collectors: Iterable[Collector] = (),
    finished_ttl_s: float = DEFAULT_FINISHED_TTL_S,
) -> MetricsServer:
    """Serve the pool metrics read from ``store`` at ``http://addr:port/metrics`` on a daemon thread.

    Args:
        store: an :class:`~gpupool_sdk.store.EtcdStore` (read with one range request per scrape).
        port: TCP port (0 picks a free one; see :attr:`MetricsServer.port`).
        addr: address to bind, chosen by the caller (``"127.0.0.1"``: this machine only;
            ``"0.0.0.0"``: every interface, for a Prometheus elsewhere; ``"::"`` for IPv6).
        prices: price table (default: the leading coordinator's published table, the policy file's
            ``[prices]``; without one ``PriceTable.load()``, i.e. ``$GPUPOOL_PRICES`` and the catalog).
        min_interval_s: minimum seconds between two etcd reads.
        extra_collectors: more collectors to serve on the same endpoint (e.g. the coordinator's
            own cycle counters).
        finished_ttl_s: how long a finished job's usage counters stay exported.

    Raises:
        ConfigError: the port is invalid or taken.

    Example:
        >>> srv = serve_metrics(store, port=9400, addr="127.0.0.1")  # doctest: +SKIP
        >>> srv.close()                                  # doctest: +SKIP
    """
    registry = CollectorRegistry()
    registry.register(
        PoolMetricsCollector(
            lambda: load_view(store),
            prices,
            min_interval_s,
            finished_ttl_s=finished_ttl_s,
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

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Expose ``/metrics`` on ``addr:port`` on a daemon thread.

        The default is loopback: a training process exposes nothing to the network unless its
        user names an address (``"0.0.0.0"`` when a Prometheus on another machine scrapes it).
        """
        return _serve(self.registry, port, addr)
