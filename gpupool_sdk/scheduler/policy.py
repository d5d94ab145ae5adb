"""The scheduler: one pure cycle from a :class:`ClusterSnapshot` to a list of decisions.

Stages, in the manner of the Kubernetes scheduling framework (one cycle at a time, a tentative
capacity ledger with reserve / un-reserve):

1. ledger: committed capacity from every allocation in the snapshot, orphans included (:mod:`.ledger`);
2. protocol: acks and missed deadlines -> Release / Revoke / Shrink / Preempt (:mod:`.protocol`);
   gangs that lost a member -> Release to PENDING on every node (:mod:`.locality`);
3. health / drain: jobs on unhealthy GPUs or draining nodes -> Preempt (:mod:`.health`);
4. reject: specs no GPU of the pool could ever satisfy -> Reject (:mod:`.reject`);
5. ordering: pending jobs by starvation, effective priority, LAS queue, FIFO (:mod:`.ordering`);
6. per pending job (a gang only once every node's member joined; a job only on its own node,
   :mod:`.locality`): filter + score (:mod:`.filter`, :mod:`.placement`) -> reserve -> Grant;
   else wait for capacity already being freed, else Balloon, else shrink elastic victims (a
   Resize down toward ``min_gpus`` for the job) or Preempt lower-priority jobs or, with LAS,
   same-level jobs in a higher attained-service queue (:mod:`.preempt`), else (with
   ``migrate_for_fragmentation``) move a few running shared jobs that fit elsewhere off one GPU
   (:mod:`.migrate`), else reserve GPUs for a long-blocked job (backfill only elsewhere) and Queue with a reason;
   jobs behind the first ``max_considered`` are only placed where they fit now, else queued;
7. when nothing is left waiting: Deflate ballooned jobs;
8. when every queued job was considered in full (none cut by ``max_decisions``,
   ``max_considered`` or ``max_preemption_attempts``): grow elastic jobs toward ``max_gpus`` into the capacity left,
   which no queued job can be placed on and which is held for nobody else: first the grants of
   this cycle (their Grant is enlarged: a job is never resized in the cycle it is granted), then
   running jobs with Resize, the one holding the fewest slices first within a priority. A resize
   that grows holds the GPUs it grows into until its ack.

Every pending job gets exactly one Grant, Queue or Reject per cycle.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpupool_sdk.resources import DirectiveKind, JobSpec, JobState, QoS
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.filter import (
    GpuLoad,
    SliceRequest,
    fits,
    predicted_peak,
    request_for,
    unschedulable_reason,
)
from gpupool_sdk.scheduler.health import health_preemptions, unusable_gpus
from gpupool_sdk.scheduler.horizon import HorizonMemo, running_horizon, time_dependent_order
from gpupool_sdk.scheduler.ledger import GpuLayout, Holding, Ledger
from gpupool_sdk.scheduler.locality import broken_gangs, gang_problem, node_wait_reason
from gpupool_sdk.scheduler.migrate import MIGRATE_PREFIX, Mover, movable_jobs, plan_migration
from gpupool_sdk.scheduler.ordering import (
    effective_priority,
    las_level,
    las_rank,
    order_pending,
    sort_key,
    waited_s,
)
from gpupool_sdk.scheduler.placement import holdings_for, place
from gpupool_sdk.scheduler.preempt import (
    Plan,
    VictimIndex,
    balloon_bound,
    balloon_reason,
    balloon_target,
    kept_after_shrink,
    las_bound,
    las_standing,
    plan_balloon,
    plan_from_freeing,
    plan_preemption,
    plan_shrink,
    preempt_bound,
    running_priority,
    victim_key,
    victim_pool,
)
from gpupool_sdk.scheduler.protocol import (
    freeing_for,
    handle_protocol,
    kept_gpus,
    preempt_deadline,
    resize_held_off,
    target_int,
)
from gpupool_sdk.scheduler.reject import PoolClass, reject_reason, slice_cap, summarize, txn_limit_reason
from gpupool_sdk.scheduler.types import (
    Balloon,
    ClusterSnapshot,
    Decision,
    Deflate,
    Grant,
    JobView,
    Preempt,
    Queue,
    Reject,
    Resize,
    SchedulerConfig,
    ScheduleResult,
    SliceGrant,
)


def build_ledger(snapshot: ClusterSnapshot, config: SchedulerConfig, memo: _BuildMemo | None = None) -> Ledger:
    """The ledger of ``snapshot``: every GPU, which may take new slices, and every allocation held.

    ``memo`` (kept by a :class:`Scheduler` from cycle to cycle) reuses the GPU layout while the
    GPUs, cordons and drains are unchanged, each job's holdings while its view is the same
    object (its holdings also while a new view has the same allocations tuple, spec, memory
    peaks and utilisation: one refreshed for its attained and remaining service), and the last cycle's ledger as it was built (before the cycle changed it): when few
    jobs' holdings changed, that ledger is brought up to date by un-reserving and reserving just
    those jobs, and the cycle works on a clone. The ledger is the same as without the memo.
    """
    memo = memo if memo is not None else _BuildMemo()
    layout = memo.layout_for(snapshot)
    index_of = layout.index_of
    same = memo.config is config and memo.held_layout is layout
    old = memo.held if same else {}
    old_below = memo.below_quota if same else set()
    old_short = memo.short if same else set()
    held_by_job: dict[str, tuple[JobView, list[Holding]]] = {}
    below: set[str] = set()
    short: set[str] = set()
    changed: list[str] = []
    jobs = snapshot.jobs
    for name, view in jobs.items():
        if not view.allocations:
            continue
        known = old.get(name)
        if known is not None and (known[0] is view or _same_holdings(known[0], view)):
            if name in old_below:
                below.add(name)
            if name in old_short:
                short.add(name)
            if known[0] is view:
                held_by_job[name] = known
                continue
            # A new view holding the same: its holdings are kept, but it is still un-reserved and
            # reserved again below, as any changed job (the loads' float sums, and so decisions,
            # stay exactly those of a ledger updated job by job for every new view).
            held_by_job[name] = (view, known[1])
            changed.append(name)
            continue
        spec = view.spec
        if spec.qos_class is QoS.SHARED and any(a.memory_bytes < spec.memory_bytes for a in view.allocations):
            below.add(name)
        held = []
        for a in view.allocations:
            i = index_of.get(a.gpu_uuid)
            if i is None:
                short.add(name)
                continue  # GPU no longer published: nothing left to account on it
            peak = predicted_peak(view, a.memory_bytes, config) if a.mode is QoS.SHARED else a.memory_bytes
            held.append(Holding(i, a.mode, a.memory_bytes, a.compute_share, peak, view.gpu_util))
        held_by_job[name] = (view, held)
        changed.append(name)
    gone = [n for n in old if n not in held_by_job]
    orphans = tuple(snapshot.orphans)
    base = memo.base
    if (
        base is not None
        and same
        and memo.base_orphans == orphans
        and len(changed) + len(gone) <= max(8, len(held_by_job) // 4)
    ):
        for name in sorted(gone + [n for n in changed if n in old]):
            base.unreserve(name)
            base.group_of.pop(name, None)
        for name in sorted(changed):
            view, held = held_by_job[name]
            base.reserve(name, held, view.spec.anti_affinity)
        base.frees = 0
    else:
        base = Ledger.from_layout(layout, config.overcommit_ratio, config.spread_idle_above)
        for name in sorted(held_by_job):
            view, held = held_by_job[name]
            base.reserve(name, held, view.spec.anti_affinity, reindex=False)
        # Allocations of no live job still take their GPU's memory until the leader deletes them.
        base.occupy(
            [Holding(index_of[a.gpu_uuid], a.mode, a.memory_bytes, a.compute_share, a.memory_bytes)
             for a in orphans if a.gpu_uuid in index_of],
            reindex=False,
        )
        base.rebuild_index()
    memo.base, memo.base_orphans = base, orphans
    memo.config, memo.held_layout, memo.held = config, layout, held_by_job
    memo.below_quota, memo.short, memo.vanished = below, short, bool(short)
    return base.clone()


def _same_holdings(old: JobView, new: JobView) -> bool:
    """True when ``new`` holds what ``old`` held, as the ledger counts it: the same allocations
    tuple and spec, the same memory peaks (the predicted peak of a shared slice) and measured
    utilisation (a view refreshed for its attained and remaining service only)."""
    return (
        old.allocations is new.allocations
        and old.spec is new.spec
        and old.memory_peak_bytes == new.memory_peak_bytes
        and old.memory_peak_history == new.memory_peak_history
        and old.gpu_util == new.gpu_util
    )


class _BuildMemo:
    """What one cycle's ledger shares with the next (a memo of pure functions of the snapshot)."""

    def __init__(self) -> None:
        self.key: tuple[object, ...] | None = None
        self.layout: GpuLayout | None = None
        self.pool: list[PoolClass] = []
        self.config: SchedulerConfig | None = None
        self.held_layout: GpuLayout | None = None
        self.held: dict[str, tuple[JobView, list[Holding]]] = {}
        #: shared jobs of ``held`` holding a slice below their declared memory (ballooned: they may deflate).
        self.below_quota: set[str] = set()
        #: jobs of ``held`` with an allocation on a GPU no longer published.
        self.short: set[str] = set()
        #: some allocation of the last ledger built is on a GPU no longer published.
        self.vanished = False
        #: the last ledger as built from its snapshot (never changed by a cycle: cycles get a clone),
        #: and the orphaned allocations it counts.
        self.base: Ledger | None = None
        self.base_orphans: tuple[object, ...] = ()

    def all_placeable(self, snapshot: ClusterSnapshot) -> bool:
        """True when no allocation of ``snapshot`` must be vacated: every GPU healthy, none
        missing, no node draining (call after :func:`build_ledger` on the same snapshot)."""
        return self.layout is not None and self.layout.all_healthy and not snapshot.draining and not self.vanished

    def layout_for(self, snapshot: ClusterSnapshot) -> GpuLayout:
        """The :class:`GpuLayout` of ``snapshot`` (rebuilt only when GPUs, cordons or drains change)."""
        key = (tuple(snapshot.gpus.values()), snapshot.cordoned, snapshot.draining)
        if self.layout is None or self.key != key:
            schedulable = [
                g.uuid
                for g in snapshot.gpus.values()
                if unschedulable_reason(g, snapshot.cordoned, snapshot.draining) is None
            ]
            self.layout = GpuLayout(snapshot.gpus.values(), schedulable)
            self.pool = summarize(snapshot.gpus.values())
            self.key = key
        return self.layout


