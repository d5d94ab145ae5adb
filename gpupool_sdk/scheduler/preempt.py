"""Preempt stage (post-filter): make room for a pending job that does not fit.

Four tools, tried in this order by the policy:

1. :func:`plan_from_freeing`: capacity already being freed for the job (victims still
   checkpointing, shrinks and balloons in flight) is enough: wait, preempt nobody else.
2. :func:`plan_balloon`: shrinking shared jobs to their predicted peak, never below their
   :func:`balloon_floor`, frees enough memory.
3. :func:`plan_shrink`: elastic victims giving up some of their GPUs (down to ``min_gpus``) make
   enough room; preferred to 4 when its victims are no more protected (a shrink costs the victim a
   checkpoint and a restart on fewer GPUs, not its place: it keeps running).
4. :func:`plan_preemption`: a minimal set of lower-priority victims, preempted whole.

Victims are GRANTED jobs without a directive in flight, whose priority is at least one whole
level below the pending job's effective priority (``priority <= floor(effective) - 1``), and
that are past their minimum guarantee
(``max(spec.min_runtime_s, config.min_runtime_s)`` since ``granted_at``). They are tried in
the order of :func:`victim_key`: shared before guaranteed/exclusive, lowest priority first,
(with LAS) highest attained-service queue first, then least work lost (seconds since the last
acknowledged checkpoint, or since the grant, times the number of slices). Every plan is
simulated in the ledger and the ledger is put back as it was before the function returns.

With least-attained-service queues (``las_threshold_gpu_s``) and ``las_preempt``, a job may
also preempt shared or guaranteed jobs of its own level or lower (:func:`las_bound`) that sit at
least one queue higher than its own (:func:`~gpupool_sdk.scheduler.ordering.las_rank`): the
Tiresias rule, composed with priorities (a higher level always wins over a lower queue) and
with the same minimum guarantee. A job moves up a queue only by running, and a victim is always
in a strictly higher queue than its preemptor, so two jobs cannot swap back and forth: each
LAS preemption follows a queue crossing (or a starvation promotion).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from gpupool_sdk.resources import JobState, QoS
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.filter import GpuLoad, SliceRequest, fits, predicted_peak
from gpupool_sdk.scheduler.ledger import Holding, Ledger
from gpupool_sdk.scheduler.ordering import effective_priority, las_level, las_rank
from gpupool_sdk.scheduler.placement import place
from gpupool_sdk.scheduler.types import JobView, SchedulerConfig


@dataclass(frozen=True)
class Plan:
    """A way to make ``req`` fit: the jobs involved and the GPUs it would then get.

    Attributes:
        jobs: victims (preemption), ballooned jobs, or the in-flight jobs waited for.
        gpus: ledger GPU indices of the placement the plan makes possible.
        targets: per-slice byte targets of ballooned jobs (balloon plans only).
        drops: per shrinking job, the ledger indices of the GPUs it gives up (shrink plans only).
    """

    jobs: tuple[str, ...]
    gpus: tuple[int, ...]
    targets: tuple[int, ...] = ()
    drops: tuple[tuple[int, ...], ...] = ()


def work_lost_s(view: JobView, now: float) -> float:
    """GPU-seconds lost if ``view`` is preempted now (since its last checkpoint, else its grant)."""
    since = view.last_checkpoint_at if view.last_checkpoint_at is not None else view.granted_at
    if since is None:
        return 0.0
    return max(0.0, now - since) * max(1, len(view.allocations))


def min_guarantee_s(view: JobView, config: SchedulerConfig) -> float:
    """The minimum run time protecting ``view`` after its grant."""
    return max(view.spec.min_runtime_s, config.min_runtime_s)


def is_protected(view: JobView, now: float, config: SchedulerConfig) -> bool:
    """True while ``view`` is inside its minimum guarantee (it may not be preempted)."""
    if view.granted_at is None:
        return False
    return now - view.granted_at < min_guarantee_s(view, config)


def running_priority(view: JobView, now: float, config: SchedulerConfig) -> float:
    """Effective priority of a granted job: its priority plus the aging credit it had when granted.

    The credit is frozen while it runs (a long run does not make a job unpreemptable), and it is
    the credit it would have if queued again (time run does not count, see
    :func:`~gpupool_sdk.scheduler.ordering.waited_s`), so a job that waited longer is not
    preempted by one that waited less, and the preempted job does not preempt its preemptor back.
    """
    return effective_priority(view, now, config)


def victim_key(view: JobView, now: float, config: SchedulerConfig | None = None) -> tuple[int, int, int, float, int, str]:
    """Sort key of victims: first in this order is preempted first.

    With ``config`` and LAS queues on, a higher attained-service queue goes first within a
    priority (the job that has had the most service gives way first, as in Tiresias).
    """
    queue = las_rank(view, now, config) if config is not None and config.las_threshold_gpu_s else 0
    spec = view.spec
    return (_RANK[spec.qos], spec.priority, -queue, work_lost_s(view, now), -view.order, view.name)


#: :attr:`QoS.rank` by class (looked up for every running job in every cycle).
_RANK: dict[object, int] = {q: q.rank for q in QoS}


def victim_pool(jobs: Iterable[JobView], now: float, config: SchedulerConfig, ledger: Ledger | None = None) -> list[JobView]:
    """Every job that could be a victim of someone this cycle, in victim order (priority not yet applied)."""
    out = [
        v
        for v in jobs
        if v.state is JobState.GRANTED
        and v.directive is None
        and not is_protected(v, now, config)
        and (ledger is None or ledger.holdings.get(v.name))
    ]
    out.sort(key=lambda v: victim_key(v, now, config))
    return out


def las_bound(view: JobView, priority: float, now: float, config: SchedulerConfig) -> tuple[int, int] | None:
    """``(level, min_queue)`` of the LAS victims of pending ``view`` of effective ``priority``.

    Running shared or guaranteed jobs whose level (integer part of their running priority) is at
    most ``level`` and whose LAS queue is at least ``min_queue`` (one above ``view``'s) may be
    preempted for it. None when LAS preemption is off or no queue is above ``view``'s.
    """
    if not config.las_threshold_gpu_s or not config.las_preempt:
        return None
    min_queue = las_rank(view, now, config) + 1
    if min_queue > len(config.las_threshold_gpu_s):
        return None
    return (las_level(priority), min_queue)


def las_standing(view: JobView, now: float, config: SchedulerConfig) -> tuple[int, int] | None:
    """``(level, queue)`` of a running job for :func:`las_bound` checks; None: never a LAS victim (exclusive)."""
    if view.spec.qos_class is QoS.EXCLUSIVE:
        return None
    return (las_level(running_priority(view, now, config)), las_rank(view, now, config))


def las_allows(standing: tuple[int, int] | None, bound: tuple[int, int] | None) -> bool:
    """True when a running job of LAS ``standing`` is a LAS victim under ``bound``."""
    return standing is not None and bound is not None and standing[0] <= bound[0] and standing[1] >= bound[1]


def eligible_victims(
    jobs: Iterable[JobView],
    priority: float,
    now: float,
    config: SchedulerConfig,
    busy: Iterable[str] = (),
    ledger: Ledger | None = None,
    pool: Sequence[JobView] | None = None,
    las: tuple[int, int] | None = None,
) -> list[JobView]:
    """GRANTED jobs that may be preempted for a job of effective ``priority``, in victim order.

    Victims are at least one whole level lower (:func:`preempt_bound`), comparing with their
    :func:`running_priority`, or, with ``las`` (from :func:`las_bound`), LAS victims. ``pool``
    (from :func:`victim_pool`) saves re-sorting every job for every pending job.
    """
    busy_set = busy if isinstance(busy, (set, frozenset)) else set(busy)
    base = pool if pool is not None else victim_pool(jobs, now, config, ledger)
    bound = preempt_bound(priority)
    return [
        v
        for v in base
        if v.name not in busy_set
        and (running_priority(v, now, config) <= bound or las_allows(las_standing(v, now, config), las))
    ]


def plan_preemption(
    ledger: Ledger, req: SliceRequest, victims: Sequence[str], groups: Iterable[list[str]] | None = None
) -> Plan | None:
    """The smallest victim set after which ``req`` fits (``victims``: job names in victim order).

    For each GPU that matches ``req``, the shortest prefix (in victim order) of the victims on
    it that lets one slice fit there is computed on a copy of its load; GPUs are ranked by the
    least protected such prefix (its last victim's place in victim order, then its length).
    Victims of the best GPUs are then freed in the ledger in doubling batches of GPUs until the
    job can be placed (topology included), and the set is pruned to the victims the placement
    needs. ``groups`` (from :meth:`VictimIndex.groups`) replaces the per-call search.
    """
    groups_it: Iterator[list[str]] = (
        iter(groups) if groups is not None else (lst for _, lst in _completion_groups(ledger, req, victims, None))
    )
    removed: list[tuple[str, list[Holding]]] = []
    gone: set[str] = set()
    gpus: list[int] | None = None
    frees = ledger.frees
    batch = max(1, req.min_count)
    try:
        while True:
            got = list(islice(groups_it, batch))
            if not got:
                break
            for names in got:
                for name in names:
                    if name not in gone:
                        gone.add(name)
                        removed.append((name, ledger.unreserve(name)))
            batch *= 2
            gpus = place(ledger, req)
            if gpus is not None:
                break
        if gpus is None:
            return None
        chosen = _prune(ledger, req, removed, gpus)
        final = place(ledger, req)
        if final is None:  # cannot happen: pruning only restores what keeps a placement
            return None
        return Plan(tuple(chosen), tuple(final))
    finally:
        for name, held in reversed(removed):
            if name in ledger.holdings:
                continue
            ledger.restore(name, held)
        ledger.frees = frees


def plan_shrink(ledger: Ledger, req: SliceRequest, victims: Sequence[tuple[str, int]]) -> Plan | None:
    """Elastic victims giving up some GPUs (each at most its budget) so that ``req`` fits; or None.

    ``victims``: ``(job name, budget)`` in victim order, the budget being how many GPUs the job
    may give up (``have - min_gpus``). The search is :func:`plan_preemption`'s, with one victim's
    change on a GPU being the removal of its slice **there** instead of the removal of the whole
    job: GPUs come cheapest first (the shortest prefix of the victims on the GPU that lets one
    slice fit), are freed in doubling batches until ``req`` can be placed (a GPU is skipped when a
    victim on it has no budget left), and the drops are then pruned to the GPUs of the placement,
    most protected victims spared first. So a victim gives up exactly GPUs the pending job is
    placed on (on its node or NVLink island when it packs), never more than its budget, and keeps
    the rest. The ledger is restored before returning.
    """
    budget = dict(victims)
    # Walked in full before anything is dropped: the walk reads the ledger's loads.
    groups_it = iter(list(_completion_groups(ledger, req, [n for n, _ in victims], None)))
    original: dict[str, list[Holding]] = {}
    lost: dict[str, set[int]] = {}
    frees = ledger.frees

    def apply(name: str) -> None:
        gone = lost[name]
        ledger.replace(name, [h for h in original[name] if h.gpu not in gone])

    batch = max(1, req.min_count)
    try:
        while True:
            got = list(islice(groups_it, batch))
            if not got:
                return None
            for gpu, names in got:
                if any(gpu not in lost.get(n, ()) and len(lost.get(n, ())) >= budget[n] for n in names):
                    continue  # a victim there may not give up another GPU
                for n in names:
                    if n not in original:
                        original[n] = list(ledger.holdings.get(n, ()))
                    lost.setdefault(n, set()).add(gpu)
                    apply(n)
            batch *= 2
            gpus = place(ledger, req)
            if gpus is not None:
                break
        # Keep only drops on the placement, then spare the most protected victims one GPU at a time.
        used = set(gpus)
        for n in lost:
            lost[n] &= used
            apply(n)
        for n in reversed([n for n, _ in victims if lost.get(n)]):
            for g in sorted(lost[n], reverse=True):
                lost[n].discard(g)
                apply(n)
                if place(ledger, req) is None:
                    lost[n].add(g)
                    apply(n)
        # Give back drops the final placement does not use (sparing one can move the placement).
        final = place(ledger, req)
        for _ in range(len(ledger.gpus) + 1):
            if final is None:  # cannot happen: pruning only keeps what leaves a placement
                return None
            on = set(final)
            off = [n for n in lost if lost[n] - on]
            if not off:
                break
            saved = {n: set(lost[n]) for n in off}
            for n in off:
                lost[n] &= on
                apply(n)
            again = place(ledger, req)
            if again is None:
                for n in off:
                    lost[n] = saved[n]
                    apply(n)
                break
            final = again
        order = [n for n, _ in victims if lost.get(n)]
        if final is None or not order:
            return None
        return Plan(tuple(order), tuple(final), drops=tuple(tuple(sorted(lost[n])) for n in order))
    finally:
        for name, held in original.items():
            ledger.replace(name, held)
        ledger.frees = frees


def kept_after_shrink(ledger: Ledger, held: Sequence[int], drop: Collection[int], keep_count: int) -> list[int]:
    """The GPUs a victim of :func:`plan_shrink` keeps when it shrinks to ``keep_count`` (its
    ``min_gpus``): never one of ``drop`` (the pending job's placement), and among the others those
    on the node and NVLink island where it holds the most, then the lowest indices (its workers
    stay together). ``held``: its GPUs, in holding order (the result keeps that order).

    A victim goes to its minimum at once rather than giving up only what one pending job needs:
    under a stream of arrivals, freeing one GPU at a time restarted the same job at every arrival
    (each shrink costs it a checkpoint and a restart on all its GPUs), and it was then preempted
    whole anyway (``docs/simulation.md`` 2d).
    """
    left = [i for i in held if i not in drop]
    if len(left) <= keep_count:
        return left
    nodes, islands = ledger.nodes, ledger.islands
    on_node: dict[str, int] = {}
    on_island: dict[tuple[str, int | None], int] = {}
    for i in left:
        on_node[nodes[i]] = on_node.get(nodes[i], 0) + 1
        on_island[(nodes[i], islands[i])] = on_island.get((nodes[i], islands[i]), 0) + 1
    best = sorted(left, key=lambda i: (-on_node[nodes[i]], nodes[i], -on_island[(nodes[i], islands[i])], i))
    chosen = set(best[:keep_count])
    return [i for i in held if i in chosen]


def _completion_groups(
    ledger: Ledger,
    req: SliceRequest,
    names: Sequence[str],
    targets: dict[str, int] | None,
    respect_blocks: bool = True,
) -> Iterator[tuple[int, list[str]]]:
    """Walk ``names`` in order, applying each one's change (removal, or shrink to ``targets[name]``)
    to working copies of the loads of the GPUs it holds; yield, for each GPU at the moment one
    slice of ``req`` first fits there, the names applied on that GPU so far.

    GPUs therefore come out cheapest first: the one whose needed prefix ends earliest in
    ``names``. GPUs reserved for another job, outside ``req``'s classes, on nodes of its
    anti-affinity group or outside its nodes (``req.nodes``) are skipped.
    """
    classes = {id(c) for c in ledger.matching_classes(req.features, req.gpu_model)}
    avoid: set[str] = set()
    if req.anti_affinity is not None and respect_blocks:
        avoid = {n for n, c in ledger.groups.get(req.anti_affinity, {}).items() if c > 0}
    state: dict[int, GpuLoad | None] = {}  # working load copy, or None once done or unusable
    taken: dict[int, list[str]] = {}
    ratio = ledger.ratio
    holdings = ledger.holdings
    blocked = ledger.blocked
    nodes = ledger.nodes
    loads = ledger.loads
    job = req.job
    for name in names:
        for h in holdings.get(name, ()):
            gpu = h.gpu
            if gpu in state:
                load = state[gpu]
                if load is None:
                    continue
            else:
                cls = ledger.class_of(gpu)
                holder = blocked.get(gpu) if respect_blocks else None
                if (
                    cls is None
                    or id(cls) not in classes
                    or (holder is not None and holder != job)
                    or (avoid and nodes[gpu] in avoid)
                    or (req.nodes and nodes[gpu] not in req.nodes)
                ):
                    state[gpu] = None
                    continue
                load = state[gpu] = loads[gpu].copy()
                taken[gpu] = []
            load.remove(h.qos, h.memory, h.compute, h.peak)
            if targets is not None:
                t = targets[name]
                load.add(h.qos, t, h.compute, min(t, h.peak))
            lst = taken[gpu]
            if not lst or lst[-1] != name:
                lst.append(name)
            if fits(load, req, ratio):
                state[gpu] = None
                yield gpu, lst


class _GpuWalk:
    """The candidates' changes on one GPU, in walk order, and the load after each of them."""

    __slots__ = ("steps", "names", "base", "loads", "monotone")

    def __init__(self) -> None:
        #: (walk position, holding, balloon target or None) of every change on this GPU.
        self.steps: list[tuple[int, Holding, int | None]] = []
        #: the job name of each step.
        self.names: list[str] = []
        #: the ledger's load the step loads were computed from (None: not yet computed).
        self.base: GpuLoad | None = None
        self.loads: list[GpuLoad] = []
        #: every step only frees capacity, so a slice fitting after none of them fits after no prefix.
        self.monotone = True

    def refresh(self, load: GpuLoad) -> None:
        """Recompute the step loads from the ledger's ``load`` (the same operations, in the same
        order, as :func:`_completion_groups` applies to its working copy)."""
        self.base = load.copy()
        work = load.copy()
        out = []
        for _pos, h, t in self.steps:
            work.remove(h.qos, h.memory, h.compute, h.peak)
            if t is not None:
                work.add(h.qos, t, h.compute, min(t, h.peak))
            out.append(work.copy())
        self.loads = out


class VictimIndex:
    """Per-cycle cache of the victim (or balloon) search, the costly part of a cycle on a large pool.

    For one priority bound (and LAS bound), the candidates' changes are walked once per cycle:
    for every GPU, the load after each prefix of the changes on it (as :func:`_completion_groups`
    computes them, refreshed for a GPU whose load changed since). For each slice signature
    (class, memory, compute, peak, features, model) the per-GPU prefixes then follow by checking
    those loads, ignoring reservations and anti-affinity; every later search of the cycle with
    the same signature only re-checks each GPU against the ledger as it is now (reserved for
    someone else, avoided node, a job already taken, or a new grant there that makes the prefix
    insufficient: skipped).

    Args:
        ledger: the cycle's ledger.
        pool: ``(job name, priority)`` of every candidate (running priority for victims), in the order
            they are to be tried.
        targets: for balloons, the per-slice byte target of each candidate (None: preemption).
        standing: for LAS preemption, ``(level, queue)`` of candidates that may be LAS victims
            (:func:`las_standing`); a candidate absent from it is only a victim by priority.
    """

    def __init__(
        self,
        ledger: Ledger,
        pool: Sequence[tuple[str, float]],
        targets: dict[str, int] | None = None,
        standing: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.pool = list(pool)
        self.targets = targets
        self.standing = standing or {}
        self._cache: dict[tuple[object, ...], list[tuple[int, list[str]]]] = {}
        self._walks: dict[tuple[object, ...], dict[int, _GpuWalk]] = {}
        self._hopeless: dict[tuple[object, ...], list[tuple[int, float, int, int]]] = {}
        self._under: dict[tuple[float, tuple[int, int] | None], list[str]] = {}
        #: how many :meth:`hopeless` answers came from a smaller request that had failed (and in all).
        self.hopeless_hits = 0
        self.hopeless_calls = 0

    def __bool__(self) -> bool:
        return bool(self.pool)

    def groups(
        self, req: SliceRequest, top_priority: float, busy: Collection[str], las: tuple[int, int] | None = None
    ) -> Iterator[list[str]]:
        """Groups for ``req`` among candidates of priority <= ``top_priority`` (or LAS victims under
        ``las``, see :func:`las_bound`) not in ``busy``, cheapest first.

        The bound is rounded down to a whole level so that searches share the cache (a slightly
        smaller candidate set, never a larger one: a victim in between becomes eligible as the
        waiting job ages further).
        """
        top_priority = float(math.floor(top_priority))
        key = (req.qos, req.memory, req.compute, req.peak, req.features, req.gpu_model, top_priority, las)
        options = self._cache.get(key)
        ledger = self.ledger
        targets = self.targets
        if options is None:
            options = self._cache[key] = self._options(req, top_priority, las)
        avoid: set[str] = set()
        if req.anti_affinity is not None:
            avoid = {n for n, c in ledger.groups.get(req.anti_affinity, {}).items() if c > 0}
        for gpu, names in options:
            holder = ledger.blocked.get(gpu)
            if holder is not None and holder != req.job:
                continue
            if avoid and ledger.nodes[gpu] in avoid:
                continue
            if req.nodes and ledger.nodes[gpu] not in req.nodes:
                continue
            if any(n in busy for n in names):
                continue
            load = ledger.loads[gpu].copy()
            for n in names:
                for h in ledger.holdings.get(n, ()):
                    if h.gpu == gpu:
                        load.remove(h.qos, h.memory, h.compute, h.peak)
                        if targets is not None:
                            t = targets[n]
                            load.add(h.qos, t, h.compute, min(t, h.peak))
            if fits(load, req, ledger.ratio):
                yield names

    def hopeless(
        self, req: SliceRequest, top_priority: float, las: tuple[int, int] | None = None, none_fit: bool = False
    ) -> bool:
        """True when no plan over these candidates can place ``req``, whatever the groups.

        A plan frees at most what all candidates together free, so when fewer than
        ``req.min_count`` GPUs would take a slice even then (or take one now, outside the
        candidates' GPUs), the search can be skipped: it would return None. Within a cycle loads
        and reservations only grow while pending jobs are considered (plans are undone), so the
        answer also holds for any later request of the same class, constraints and bound that
        asks at least as much of every resource and at least as many GPUs: failed requests are
        remembered and such requests answered without a walk. False is always safe; it is
        answered for requests with anti-affinity (freeing a group member can unblock a node),
        for jobs that hold reservations, and when a balloon target exceeds a quota (the change
        would not only free). A job restricted to some nodes (``req.nodes``) counts only their
        GPUs, and its failures are remembered apart from other nodes'.

        ``none_fit``: the caller knows that no GPU takes a slice of ``req`` now (a one-slice
        request whose placement just failed in this cycle's ledger): the GPUs outside the
        candidates' are then not scanned for one.
        """
        ledger = self.ledger
        if req.anti_affinity is not None or req.job in ledger.blocked_jobs:
            return False
        self.hopeless_calls += 1
        top = float(math.floor(top_priority))
        key = (req.qos, req.features, req.gpu_model, top, las, req.nodes)
        front = self._hopeless.get(key)
        if front is not None:
            for m, c, p, n in front:
                if req.memory >= m and req.compute >= c and req.peak >= p and req.min_count >= n:
                    self.hopeless_hits += 1
                    return True
        walk = self._walk(top, las)
        if not all(w.monotone for w in walk.values()):
            return False
        classes = {id(c) for c in ledger.matching_classes(req.features, req.gpu_model)}
        loads = ledger.loads
        ratio = ledger.ratio
        blocked = ledger.blocked
        need = req.min_count
        found = 0
        only = frozenset(req.nodes)
        for gpu, w in walk.items():
            if id(ledger.class_of(gpu)) not in classes or gpu in blocked:
                continue
            if only and ledger.nodes[gpu] not in only:
                continue
            load = loads[gpu]
            if w.base != load:
                w.refresh(load)
            if _fits_loose(w.loads[-1], req, ratio):
                found += 1
                if found >= need:
                    return False
        if not none_fit:
            for gpu in ledger.candidates(req):
                if gpu not in walk:
                    found += 1
                    if found >= need:
                        return False
        m, c, p, n = entry = (req.memory, req.compute, req.peak, req.min_count)
        kept = [e for e in front or () if not (e[0] >= m and e[1] >= c and e[2] >= p and e[3] >= n)]
        self._hopeless[key] = [*kept, entry]
        return True

    def _walk(self, top_priority: float, las: tuple[int, int] | None) -> dict[int, _GpuWalk]:
        """The per-GPU changes of the candidates under this bound (step loads computed lazily)."""
        wkey = (top_priority, las)
        walk = self._walks.get(wkey)
        if walk is None:
            targets = self.targets
            ledger = self.ledger
            walk = self._walks[wkey] = {}
            pos = 0
            for n in self.candidates_under(top_priority, las):
                t = targets[n] if targets is not None else None
                for h in ledger.holdings.get(n, ()):
                    if ledger.class_of(h.gpu) is None:
                        continue
                    w = walk.get(h.gpu)
                    if w is None:
                        w = walk[h.gpu] = _GpuWalk()
                    w.steps.append((pos, h, t))
                    w.names.append(n)
                    if t is not None and t > h.memory:
                        w.monotone = False
                    pos += 1
        return walk

    def candidates_under(self, top_priority: float, las: tuple[int, int] | None) -> list[str]:
        """The candidates of priority <= ``top_priority`` or LAS victims under ``las``, in pool order
        (computed once per bound and cycle: the pool does not change within a cycle; callers filter)."""
        key = (top_priority, las)
        found = self._under.get(key)
        if found is None:
            standing = self.standing
            found = self._under[key] = [
                n for n, p in self.pool if p <= top_priority or las_allows(standing.get(n), las)
            ]
        return found

    def _options(self, req: SliceRequest, top_priority: float, las: tuple[int, int] | None) -> list[tuple[int, list[str]]]:
        """What ``_completion_groups(ledger, req, candidates_under(...), targets, respect_blocks=False)``
        yields, from the per-GPU walk instead of a walk over every candidate."""
        walk = self._walk(top_priority, las)
        ledger = self.ledger
        classes = {id(c) for c in ledger.matching_classes(req.features, req.gpu_model)}
        loads = ledger.loads
        ratio = ledger.ratio
        found: list[tuple[int, int, int]] = []
        for gpu, w in walk.items():
            if id(ledger.class_of(gpu)) not in classes:
                continue
            load = loads[gpu]
            if w.base != load:
                w.refresh(load)
            after = w.loads
            if w.monotone and not fits(after[-1], req, ratio):
                continue
            for k, work in enumerate(after):
                if fits(work, req, ratio):
                    found.append((w.steps[k][0], gpu, k))
                    break
        found.sort()
        out = []
        for _pos, gpu, k in found:
            names: list[str] = []
            for n in walk[gpu].names[: k + 1]:
                if not names or names[-1] != n:
                    names.append(n)
            out.append((gpu, names))
        return out


def _fits_loose(load: GpuLoad, req: SliceRequest, ratio: float) -> bool:
    """:func:`~gpupool_sdk.scheduler.filter.fits` with a wider compute tolerance: shares freed in
    another order may differ in the last bits, and an upper bound must not miss a fit."""
    if req.qos is QoS.GUARANTEED and not load.exclusive:
        return load.reserved + load.shared_quota + req.memory <= load.phys and load.compute + req.compute <= 1.0 + 1e-6
    return fits(load, req, ratio)


def preempt_bound(priority: float) -> float:
    """Highest running priority a victim of a job with effective ``priority`` may have.

    A whole level lower: ``priority - 1``. Aging thus lets a job preempt one of its own base
    priority only once it has waited ``aging_s_per_priority`` longer than the victim had.
    """
    return priority - 1.0


def balloon_bound(priority: float) -> int:
    """Highest base priority a job ballooned for a job with effective ``priority`` may have (not higher)."""
    return math.floor(priority)


def _prune(ledger: Ledger, req: SliceRequest, removed: list[tuple[str, list[Holding]]], gpus: list[int]) -> list[str]:
    """Restore victims the placement does not need; returns the victims still removed (in order)."""
    used = set(gpus)
    keep: list[tuple[str, list[Holding]]] = []
    for name, held in reversed(removed):
        if not any(h.gpu in used for h in held):
            ledger.restore(name, held)
        else:
            keep.append((name, held))
    keep.reverse()
    # Try to spare the most protected needed victims (last in victim order) one by one.
    still: list[str] = []
    for name, held in reversed(keep):
        ledger.restore(name, held)
        if place(ledger, req) is None:
            ledger.unreserve(name)
            still.append(name)
    still.reverse()
    return still


def balloon_floor(memory_bytes: int, config: SchedulerConfig) -> int:
    """The smallest per-slice quota a balloon may leave a shared job that declared ``memory_bytes``.

    ``max(memory_bytes x balloon_floor_fraction, balloon_floor_bytes)``, at most ``memory_bytes``
    (a job that declared less than the absolute floor is never ballooned).

    Example:
        >>> from gpupool_sdk.resources import GiB, MiB
        >>> balloon_floor(30 * GiB, SchedulerConfig()) == 15 * GiB, balloon_floor(300 * MiB, SchedulerConfig()) == 256 * MiB
        (True, True)
    """
    floor = max(math.ceil(memory_bytes * config.balloon_floor_fraction), config.balloon_floor_bytes)
    return min(memory_bytes, floor)


def balloon_target(view: JobView, quota: int, config: SchedulerConfig) -> int:
    """Per-slice quota a balloon asks of shared ``view`` holding ``quota`` per slice: its predicted
    peak, never below its :func:`balloon_floor` (a target >= ``quota`` means it cannot shrink)."""
    return max(predicted_peak(view, quota, config), balloon_floor(view.spec.memory_bytes, config))


def balloon_reason(view: JobView, target: int, config: SchedulerConfig) -> str:
    """What a balloon to ``target`` per slice asks, for the directive's reason: the predicted peak,
    or the floor when the predicted peak is below it (the peak is then named too)."""
    quota = max((a.memory_bytes for a in view.allocations), default=view.spec.memory_bytes)
    peak = predicted_peak(view, quota, config)
    if peak >= target:
        return f"shrink to predicted peak {format_size(target)} per slice"
    return (
        f"shrink to the balloon floor {format_size(target)} per slice (predicted peak {format_size(peak)}; "
        f"a balloon keeps at least {config.balloon_floor_fraction:g} of the {format_size(view.spec.memory_bytes)} "
        f"declared and at least {format_size(config.balloon_floor_bytes)})"
    )


def balloon_targets(views: Iterable[JobView], priority: float, config: SchedulerConfig, busy: Iterable[str] = ()) -> dict[str, int]:
    """Shared GRANTED jobs that could shrink, with their target per slice (:func:`balloon_target`)."""
    busy_set = set(busy)
    out: dict[str, int] = {}
    for v in views:
        if v.spec.qos != QoS.SHARED or v.state is not JobState.GRANTED or v.directive is not None:
            continue
        if v.name in busy_set or not v.allocations or v.spec.priority > priority:
            continue
        quota = max(a.memory_bytes for a in v.allocations)
        target = balloon_target(v, quota, config)
        if target < quota:
            out[v.name] = target
    return out


def plan_balloon(
    ledger: Ledger, req: SliceRequest, targets: dict[str, int], groups: Iterable[list[str]] | None = None
) -> Plan | None:
    """Shrink shared jobs to their targets if that alone makes ``req`` fit; only the needed ones.

    Candidates are tried GPU by GPU (cheapest first, see :func:`_completion_groups`) in doubling
    batches, like victims. ``groups`` (from :meth:`VictimIndex.groups` built with targets)
    replaces the per-call search; ``targets`` must then cover every job it names.
    """
    groups_it: Iterator[list[str]] = (
        iter(groups)
        if groups is not None
        else (lst for _, lst in _completion_groups(ledger, req, sorted(targets), targets))
    )
    old: dict[str, list[Holding]] = {}
    frees = ledger.frees
    batch = max(1, req.min_count)
    gpus: list[int] | None = None
    try:
        while True:
            got = list(islice(groups_it, batch))
            if not got:
                return None
            for names in got:
                for name in names:
                    if name not in old:
                        old[name] = ledger.set_quota(name, targets[name], targets[name])
            batch *= 2
            gpus = place(ledger, req)
            if gpus is not None:
                break
        used = set(gpus)
        needed = sorted(n for n in old if any(h.gpu in used for h in old[n]))
        for n in sorted(old):
            if n not in needed:
                ledger.replace(n, old.pop(n))
        final = place(ledger, req)
        if final is None:
            return None
        return Plan(tuple(needed), tuple(final), tuple(targets[n] for n in needed))
    finally:
        for name, held in old.items():
            ledger.replace(name, held)
        ledger.frees = frees


def plan_from_freeing(
    ledger: Ledger,
    req: SliceRequest,
    preempting: Sequence[str],
    ballooning: dict[str, int],
    shrinking: Mapping[str, Collection[int]] | None = None,
) -> Plan | None:
    """Would ``req`` fit once the in-flight preemptions, shrinks and balloons complete? Only the
    needed ones are named. ``shrinking``: elastic jobs resizing down for someone, with the ledger
    indices of the GPUs they keep (their other slices are being freed)."""
    shrinking = shrinking or {}
    pre = _touching(ledger, req, list(preempting))
    bal = _touching(ledger, req, sorted(ballooning))
    shr = _touching(ledger, req, sorted(shrinking))
    if not pre and not bal and not shr:
        return None
    removed: list[tuple[str, list[Holding]]] = []
    shrunk: dict[str, list[Holding]] = {}
    resized: dict[str, list[Holding]] = {}
    frees = ledger.frees
    try:
        for name in pre:
            removed.append((name, ledger.unreserve(name)))
        for name in bal:
            shrunk[name] = ledger.set_quota(name, ballooning[name], ballooning[name])
        for name in shr:
            held = resized[name] = list(ledger.holdings.get(name, ()))
            ledger.replace(name, [h for h in held if h.gpu in shrinking[name]])
        gpus = place(ledger, req)
        if gpus is None:
            return None
        used = set(gpus)
        needed = [n for n, held in removed if any(h.gpu in used for h in held)]
        needed += [n for n in bal if any(h.gpu in used for h in shrunk[n])]
        needed += [n for n in shr if any(h.gpu in used and h.gpu not in shrinking[n] for h in resized[n])]
        return Plan(tuple(needed), tuple(gpus))
    finally:
        for name, held in resized.items():
            ledger.replace(name, held)
        for name, held in shrunk.items():
            ledger.replace(name, held)
        for name, held in reversed(removed):
            ledger.restore(name, held)
        ledger.frees = frees


def _touching(ledger: Ledger, req: SliceRequest, names: Sequence[str]) -> list[str]:
    """Those of ``names`` holding a slice on a schedulable GPU that statically matches ``req`` (order kept)."""
    classes = {id(c) for c in ledger.matching_classes(req.features, req.gpu_model)}
    out = []
    for name in names:
        for h in ledger.holdings.get(name, ()):
            cls = ledger.class_of(h.gpu)
            if cls is not None and id(cls) in classes:
                out.append(name)
                break
    return out
