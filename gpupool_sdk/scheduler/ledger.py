"""The tentative capacity ledger of one scheduling cycle (reserve / un-reserve).

Built once per cycle from the snapshot's allocations, then mutated as the cycle grants,
releases and simulates preemptions. Every mutation is undoable (:meth:`Ledger.unreserve`
returns the holdings that :meth:`Ledger.restore` puts back), which is how the preempt stage
tries victim sets and how a gang that cannot be completed is rolled back.

Indexes kept up to date on every change, so that placement never scans the whole pool per job:

* GPUs are grouped in *classes* of identical static properties (model, features, memory); a job
  resolves which classes match once.
* Per class, sorted lists of ``(key, gpu)``: idle GPUs by physical memory; partly used GPUs
  by free guaranteed memory, one list per free-compute bucket; and partly used GPUs by shared
  room (the smaller of quota headroom and predicted-peak room). Best fit is a bisection
  followed by a short forward scan.
* Per anti-affinity group, the nodes its live members occupy.
* GPUs reserved for a blocked job (backfill only elsewhere).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

from gpupool_sdk.resources import GpuInfo, QoS
from gpupool_sdk.scheduler.filter import (
    COMPUTE_EPS,
    GpuLoad,
    SliceRequest,
    features_match,
    fits,
    matches_static,
)

_ClassKey = tuple[str, tuple[str, ...], int]

#: lower bounds of the free-compute buckets of partly used GPUs (a GPU sits in the first bucket it reaches).
COMPUTE_BUCKETS = (1.0, 0.75, 0.5, 0.25, 0.0)


def _bucket(free_compute: float) -> int:
    for b, floor in enumerate(COMPUTE_BUCKETS):
        if free_compute >= floor - COMPUTE_EPS:
            return b
    return len(COMPUTE_BUCKETS) - 1


def _buckets_for(compute: float) -> list[int]:
    """Buckets that may hold a GPU with ``compute`` free: those whose floor reaches it, plus the next one."""
    out = []
    for b, floor in enumerate(COMPUTE_BUCKETS):
        out.append(b)
        if floor < compute - COMPUTE_EPS:
            break
    return out


@dataclass(frozen=True, slots=True)
class Holding:
    """One slice held by a job, as the ledger accounts it (``gpu`` is the ledger's GPU index;
    ``util``: the job's measured GPU utilisation, None when unknown)."""

    gpu: int
    qos: QoS
    memory: int
    compute: float
    peak: int
    util: float | None = None


class _ClassIndex:
    __slots__ = ("features", "model", "phys", "empty", "part_g", "part_s", "max_island", "size")

    def __init__(self, model: str, features: tuple[str, ...], phys: int) -> None:
        self.model = model
        self.features = features
        self.phys = phys
        self.empty: list[tuple[float, int]] = []
        # Partly used GPUs by free guaranteed memory, one list per free-compute bucket (COMPUTE_BUCKETS).
        self.part_g: list[list[tuple[float, int]]] = [[] for _ in COMPUTE_BUCKETS]
        self.part_s: list[tuple[float, int]] = []
        self.max_island = 0
        #: schedulable GPUs of the class (``len(empty)`` of them are idle).
        self.size = 0


class GpuLayout:
    """The static part of a ledger: GPUs in ledger order, their classes and NVLink islands.

    It depends only on the GPUs and on which of them are schedulable, so a scheduler that runs
    cycle after cycle on the same GPUs builds it once and starts each cycle's ledger from it
    (:meth:`Ledger.from_layout`); nothing in it is mutated by a ledger.

    Args:
        gpus: every GPU of the snapshot (any order; sorted here by node, index, UUID).
        schedulable: UUIDs that may take new slices (healthy, not cordoned, node not draining).
    """

    def __init__(self, gpus: Iterable[GpuInfo], schedulable: Iterable[str]) -> None:
        self.gpus: list[GpuInfo] = sorted(gpus, key=lambda g: (g.node, g.index, g.uuid))
        self.index_of: dict[str, int] = {g.uuid: i for i, g in enumerate(self.gpus)}
        ok = set(schedulable)
        self.schedulable: list[bool] = [g.uuid in ok for g in self.gpus]
        self.nodes: list[str] = [g.node for g in self.gpus]
        #: physical memory per GPU (each cycle's empty loads are made from it).
        self.phys: list[int] = [g.memory_bytes for g in self.gpus]
        self.islands: list[int | None] = [g.nvlink_island for g in self.gpus]
        sizes = Counter((g.node, g.nvlink_island) for g in self.gpus if g.nvlink_island is not None)
        self.max_island = max(sizes.values(), default=0)
        #: per class: (model, features, physical memory), largest NVLink island, idle keys sorted.
        self.class_keys: list[_ClassKey] = []
        self.class_island: list[int] = []
        self.class_empty: list[list[tuple[float, int]]] = []
        #: per GPU: its class number, or None when it is not schedulable.
        self.class_id: list[int | None] = []
        ids: dict[_ClassKey, int] = {}
        for i, g in enumerate(self.gpus):
            if not self.schedulable[i]:
                self.class_id.append(None)
                continue
            key = (g.model, tuple(sorted(g.features)), g.memory_bytes)
            c = ids.get(key)
            if c is None:
                c = ids[key] = len(self.class_keys)
                self.class_keys.append(key)
                self.class_island.append(0)
                self.class_empty.append([])
            self.class_id.append(c)
            self.class_empty[c].append((float(g.memory_bytes), i))
            if g.nvlink_island is not None:
                self.class_island[c] = max(self.class_island[c], sizes[(g.node, g.nvlink_island)])
        for lst in self.class_empty:
            lst.sort()
        #: per GPU: its idle key while it holds nothing.
        self.empty_key: list[tuple[float, int] | None] = [None] * len(self.gpus)
        for lst in self.class_empty:
            for k in lst:
                self.empty_key[k[1]] = k
        self.all_healthy = all(g.health.healthy for g in self.gpus)


class Ledger:
    """Per-GPU committed capacity plus the indexes placement needs.

    Args:
        gpus: every GPU of the snapshot (any order; the ledger sorts by node, index, UUID).
        schedulable: UUIDs that may take new slices (healthy, not cordoned, node not draining).
        overcommit_ratio: the shared-class overcommit ratio.
    """

    def __init__(
        self, gpus: Iterable[GpuInfo], schedulable: Iterable[str], overcommit_ratio: float,
        spread_idle_above: float = 1.0,
    ) -> None:
        self._setup(GpuLayout(gpus, schedulable), overcommit_ratio, spread_idle_above)

    @classmethod
    def from_layout(cls, layout: GpuLayout, overcommit_ratio: float, spread_idle_above: float = 1.0) -> Ledger:
        """An empty ledger on the GPUs of ``layout`` (cheaper than the constructor: nothing is sorted)."""
        ledger = cls.__new__(cls)
        ledger._setup(layout, overcommit_ratio, spread_idle_above)
        return ledger

    def _setup(self, layout: GpuLayout, overcommit_ratio: float, spread_idle_above: float = 1.0) -> None:
        self.layout = layout
        #: ``SchedulerConfig.spread_idle_above`` (see :meth:`prefers_idle`).
        self.spread_idle_above = spread_idle_above
        self.gpus = layout.gpus
        self.index_of = layout.index_of
        self.ratio = overcommit_ratio
        self.loads: list[GpuLoad] = list(map(GpuLoad, layout.phys))
        self.schedulable = layout.schedulable
        self.nodes = layout.nodes
        self.islands = layout.islands
        #: the largest NVLink island of the pool (a pack gang larger than this needs a node or more).
        self.max_island = layout.max_island
        self.holdings: dict[str, list[Holding]] = {}
        self.groups: dict[str, Counter[str]] = {}
        self.group_of: dict[str, str] = {}
        self.blocked: dict[int, str] = {}
        #: jobs some GPUs are reserved for (a placement failure of another job says nothing about them).
        self.blocked_jobs: set[str] = set()
        #: bumped whenever capacity is freed; a failed placement stays failed while it is unchanged.
        self.frees = 0
        self._classes: dict[_ClassKey, _ClassIndex] = {}
        for c, key in enumerate(layout.class_keys):
            cls = self._classes[key] = _ClassIndex(key[0], key[1], key[2])
            cls.max_island = layout.class_island[c]
            cls.empty = list(layout.class_empty[c])
            cls.size = len(cls.empty)
        by_id = list(self._classes.values())
        self._class_of: list[_ClassIndex | None] = [None if c is None else by_id[c] for c in layout.class_id]
        self._key_empty: list[tuple[float, int] | None] = list(layout.empty_key)
        self._key_g: list[tuple[float, int] | None] = [None] * len(layout.gpus)
        self._bucket_g: list[int] = [0] * len(layout.gpus)
        self._key_s: list[tuple[float, int] | None] = [None] * len(layout.gpus)
        self._match_cache: dict[tuple[tuple[str, ...], str | None], list[_ClassIndex]] = {}
        self._count_cache: dict[tuple[tuple[str, ...], str | None], int] = {}
        #: GPUs whose load changed since their index keys were placed (see :meth:`_flush`).
        self._dirty: set[int] = set()

    def clone(self) -> Ledger:
        """An independent copy: every later change to either leaves the other as it was.

        Holdings lists are shared (the ledger never changes one in place: :meth:`reserve` makes a
        new list); loads, indexes, groups and reservations are copied.
        """
        if self._dirty:
            self._flush()
        new = Ledger.__new__(Ledger)
        new._dirty = set()
        new.layout = self.layout
        new.spread_idle_above = self.spread_idle_above
        new.gpus = self.gpus
        new.index_of = self.index_of
        new.ratio = self.ratio
        new.loads = list(map(GpuLoad.copy, self.loads))
        new.schedulable = self.schedulable
        new.nodes = self.nodes
        new.islands = self.islands
        new.max_island = self.max_island
        new.holdings = dict(self.holdings)
        new.groups = {g: Counter(c) for g, c in self.groups.items()}
        new.group_of = dict(self.group_of)
        new.blocked = dict(self.blocked)
        new.blocked_jobs = set(self.blocked_jobs)
        new.frees = self.frees
        twin: dict[int, _ClassIndex] = {}
        new._classes = {}
        for key, cls in self._classes.items():
            c = _ClassIndex(cls.model, cls.features, cls.phys)
            c.empty = list(cls.empty)
            c.part_g = [list(lst) for lst in cls.part_g]
            c.part_s = list(cls.part_s)
            c.max_island = cls.max_island
            c.size = cls.size
            new._classes[key] = twin[id(cls)] = c
        new._class_of = [None if c is None else twin[id(c)] for c in self._class_of]
        new._key_empty = list(self._key_empty)
        new._key_g = list(self._key_g)
        new._bucket_g = list(self._bucket_g)
        new._key_s = list(self._key_s)
        new._match_cache = {k: [twin[id(c)] for c in v] for k, v in self._match_cache.items()}
        new._count_cache = dict(self._count_cache)
        return new

    # ------------------------------------------------------------------ accounting

    def __len__(self) -> int:
        return len(self.gpus)

    def reserve(self, job: str, holdings: Sequence[Holding], group: str | None = None, reindex: bool = True) -> None:
        """Commit ``holdings`` for ``job`` (adds to what it already holds).

        ``reindex=False`` defers the sorted indexes (bulk loading); call :meth:`rebuild_index` after.
        """
        if not holdings:
            return
        # A new list every time: a clone shares its holdings lists with its origin (see :meth:`clone`).
        held = list(self.holdings.get(job, ()))
        self.holdings[job] = held
        for h in holdings:
            held.append(h)
            self.loads[h.gpu].add(h.qos, h.memory, h.compute, h.peak)
            if reindex:
                self._reindex(h.gpu)
        if group is not None:
            self.group_of[job] = group
        group = self.group_of.get(job)
        if group is not None:
            counter = self.groups.setdefault(group, Counter())
            for h in holdings:
                counter[self.nodes[h.gpu]] += 1

    def occupy(self, holdings: Sequence[Holding], reindex: bool = True) -> None:
        """Count ``holdings`` as used by nobody the scheduler may move (orphaned allocations).

        Unlike :meth:`reserve` they belong to no job: no preemption or release frees them, so
        neither a grant nor a victim search ever treats their memory as free.
        """
        for h in holdings:
            self.loads[h.gpu].add(h.qos, h.memory, h.compute, h.peak)
            if reindex:
                self._reindex(h.gpu)

    def vacate(self, holdings: Sequence[Holding]) -> None:
        """Undo :meth:`occupy` of ``holdings`` (capacity is freed: ``frees`` is bumped)."""
        for h in holdings:
            self.loads[h.gpu].remove(h.qos, h.memory, h.compute, h.peak)
            self._reindex(h.gpu)
        if holdings:
            self.frees += 1

    def unreserve(self, job: str) -> list[Holding]:
        """Free everything ``job`` holds; returns the holdings (give them to :meth:`restore` to undo)."""
        held = self.holdings.pop(job, [])
        for h in held:
            self.loads[h.gpu].remove(h.qos, h.memory, h.compute, h.peak)
            self._reindex(h.gpu)
        group = self.group_of.get(job)
        if group is not None and held:
            counter = self.groups[group]
            for h in held:
                counter[self.nodes[h.gpu]] -= 1
                if counter[self.nodes[h.gpu]] <= 0:
                    del counter[self.nodes[h.gpu]]
        if held:
            self.frees += 1
        return held

    def restore(self, job: str, holdings: Sequence[Holding]) -> None:
        """Undo :meth:`unreserve` (same holdings, same order)."""
        self.reserve(job, holdings)

    def set_quota(self, job: str, memory: int, peak: int) -> list[Holding]:
        """Change the per-slice quota (and predicted peak) of a job's shared slices; returns the old holdings."""
        old = self.unreserve(job)
        new = [
            Holding(h.gpu, h.qos, memory, h.compute, min(peak, memory), h.util) if h.qos is QoS.SHARED else h for h in old
        ]
        self.reserve(job, new)
        return old

    def replace(self, job: str, holdings: Sequence[Holding]) -> None:
        """Set ``job``'s holdings to exactly ``holdings`` (used to undo :meth:`set_quota`)."""
        self.unreserve(job)
        self.reserve(job, holdings)

    def class_of(self, gpu: int) -> object | None:
        """The class index of a schedulable GPU (identity only matters), or None when unschedulable."""
        return self._class_of[gpu]

    def holders(self, gpu: int) -> list[str]:
        """Jobs holding a slice of GPU ``gpu`` (sorted)."""
        return sorted(job for job, held in self.holdings.items() if any(h.gpu == gpu for h in held))

    def shared_fit_key(self, gpu: int) -> float | None:
        """The best-fit key of a partly used GPU for ``shared`` slices (the room left: smaller
        is a tighter fit), or None when the GPU is idle, exclusive or unschedulable."""
        if self._dirty:
            self._flush()
        key = self._key_s[gpu]
        return None if key is None else key[0]

    def holders_util(self, gpus: Collection[int], unknown: float) -> dict[int, float]:
        """Per GPU of ``gpus``: the summed measured utilisation of the slices on it (a holder
        that published none counts as ``unknown``)."""
        out = dict.fromkeys(gpus, 0.0)
        for held in self.holdings.values():
            for h in held:
                if h.gpu in out:
                    out[h.gpu] += unknown if h.util is None else h.util
        return out

    # ------------------------------------------------------------------ reservations for blocked jobs

    def block(self, gpus: Iterable[int], for_job: str) -> None:
        """Reserve GPUs for a blocked job: no other job is placed on them this cycle."""
        for i in gpus:
            if self.blocked.setdefault(i, for_job) == for_job:
                self.blocked_jobs.add(for_job)

    # ------------------------------------------------------------------ candidate search

    def matching_classes(self, features: tuple[str, ...], gpu_model: str | None) -> list[_ClassIndex]:
        """The GPU classes whose static properties satisfy ``features`` and ``gpu_model``."""
        key = (features, gpu_model)
        found = self._match_cache.get(key)
        if found is None:
            found = [
                cls
                for cls in self._classes.values()
                if (gpu_model is None or cls.model.lower() == gpu_model.lower())
                and features_match(cls.features, features)
            ]
            self._match_cache[key] = found
        return found

    def matching_count(self, req: SliceRequest) -> int:
        """How many schedulable GPUs match ``req`` statically (ignoring capacity)."""
        key = (req.features, req.gpu_model)
        n = self._count_cache.get(key)
        if n is None:
            n = self._count_cache[key] = sum(
                1
                for i, g in enumerate(self.gpus)
                if self.schedulable[i] and matches_static(g, req.features, req.gpu_model)
            )
        return n

    def rebuild_index(self) -> None:
        """Rebuild every sorted index from the loads (after bulk :meth:`reserve` with ``reindex=False``)."""
        layout = self.layout
        n = len(self.gpus)
        self._dirty.clear()
        for cls in self._classes.values():
            for lst in cls.part_g:
                lst.clear()
            cls.part_s.clear()
        self._key_empty = list(layout.empty_key)
        self._key_g = [None] * n
        self._key_s = [None] * n
        loads = self.loads
        key_empty = self._key_empty
        for i in [i for i in range(n) if loads[i].slices]:
            key_empty[i] = None
            self._place_keys(i, sort=False)
        for c, cls in enumerate(self._classes.values()):
            cls.empty = [k for k in layout.class_empty[c] if key_empty[k[1]] is not None]
            for lst in cls.part_g:
                lst.sort()
            cls.part_s.sort()

    def prefers_idle(self, req: SliceRequest) -> bool:
        """True when a slice of ``req`` should go to an idle GPU first (``spread_idle_above``).

        That is while more than ``spread_idle_above`` of the schedulable GPUs ``req`` may use are
        idle; exclusive requests only ever see idle GPUs anyway.
        """
        threshold = self.spread_idle_above
        if threshold >= 1.0 or req.qos is QoS.EXCLUSIVE:
            return False
        if self._dirty:
            self._flush()
        classes = self.matching_classes(req.features, req.gpu_model)
        total = sum(c.size for c in classes)
        return total > 0 and sum(len(c.empty) for c in classes) > threshold * total

    def candidate_bound(self, req: SliceRequest) -> int:
        """How many GPUs :meth:`candidates` would look at for ``req`` (those of its classes whose
        index key clears the request's size), before checking reservations, nodes and the full
        fit: at least as many as it yields. A placement needing more distinct GPUs than this
        cannot succeed."""
        if self._dirty:
            self._flush()
        classes = self.matching_classes(req.features, req.gpu_model)
        partial_lists, need_part, need_empty = self._index_lists(classes, req)
        n = 0
        for lst in partial_lists:
            n += len(lst) - bisect.bisect_left(lst, (need_part, -1))
        for c in classes:
            n += len(c.empty) - bisect.bisect_left(c.empty, (need_empty, -1))
        return n

    def _index_lists(
        self, classes: list[_ClassIndex], req: SliceRequest
    ) -> tuple[list[list[tuple[float, int]]], float, float]:
        """The partly-used index lists ``req`` may take a GPU from, and the key each list (and the
        idle lists) must reach: exclusive jobs take idle GPUs only; guaranteed ones a compute bucket
        that fits; shared ones the shared list, by quota headroom."""
        if req.qos is QoS.EXCLUSIVE:
            return [], 0.0, float(req.memory)
        if req.qos is QoS.GUARANTEED:
            wanted = _buckets_for(req.compute)
            return [c.part_g[b] for c in classes for b in wanted], float(req.memory), float(req.memory)
        return [c.part_s for c in classes], float(req.peak), max(req.memory / self.ratio, float(req.peak))

    def candidates(
        self, req: SliceRequest, avoid_nodes: Iterable[str] = (), min_island: int = 0, idle_first: bool = False
    ) -> Iterator[int]:
        """GPUs that can take one slice of ``req`` now, best fit first.

        Order: partly used GPUs by least leftover (memory for guaranteed, quota headroom for
        shared), then idle GPUs by smallest memory, ties by node and index; ``idle_first`` puts
        the idle GPUs first (spreading instead of packing, see :meth:`prefers_idle`). Exclusive jobs only
        see idle GPUs, so whole GPUs stay whole for them. GPUs reserved for another job and nodes
        of the job's anti-affinity group (and ``avoid_nodes``) are skipped, and so are nodes
        outside ``req.nodes`` when it names any (a job's own node, a gang's member nodes). ``min_island`` > 0
        restricts the search to classes that have NVLink islands of at least that size.
        """
        if self._dirty:
            self._flush()
        classes = self.matching_classes(req.features, req.gpu_model)
        if min_island:
            classes = [c for c in classes if c.max_island >= min_island]
        if not classes:
            return
        avoid = set(avoid_nodes)
        if req.anti_affinity is not None:
            avoid.update(n for n, c in self.groups.get(req.anti_affinity, {}).items() if c > 0)
        only = frozenset(req.nodes)  # a job leases only its own node (a gang: its members' nodes)
        blocked = self.blocked
        loads = self.loads
        nodes = self.nodes
        ratio = self.ratio
        job = req.job
        partial_lists, need_part, need_empty = self._index_lists(classes, req)
        streams = [_merged(partial_lists, need_part), _merged([c.empty for c in classes], need_empty)]
        if idle_first:
            streams.reverse()
        for stream in streams:
            for _key, i in stream:
                holder = blocked.get(i)
                if holder is not None and holder != job:
                    continue
                if avoid and nodes[i] in avoid:
                    continue
                if only and nodes[i] not in only:
                    continue
                if fits(loads[i], req, ratio):
                    yield i

    # ------------------------------------------------------------------ index maintenance

    def _reindex(self, i: int) -> None:
        """Note that GPU ``i``'s load changed: its index keys are moved at the next read of the
        indexes (:meth:`_flush`), so a change undone before then (a trial plan, an un-reserve and
        re-reserve of the same holdings) costs no index work."""
        if self._class_of[i] is not None:
            self._dirty.add(i)

    def _flush(self) -> None:
        """Bring the sorted indexes up to date for every GPU noted by :meth:`_reindex` (a GPU
        whose keys come out as they were is left in place)."""
        dirty = sorted(self._dirty)
        self._dirty.clear()
        ratio = self.ratio
        for i in dirty:
            cls = self._class_of[i]
            assert cls is not None
            load = self.loads[i]
            # The keys the GPU's load gives now (as :meth:`_place_keys` computes them).
            ke: tuple[float, int] | None = None
            kg: tuple[float, int] | None = None
            ks: tuple[float, int] | None = None
            b = self._bucket_g[i]
            if load.slices == 0:
                ke = (float(load.phys), i)
            elif not load.exclusive:
                if load.compute < 1.0 - COMPUTE_EPS:
                    kg = (float(load.free_guaranteed), i)
                    b = _bucket(1.0 - load.compute)
                ks = (float(min(load.shared_headroom(ratio), load.phys - load.reserved - load.shared_peak)), i)
            old = self._key_empty[i]
            if old != ke:
                if old is not None:
                    _remove(cls.empty, old)
                if ke is not None:
                    bisect.insort(cls.empty, ke)
                self._key_empty[i] = ke
            old = self._key_g[i]
            if old != kg or (kg is not None and b != self._bucket_g[i]):
                if old is not None:
                    _remove(cls.part_g[self._bucket_g[i]], old)
                if kg is not None:
                    bisect.insort(cls.part_g[b], kg)
                    self._bucket_g[i] = b
                self._key_g[i] = kg
            old = self._key_s[i]
            if old != ks:
                if old is not None:
                    _remove(cls.part_s, old)
                if ks is not None:
                    bisect.insort(cls.part_s, ks)
                self._key_s[i] = ks

    def _place_keys(self, i: int, sort: bool) -> None:
        cls = self._class_of[i]
        if cls is None:
            return
        load = self.loads[i]
        put = bisect.insort if sort else list.append
        if load.slices == 0:
            k = (float(load.phys), i)
            put(cls.empty, k)
            self._key_empty[i] = k
        elif not load.exclusive:
            if load.compute < 1.0 - COMPUTE_EPS:  # no guaranteed slice fits where compute is all taken
                kg = (float(load.free_guaranteed), i)
                b = self._bucket_g[i] = _bucket(1.0 - load.compute)
                put(cls.part_g[b], kg)
                self._key_g[i] = kg
            # Shared fit needs headroom >= quota and peak room >= predicted peak (<= quota): keyed
            # by the smaller of the two, a bisection at the predicted peak is exact when peaks are unknown.
            ks = (float(min(load.shared_headroom(self.ratio), load.phys - load.reserved - load.shared_peak)), i)
            put(cls.part_s, ks)
            self._key_s[i] = ks


def _remove(lst: list[tuple[float, int]], key: tuple[float, int]) -> None:
    j = bisect.bisect_left(lst, key)
    if j < len(lst) and lst[j] == key:
        del lst[j]


def _tail(lst: list[tuple[float, int]], need: float) -> Iterator[tuple[float, int]]:
    start = bisect.bisect_left(lst, (need, -1))
    for j in range(start, len(lst)):
        yield lst[j]


def _merged(lists: list[list[tuple[float, int]]], need: float) -> Iterator[tuple[float, int]]:
    if len(lists) == 1:
        return _tail(lists[0], need)
    return heapq.merge(*(_tail(lst, need) for lst in lists))