#: a pending job in line: its view, request, request shape and sort key (see ``Scheduler._line_up``).
_Entry = tuple[JobView, SliceRequest, tuple[object, ...], tuple[object, ...]]


@dataclass
class _Cycle:
    snapshot: ClusterSnapshot
    config: SchedulerConfig
    ledger: Ledger
    decisions: list[Decision] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)
    actions: int = 0
    queued: int = 0
    reservations: int = 0
    fail_cache: dict[tuple[object, ...], tuple[int, str]] = field(default_factory=dict)
    #: failed placements by constraints (see :func:`_no_place_key`): (frees, memory, compute, peak, min_count).
    no_place: dict[tuple[object, ...], list[tuple[int, int, float, int, int]]] = field(default_factory=dict)
    no_preempt: dict[tuple[object, ...], tuple[int, float]] = field(default_factory=dict)
    preempting: dict[str, str | None] = field(default_factory=dict)
    ballooning: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    #: elastic jobs shrinking for a pending job: (ledger indices of the GPUs they keep, that job).
    shrinking: dict[str, tuple[frozenset[int], str | None]] = field(default_factory=dict)
    #: jobs re-placed after a shrink: the GPUs they kept (they are re-granted exactly those).
    pinned: dict[str, list[int]] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)
    attempts: int = 0
    freeing_by_job: dict[str | None, list[str]] | None = None
    victims: VictimIndex | None = None
    #: the candidates of ``victims`` that could shrink (elastic, above ``min_gpus``), with how many GPUs they may give up.
    shrink_budget: dict[str, int] | None = None
    #: per (priority bound, LAS bound): the candidates of ``shrink_budget`` under it, in victim order.
    shrink_under: dict[tuple[float, tuple[int, int] | None], list[tuple[str, int]]] = field(default_factory=dict)
    balloonable: VictimIndex | None = None
    no_balloon: dict[tuple[object, ...], tuple[int, float]] = field(default_factory=dict)
    #: :func:`victim_key` (without LAS) of the jobs holding capacity, for reservations.
    holder_keys: dict[str, tuple[int, int, int, float, int, str]] = field(default_factory=dict)
    #: the jobs holding capacity in victim order (for reservations), and their names when sorted.
    holder_order: list[str] | None = None
    holder_names: set[str] = field(default_factory=set)
    #: the lowest and highest base priority among them.
    holder_prios: tuple[int, int] = (0, 0)
    #: elastic jobs granted this cycle below ``max_gpus``: (index of their Grant in ``decisions``, request).
    fresh: dict[str, tuple[int, SliceRequest]] = field(default_factory=dict)
    #: queued jobs not considered in full (cut by ``max_decisions`` or ``max_preemption_attempts``):
    #: they might have used free capacity or made a plan, so nothing grows this cycle.
    deferred: int = 0
    #: the first instant a pending job considered this cycle reaches ``reserve_after_s`` or a held
    #: landing room lapses (``migrate_hold_s``; see :mod:`.horizon`).
    until: float = math.inf
    #: jobs that may be moved for fragmentation, per ledger GPU (built at the first search), and
    #: the jobs moved this cycle.
    movers: dict[int, list[Mover]] | None = None
    moved: int = 0
    #: failed migration searches by constraints (:func:`_no_place_key`): (frees, memory, compute, peak).
    no_migrate: dict[tuple[object, ...], list[tuple[int, int, float, int]]] = field(default_factory=dict)
    #: movers that could not land anywhere, by (request shape, GPU left): ``ledger.frees`` then.
    no_land: dict[tuple[object, ...], int] = field(default_factory=dict)
    #: moved jobs whose landing room is held this cycle (see :class:`_MoveHold`): (ledger index, the room).
    holds: dict[str, tuple[int, Holding]] = field(default_factory=dict)


@dataclass(frozen=True)
class _MoveHold:
    """The landing room of a job moved for fragmentation, held from cycle to cycle until it runs again.

    ``gpu``: the destination's uuid (ledger indices change with the layout); ``req``: the mover's
    one-slice request as checked there; ``until``: when the hold lapses (``migrate_hold_s`` after
    the move); ``released``: last seen SUSPENDED (released, about to queue again)."""

    gpu: str
    req: SliceRequest
    until: float
    released: bool = False


