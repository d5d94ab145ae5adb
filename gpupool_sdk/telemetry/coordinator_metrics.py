"""The coordinator's own metrics: scheduler internals and leadership, per replica.

:class:`CoordinatorMetrics` is fed by the coordinator's ``on_cycle`` hook (one
:class:`~gpupool_sdk.coordinator.coordinator.CycleReport` per scheduling cycle) and reads the
replica's leadership at scrape time. ``gpupool coordinator --metrics-port`` serves it beside the
pool metrics (:func:`~gpupool_sdk.telemetry.prometheus.serve_metrics`).

Reasons are free text in the pool (they name jobs, sizes and models); as labels they would make
a series per job, so :func:`reason_code` folds them into a short fixed vocabulary.

Example:
    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> m = CoordinatorMetrics()
    >>> reg = CollectorRegistry()
    >>> reg.register(m)
    >>> b"gpupool_scheduler_cycles_total 0.0" in generate_latest(reg)
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Buckets of ``gpupool_scheduler_cycle_duration_seconds`` (a cycle is milliseconds to seconds).
CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Buckets of ``gpupool_scheduler_queue_wait_seconds`` (from queued to granted: seconds to a day).
QUEUE_WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)

# (substring of the reason, code); first match wins. Kept in step with the reasons the
# scheduler's reject, health and preemption stages and the applier write.
_REASON_CODES: tuple[tuple[str, str], ...] = (
    ("max-txn-ops", "txn_limit"),
    ("no gpu of model", "no_such_model"),
    ("offers feature", "missing_feature"),
    ("no single gpu offers all", "missing_feature"),
    ("per slice; the largest", "memory_too_large"),
    ("but only", "too_many_gpus"),
    ("spread over", "topology"),
    ("checkpoint and move", "unhealthy_gpu"),
    ("migrate:", "migrate"),  # a move for fragmentation (scheduler.migrate.MIGRATE_PREFIX)
    ("to make room for", "priority"),
    ("shrunk", "shrink"),
)


def reason_code(reason: str, for_job: str | None = None) -> str:
    """A short, bounded label for a free-text reason.

    Example:
        >>> reason_code("impossible: no GPU of model B200 in the pool (models: H100-80GB)")
        'no_such_model'
        >>> reason_code("xid 79 (GPU has fallen off the bus); checkpoint and move")
        'unhealthy_gpu'
    """
    low = reason.lower()
    for needle, code in _REASON_CODES:
        if needle in low:
            return code
    return "priority" if for_job else "other"


class CoordinatorMetrics(Collector):
    """Scheduler counters and histograms of one coordinator replica.

    Args:
        leader: returns ``(is_leader, term, terms_won, demotions)`` of the replica at scrape
            time (or see :meth:`watch`); None exports no leadership series.

    Call :meth:`observe_cycle` with every cycle's report (pass it as the coordinator's ``on_cycle``).
    """

    def __init__(self, leader: Callable[[], tuple[bool, int, int, int]] | None = None) -> None:
        self._leader = leader
        self._lock = threading.Lock()
        self.cycles = Counter("gpupool_scheduler_cycles", "Scheduling cycles run by this replica as leader.", registry=None)
        self.cycles_skipped = Counter(
            "gpupool_scheduler_cycles_skipped",
            "Cycles (counted in gpupool_scheduler_cycles too) in which nothing but the clock changed before "
            "the last decisions' valid_until, so the scheduler and the writes were skipped.",
            registry=None,
        )
        self.cycle_seconds = Histogram(
            "gpupool_scheduler_cycle_duration_seconds",
            "Wall time of one scheduling cycle (read, schedule, fenced writes).",
            buckets=CYCLE_BUCKETS,
            registry=None,
        )
        self.decisions = Counter(
            "gpupool_scheduler_decisions", "Decisions of the scheduler, by kind.", ["kind"], registry=None
        )
        self.grants = Counter(
            "gpupool_scheduler_grants", "Grants written (a job given its slices), by QoS class.", ["qos"], registry=None
        )
        self.preemptions = Counter(
            "gpupool_scheduler_preemptions",
            "Preemption directives issued, by reason and the victim's QoS class.",
            ["reason", "qos"],
            registry=None,
        )
        self.resizes = Counter(
            "gpupool_scheduler_resizes",
            "Elastic resize directives issued (counted apart from preemptions), by direction "
            "(grow, shrink) and the job's QoS class.",
            ["direction", "qos"],
            registry=None,
        )
        self.resize_refusals = Counter(
            "gpupool_scheduler_resize_refusals",
            "Resize directives a job refused (acked ok=False; its grant kept, the resize withdrawn), by QoS class.",
            ["qos"],
            registry=None,
        )
        self.rejections = Counter(
            "gpupool_scheduler_rejections",
            "Jobs rejected as impossible, by reason and QoS class.",
            ["reason", "qos"],
            registry=None,
        )
        self.queue_wait = Histogram(
            "gpupool_scheduler_queue_wait_seconds",
            "Seconds from queued to granted, observed at each grant, by QoS class.",
            ["qos"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=None,
        )
        self.gpu_changed = Counter(
            "gpupool_scheduler_gpu_changed",
            "Writes adding to a GPU (kind: Grant, Regrant, Deflate) that etcd refused because an allocation on "
            "that GPU was written after the snapshot they were decided on, not by the leader (garbage in etcd); "
            "the next cycle decides again.",
            ["kind"],
            registry=None,
        )
        self._parts: tuple[Any, ...] = (
            self.cycles, self.cycles_skipped, self.cycle_seconds, self.decisions, self.grants, self.preemptions, self.resizes,
            self.resize_refusals, self.rejections, self.queue_wait, self.gpu_changed,
        )  # fmt: skip
        self._autoscale: Any = None  # the last cycle's AutoscaleSignal

    def watch(self, coord: Any) -> None:
        """Export the leadership of a :class:`~gpupool_sdk.coordinator.Coordinator` (read at scrape time).

        The coordinator is built with ``on_cycle=metrics.observe_cycle`` first, then watched.
        """
        self._leader = lambda: (
            bool(coord.is_leader), int(coord.term), int(coord.election.terms_won), int(coord.stats.fenced_out)
        )

    def observe_cycle(self, report: Any) -> None:
        """Count one :class:`~gpupool_sdk.coordinator.coordinator.CycleReport`."""
        snap = report.snapshot
        jobs = snap.jobs if snap is not None else {}

        def qos(job: str) -> str:
            view = jobs.get(job)
            return view.spec.qos_class.value if view is not None else "unknown"

        with self._lock:
            signal = getattr(report, "autoscale", None)
            if signal is not None:
                self._autoscale = signal
            self.cycles.inc()
            if getattr(report, "skipped", False):
                self.cycles_skipped.inc()
            self.cycle_seconds.observe(max(0.0, report.duration_s))
            for d in report.decided:
                kind = type(d).__name__
                self.decisions.labels(kind=kind).inc()
                if kind == "Preempt":
                    self.preemptions.labels(reason=reason_code(d.reason, d.for_job), qos=qos(d.job)).inc()
                elif kind == "Resize":
                    view = jobs.get(d.job)
                    have = len(view.allocations) if view is not None else 0
                    self.resizes.labels(direction="grow" if d.gpus > have else "shrink", qos=qos(d.job)).inc()
                elif kind == "Withdraw":
                    self.resize_refusals.labels(qos=qos(d.job)).inc()
                elif kind == "Reject":
                    self.rejections.labels(reason=reason_code(d.reason), qos=qos(d.job)).inc()
            for kind, n in (getattr(report, "gpu_changed", None) or {}).items():
                self.gpu_changed.labels(kind=kind).inc(n)
            for job in report.granted_jobs:
                self.grants.labels(qos=qos(job)).inc()
                view = jobs.get(job)
                if view is not None and view.queued_at and snap is not None:
                    self.queue_wait.labels(qos=qos(job)).observe(max(0.0, snap.now - view.queued_at))

    def _autoscale_families(self) -> Iterator[Metric]:
        signal = self._autoscale
        if signal is None:
            return
        desired = GaugeMetricFamily(
            "gpupool_autoscale_desired_nodes",
            "Nodes the pool wants per GPU type (pending demand and idle capacity, with hysteresis); "
            "a cloud autoscaler converges the node group to it.",
            labels=["gpu_type"],
        )
        current = GaugeMetricFamily("gpupool_autoscale_current_nodes", "Nodes present per GPU type.", labels=["gpu_type"])
        down = GaugeMetricFamily(
            "gpupool_autoscale_scale_down_nodes",
            "Idle nodes named for removal per GPU type (their names are in the {prefix}/autoscale key).",
            labels=["gpu_type"],
        )
        for t in sorted(signal.desired):
            desired.add_metric([t], signal.desired[t])
            current.add_metric([t], signal.current.get(t, 0))
            down.add_metric([t], len(signal.scale_down.get(t, ())))
        yield from (desired, current, down)

    def collect(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from part.collect()
        if self._leader is None:
            yield from self._autoscale_families()
            return
        is_leader, term, won, demoted = self._leader()
        if is_leader:
            yield from self._autoscale_families()  # only the leader's signal is current
        lead = GaugeMetricFamily("gpupool_coordinator_is_leader", "1 while this replica leads the pool.")
        lead.add_metric([], 1 if is_leader else 0)
        t = GaugeMetricFamily("gpupool_coordinator_term", "Term this replica holds (0: it does not lead).")
        t.add_metric([], term if is_leader else 0)
        # Counters whose values the election keeps: CounterMetricFamily adds the _total suffix.
        changes = CounterMetricFamily(
            "gpupool_coordinator_leader_changes",
            "Times this replica became leader (sum over replicas: leader changes of the pool).",
        )
        changes.add_metric([], won)
        lost = CounterMetricFamily(
            "gpupool_coordinator_demotions", "Times this replica lost leadership (lease lost, fenced out)."
        )
        lost.add_metric([], demoted)
        yield from (lead, t, changes, lost)
