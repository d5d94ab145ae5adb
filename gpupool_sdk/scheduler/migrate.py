"""Migration for fragmentation: move a few running shared jobs so that a large slice fits.

Best-fit placement keeps fragmentation low, but it cannot prevent it: a pending job asking for 12
GiB waits while four 16 GiB GPUs have 8 GiB free each, although moving one 4 GiB job would open
12 GiB on one GPU. Preemption does not help when the jobs in the way have the same or a higher
priority, and a preempted job loses its place. A *move* is a preemption whose job fits right now
on another GPU: it checkpoints, is released, and queues again at its old place in line (the
coordinator keeps a re-queued job's submission order; ``gpupool run`` re-queues it at once), so it
pays a checkpoint and a restart, not a wait: the scheduler holds its landing room until it runs
again (``migrate_hold_s``; ``Scheduler._apply_holds``).

:func:`plan_migration` is pure: for a one-slice request that fits on no GPU, it looks at the GPUs
of the request's class holding movable jobs (:func:`movable_jobs`: running ``shared`` one-slice
jobs with no directive, past their minimum guarantee and ``migrate_min_run_s`` since their grant),
picks on each a small set of movers after which the request fits there (the smallest one alone
if one suffices, else the largest first, at most :data:`MAX_MOVERS`, those not needed put back),
ranks the GPUs by fewest movers then fewest bytes moved, and for the first :data:`MAX_GPUS` of
them checks in the ledger that every
mover can be placed on another GPU right now, each after the previous ones (its own request:
node, features, model, anti-affinity, overcommit; the defragmented GPU held for the pending job).
The ledger is put back as it was.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from gpupool_sdk.resources import JobState, QoS
from gpupool_sdk.scheduler.filter import COMPUTE_EPS, GpuLoad, SliceRequest, fits, request_for
from gpupool_sdk.scheduler.ledger import Holding, Ledger
from gpupool_sdk.scheduler.placement import holdings_for, place
from gpupool_sdk.scheduler.preempt import is_protected
from gpupool_sdk.scheduler.types import JobView, SchedulerConfig

#: Candidate GPUs checked per pending job (the best ranked), and movers taken off one GPU.
MAX_GPUS = 4
MAX_MOVERS = 3
#: The reason of a move starts with this (metrics and the simulator count moves by it).
MIGRATE_PREFIX = "migrate:"


@dataclass(frozen=True)
class Move:
    """One job moved: its request when placed again, and the GPUs it leaves and lands on (ledger indices)."""

    job: str
    req: SliceRequest
    src: int
    dest: int


@dataclass(frozen=True)
class MigrationPlan:
    """Moves that open room for a pending job on ledger GPU ``gpu``."""

    gpu: int
    moves: tuple[Move, ...]


#: a movable job on one GPU: (name, its request when placed again, what it holds there).
Mover = tuple[str, SliceRequest, Holding]


def movable_jobs(
    views: Iterable[JobView],
    ledger: Ledger,
    now: float,
    config: SchedulerConfig,
    memo: dict[str, tuple[JobView, SliceRequest]] | None = None,
) -> dict[int, list[Mover]]:
    """Per ledger GPU, the jobs that may be moved off it, smallest slice first (then by name).

    A mover is a GRANTED ``shared`` job of one slice (no gang, no elastic range) with no
    directive, past its minimum guarantee and ``migrate_min_run_s`` since its grant. ``memo``
    (kept by the scheduler from cycle to cycle) keeps each job's request while its view is the
    same object (with the same config)."""
    out: dict[int, list[Mover]] = {}
    memo = memo if memo is not None else {}
    seen: set[str] = set()
    for v in views:
        spec = v.spec
        if v.state is not JobState.GRANTED or v.directive is not None or spec.qos_class is not QoS.SHARED:
            continue
        if spec.gpus != 1 or spec.is_gang or len(v.allocations) != 1 or v.granted_at is None:
            continue
        if now - v.granted_at < config.migrate_min_run_s or is_protected(v, now, config):
            continue
        held = ledger.holdings.get(spec.name, ())
        if len(held) != 1:
            continue
        hit = memo.get(spec.name)
        if hit is None or hit[0] is not v:
            hit = memo[spec.name] = (v, request_for(v, config, 1))
        seen.add(spec.name)
        out.setdefault(held[0].gpu, []).append((spec.name, hit[1], held[0]))
    if len(memo) > 2 * len(seen) + 256:
        for name in [n for n in memo if n not in seen]:
            del memo[name]
    for lst in out.values():
        lst.sort(key=lambda m: (m[2].memory, m[0]))
    return out


def plan_migration(
    ledger: Ledger,
    req: SliceRequest,
    movers: Mapping[int, list[Mover]],
    busy: Collection[str] = (),
    no_land: dict[tuple[object, ...], int] | None = None,
) -> MigrationPlan | None:
    """Moves after which one slice of ``req`` fits on one GPU, every mover placed elsewhere now; or None.

    ``busy``: jobs that may not be moved (a directive this cycle). ``no_land`` (kept for a
    cycle): movers that could not be placed elsewhere, by (request shape, GPU left), with
    ``ledger.frees`` then; they are skipped until capacity is freed (loads only grow meanwhile).
    The ledger is left as it was."""
    no_land = no_land if no_land is not None else {}
    frees = ledger.frees
    if req.count != 1 or req.per_node:
        return None
    classes = {id(c) for c in ledger.matching_classes(req.features, req.gpu_model)}
    avoid: set[str] = set()
    if req.anti_affinity is not None:
        avoid = {n for n, c in ledger.groups.get(req.anti_affinity, {}).items() if c > 0}
    only = frozenset(req.nodes)
    ratio = ledger.ratio
    options: list[tuple[int, int, int, list[Mover]]] = []
    for i in sorted(movers):
        cls = ledger.class_of(i)
        if cls is None or id(cls) not in classes:
            continue
        holder = ledger.blocked.get(i)
        if (holder is not None and holder != req.job) or ledger.nodes[i] in avoid or (only and ledger.nodes[i] not in only):
            continue
        free = [m for m in movers[i] if m[0] not in busy and no_land.get((m[1].shape, i)) != frees]
        chosen = _choose(ledger.loads[i], req, ratio, free)
        if chosen is not None:
            options.append((len(chosen), sum(m[2].memory for m in chosen), i, chosen))
    options.sort(key=lambda o: o[:3])
    for _n, _b, i, chosen in options[:MAX_GPUS]:
        moves = _try_moves(ledger, req, i, chosen, no_land)
        if moves is not None:
            return MigrationPlan(i, moves)
    return None


def _choose(load: GpuLoad, req: SliceRequest, ratio: float, free: list[Mover]) -> list[Mover] | None:
    """The movers to take off a GPU with ``load`` so that ``req`` fits there: the smallest one
    that suffices alone, else the largest first (at most :data:`MAX_MOVERS`: the fewest moves)
    with those not needed put back (largest first); None when that is not enough."""
    for m in free:
        h = m[2]
        if _fits_minus(load, req, ratio, h.memory, h.peak, 1):
            return [m]
    if len(free) < 2:
        return None
    chosen: list[Mover] = []
    quota = peak = 0
    for m in free[::-1][:MAX_MOVERS]:
        chosen.append(m)
        quota += m[2].memory
        peak += m[2].peak
        if len(chosen) > 1 and _fits_minus(load, req, ratio, quota, peak, len(chosen)):
            break
    else:
        return None
    for m in list(chosen):
        h = m[2]
        if len(chosen) > 1 and _fits_minus(load, req, ratio, quota - h.memory, peak - h.peak, len(chosen) - 1):
            chosen.remove(m)
            quota -= h.memory
            peak -= h.peak
    return chosen


def _fits_minus(load: GpuLoad, req: SliceRequest, ratio: float, quota: int, peak: int, slices: int) -> bool:
    """:func:`~gpupool_sdk.scheduler.filter.fits` of ``req`` on ``load`` without ``slices`` shared
    slices of ``quota`` bytes and ``peak`` predicted bytes in all (movers are shared slices: they
    hold no reservation and no compute), without copying the load."""
    if req.qos is QoS.EXCLUSIVE:
        return load.slices - slices == 0 and load.phys >= req.memory
    if load.exclusive:
        return False
    if req.qos is QoS.GUARANTEED:
        return (
            load.reserved + load.shared_quota - quota + req.memory <= load.phys
            and load.compute + req.compute <= 1.0 + COMPUTE_EPS
        )
    return (
        load.shared_quota - quota + req.memory + load.reserved <= ratio * load.phys
        and load.shared_peak - peak + req.peak + load.reserved <= load.phys
    )


def _try_moves(
    ledger: Ledger, req: SliceRequest, gpu: int, chosen: list[Mover], no_land: dict[tuple[object, ...], int]
) -> tuple[Move, ...] | None:
    """Place each of ``chosen`` on another GPU, in order, with ``gpu`` held for ``req.job``; the
    moves when all land and ``req`` then fits on ``gpu``, else None (a first mover that lands
    nowhere is noted in ``no_land``). The ledger is put back."""
    frees = ledger.frees
    had = ledger.blocked.get(gpu)
    ledger.blocked[gpu] = req.job  # nobody lands back on the GPU being emptied
    undo: list[tuple[str, list[Holding]]] = []
    moves: list[Move] = []
    try:
        for name, mreq, _h in chosen:
            undo.append((name, ledger.unreserve(name)))
            dest = place(ledger, mreq)
            if dest is None or dest[0] == gpu:
                if not moves:
                    no_land[(mreq.shape, gpu)] = frees
                return None
            ledger.reserve(name, holdings_for(ledger, mreq, dest), mreq.anti_affinity)
            moves.append(Move(name, mreq, gpu, dest[0]))
        return tuple(moves) if fits(ledger.loads[gpu], req, ledger.ratio) else None
    finally:
        for name, old in reversed(undo):
            ledger.unreserve(name)
            ledger.restore(name, old)
        if had is None:
            del ledger.blocked[gpu]
        else:
            ledger.blocked[gpu] = had
        ledger.frees = frees