class Scheduler:
    """The pure scheduling policy shared by the coordinator, the simulator and the benchmarks.

    Args:
        config: operator knobs (validated by :class:`SchedulerConfig`); None: ``DEFAULT_SCHEDULER``, the defaults `gpupool coordinator` runs.

    Example:
        >>> from gpupool_sdk.resources import GpuInfo, JobSpec, GiB
        >>> from gpupool_sdk.scheduler import ClusterSnapshot, JobView, Scheduler, SchedulerConfig
        >>> gpu = GpuInfo(uuid="GPU-0", node="n", index=0, model="H100-80GB", memory_bytes=80 * GiB)
        >>> job = JobView(spec=JobSpec(name="a", memory="20GiB"))
        >>> snap = ClusterSnapshot(now=0.0, gpus={"GPU-0": gpu}, jobs={"a": job})
        >>> [type(d).__name__ for d in Scheduler(SchedulerConfig()).schedule(snap)]
        ['Grant']
    """

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or DEFAULT_SCHEDULER  # what `gpupool coordinator` runs
        self._memo = _BuildMemo()
        #: per pending job, what depends only on its view and the GPU layout (a memo of pure functions,
        #: reused while the job's spec is the same object and its peak and count are unchanged):
        #: (spec, peak, count, request, reject or etcd-limit reason, count is the spec's own).
        self._pend: dict[str, tuple[JobSpec, tuple[int | None, tuple[int, ...]], int, SliceRequest, str | None, bool]] = {}
        self._pend_layout: GpuLayout | None = None
        #: per pending job without allocations, its sort key while the order does not move with time:
        #: (spec, attained, remaining, order, key).
        self._keys: dict[str, tuple[JobSpec, float, float | None, int, tuple[object, ...]]] = {}
        #: the reason a request could not be placed, by request object (see :meth:`_why`), while
        #: the GPU layout is the same: (request, reason).
        self._whys: dict[int, tuple[SliceRequest, str]] = {}
        self._whys_layout: GpuLayout | None = None
        self._horizon = HorizonMemo()
        #: Queue decisions of the last cycle and of this one, by job (see :meth:`_queue_decision`).
        self._queued_last: dict[str, Queue] = {}
        self._queued_now: dict[str, Queue] = {}
        #: per reason, the jobs :meth:`_queue_all` queued with it last cycle and this one, and the decisions.
        self._bulk_last: dict[str, tuple[list[str], list[Queue]]] = {}
        self._bulk_now: dict[str, tuple[list[str], list[Queue]]] = {}
        #: the line of pending jobs kept from cycle to cycle (see :meth:`_line_up`): per job
        #: (view, request, request shape, sort key); the keys sorted, and the names in that order;
        #: the (GPU layout, config) it was built for.
        self._line: dict[str, _Entry] = {}
        self._line_keys: list[tuple[object, ...]] = []
        self._line_names: list[str] = []
        self._line_ctx: tuple[GpuLayout | None, SchedulerConfig] | None = None
        #: reservations of the last cycle and of this one, by job (``keep_reservations``; see
        #: :meth:`_kept_reservation`): (request shape, GPUs, their loads when chosen), while the
        #: GPU layout is the same.
        self._kept_last: dict[str, tuple[tuple[object, ...], tuple[int, ...], tuple[GpuLoad, ...]]] = {}
        self._kept_now: dict[str, tuple[tuple[object, ...], tuple[int, ...], tuple[GpuLoad, ...]]] = {}
        self._kept_layout: GpuLayout | None = None
        #: per shared job holding allocations: (allocations, spec, peak, peak history, quota, balloon target).
        self._btargets: dict[str, tuple[tuple[object, ...], JobSpec, int | None, tuple[int, ...], int, int]] = {}
        self._btargets_config: SchedulerConfig | None = None
        #: per job that may be moved for fragmentation: (view, its request when placed again).
        self._mover_reqs: dict[str, tuple[JobView, SliceRequest]] = {}
        #: per running job in the last victim index: (view, running priority, LAS standing).
        self._standings: dict[str, tuple[JobView, float, tuple[int, int] | None]] = {}
        #: jobs moved for fragmentation whose landing room is held until they run again (lost at a failover).
        self._holds: dict[str, _MoveHold] = {}

    def schedule(self, snapshot: ClusterSnapshot) -> list[Decision]:
        """Run one cycle; returns the decisions in the order they should be applied."""
        return list(self.run(snapshot).decisions)

    def run(self, snapshot: ClusterSnapshot) -> ScheduleResult:
        """Run one cycle; returns the decisions plus how many pending jobs were considered."""
        config = self.config
        self._queued_last, self._queued_now = self._queued_now, {}
        self._bulk_last, self._bulk_now = self._bulk_now, {}
        ledger = build_ledger(snapshot, config, self._memo)
        cyc = _Cycle(snapshot, config, ledger)
        same_layout = self._kept_layout is ledger.layout
        self._kept_last, self._kept_now = (self._kept_now if same_layout else {}), {}
        self._kept_layout = ledger.layout
        now = snapshot.now

        # Protocol: acks and deadlines.
        proto = handle_protocol(snapshot, ledger, config)
        cyc.decisions.extend(proto.decisions)
        cyc.busy |= proto.busy
        for dec in proto.decisions:
            if isinstance(dec, Preempt):  # a balloon it could not honour: now it is being preempted
                cyc.busy.add(dec.job)
                cyc.preempting[dec.job] = dec.for_job

        # Gangs that lost a member: release every node's part (no half-gang keeps a slice).
        for rel in broken_gangs(snapshot, ledger, proto.freed, self._memo.held):
            cyc.decisions.append(rel)
            cyc.busy.add(rel.job)
            proto.busy.discard(rel.job)
            proto.freed.add(rel.job)

        # Health / drain.
        vacate = [] if self._memo.all_placeable(snapshot) else health_preemptions(snapshot, config, cyc.busy | proto.freed)
        for p in vacate:
            cyc.decisions.append(p)
            cyc.busy.add(p.job)
            cyc.preempting[p.job] = None

        # Capacity already being freed: jobs with a preempt / resize / balloon directive in flight.
        for name in sorted(proto.busy):
            view = snapshot.jobs[name]
            d = view.directive
            if d is None or name in cyc.preempting:
                continue
            if d.kind is DirectiveKind.PREEMPT:
                cyc.preempting[name] = freeing_for(view)
            elif d.kind is DirectiveKind.RESIZE and "keep" in d.target:
                cyc.shrinking[name] = (frozenset(kept_gpus(d, ledger.index_of)), freeing_for(view))
            elif d.kind is DirectiveKind.BALLOON and "memory_bytes" in d.target:
                cyc.ballooning[name] = (target_int(d, "memory_bytes", view.spec.memory_bytes), freeing_for(view))

        # Pending jobs: the spec's PENDING jobs plus resized jobs re-placed at their target count.
        requeued, busy, jobs = proto.requeued, cyc.busy, snapshot.jobs
        waiting = JobState.PENDING
        own = [
            (n, v)
            for n, v in jobs.items()
            if v.state is waiting and not v.allocations and n not in busy and n not in requeued
        ]
        counts: dict[str, int] = {}
        for name in requeued:
            resized = jobs.get(name)
            if resized is not None:
                cap = slice_cap(resized.spec, config.etcd_max_txn_ops)
                counts[name] = max(resized.spec.min_gpus or 1, min(requeued[name], cap))

        # A moved job's landing room stays held until it runs again; a resize holds the room it
        # grows into, from its directive to its re-placement.
        cyc.pinned = proto.pinned
        if self._holds:
            self._apply_holds(cyc)
        if snapshot.gpus:
            self._hold_resizes(cyc, proto.busy, counts)

        if not snapshot.gpus:
            for name in sorted([n for n, _ in own] + list(counts)):
                cyc.decisions.append(Queue(name, "queued: no GPUs published"))
            return ScheduleResult(tuple(cyc.decisions), considered=0)

        layout = self._memo.layout_for(snapshot)
        if self._pend_layout is not layout:
            self._pend, self._pend_layout = {}, layout
        if time_dependent_order(config):
            names, entries = self._line_up_plain(cyc, own, counts, now)
        else:
            names, entries = self._line_up(cyc, own, counts, now)

        considered = 0
        max_decisions = config.max_decisions
        total = len(names)
        limit = config.max_considered or total
        i = 0
        while i < total and cyc.actions < max_decisions and considered < limit:
            entry = entries[names[i]]
            considered += 1
            i += 1
            self._consider(cyc, entry[0], entry[1])
        rest = names[i:] if i < total else []
        if rest and cyc.actions < max_decisions:
            # Behind the first ``max_considered``: placed where they fit now (backfill: no wait,
            # balloon, shrink, preemption or reservation is planned for them), else queued.
            behind = f"queued: behind the first {limit} in order (max_considered): placed only where it fits now"
            fail_cache, ledger, pinned = cyc.fail_cache, cyc.ledger, cyc.pinned
            blocked = ledger.blocked_jobs
            #: shapes that failed here, with ``ledger.frees`` then: the same shape fails again until a free.
            failed: dict[tuple[object, ...], int] = {}
            unplaced: list[str] = []
            for j, name in enumerate(rest):
                if cyc.actions >= max_decisions:
                    rest = rest[j:]
                    break
                view, req, shape, _key = entries[name]
                generic = name not in blocked and name not in pinned and name not in cyc.holds
                if generic and failed.get(shape) == ledger.frees:
                    unplaced.append(name)
                    continue
                gpus = self._place(cyc, view, req, fail_cache.get(shape) if generic else None)
                if gpus is None:
                    if generic:
                        failed[shape] = ledger.frees
                    unplaced.append(name)
                else:
                    self._grant(cyc, view, req, gpus)
            else:
                rest = []
            self._queue_all(cyc, unplaced, behind)
        if rest:
            self._queue_all(cyc, rest, f"queued: not considered this cycle (max_decisions={max_decisions} reached)")

        if cyc.queued == 0:
            self._deflate(cyc)
        if config.resize_up and cyc.deferred == 0:
            self._grow_fresh(cyc)
            self._resize_up(cyc)
        # Only jobs holding allocations (memo.held) or with a directive in flight have timed rules.
        held = self._memo.held.keys() | proto.busy
        valid_until = min(cyc.until, running_horizon(snapshot, config, held, self._horizon))
        return ScheduleResult(tuple(cyc.decisions), considered=considered, valid_until=valid_until)

    # ------------------------------------------------------------------ one pending job

    def _consider(self, cyc: _Cycle, view: JobView, req: SliceRequest) -> None:
        ledger = cyc.ledger
        config = cyc.config
        now = cyc.snapshot.now
        shape = req.shape
        cached = None if view.name in ledger.blocked_jobs or view.name in cyc.holds else cyc.fail_cache.get(shape)
        gpus = self._place(cyc, view, req, cached)
        if gpus is not None:
            self._grant(cyc, view, req, gpus)
            return
        prio = effective_priority(view, now, config)

        # 1. Capacity already being freed for this job (or for nobody in particular): wait for it.
        if cyc.preempting or cyc.ballooning or cyc.shrinking:
            plan = self._plan_waiting(cyc, view, req)
            if plan is not None:
                cyc.claimed.update(plan.jobs)
                ledger.block(plan.gpus, view.name)
                self._queue(cyc, view, f"queued: waiting for {_count(len(plan.jobs), 'release')} of {', '.join(plan.jobs)}")
                return

        # 2-3. Balloon shared jobs down to their predicted peaks, else preempt lower-priority jobs.
        if config.allow_preemption and cyc.actions < config.max_decisions:
            held_for_it = view.name in ledger.blocked_jobs  # others' failures say nothing about its GPUs
            known = self._keys.get(view.name) if not view.allocations else None
            if known is not None and known[0] is view.spec and config.las_threshold_gpu_s and config.las_preempt:
                # The LAS queue is in the sort key _order kept for this view this cycle.
                min_queue = int(known[4][2]) + 1  # type: ignore[call-overload]
                las = (las_level(prio), min_queue) if min_queue <= len(config.las_threshold_gpu_s) else None
            else:
                las = las_bound(view, prio, now, config)
            # A failed victim search says nothing about a job with other LAS victims: key by them.
            pkey = shape if las is None else (*shape, las)
            try_balloon = held_for_it or _worth_trying(cyc.no_balloon.get(shape), ledger.frees, prio)
            try_preempt = held_for_it or _worth_trying(cyc.no_preempt.get(pkey), ledger.frees, prio)
            none_fit = True
            if (try_balloon or try_preempt) and cyc.attempts >= config.max_preemption_attempts:
                # It may have had a plan: it searches again next cycle, and nothing grows meanwhile.
                cyc.deferred += 1
                try_balloon = try_preempt = False
                none_fit = False  # no migration search either (it comes after them)
            if try_balloon or try_preempt:
                cyc.attempts += 1
            # A one-slice request that was not placed above: no GPU takes a slice of it now (the
            # ledger is as it was then: a plan tried since was undone), as the searches may assume.
            none_fit = none_fit and req.count == 1 and not req.per_node
            if try_balloon and self._try_balloon(cyc, view, req, prio, none_fit):
                return
            if try_balloon:
                cyc.no_balloon[shape] = _failed(cyc.no_balloon.get(shape), ledger.frees, prio)
            if try_preempt and self._try_preempt(cyc, view, req, prio, las, none_fit):
                return
            if try_preempt:
                cyc.no_preempt[pkey] = _failed(cyc.no_preempt.get(pkey), ledger.frees, prio)
            # Move a few running shared jobs off one GPU (each fits elsewhere now) to open room there.
            if (
                config.migrate_for_fragmentation
                and none_fit
                and cyc.moved < config.migrate_max_per_cycle
                and cyc.actions < config.max_decisions
                and (held_for_it or not _dominated(cyc.no_migrate.get(_no_place_key(req)), ledger.frees, req))
                and self._try_migrate(cyc, view, req)
            ):
                return

        reason = self._reason(cyc, req) if cached is None or cached[0] != ledger.frees else cached[1]
        cyc.fail_cache[shape] = (ledger.frees, reason)

        # 4. Reserve GPUs for a job blocked for long: lower jobs only backfill elsewhere.
        if cyc.reservations < config.max_reservations:
            waited = waited_s(view, now)
            if waited >= config.reserve_after_s:
                hold = self._kept_reservation(cyc, view.name, req) if config.keep_reservations else None
                if hold is None:
                    hold = self._reservation(cyc, view, req, prio)
                if hold:
                    if config.keep_reservations:
                        loads = ledger.loads
                        self._kept_now[view.name] = (req.shape, tuple(hold), tuple(loads[i].copy() for i in hold))
                    ledger.block(hold, view.name)
                    cyc.reservations += 1
                    reason += f"; {_count(len(hold), 'GPU')} reserved for it (others backfill elsewhere)"
            else:
                cyc.until = min(cyc.until, now + config.reserve_after_s - waited)
        self._queue(cyc, view, reason)

    def _place(
        self, cyc: _Cycle, view: JobView, req: SliceRequest, cached: tuple[int, str] | None
    ) -> list[int] | None:
        """Where ``req`` fits now (for a shrunk job, the GPUs it kept), or None; ``cached`` is
        this cycle's failure for its shape, if any (it answers while nothing was freed since)."""
        ledger = cyc.ledger
        gpus: list[int] | None = None
        name = req.job
        pinned = cyc.pinned
        if pinned and name in pinned:
            gpus = self._pinned(cyc, req, pinned[name])
        elif cyc.holds and name in cyc.holds:
            gpus = self._held_room(cyc, req)
        if gpus is None and (cached is None or cached[0] != ledger.frees):
            # A request at least as large as one that failed since the last free fails too (loads
            # only grow while a cycle considers pending jobs); not for a job GPUs are held for.
            generic = name not in ledger.blocked_jobs and name not in pinned and not req.per_node and name not in cyc.holds
            nkey = _no_place_key(req) if generic else None
            failed = cyc.no_place.get(nkey) if nkey is not None else None
            frees = ledger.frees
            memory, compute, peak, count = req.memory, req.compute, req.peak, req.min_count
            dominated = False
            if failed:
                for f, m, c, p, n in failed:
                    if f == frees and m <= memory and c <= compute and p <= peak and n <= count:
                        dominated = True
                        break
            if not dominated:
                gpus = place(ledger, req)
                if gpus is None and nkey is not None:
                    # Keep only the smallest failures (an antichain): one that asks at least as
                    # much as this one answers nothing this one does not.
                    entries = [
                        e
                        for e in (failed or ())
                        if e[0] == frees and not (memory <= e[1] and compute <= e[2] and peak <= e[3] and count <= e[4])
                    ]
                    entries.append((frees, memory, compute, peak, count))
                    cyc.no_place[nkey] = entries
        return gpus

    def _request(
        self, cyc: _Cycle, view: JobView, count: int | None, reject_cache: dict[tuple[object, ...], str | None]
    ) -> SliceRequest | None:
        """The request of pending ``view`` (``count``: a resized job's target, None: the spec's own
        count), or None after appending its ``Queue`` (a gang still forming) or ``Reject``.

        What depends only on the spec, the job's memory peaks and the GPU layout is kept in
        ``self._pend`` (a memo of pure functions: reused while the spec is the same object and the
        peaks and count are unchanged; the caller clears it when the layout changes)."""
        config = self.config
        spec = view.spec
        name = view.name
        if spec.is_gang:
            gang_wait = gang_problem(view)
            if gang_wait is not None:
                self._queue(cyc, view, f"queued: {gang_wait}")
                return None
        pend = self._pend
        hit = pend.get(name)
        own = count is None
        max_ops = config.etcd_max_txn_ops
        if hit is not None and hit[0] is spec and own and hit[5]:
            count = hit[2]  # the spec's own count: a function of the spec
        elif count is None:
            count = min(spec.gpus, slice_cap(spec, max_ops))
        peaks = (view.memory_peak_bytes, view.memory_peak_history)
        if hit is not None and hit[0] is spec and hit[1] == peaks and hit[2] == count:
            req, why = hit[3], hit[4]
        else:
            req = request_for(view, config, count)
            key = req.shape
            if key not in reject_cache:
                reject_cache[key] = reject_reason(req, self._memo.pool, config.overcommit_ratio)
            why = reject_cache[key] or txn_limit_reason(spec, max_ops)
        if not spec.is_gang:  # a gang's request depends on its members too
            pend[name] = (spec, peaks, count, req, why, own)
        if why is not None:
            cyc.decisions.append(Reject(name, f"impossible: {why}"))
            return None
        return req

    def _prune_memos(self, jobs: Mapping[str, JobView]) -> None:
        """Drop the per-job memos of jobs no longer in the snapshot (they are pure functions of a
        job's view: an entry of a job still there is never wrong, only possibly unused)."""
        if len(self._pend) > 2 * len(jobs) + 256:
            self._pend = {n: e for n, e in self._pend.items() if n in jobs}
        if len(self._keys) > 2 * len(jobs) + 256:
            self._keys = {n: e for n, e in self._keys.items() if n in jobs}

    def _line_up_plain(
        self, cyc: _Cycle, own: list[tuple[str, JobView]], counts: dict[str, int], now: float
    ) -> tuple[list[str], dict[str, _Entry]]:
        """The pending jobs in the order of :func:`order_pending`, computed afresh (for a pending
        order that moves with time: aging, ``max_wait_s``, LAS promotion), and per job its view,
        request and request shape; Queue / Reject decisions of jobs that cannot be placed are
        appended in name order."""
        jobs = cyc.snapshot.jobs
        self._line, self._line_keys, self._line_names, self._line_ctx = {}, [], [], None
        self._prune_memos(jobs)
        reject_cache: dict[tuple[object, ...], str | None] = {}
        live: dict[str, _Entry] = {}
        for name in sorted([n for n, _ in own] + list(counts)):
            view = jobs[name]
            req = self._request(cyc, view, counts.get(name), reject_cache)
            if req is not None:
                live[name] = (view, req, req.shape, ())
        ordered = order_pending((e[0] for e in live.values()), now, self.config)
        return [v.name for v in ordered], live

    def _line_up(
        self, cyc: _Cycle, own: list[tuple[str, JobView]], counts: dict[str, int], now: float
    ) -> tuple[list[str], dict[str, _Entry]]:
        """What :meth:`_line_up_plain` returns, for a pending order that does not move with time,
        kept from cycle to cycle: the line of pending jobs (sorted by :func:`sort_key`) holds each
        job with its spec's own count, no allocations and no gang; a job whose view is the same
        object as when it joined stays where it is with its request, and only the others (new,
        changed, gone) are looked at. The same view, layout and config give the same request
        (the memo of :meth:`_request`) and the same sort key (the key depends on the view alone
        when the order does not move with time), so the line is the one a fresh sort would give.
        ``tests/scheduler/test_incremental_line.py`` compares it with a fresh scheduler."""
        jobs = cyc.snapshot.jobs
        ctx = (self._pend_layout, self.config)
        if self._line_ctx is None or self._line_ctx[0] is not ctx[0] or self._line_ctx[1] is not ctx[1]:
            self._line, self._line_keys, self._line_names, self._line_ctx = {}, [], [], ctx
        line, keys, names = self._line, self._line_keys, self._line_names
        slow: list[str] = []
        line_get = line.get
        for name, view in own:
            entry = line_get(name)
            if entry is None or entry[0] is not view:
                slow.append(name)
        gone = line.keys() - {n for n, _ in own}
        if slow or gone or counts:
            self._prune_memos(jobs)
            for name in [*gone, *slow, *counts]:
                entry = line.pop(name, None)
                if entry is not None:
                    k = bisect_left(keys, entry[3])
                    del keys[k]
                    del names[k]
        if not slow and not counts:
            return names, line
        reject_cache: dict[tuple[object, ...], str | None] = {}
        extra: list[tuple[tuple[object, ...], str]] = []
        extra_entries: dict[str, _Entry] = {}
        for name in sorted([*slow, *counts]):
            view = jobs[name]
            count = counts.get(name)
            req = self._request(cyc, view, count, reject_cache)
            if req is None:
                continue
            key = self._sort_key(view, now)
            if count is None and not view.spec.is_gang:
                line[name] = (view, req, req.shape, key)
                k = bisect_left(keys, key)
                keys.insert(k, key)
                names.insert(k, name)
            else:  # a resized job re-placed at its target, or a gang: looked at every cycle
                extra.append((key, name))
                extra_entries[name] = (view, req, req.shape, key)
        if not extra:
            return names, line
        extra.sort()
        merged = [n for _k, n in heapq.merge(zip(keys, names, strict=True), extra)]
        return merged, {**line, **extra_entries}

    def _sort_key(self, view: JobView, now: float) -> tuple[object, ...]:
        """:func:`sort_key` of ``view``, kept per job while the order does not move with time and
        its spec, attained and remaining service and order are unchanged (a job holding
        allocations, a resized job re-placed, is ranked by the compute it holds: not kept)."""
        config = self.config
        if view.allocations:
            return sort_key(view, now, config)
        spec, attained, remaining, order = view.spec, view.attained_gpu_s, view.remaining_s, view.order
        hit = self._keys.get(spec.name)
        if hit is not None and hit[0] is spec and hit[1] == attained and hit[2] == remaining and hit[3] == order:
            return hit[4]
        key = sort_key(view, now, config)
        self._keys[spec.name] = (spec, attained, remaining, order, key)
        return key

    def _pinned(self, cyc: _Cycle, req: SliceRequest, keep: list[int]) -> list[int] | None:
        """The GPUs a shrunk job kept, when each still takes a slice of ``req`` (else None: it is
        placed like any job)."""
        ledger = cyc.ledger
        avoid: set[str] = set()
        if req.anti_affinity is not None:
            avoid = {n for n, c in ledger.groups.get(req.anti_affinity, {}).items() if c > 0}
        ok = [
            i
            for i in keep
            if ledger.class_of(i) is not None
            and ledger.blocked.get(i, req.job) == req.job
            and ledger.nodes[i] not in avoid
            and fits(ledger.loads[i], req, ledger.ratio)
        ][: req.count]
        return ok if len(ok) >= req.min_count else None

    def _apply_holds(self, cyc: _Cycle) -> None:
        """Occupy in the ledger the landing room of each moved job still on its way (its move
        directive in flight, released, or pending again), so that nobody else is placed there, as
        a reservation. A hold is dropped when it lapses (``migrate_hold_s``), when its job is gone
        (but for the instant a released job queues again: ``gpupool run`` releases its lease,
        which takes the spec with it, and submits the spec again at once) or runs (granted
        anywhere: it holds allocations without a preemption in flight), when its GPU is gone or
        unschedulable, and when the room no longer fits it (someone else was granted it, e.g. by
        a leader that did not know the hold). The first lapse bounds ``valid_until``."""
        ledger = cyc.ledger
        jobs = cyc.snapshot.jobs
        now = cyc.snapshot.now
        for name in sorted(self._holds):
            hold = self._holds[name]
            view = jobs.get(name)
            i = ledger.index_of.get(hold.gpu)
            if view is None:
                on_its_way = hold.released
            else:
                d = view.directive
                released = view.state is JobState.SUSPENDED and not view.allocations
                on_its_way = (
                    (d is not None and d.kind is DirectiveKind.PREEMPT)
                    or released
                    or (view.state is JobState.PENDING and not view.allocations)
                )
                if released != hold.released:
                    hold = self._holds[name] = replace(hold, released=released)
            if (
                now >= hold.until
                or not on_its_way
                or i is None
                or ledger.class_of(i) is None
                or not fits(ledger.loads[i], hold.req, ledger.ratio)
            ):
                del self._holds[name]
                continue
            room = holdings_for(ledger, hold.req, [i])[0]
            ledger.occupy([room])
            cyc.holds[name] = (i, room)
            cyc.until = min(cyc.until, hold.until)

    def _held_room(self, cyc: _Cycle, req: SliceRequest) -> list[int] | None:
        """The landing room held for moved job ``req.job``, when it still takes ``req`` there (it
        is then granted it); else None and the hold is dropped (it is placed like any job).

        The room is its own even on a GPU held for another job this cycle (a reservation, a
        preemption's or a migration's room): each such plan was made with the room counted as
        taken, so it does not need it."""
        ledger = cyc.ledger
        name = req.job
        i, room = cyc.holds.pop(name)
        ledger.vacate([room])
        avoid: set[str] = set()
        if req.anti_affinity is not None:
            avoid = {n for n, c in ledger.groups.get(req.anti_affinity, {}).items() if c > 0}
        if req.count == 1 and ledger.nodes[i] not in avoid and fits(ledger.loads[i], req, ledger.ratio):
            return [i]
        self._holds.pop(name, None)
        return None

    def _plan_waiting(self, cyc: _Cycle, view: JobView, req: SliceRequest) -> Plan | None:
        if cyc.freeing_by_job is None:
            by_job: dict[str | None, list[str]] = {}
            for n, who in cyc.preempting.items():
                by_job.setdefault(who, []).append(n)
            for n, (_t, who) in cyc.ballooning.items():
                by_job.setdefault(who, []).append(n)
            for n, (_k, who) in cyc.shrinking.items():
                by_job.setdefault(who, []).append(n)
            cyc.freeing_by_job = by_job
        names = [
            n for n in (*cyc.freeing_by_job.get(None, ()), *cyc.freeing_by_job.get(view.name, ())) if n not in cyc.claimed
        ]
        if not names:
            return None
        pre = sorted(n for n in names if n in cyc.preempting)
        bal = {n: cyc.ballooning[n][0] for n in names if n in cyc.ballooning and n not in cyc.preempting}
        shr = {n: cyc.shrinking[n][0] for n in names if n in cyc.shrinking}
        return plan_from_freeing(cyc.ledger, req, pre, bal, shr)

    def _balloon_targets(self, cyc: _Cycle) -> dict[str, int]:
        """:func:`balloon_targets` of the jobs holding allocations (any priority, none busy), each
        job's quota and target kept from cycle to cycle while its allocations tuple and spec are
        the same objects and its memory peaks are unchanged (what they are a function of)."""
        config = cyc.config
        if self._btargets_config is not config:
            self._btargets, self._btargets_config = {}, config
        memo = self._btargets
        busy = cyc.busy
        out: dict[str, int] = {}
        for v, _held in self._memo.held.values():
            spec = v.spec
            if spec.qos != QoS.SHARED or v.state is not JobState.GRANTED or v.directive is not None:
                continue
            name = spec.name
            allocs = v.allocations
            if name in busy or not allocs:
                continue
            hit = memo.get(name)
            if (
                hit is None
                or hit[0] is not allocs
                or hit[1] is not spec
                or hit[2] != v.memory_peak_bytes
                or hit[3] != v.memory_peak_history
            ):
                quota = max(a.memory_bytes for a in allocs)
                hit = memo[name] = (allocs, spec, v.memory_peak_bytes, v.memory_peak_history, quota,
                                    balloon_target(v, quota, config))
            if hit[5] < hit[4]:
                out[name] = hit[5]
        if len(memo) > 2 * len(self._memo.held) + 256:
            held = self._memo.held
            self._btargets = {n: e for n, e in memo.items() if n in held}
        return out

    def _try_balloon(self, cyc: _Cycle, view: JobView, req: SliceRequest, prio: float, none_fit: bool = False) -> bool:
        jobs = cyc.snapshot.jobs
        if cyc.balloonable is None:
            # Only jobs holding allocations can be ballooned (not the whole queue, every cycle).
            targets = self._balloon_targets(cyc)
            pool = sorted((jobs[n].spec.priority, n) for n in targets)
            cyc.balloonable = VictimIndex(cyc.ledger, [(n, float(p)) for p, n in pool], targets)
        if not cyc.balloonable or cyc.balloonable.hopeless(req, balloon_bound(prio), None, none_fit):
            return False
        groups = cyc.balloonable.groups(req, balloon_bound(prio), cyc.busy)
        assert cyc.balloonable.targets is not None
        plan = plan_balloon(cyc.ledger, req, cyc.balloonable.targets, groups=groups)
        if plan is None:
            return False
        now = cyc.snapshot.now
        for name, target in zip(plan.jobs, plan.targets, strict=True):
            cyc.decisions.append(
                Balloon(
                    name,
                    target,
                    f"{balloon_reason(jobs[name], target, cyc.config)} to make room for {view.name}",
                    deadline=now + cyc.config.balloon_grace_s,
                    for_job=view.name,
                )
            )
            cyc.busy.add(name)
            cyc.claimed.add(name)
            cyc.ballooning[name] = (target, view.name)
            cyc.freeing_by_job = None
            cyc.actions += 1
        cyc.ledger.block(plan.gpus, view.name)
        self._queue(cyc, view, f"queued: waiting for {_count(len(plan.jobs), 'balloon')} of {', '.join(plan.jobs)}")
        return True

    def _try_preempt(
        self,
        cyc: _Cycle,
        view: JobView,
        req: SliceRequest,
        prio: float,
        las: tuple[int, int] | None,
        none_fit: bool = False,
    ) -> bool:
        now = cyc.snapshot.now
        config = cyc.config
        if cyc.victims is None:
            # Victims hold allocations in the snapshot (this cycle's grants are not GRANTED yet).
            pool = victim_pool((v for v, _ in self._memo.held.values()), now, config, cyc.ledger)
            use_las = bool(config.las_threshold_gpu_s and config.las_preempt)
            # Running priority and LAS standing move with time only with aging, max_wait_s or
            # promotion; otherwise each view's are kept from the last cycle that built the index.
            old = self._standings if not time_dependent_order(config) else {}
            new: dict[str, tuple[JobView, float, tuple[int, int] | None]] = {}
            standing: dict[str, tuple[int, int]] = {}
            ranked: list[tuple[str, float]] = []
            for v in pool:
                hit = old.get(v.name)
                if hit is None or hit[0] is not v:
                    hit = (v, running_priority(v, now, config), las_standing(v, now, config) if use_las else None)
                new[v.name] = hit
                if hit[2] is not None:
                    standing[v.name] = hit[2]
                ranked.append((v.name, hit[1]))
            self._standings = new
            cyc.victims = VictimIndex(cyc.ledger, ranked, None, standing)
        if not cyc.victims or cyc.victims.hopeless(req, preempt_bound(prio), las, none_fit):
            return False  # also answers the shrink search: a shrink frees less than a preemption
        shrink = self._shrink_plan(cyc, req, prio, las) if config.shrink_elastic else None
        groups = cyc.victims.groups(req, preempt_bound(prio), cyc.busy, las)
        plan = plan_preemption(cyc.ledger, req, (), groups=groups)
        if shrink is not None and (plan is None or self._standing(cyc, shrink.jobs) <= self._standing(cyc, plan.jobs)):
            self._shrink(cyc, view, shrink, prio)
            return True
        if plan is None:
            return False
        mine = f"priority {view.spec.priority}, effective {prio:.1f}"
        if config.las_threshold_gpu_s:
            mine += f", LAS queue {las_rank(view, now, config)}"
        for name in plan.jobs:
            victim = cyc.snapshot.jobs[name]
            theirs = f"priority {victim.spec.priority}"
            if config.las_threshold_gpu_s:
                theirs += f", LAS queue {las_rank(victim, now, config)}"
            cyc.decisions.append(
                Preempt(
                    name,
                    f"preempted to make room for {view.name} ({mine}); {name} has {theirs}",
                    deadline=preempt_deadline(victim, now, cyc.config),
                    for_job=view.name,
                )
            )
            cyc.busy.add(name)
            cyc.claimed.add(name)
            cyc.preempting[name] = view.name
            cyc.freeing_by_job = None
            cyc.actions += 1
        # Nobody else may take the room being made for this job.
        cyc.ledger.block(plan.gpus, view.name)
        self._queue(cyc, view, f"queued: waiting for {_count(len(plan.jobs), 'preemption')} of {', '.join(plan.jobs)}")
        return True

    def _try_migrate(self, cyc: _Cycle, view: JobView, req: SliceRequest) -> bool:
        """Move running shared jobs off one GPU for ``view`` (:mod:`.migrate`): each is preempted
        with a ``migrate:`` reason naming ``view`` and queues again at its old place; the GPU is
        held for ``view`` (as for a preemption) and each mover's landing room for the rest of this
        cycle. The plan is bounded by ``migrate_max_per_cycle`` (moves left this cycle)."""
        ledger = cyc.ledger
        config = cyc.config
        now = cyc.snapshot.now
        if cyc.movers is None:
            cyc.movers = movable_jobs((v for v, _ in self._memo.held.values()), ledger, now, config, self._mover_reqs)
        plan = plan_migration(ledger, req, cyc.movers, cyc.busy, cyc.no_land) if cyc.movers else None
        if plan is None or cyc.moved + len(plan.moves) > config.migrate_max_per_cycle:
            if view.name not in ledger.blocked_jobs:
                # A request asking at least as much, with the same constraints, is not searched
                # again until capacity is freed (moving more rarely lands where moving less did not).
                key = _no_place_key(req)
                kept = [e for e in cyc.no_migrate.get(key, ()) if e[0] == ledger.frees]
                kept.append((ledger.frees, req.memory, req.compute, req.peak))
                cyc.no_migrate[key] = kept
            return False
        where = ledger.gpus[plan.gpu].uuid
        for move in plan.moves:
            mover = cyc.snapshot.jobs[move.job]
            dest = ledger.gpus[move.dest]
            # Its landing room is held for the rest of this cycle (it keeps its own until its
            # release), and in the next ones until it runs again (``migrate_hold_s`` at most).
            ledger.reserve(move.job, holdings_for(ledger, move.req, [move.dest]), move.req.anti_affinity)
            if config.migrate_hold_s > 0:
                self._holds[move.job] = _MoveHold(dest.uuid, move.req, now + config.migrate_hold_s)
            cyc.decisions.append(
                Preempt(
                    move.job,
                    f"{MIGRATE_PREFIX} defragmenting {where} for {view.name} "
                    f"({format_size(req.memory)} per slice); {move.job} fits now on {dest.uuid} ({dest.node}) "
                    f"and queues again at its place",
                    deadline=preempt_deadline(mover, now, config),
                    for_job=view.name,
                )
            )
            cyc.busy.add(move.job)
            cyc.claimed.add(move.job)
            cyc.preempting[move.job] = view.name
            cyc.freeing_by_job = None
            cyc.actions += 1
            cyc.moved += 1
        ledger.block([plan.gpu], view.name)
        names = ", ".join(m.job for m in plan.moves)
        self._queue(cyc, view, f"queued: waiting for {_count(len(plan.moves), 'migration')} of {names} (defragmenting {where})")
        return True

    def _shrink_plan(
        self, cyc: _Cycle, req: SliceRequest, prio: float, las: tuple[int, int] | None
    ) -> Plan | None:
        """The shrink plan for ``req`` among the victims of this bound that are elastic above
        their ``min_gpus`` (in victim order), or None."""
        assert cyc.victims is not None
        if cyc.shrink_budget is None:
            jobs = cyc.snapshot.jobs
            holdings = cyc.ledger.holdings
            cyc.shrink_budget = {}
            for name, _p in cyc.victims.pool:
                spec = jobs[name].spec
                budget = len(holdings.get(name, ())) - (spec.min_gpus or spec.gpus)
                # A job that refused a resize is not asked again before its retry time (it may be preempted).
                if spec.is_elastic and budget > 0 and not resize_held_off(jobs[name], cyc.snapshot.now):
                    cyc.shrink_budget[name] = budget
        if not cyc.shrink_budget:
            return None
        budgets = cyc.shrink_budget
        bound = float(math.floor(preempt_bound(prio)))
        # The elastic candidates under this bound, once per bound and cycle (the pool and the
        # budgets do not change within a cycle; who is busy does).
        under = cyc.shrink_under.get((bound, las))
        if under is None:
            under = cyc.shrink_under[(bound, las)] = [
                (n, budgets[n]) for n in cyc.victims.candidates_under(bound, las) if n in budgets
            ]
        shrinkable = [(n, b) for n, b in under if n not in cyc.busy]
        if not shrinkable:
            return None
        if req.min_count < req.count:
            full = plan_shrink(cyc.ledger, replace(req, min_count=req.count), shrinkable)
            if full is not None:
                return full
        return plan_shrink(cyc.ledger, req, shrinkable)

    def _standing(self, cyc: _Cycle, names: tuple[str, ...]) -> tuple[int, int, int]:
        """How protected the most protected of ``names`` is as a victim (class, priority, LAS
        queue: the first three fields of :func:`victim_key`; work lost left out)."""
        now = cyc.snapshot.now
        jobs = cyc.snapshot.jobs
        keys = [victim_key(jobs[n], now, cyc.config)[:3] for n in names]
        return max(keys)

    def _shrink(self, cyc: _Cycle, view: JobView, plan: Plan, prio: float) -> None:
        """Resize the plan's elastic victims down to ``min_gpus`` for ``view``: each gives up the
        GPUs of ``plan.drops`` and as many more as its minimum allows (:func:`kept_after_shrink`);
        the GPUs it keeps are named in the Resize and re-granted to it at its ack."""
        now = cyc.snapshot.now
        config = cyc.config
        ledger = cyc.ledger
        mine = f"priority {view.spec.priority}, effective {prio:.1f}"
        if config.las_threshold_gpu_s:
            mine += f", LAS queue {las_rank(view, now, config)}"
        for name, drop in zip(plan.jobs, plan.drops, strict=True):
            victim = cyc.snapshot.jobs[name]
            held = [h.gpu for h in ledger.holdings.get(name, ())]
            keep = kept_after_shrink(ledger, held, drop, victim.spec.min_gpus or victim.spec.gpus)
            cyc.decisions.append(
                Resize(
                    name,
                    len(keep),
                    f"shrink from {len(held)} to {len(keep)} GPU(s) (min {victim.spec.min_gpus}) "
                    f"to make room for {view.name} ({mine})",
                    deadline=preempt_deadline(victim, now, config),
                    for_job=view.name,
                    keep=tuple(ledger.gpus[i].uuid for i in keep),
                )
            )
            cyc.busy.add(name)
            cyc.claimed.add(name)
            cyc.shrinking[name] = (frozenset(keep), view.name)
            cyc.freeing_by_job = None
            cyc.actions += 1
        ledger.block(plan.gpus, view.name)
        self._queue(cyc, view, f"queued: waiting for {_count(len(plan.jobs), 'shrink')} of {', '.join(plan.jobs)}")

    def _grant(self, cyc: _Cycle, view: JobView, req: SliceRequest, gpus: list[int]) -> None:
        ledger = cyc.ledger
        if self._holds:
            self._holds.pop(view.name, None)  # a moved job runs again: its landing room is no longer held
        held = holdings_for(ledger, req, gpus)
        ledger.reserve(view.name, held, req.anti_affinity)
        slices = self._slices(ledger, held)
        nodes = sorted({s.node for s in slices})
        reason = f"granted {_count(len(slices), 'slice')} on {', '.join(nodes)}"
        if len(slices) < view.spec.gpus:
            reason += f" (elastic: {len(slices)} of {view.spec.gpus} wanted)"
        if len(slices) < slice_cap(view.spec, cyc.config.etcd_max_txn_ops):
            cyc.fresh[view.name] = (len(cyc.decisions), req)
        cyc.decisions.append(Grant(view.name, slices, reason))
        cyc.actions += 1

    def _slices(self, ledger: Ledger, held: list[Holding]) -> tuple[SliceGrant, ...]:
        return tuple(
            SliceGrant(
                node=ledger.gpus[h.gpu].node,
                gpu_uuid=ledger.gpus[h.gpu].uuid,
                gpu_index=ledger.gpus[h.gpu].index,
                memory_bytes=h.memory,
                compute_share=h.compute,
            )
            for h in held
        )

    def _queue(self, cyc: _Cycle, view: JobView, reason: str) -> None:
        cyc.decisions.append(self._queue_decision(view.name, reason))
        cyc.queued += 1

    def _queue_all(self, cyc: _Cycle, names: list[str], reason: str) -> None:
        """Queue every job of ``names`` with one ``reason``, as jobs not considered in full: they
        might have used free capacity or made a plan, so nothing grows this cycle (``deferred``).
        One reason for all, so that each job's Queue decision stays the same object from cycle to
        cycle while it stays behind (and when the same jobs are queued for the same reason as
        last cycle, last cycle's decisions are reused whole)."""
        last = self._bulk_last.get(reason)
        if last is not None and last[0] == names:
            queues = last[1]
        else:
            before = self._queued_last
            queues = []
            for name in names:
                q = before.get(name)
                if q is None or q.reason != reason:
                    q = Queue(name, reason)
                queues.append(q)
        self._bulk_now[reason] = (names, queues)
        self._queued_now.update(zip(names, queues, strict=True))
        cyc.decisions.extend(queues)
        cyc.queued += len(names)
        cyc.deferred += len(names)

    def _queue_decision(self, name: str, reason: str) -> Queue:
        """``Queue(name, reason)``; the last cycle's decision when it is equal (decisions are
        immutable: most jobs of a long queue are told the same thing cycle after cycle)."""
        q = self._queued_last.get(name)
        if q is None or q.reason != reason:
            q = Queue(name, reason)
        self._queued_now[name] = q
        return q

    def _reason(self, cyc: _Cycle, req: SliceRequest) -> str:
        """:meth:`_why`, kept from cycle to cycle per request object while the GPU layout is the
        same: without node restrictions it depends only on the request and on how many schedulable
        GPUs match it (fixed by the layout), except when none does (then GPU health is named)."""
        if req.nodes:
            return self._why(cyc, req)
        layout = cyc.ledger.layout
        if self._whys_layout is not layout:
            self._whys, self._whys_layout = {}, layout
        hit = self._whys.get(id(req))
        if hit is not None and hit[0] is req:
            return hit[1]
        reason = self._why(cyc, req)
        if cyc.ledger.matching_count(req) > 0:
            if len(self._whys) > 4 * len(self._pend) + 1024:
                self._whys = {}  # requests of jobs long gone
            self._whys[id(req)] = (req, reason)
        return reason

    def _why(self, cyc: _Cycle, req: SliceRequest) -> str:
        matching = cyc.ledger.matching_count(req)
        if matching == 0:
            which = unusable_gpus(cyc.snapshot, req.features, req.gpu_model)
            return f"queued: every matching GPU is unhealthy, cordoned or draining: {which}"
        if req.qos is QoS.EXCLUSIVE:
            what = "idle GPU" + (f" with >= {format_size(req.memory)}" if req.memory else "")
        elif req.qos is QoS.GUARANTEED:
            what = f"GPU with {format_size(req.memory)} free" + (
                f" and {req.compute:g} compute" if req.compute < 1.0 else " and full compute"
            )
        else:
            what = f"GPU with {format_size(req.memory)} shared quota free (predicted peak {format_size(req.peak)})"
        if req.nodes:
            return node_wait_reason(
                cyc.ledger, req, what, explain=lambda nodes: unusable_gpus(cyc.snapshot, req.features, req.gpu_model, nodes)
            )
        if req.count == 1:
            return f"queued: no {what} among {matching} matching"
        layout = {"pack": "", "spread": " on distinct nodes", "any": ""}[req.topology]
        if req.anti_affinity:
            layout += f" away from group {req.anti_affinity}"
        want = f"{req.min_count}-{req.count}" if req.min_count < req.count else str(req.count)
        return f"queued: needs {want} x {what}{layout} among {matching} matching"

    def _kept_reservation(self, cyc: _Cycle, name: str, req: SliceRequest) -> list[int] | None:
        """The GPUs ``name`` held as its reservation last cycle, when that cycle reserved for it,
        its request has the same shape and each of those GPUs carries the same load as when they
        were chosen and is held for nobody else (``keep_reservations``): the job keeps its
        nominated GPUs, as a preemptor keeps its nominated node in the Kubernetes scheduler,
        instead of a new search over every job holding capacity. Else None."""
        kept = self._kept_last.get(name)
        if kept is None or kept[0] != req.shape:
            return None
        ledger = cyc.ledger
        loads, blocked = ledger.loads, ledger.blocked
        for i, load in zip(kept[1], kept[2], strict=True):
            if loads[i] != load or blocked.get(i, name) != name:
                return None
        return list(kept[1])

    def _reservation(self, cyc: _Cycle, view: JobView, req: SliceRequest, prio: float) -> list[int] | None:
        """GPUs to hold for a long-blocked ``view``: where it fits once the cheapest set of running
        jobs is gone (lower priority and least work first, the same order as victims, but nobody is
        preempted: they finish or are preempted later, and meanwhile nobody else lands there)."""
        now = cyc.snapshot.now
        jobs = cyc.snapshot.jobs
        keys = cyc.holder_keys
        holdings = cyc.ledger.holdings
        if cyc.holder_order is None or cyc.holder_names != holdings.keys():
            # Sorted once per cycle while the holders are the same (keys are unique: they end with the name).
            for n in holdings:
                if n not in keys:
                    keys[n] = victim_key(jobs[n], now)
            cyc.holder_order = sorted(holdings, key=keys.__getitem__)
            cyc.holder_names = set(holdings)
            prios = [jobs[n].spec.priority for n in holdings]
            cyc.holder_prios = (min(prios), max(prios)) if prios else (0, 0)
        order = cyc.holder_order
        # Lower base priority first, then the victim order (a stable partition of the sorted
        # holders; no partition to make when they are all on one side of ``prio``).
        low, high = cyc.holder_prios
        if high < prio or low >= prio:
            victims = order
        else:
            victims = [n for n in order if jobs[n].spec.priority < prio]
            victims += [n for n in order if jobs[n].spec.priority >= prio]
        plan = plan_preemption(cyc.ledger, req, victims)
        return list(plan.gpus) if plan is not None else None

    # ------------------------------------------------------------------ nothing pending: give back

    def _deflate(self, cyc: _Cycle) -> None:
        ledger = cyc.ledger
        config = cyc.config
        jobs = cyc.snapshot.jobs
        # Only shared jobs holding a slice below their declared memory (the ledger's build noted
        # them) and without a directive can deflate: filter before sorting the names.
        for name in sorted(n for n in self._memo.below_quota if jobs[n].directive is None):
            if cyc.actions >= config.max_decisions:
                return
            view = jobs[name]
            if view.spec.qos_class is not QoS.SHARED or view.directive is not None or name in cyc.busy:
                continue
            if view.state is not JobState.GRANTED or not view.allocations:
                continue
            full = view.spec.memory_bytes
            if all(a.memory_bytes >= full for a in view.allocations):
                continue
            old = ledger.set_quota(name, full, predicted_peak(view, full, config))
            # Next to a guaranteed reservation shared quotas count in full (the rule that made the
            # balloon necessary): deflating past it would undo the balloon right after the grant.
            ok = all(
                load.shared_quota + load.reserved <= config.overcommit_ratio * load.phys
                and load.shared_peak + load.reserved <= load.phys
                and (not load.reserved or load.shared_quota + load.reserved <= load.phys)
                for load in (ledger.loads[h.gpu] for h in old)
            )
            if ok:
                cyc.decisions.append(Deflate(name, f"memory pressure over: quota back to {format_size(full)} per slice"))
                cyc.actions += 1
            else:
                ledger.replace(name, old)

    # ------------------------------------------------------------------ elastic growth

    def _hold_resizes(self, cyc: _Cycle, busy: set[str], requeued: dict[str, int]) -> None:
        """Hold for each growing resize the GPUs it will be re-placed on, as a preemption's room is
        held for its ``for_job``: while it checkpoints (its directive in flight, before its
        deadline) and in the cycle of its ack (``requeued``: its slices were just freed), nobody
        else is placed there. The GPUs are found again each cycle, best fit, among those held for
        nobody else (the snapshot does not say which ones the resize chose)."""
        ledger = cyc.ledger
        config = cyc.config
        jobs = cyc.snapshot.jobs
        frees = ledger.frees
        for name in sorted(busy | requeued.keys()):
            view = jobs[name]
            if name in cyc.pinned:
                continue  # a shrink: the protocol stage holds the GPUs it keeps
            if name in requeued:
                req = request_for(view, config, requeued[name])
                gpus = place(ledger, req)
            else:
                d = view.directive
                if d is None or d.kind is not DirectiveKind.RESIZE:
                    continue
                have = len(view.allocations)
                target = min(target_int(d, "gpus", have), slice_cap(view.spec, config.etcd_max_txn_ops))
                if target <= have:
                    continue  # a shrink needs no room
                req = replace(request_for(view, config, target), min_count=have + 1)
                old = ledger.unreserve(name)
                gpus = place(ledger, req)
                ledger.restore(name, old)
            if gpus:
                ledger.block(gpus, name)
        ledger.frees = frees

    def _grow_fresh(self, cyc: _Cycle) -> None:
        """Enlarge this cycle's grants of elastic jobs toward ``max_gpus`` into the capacity left
        after every pending job was considered (no queued job can be placed on it; GPUs held for
        others are skipped), in the order they were granted. Growing a job at its grant costs
        nothing; a Resize right after it would cost a checkpoint and a restart."""
        ledger = cyc.ledger
        jobs = cyc.snapshot.jobs
        for name, (idx, req) in cyc.fresh.items():
            grant = cyc.decisions[idx]
            assert isinstance(grant, Grant) and grant.job == name
            have = len(grant.slices)
            max_g = slice_cap(jobs[name].spec, cyc.config.etcd_max_txn_ops)
            big = replace(req, count=max_g, min_count=have + 1)
            held = _regrow(ledger, name, big, have)
            if held is None:
                continue
            slices = self._slices(ledger, held)
            nodes = sorted({s.node for s in slices})
            why = "nothing queued" if cyc.queued == 0 else "no queued job can use them"
            reason = (
                f"granted {_count(len(slices), 'slice')} on {', '.join(nodes)} "
                f"(elastic: {len(slices)} of max {max_g}, {why})"
            )
            cyc.decisions[idx] = Grant(name, slices, reason)

    def _resize_up(self, cyc: _Cycle) -> None:
        """Resize running elastic jobs up toward ``max_gpus`` into the capacity left (see
        :meth:`_grow_fresh`); never a job granted at this instant.

        Within a priority, the job holding the fewest slices grows first (then FIFO): under any
        speed-up curve that flattens with more GPUs (data parallelism's), a GPU added to a job on
        ``k`` GPUs speeds it up by about ``1/k``, so the free GPUs go where they buy the most
        speed. Only the slice counts are used (what a live pool knows), never a job's true curve."""
        ledger = cyc.ledger
        config = cyc.config
        now = cyc.snapshot.now
        views = sorted(
            (v for v in cyc.snapshot.jobs.values() if v.spec.is_elastic),
            key=lambda v: (-v.spec.priority, len(v.allocations), v.order, v.name),
        )
        why = "nothing pending" if cyc.queued == 0 else "no queued job can use the free GPUs"
        for view in views:
            if cyc.actions >= config.max_decisions:
                return
            have = len(view.allocations)
            max_g = slice_cap(view.spec, cyc.config.etcd_max_txn_ops)
            if view.state is not JobState.GRANTED or view.directive is not None or view.name in cyc.busy:
                continue
            if resize_held_off(view, now):
                continue  # it refused a resize: none before its retry time
            if have == 0 or have >= max_g or (view.granted_at is not None and view.granted_at >= now):
                continue
            req = request_for(view, config, max_g)
            req = replace(req, min_count=min(have + 1, req.count))
            held = _regrow(ledger, view.name, req, have)
            if held is None:
                continue
            cyc.decisions.append(
                Resize(
                    view.name,
                    len(held),
                    f"{why}: grow from {have} to {len(held)} GPU(s) (max {max_g})",
                    deadline=preempt_deadline(view, now, config),
                )
            )
            cyc.busy.add(view.name)
            cyc.actions += 1


