"""The ``gpupool`` policy in the simulator: the coordinator's pure :class:`Scheduler`, unchanged.

The adapter keeps a :class:`JobView` per live job, rebuilt only when the engine reports a change
(grant, preempt, ack, balloon, release), builds a :class:`ClusterSnapshot` from those views at
each event, runs ``Scheduler.schedule`` and hands the decisions back to the engine, which applies
them like the coordinator would (see :mod:`gpupool_sdk.sim.engine`).

Trace rows become :class:`JobSpec` as follows (documented in ``docs/simulation.md``):

* ``Guaranteed`` and ``LS`` (latency-sensitive) -> ``guaranteed``; ``Burstable`` and ``BE``
  (best effort) -> ``shared``. These are Kubernetes/Koordinator QoS classes (Alibaba): they say
  what a pod is guaranteed and what is evicted first, not who queues first, so every class gets
  priority 0 unless ``PoolMapping.class_priority`` (``--class-priority``) gives it one;
* an integer ``n`` -> ``guaranteed``, priority ``n``;
* empty or another word -> ``untagged_qos``, priority 0 (Pollux/Sia/Tiresias have no classes).

Among jobs of one priority the QoS class still decides who gives way first: shared slices are
ballooned and preempted before guaranteed ones (the scheduler's victim order).

Elastic bounds (``min_gpus`` / ``max_gpus``): a row's own ``min_gpu=`` / ``max_gpu=`` in ``extra``
(a missing one = ``num_gpu``); else, with ``PoolMapping.elastic = (f, m)`` (``--elastic f,m``),
every job asking ``n`` GPUs gets ``min_gpus = ceil(n * f)`` and ``max_gpus = floor(n * m)``; else
rigid (``n``). The scheduler then grants fewer slices (down to ``min_gpus``) when ``n`` do not fit
and grows granted jobs toward ``max_gpus`` with ``Resize`` when nothing waits.

``compute_share`` = the trace's ``gpu_fraction``; ``memory`` = the job's memory demand times
``memory_request_factor`` (users ask more than they use), capped at the largest GPU; the
telemetry peak the scheduler sees (``memory_peak_bytes``) is the demand itself, known once the
job has run (a job never granted reports no peak).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    DirectiveKind,
    GiB,
    GpuHealth,
    GpuInfo,
    JobSpec,
    JobState,
    QoS,
)
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.ordering import las_queue, order_pending, static_key
from gpupool_sdk.scheduler.policy import Scheduler
from gpupool_sdk.scheduler.types import ClusterSnapshot, Decision, JobView, SchedulerConfig
from gpupool_sdk.sim.engine import DONE, PENDING, PREEMPTING, REJECTED, RUNNING, SimJob, Simulator
from gpupool_sdk.sim.estimates import EstimateModel, JobEstimates
from gpupool_sdk.sim.trace import TraceJob

#: trace QoS class (lower-cased) -> the pool's QoS class.
QOS_MAP: Mapping[str, QoS] = {
    "guaranteed": QoS.GUARANTEED,
    "ls": QoS.GUARANTEED,
    "burstable": QoS.SHARED,
    "be": QoS.SHARED,
}

#: ``--class-priority`` that ranks Alibaba's classes as queue priorities (the mapping the first
#: simulation runs used; ``docs/simulation.md`` compares both).
RANKED_CLASS_PRIORITY: Mapping[str, int] = {"guaranteed": 20, "ls": 10, "burstable": 5, "be": 0}


def parse_class_priority(text: str) -> dict[str, int]:
    """Parse ``"LS=10,BE=0"`` (class names case-insensitive) into ``{"ls": 10, "be": 0}``.

    Raises:
        ConfigError: a malformed pair or a non-integer priority (the message shows the form).

    Example:
        >>> parse_class_priority("LS=10, BE=0")
        {'ls': 10, 'be': 0}
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            if not sep or not name:
                raise ValueError(part)
            out[name] = int(value.strip())
        except ValueError:
            raise ConfigError(
                "class_priority", f"expected CLASS=INT pairs separated by commas (LS=10,BE=0), got {part!r}"
            ) from None
    return out