def _regrow(ledger: Ledger, name: str, req: SliceRequest, have: int) -> list[Holding] | None:
    """Re-place ``name`` with ``req`` (more than ``have`` slices) in place of what it holds; its
    new holdings are reserved, or None (and its old ones kept) when no larger placement exists."""
    if req.anti_affinity is None and not req.per_node:
        # More than ``have`` distinct GPUs need one outside its own, and there its own holdings
        # change nothing (same load, reservations and node filter): if none of them takes a slice
        # now, none will once it is un-reserved. Skips the un-reserve / place / restore.
        own = {h.gpu for h in ledger.holdings.get(name, ())}
        if not any(i not in own for i in ledger.candidates(req)):
            return None
    old = ledger.unreserve(name)
    gpus = place(ledger, req)
    if gpus is None or len(gpus) <= have:
        ledger.restore(name, old)
        return None
    held = holdings_for(ledger, req, gpus)
    ledger.reserve(name, held, req.anti_affinity)
    return held


def _no_place_key(req: SliceRequest) -> tuple[object, ...]:
    """What a placement failure is keyed by for the dominance check in ``_consider``: everything
    but the sizes (memory, compute, peak, count), in which failing is monotone (a larger request
    has a subset of the candidate GPUs, and placement fails only when fewer than ``min_count``
    candidates, or distinct nodes for ``spread``, take a slice)."""
    return (req.qos, req.features, req.gpu_model, req.topology, req.anti_affinity, req.nodes)


def _dominated(failed: list[tuple[int, int, float, int]] | None, frees: int, req: SliceRequest) -> bool:
    """True when a migration search for no more than ``req`` asks failed since the last free."""
    return bool(failed) and any(
        f == frees and m <= req.memory and c <= req.compute and p <= req.peak for f, m, c, p in failed or ()
    )


def _worth_trying(known: tuple[int, float] | None, frees: int, prio: float) -> bool:
    """A balloon / preemption search failed for this shape at ``known`` = (frees, priority): only a
    higher priority, or capacity freed since, can change the answer."""
    return known is None or known[0] != frees or prio > known[1]


def _failed(known: tuple[int, float] | None, frees: int, prio: float) -> tuple[int, float]:
    if known is not None and known[0] == frees:
        return (frees, max(prio, known[1]))
    return (frees, prio)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