def parse_elastic(text: str) -> tuple[float, float]:
    """Parse ``"MIN_FRACTION[,MAX_FACTOR]"`` (``--elastic``): ``"0.5,2"`` -> ``(0.5, 2.0)``; the factor defaults to 1.

    Raises:
        ConfigError: not one or two numbers, a fraction outside (0, 1] or a factor below 1.

    Example:
        >>> parse_elastic("0.5,2")
        (0.5, 2.0)
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        if not 1 <= len(parts) <= 2:
            raise ValueError(text)
        frac = float(parts[0])
        factor = float(parts[1]) if len(parts) == 2 else 1.0
    except ValueError:
        raise ConfigError(
            "elastic", f"expected MIN_FRACTION[,MAX_FACTOR], e.g. 0.5,2 (min = ceil(n*0.5), max = n*2), got {text!r}"
        ) from None
    _check_elastic((frac, factor))
    return frac, factor


def _check_elastic(elastic: tuple[float, float]) -> None:
    frac, factor = elastic
    if not 0.0 < frac <= 1.0:  # NaN fails too
        raise ConfigError("elastic", f"MIN_FRACTION must be in (0, 1] (0.5 = down to half the GPUs), got {frac}")
    if not (1.0 <= factor < math.inf):
        raise ConfigError("elastic", f"MAX_FACTOR must be a finite number >= 1 (2 = up to twice the GPUs), got {factor}")


@dataclass(frozen=True)
class PoolMapping:
    """How trace rows become job specs for the ``gpupool`` policy.

    Attributes:
        untagged_qos: QoS of rows without a known priority class (``guaranteed`` or ``shared``).
        class_priority: priority per trace class (lower-cased name -> priority); classes not
            named get 0. Empty (default): the classes only choose the QoS.
        memory_request_factor: memory asked = demand x this (>= 1).
        min_runtime_s: the spec's minimum run time before it may be preempted.
        preempt_grace_s: the spec's time to checkpoint and ack.
        elastic: ``(min_fraction, max_factor)``: every job asking ``n`` GPUs without its own
            ``min_gpu=`` / ``max_gpu=`` becomes elastic from ``ceil(n * min_fraction)`` to
            ``floor(n * max_factor)`` GPUs; None (default): such jobs are rigid.
    """

    untagged_qos: str = "guaranteed"
    class_priority: Mapping[str, int] = field(default_factory=dict)
    memory_request_factor: float = 1.25
    min_runtime_s: float = 0.0
    preempt_grace_s: float = 60.0
    elastic: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.elastic is not None:
            _check_elastic(self.elastic)
        if self.untagged_qos not in ("guaranteed", "shared", "exclusive"):
            raise ConfigError("untagged_qos", f"use guaranteed, shared or exclusive, got {self.untagged_qos!r}")
        if not self.memory_request_factor >= 1.0:
            raise ConfigError("memory_request_factor", f"must be >= 1, got {self.memory_request_factor}")

    def gpu_bounds(self, tj: TraceJob) -> tuple[int, int]:
        """(min_gpus, max_gpus) of a trace job: its row's bounds, else ``elastic``'s, else rigid.

        Example:
            >>> from gpupool_sdk.sim.trace import TraceJob
            >>> tj = TraceJob(index=0, job_id="a", source="t", submit_s=0, duration_s=60, num_gpu=3, gpu_fraction=1)
            >>> PoolMapping(elastic=(0.5, 2)).gpu_bounds(tj)
            (2, 6)
        """
        n = tj.num_gpu
        if tj.min_gpu is not None or tj.max_gpu is not None:
            return (tj.min_gpu or n, tj.max_gpu or n)
        if self.elastic is None:
            return (n, n)
        frac, factor = self.elastic
        # The epsilon keeps 3 * (1/3) from rounding up to 2.
        return (max(1, math.ceil(n * frac - 1e-9)), max(n, math.floor(n * factor + 1e-9)))

    def qos_priority(self, priority: str) -> tuple[QoS, int]:
        """The (QoS, priority) of a trace priority class."""
        key = priority.strip().lower()
        prio = self.class_priority.get(key, 0)
        if key in QOS_MAP:
            return QOS_MAP[key], prio
        try:
            return QoS.GUARANTEED, int(key)
        except ValueError:
            return QoS(self.untagged_qos), prio


class PoolPolicy:
    """Runs :class:`gpupool_sdk.scheduler.policy.Scheduler` inside the simulator.

    Args:
        config: the scheduler's knobs (the same object the coordinator takes); None: ``DEFAULT_SCHEDULER``.
        mapping: trace-to-spec mapping.
        max_pending_in_snapshot: speed knob for big congested runs: put only the first N pending
            jobs in the scheduler's own order (priority, LAS queue, FIFO) into each snapshot, plus
            every granted job. None (default) shows every pending job, as the coordinator does.
            Jobs further back could only have backfilled; ``docs/simulation.md`` measures the effect.
        estimates: how jobs report their remaining time (``JobView.remaining_s``; see
            :mod:`gpupool_sdk.sim.estimates`); default :class:`EstimateModel` (None there: the default).
        skip_unchanged: skip a cycle (decide nothing) when nothing changed since the last one but
            the clock, before that cycle's ``ScheduleResult.valid_until``, and no running job's
            refreshed view moved to another LAS queue: such a cycle would decide exactly what the
            last one did, all of which was applied (``tests/sim/test_engine.py`` checks the results
            are identical with it off). The coordinator's time-driven cycles could do the same.

    Example:
        >>> PoolPolicy(SchedulerConfig(overcommit_ratio=1.5)).name
        'gpupool'
    """

    name = "gpupool"
    uses_protocol = True

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        mapping: PoolMapping | None = None,
        max_pending_in_snapshot: int | None = None,
        estimates: EstimateModel | None = None,
        skip_unchanged: bool = True,
    ) -> None:
        if max_pending_in_snapshot is not None and max_pending_in_snapshot < 1:
            raise ConfigError("max_pending_in_snapshot", f"must be >= 1 or None, got {max_pending_in_snapshot}")
        self.config = config or DEFAULT_SCHEDULER  # the coordinator's defaults
        self.max_pending = max_pending_in_snapshot
        # The scheduler's pending order is static (priority, LAS queue, FIFO) when aging and the
        # starvation bypass are off; then it can be kept incrementally here.
        # The head of the queue may be kept pre-sorted only while the pending order does not depend
        # on time: no aging, no max-wait promotion, no LAS starvation promotion.
        self._static_order = (
            self.config.aging_s_per_priority == 0
            and self.config.max_wait_s == 0
            and self.config.las_promote_after_factor == 0
        )
        self._pkey: dict[str, tuple[int, int, float, int]] = {}
        self._psorted: list[tuple[int, int, float, int]] = []
        self.estimates = estimates or EstimateModel()
        self._estimates = JobEstimates(self.estimates)
        self._granted_views: dict[str, JobView] = {}
        self.mapping = mapping or PoolMapping()
        self.scheduler = Scheduler(self.config)
        self.overcommit_ratio = self.config.overcommit_ratio
        self._views: dict[str, JobView] = {}
        self._built_at: dict[str, float] = {}
        self._specs: dict[int, JobSpec] = {}
        self._inflight: set[str] = set()
        self._gpus: dict[str, GpuInfo] = {}
        #: running elastic jobs below their max_gpus (a cycle may grow them when capacity frees).
        self._growable: set[str] = set()
        #: the snapshot changed since the last cycle (a cycle on the same snapshot decides the same).
        self._dirty = True
        self.cycles = 0
        self.skip_unchanged = skip_unchanged
        #: ``valid_until`` of the last cycle run (see ``skip_unchanged``).
        self._valid_until = -math.inf
        #: cycles skipped (nothing but the clock changed, before ``valid_until``).
        self.skipped = 0

    # ------------------------------------------------------------------ specs

    def spec_for(self, job: SimJob) -> JobSpec:
        """The :class:`JobSpec` of a simulated job (see the module docstring for the mapping)."""
        spec = self._specs.get(job.index)
        if spec is None:
            qos, prio = self.mapping.qos_priority(job.tj.priority)
            lo, hi = self.mapping.gpu_bounds(job.tj)
            cap = self.sim.max_gpu_memory
            # Users ask memory in whole GiB.
            memory = int(math.ceil(job.demand * self.mapping.memory_request_factor / GiB)) * GiB
            memory = max(min(cap, memory), min(cap, job.demand), 1)
            if qos is QoS.EXCLUSIVE:
                spec = JobSpec(name=job.name, gpus=job.num_gpu, qos=qos, priority=prio, memory=0,
                               min_runtime_s=self.mapping.min_runtime_s, preempt_grace_s=self.mapping.preempt_grace_s,
                               min_gpus=lo, max_gpus=hi)
            else:
                spec = JobSpec(
                    name=job.name, gpus=job.num_gpu, memory=memory, compute_share=float(job.fraction), qos=qos,
                    priority=prio, min_runtime_s=self.mapping.min_runtime_s,
                    preempt_grace_s=self.mapping.preempt_grace_s, min_gpus=lo, max_gpus=hi,
                )
            self._specs[job.index] = spec
        return spec

    def gpu_bounds(self, job: SimJob) -> tuple[int, int]:
        """(fewest, most) slices the scheduler may grant ``job`` (its spec's elastic bounds; the engine checks grants)."""
        spec = self.spec_for(job)
        return (spec.min_gpus or spec.gpus, spec.max_gpus or spec.gpus)

    def slice_demand(self, job: SimJob) -> tuple[float, int]:
        spec = self.spec_for(job)
        if spec.qos_class is QoS.EXCLUSIVE:
            return 1.0, 0
        return spec.compute_share, spec.memory_bytes

    # ------------------------------------------------------------------ views

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        self._gpus = {g.uuid: g for g in sim.gpus}
        self._estimates = JobEstimates(self.estimates, sim.config.seed)
        sim.listeners.append(self._on_change)

    def on_health_change(self, sim: Simulator, g: int) -> None:
        """Publish a failed or repaired GPU to the snapshot (an agent would)."""
        info = sim.gpus[g]
        health = GpuHealth() if sim.healthy[g] else GpuHealth(healthy=False, reasons=("simulated failure",))
        self._gpus[info.uuid] = replace(info, health=health)
        self._dirty = True

    def _on_change(self, job: SimJob) -> None:
        self._dirty = True
        if job.state == RUNNING and job.gpus and len(job.gpus) < self.gpu_bounds(job)[1]:
            self._growable.add(job.name)
        else:
            self._growable.discard(job.name)
        key = self._pkey.pop(job.name, None)
        if key is not None:
            del self._psorted[bisect.bisect_left(self._psorted, key)]
        if job.state in (DONE, REJECTED):
            self._views.pop(job.name, None)
            self._granted_views.pop(job.name, None)
            self._built_at.pop(job.name, None)
            self._inflight.discard(job.name)
            return
        view = self._view(job)
        self._views[job.name] = view
        self._built_at[job.name] = self.sim.now
        if job.state == PENDING:
            self._granted_views.pop(job.name, None)
            key = static_key(view, self.config)
            self._pkey[job.name] = key
            bisect.insort(self._psorted, key)
        else:
            self._granted_views[job.name] = view
        if job.directive_kind is not None or job.balloon_factor < 1.0 or any(
            m < self.slice_demand(job)[1] for m in job.mems
        ):
            self._inflight.add(job.name)
        else:
            self._inflight.discard(job.name)

    def _view(self, job: SimJob) -> JobView:
        sim = self.sim
        spec = self.spec_for(job)
        now = sim.now
        if job.state == PENDING:
            return JobView(
                spec=spec, state=JobState.PENDING, queued_at=job.submit, attained_gpu_s=job.attained_gpu_s,
                memory_peak_bytes=job.demand if job.peak_known else None, order=job.index,
                remaining_s=self._estimates.remaining_s(job, now), gpu_util=self._measured_util(job, now),
            )
        attained = job.attained_gpu_s + (now - job.last) * sum(job.shares) if job.state == RUNNING else job.attained_gpu_s
        allocs = tuple(
            Allocation(
                job=job.name, node=sim.node_of[g], gpu_uuid=sim.gpus[g].uuid, gpu_index=sim.gpus[g].index,
                memory_bytes=job.mems[k], compute_share=job.shares[k], mode=spec.qos_class, granted_at=job.granted_at,
            )
            for k, g in enumerate(job.gpus)
        )
        directive = ack = None
        if job.directive_kind is not None:
            kind = {"preempt": DirectiveKind.PREEMPT, "resize": DirectiveKind.RESIZE}.get(
                job.directive_kind, DirectiveKind.BALLOON
            )
            target: dict[str, object] = {}
            if job.directive_for:
                target["for_job"] = job.directive_for
            if kind is DirectiveKind.BALLOON:
                target["memory_bytes"] = job.directive_target
            elif kind is DirectiveKind.RESIZE:
                target["gpus"] = job.directive_target
                if job.directive_keep:
                    target["keep"] = list(job.directive_keep)
            directive = Directive(kind=kind, seq=job.directive_seq, deadline=job.directive_deadline, target=target)
            if job.acked:
                ack = Ack(seq=job.directive_seq, reached_bytes=job.ack_reached if kind is DirectiveKind.BALLOON else None)
        return JobView(
            spec=spec,
            state=JobState.PREEMPTING if job.state == PREEMPTING else JobState.GRANTED,
            allocations=allocs,
            queued_at=job.submit,
            granted_at=job.granted_at,
            attained_gpu_s=attained,
            directive=directive,
            ack=ack,
            memory_peak_bytes=job.demand,
            order=job.index,
            remaining_s=self._estimates.remaining_s(job, now),
            gpu_util=self._measured_util(job, now),
        )

    def _refreshed(self, job: SimJob, old: JobView) -> JobView:
        """``_view(job)`` for a running job whose view ``old`` was built after its last change
        (every change of a job goes through ``_on_change``, which rebuilds its view): only the
        service attained, the remaining time and the measured utilisation move with the clock;
        the rest is ``old``'s, its allocations tuple included, so the scheduler's ledger keeps the
        job's holdings (``tests/sim/test_engine.py`` checks it equals a rebuilt view)."""
        now = self.sim.now
        attained = (
            job.attained_gpu_s + (now - job.last) * sum(job.shares) if job.state == RUNNING else job.attained_gpu_s
        )
        # ``dataclasses.replace`` re-runs the constructor over every field (10x the cost of this
        # copy of the frozen view's fields, on the hottest path of a congested run).
        new = object.__new__(JobView)
        fields = new.__dict__
        fields.update(old.__dict__)
        fields["attained_gpu_s"] = attained
        fields["remaining_s"] = self._estimates.remaining_s(job, now)
        fields["gpu_util"] = self._measured_util(job, now)
        return new

    def _measured_util(self, job: SimJob, now: float) -> float | None:
        # The utilisation a job's telemetry reports (its workload profile's): only once it has run
        # as long as a remaining-time estimate needs (``after_s``), never before it started.
        ran = job.run_s + (now - job.last if job.state == RUNNING else 0.0)
        return job.util if ran >= self.estimates.after_s else None

    # ------------------------------------------------------------------ the cycle

    def schedule(self, sim: Simulator) -> list[Decision]:
        if not sim.pending and not self._inflight and not (self._growable and self._dirty):
            # Nothing waits, no directive is in flight, and no elastic job could grow into capacity
            # freed since the last cycle: a cycle would decide nothing.
            return []
        changed = self._dirty
        self._dirty = False
        now = sim.now
        if self.config.las_threshold_gpu_s:
            stale = now - self.sim.config.view_refresh_s
            for name, job in sim.running.items():
                if self._built_at.get(name, now) < stale:
                    old = self._views[name]
                    self._views[name] = self._refreshed(job, old)
                    self._built_at[name] = now
                    self._granted_views[name] = self._views[name]
                    if las_queue(old, self.config) != las_queue(self._views[name], self.config):
                        changed = True
        if self.skip_unchanged and not changed and now < self._valid_until:
            self.skipped += 1
            return []
        self.cycles += 1
        jobs: Mapping[str, JobView] = self._views
        if self.max_pending is not None and len(sim.pending) > self.max_pending:
            if self._static_order:
                head = [sim.jobs[idx].name for *_, idx in self._psorted[: self.max_pending]]
            else:
                pend = [self._views[n] for n in sim.pending]
                head = [v.name for v in order_pending(pend, now, self.config)[: self.max_pending]]
            jobs = dict(self._granted_views)
            for name in head:
                jobs[name] = self._views[name]
        snapshot = ClusterSnapshot(now=now, gpus=self._gpus, jobs=jobs)
        result = self.scheduler.run(snapshot)
        self._valid_until = result.valid_until
        return list(result.decisions)

    def follow_up(self, sim: Simulator) -> bool:
        """Another cycle at this instant? Only when nothing waits and an elastic job granted below
        its maximum could grow into what changed: the coordinator reacts to its own writes the same
        way (with jobs pending, the next event's cycle sees the change anyway)."""
        return not sim.pending and bool(self._growable) and self._dirty

    def next_wakeup(self, sim: Simulator) -> float | None:
        if not self._inflight:
            return None
        # Directive deadlines: a missed one must be noticed (Revoke, or Preempt after a balloon).
        best: float | None = None
        for name in self._inflight:
            job = sim.by_name[name]
            if job.directive_kind is not None and job.directive_deadline > sim.now:
                t = job.directive_deadline + 1e-6
                best = t if best is None else min(best, t)
        return best
