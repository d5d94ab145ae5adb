"""How far can any scheduler take simulation 5b? Reference points for ``docs/simulation.md`` 5b.

The eight Pollux/Sia workloads of section 5b (2x arrivals, ``16*4xT4-16GB``: 64 GPUs), with the
simulator's own trace loader and speed-up model (``elastic_scale``: ``throughput(k) = k / (1 +
sigma (k - 1))``; adaptive rows may run on their ask to ``4 x`` their ask). Printed, as mean of
the eight average JCTs:

* ``fluid SRPT to max``: a clairvoyant fluid scheduler (true run times, free and instant resizes,
  whole GPUs, no placement limits) that runs the job with the shortest remaining time first, on
  up to its ``max_gpu``, then the next, until the GPUs run out;
* ``fluid SRPT 2x then leftovers``: the same, each job first taking up to twice its ask, then the
  GPUs left going shortest-first up to ``max_gpu``;
* ``fluid heSRPT``: the mean-flow-time-optimal split of the GPUs among the jobs present
  (heSRPT, Berg, Moseley, Wang and Harchol-Balter 2020, solved for this speed-up curve with each
  job's ``max_gpu`` as a cap: :func:`hesrpt_allocation`), recomputed at every arrival and
  completion (optimal without arrivals; a heuristic with them): every job gets some GPUs, the
  shortest the most. Four shapes: fractional GPUs (a job may run on any share, down to 0: the
  fluid relaxation); whole GPUs (the fractional split rounded, a job may get none); at least
  one GPU (jobs admitted shortest first while one GPU each is left, each on at least one); at
  least the ask (jobs admitted shortest first while their asks fit, each on at least its ask:
  the bounds the pool's adaptive rows declare, ``min_gpus`` = ask);
* ``fluid greedy static marginal``: whole GPUs one at a time to the job whose completion time
  (were its allocation kept) falls most; shows that weighting the marginal gain by a job's own
  completion time favours the long jobs (far worse than any of the above);
* ``lower bound``: per workload the larger of (a) each job alone on its ``max_gpu`` from its
  arrival and (b) preemptive shortest-first on one machine as fast as the 64 GPUs together, each
  job needing its GPU-seconds at its ask (no allocation of at least the ask spends fewer, the
  efficiency falling with more GPUs). Any schedule's mean JCT is at least this.

The fluid figures are heuristics, not bounds: a real scheduler can beat some of them (at
``--sigma 0.2`` the pool beats SRPT 2x). Usage: ``python benchmarks/pollux_headroom.py [--sigma
0.05] [--per-workload]`` (about 10 minutes on a loaded 2-core machine: the heSRPT splits are
solved numerically).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import math
import statistics
from collections.abc import Callable

from gpupool_sdk.sim.engine import elastic_scale
from gpupool_sdk.sim.trace import TraceJob, load_trace

WORKLOADS = (
    "pollux_workloads_workload-1", "pollux_workloads_workload-2",
    "pollux_workloads-realistic_workload-1", "pollux_workloads-realistic_workload-2",
    "sia_philly_workload-1", "sia_philly_workload-2", "sia_saturn_workload-1", "sia_saturn_workload-2",
)
GPUS = 64


def fluid_srpt(jobs: list[TraceJob], sigma: float, first_factor: float | None) -> float:
    """Mean JCT of the clairvoyant fluid scheduler (``first_factor`` None: SRPT to ``max_gpu``).

    Example:
        >>> from gpupool_sdk.sim.trace import TraceJob
        >>> j = TraceJob(index=0, job_id="a", source="s", submit_s=0.0, duration_s=100.0, num_gpu=1,
        ...              gpu_fraction=1.0, priority="", status="", extra={}, censored=False,
        ...              duration_origin="trace", row=2, max_gpu=2)
        >>> round(fluid_srpt([j], 0.0, None), 1)
        50.0
    """
    todo = sorted(jobs, key=lambda j: j.submit_s)
    left = {j.index: j.duration_s for j in todo}  # seconds of work on the job's ask
    top = {j.index: min(j.max_gpu or j.num_gpu, GPUS) for j in todo}
    t, i, active, jct = 0.0, 0, [], []
    while i < len(todo) or active:
        if not active:
            t = max(t, todo[i].submit_s)
        while i < len(todo) and todo[i].submit_s <= t:
            active.append(todo[i])
            i += 1
        order = sorted(active, key=lambda j: left[j.index] / elastic_scale(top[j.index], j.num_gpu, sigma))
        free, held = GPUS, {}
        for j in order:
            want = top[j.index] if first_factor is None else min(top[j.index], max(j.num_gpu, int(first_factor * j.num_gpu)))
            k = min(want, free)
            held[j.index] = k
            free -= k
        for j in order:
            add = min(free, top[j.index] - held[j.index])
            held[j.index] += add
            free -= add
        speed = {j.index: elastic_scale(held[j.index], j.num_gpu, sigma) if held[j.index] else 0.0 for j in active}
        arrival = todo[i].submit_s if i < len(todo) else float("inf")
        dt = min([left[j.index] / speed[j.index] for j in active if speed[j.index] > 0] + [arrival - t])
        t += dt
        for j in list(active):
            left[j.index] -= speed[j.index] * dt
            if left[j.index] <= 1e-6:
                active.remove(j)
                jct.append(t - j.submit_s)
    return statistics.mean(jct)


def _speed(k: float, sigma: float) -> float:
    """``elastic_throughput`` for any real ``k >= 0`` (the fluid relaxation's speed-up; concave)."""
    return k / (1.0 + sigma * (k - 1.0))


def _marginal(k: float, sigma: float) -> float:
    """Derivative of :func:`_speed` in ``k``: ``(1 - sigma) / (1 + sigma (k - 1))^2`` (decreasing)."""
    return (1.0 - sigma) / (1.0 + sigma * (k - 1.0)) ** 2


def _inverse_marginal(y: float, sigma: float) -> float:
    """The ``k`` at which :func:`_marginal` equals ``y`` (``inf`` for ``y`` at or below 0)."""
    if y <= 0.0:
        return math.inf
    return 1.0 + (math.sqrt((1.0 - sigma) / y) - 1.0) / sigma


def _water_fill(
    mus: tuple[float, ...], floors: tuple[float, ...], caps: tuple[float, ...], gpus: float, sigma: float
) -> list[float]:
    """The allocation that equalises ``mu_j * speed'(k_j)`` (each ``k_j`` in ``[floor_j, cap_j]``,
    summing to ``gpus``, or every job at its cap when the caps sum to less)."""
    if sum(caps) <= gpus:
        return list(caps)

    def fill(nu: float) -> list[float]:
        return [min(c, max(f, _inverse_marginal(nu / m, sigma))) for m, f, c in zip(mus, floors, caps, strict=True)]

    lo, hi = -40.0, 40.0  # log of the water level nu: a higher level gives fewer GPUs in all
    for _ in range(48):
        mid = (lo + hi) / 2
        if sum(fill(math.exp(mid))) > gpus:
            lo = mid
        else:
            hi = mid
    return fill(math.exp(hi))


def hesrpt_allocation(
    caps: tuple[float, ...], gpus: float, sigma: float, floors: tuple[float, ...] | None = None
) -> list[float]:
    """Mean-flow-time-optimal fluid split of ``gpus`` among jobs present (no later arrivals), the
    jobs given in the order they complete (shortest remaining work first), each in ``[floor,
    cap]`` (floors 0 unless given; their sum at most ``gpus``).

    heSRPT (Berg, Moseley, Wang, Harchol-Balter 2020) for a speed-up ``s(k)`` shared by every job:
    as a convex program over the phases between completions, the KKT conditions give each job a
    weight ``mu_j`` such that, in every phase, the GPUs equalise ``mu_j s'(k_j)`` (within the
    bounds) and the weighted throughput ``sum mu_j s(k_j)`` equals the number of jobs alive. Solved
    backward from the last phase (one job: ``mu s(k) = 1``); the allocation depends only on the
    ranks and bounds, not on the sizes (heSRPT's closed form for ``s(k) = k^p`` is the unbounded
    case of the same conditions). Optimal for the completion order given; with unequal bounds
    another order may do better (heSRPT proves shortest-first optimal for equal jobs' curves
    without bounds).

    Example:
        >>> [round(k, 2) for k in hesrpt_allocation((1.0, 8.0), 8.0, 0.05)]
        [1.0, 7.0]
        >>> a = hesrpt_allocation((64.0, 64.0, 64.0), 64.0, 0.05)
        >>> a[0] > a[1] > a[2] > 0, round(sum(a), 6)
        (True, 64.0)
    """
    lows = floors if floors is not None else (0.0,) * len(caps)
    mus = _weights(lows, caps, gpus, sigma)
    return _water_fill(mus, lows, caps, gpus, sigma)


@functools.lru_cache(maxsize=200_000)
def _weights(floors: tuple[float, ...], caps: tuple[float, ...], gpus: float, sigma: float) -> tuple[float, ...]:
    """The KKT weights ``mu`` of :func:`hesrpt_allocation` (memoised per suffix: a completion or a
    late arrival leaves the suffix behind it unchanged)."""
    if len(caps) == 1:
        return (1.0 / _speed(max(floors[0], min(caps[0], gpus)), sigma),)
    rest = _weights(floors[1:], caps[1:], gpus, sigma)
    alive = len(caps)

    def weighted(mu: float) -> float:
        mus = (mu, *rest)
        ks = _water_fill(mus, floors, caps, gpus, sigma)
        return sum(m * _speed(k, sigma) for m, k in zip(mus, ks, strict=True))

    lo, hi = -40.0, 40.0
    for _ in range(48):
        mid = (lo + hi) / 2
        if weighted(math.exp(mid)) < alive:
            lo = mid
        else:
            hi = mid
    return (math.exp(hi), *rest)


def hesrpt_admitted(caps: tuple[float, ...], floors: tuple[float, ...], gpus: float, sigma: float) -> list[float]:
    """heSRPT with a floor per job: a job runs on at least its floor or not at all. Jobs (shortest
    first) are admitted while their floors fit (backfill: a later, smaller one may fit where an
    earlier one does not); the admitted split the GPUs by :func:`hesrpt_allocation` within
    ``[floor, cap]``; the others get none.

    Example:
        >>> hesrpt_admitted((8.0, 8.0, 2.0), (4.0, 4.0, 2.0), 6.0, 0.05)
        [4.0, 0.0, 2.0]
    """
    room, admitted = gpus, []
    for j, floor in enumerate(floors):
        if floor <= room:
            admitted.append(j)
            room -= floor
    shares = hesrpt_allocation(tuple(caps[j] for j in admitted), gpus, sigma, floors=tuple(floors[j] for j in admitted))
    held = [0.0] * len(caps)
    for j, k in zip(admitted, shares, strict=True):
        held[j] = k
    return held


def greedy_static_allocation(left: list[float], caps: tuple[float, ...], gpus: int, sigma: float) -> list[float]:
    """Whole GPUs one at a time to the job whose own completion time (at a constant allocation)
    falls most: ``left_j (1 / s(k) - 1 / s(k + 1))`` (``left`` in single-GPU seconds)."""
    held = [0] * len(left)
    heap = [(-left[j] / _speed(1, sigma), j) for j in range(len(left)) if caps[j] >= 1]
    heapq.heapify(heap)
    for _ in range(gpus):
        if not heap:
            break
        _, j = heapq.heappop(heap)
        held[j] += 1
        if held[j] < caps[j]:
            gain = left[j] * (1.0 / _speed(held[j], sigma) - 1.0 / _speed(held[j] + 1, sigma))
            heapq.heappush(heap, (-gain, j))
    return [float(h) for h in held]


def whole_gpus(shares: list[float], caps: tuple[float, ...], gpus: int) -> list[float]:
    """Round a fluid split to whole GPUs: floors, then the largest remainders (within caps)."""
    held = [math.floor(x + 1e-9) for x in shares]
    spare = gpus - sum(held)
    for j in sorted(range(len(shares)), key=lambda j: held[j] - shares[j]):
        if spare <= 0:
            break
        if held[j] < caps[j]:
            held[j] += 1
            spare -= 1
    return [float(h) for h in held]


#: ``allocate(left, caps, asks, gpus)``: the jobs' split of ``gpus`` (see :func:`fluid`).
Allocator = Callable[[list[float], tuple[float, ...], tuple[float, ...], float], list[float]]


def fluid(jobs: list[TraceJob], sigma: float, allocate: Allocator) -> float:
    """Mean JCT of a clairvoyant fluid scheduler that splits the GPUs with ``allocate(left, caps,
    asks, gpus)`` at every arrival and completion (``left``: remaining work in single-GPU seconds,
    the jobs sorted shortest first; ``caps`` their ``max_gpu``, ``asks`` their ``num_gpu``; free,
    instant resizes; no placement limits)."""
    todo = sorted(jobs, key=lambda j: j.submit_s)
    # work in seconds of one GPU, so that every job shares the speed-up s(k)
    left = {j.index: j.duration_s * _speed(j.num_gpu, sigma) for j in todo}
    top = {j.index: float(min(j.max_gpu or j.num_gpu, GPUS)) for j in todo}
    t, i, active, jct = 0.0, 0, [], []
    while i < len(todo) or active:
        if not active:
            t = max(t, todo[i].submit_s)
        while i < len(todo) and todo[i].submit_s <= t:
            active.append(todo[i])
            i += 1
        active.sort(key=lambda j: (left[j.index], j.index))
        held = allocate(
            [left[j.index] for j in active], tuple(top[j.index] for j in active),
            tuple(float(min(j.num_gpu, GPUS)) for j in active), GPUS,
        )
        speed = {j.index: _speed(k, sigma) for j, k in zip(active, held, strict=True)}
        arrival = todo[i].submit_s if i < len(todo) else float("inf")
        dt = min([left[j.index] / speed[j.index] for j in active if speed[j.index] > 0] + [arrival - t])
        t += dt
        for j in list(active):
            left[j.index] -= speed[j.index] * dt
            if left[j.index] <= 1e-6 * max(1.0, j.duration_s):
                active.remove(j)
                jct.append(t - j.submit_s)
    return statistics.mean(jct)


def lower_bound(jobs: list[TraceJob], sigma: float) -> float:
    """The larger of the two bounds of the module docstring, for one workload."""
    alone = statistics.mean(j.duration_s / elastic_scale(min(j.max_gpu or j.num_gpu, GPUS), j.num_gpu, sigma) for j in jobs)
    arrivals = sorted((j.submit_s, j.duration_s * j.num_gpu / GPUS) for j in jobs)
    t, i, heap, total = 0.0, 0, [], 0.0
    while i < len(arrivals) or heap:
        if not heap:
            t = max(t, arrivals[i][0])
        while i < len(arrivals) and arrivals[i][0] <= t:
            heapq.heappush(heap, [arrivals[i][1], arrivals[i][0]])
            i += 1
        nxt = arrivals[i][0] if i < len(arrivals) else float("inf")
        size, submit = heap[0]
        if t + size <= nxt:
            t += size
            heapq.heappop(heap)
            total += t - submit
        else:
            heap[0][0] -= nxt - t
            t = nxt
    return max(alone, total / len(arrivals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sigma", type=float, default=0.05, help="serial fraction of the speed-up model (simulate's --elastic-sigma)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="arrival time scale (5b: 0.5, 2x arrivals)")
    parser.add_argument("--per-workload", action="store_true", help="also print each workload's figures (columns in row order)")
    args = parser.parse_args()
    sigma = args.sigma

    def hesrpt(left: list[float], caps: tuple[float, ...], asks: tuple[float, ...], gpus: float) -> list[float]:
        return hesrpt_allocation(caps, gpus, sigma)

    def hesrpt_whole(left: list[float], caps: tuple[float, ...], asks: tuple[float, ...], gpus: float) -> list[float]:
        return whole_gpus(hesrpt_allocation(caps, gpus, sigma), caps, int(gpus))

    def hesrpt_one(left: list[float], caps: tuple[float, ...], asks: tuple[float, ...], gpus: float) -> list[float]:
        return whole_gpus(hesrpt_admitted(caps, (1.0,) * len(caps), gpus, sigma), caps, int(gpus))

    def hesrpt_ask(left: list[float], caps: tuple[float, ...], asks: tuple[float, ...], gpus: float) -> list[float]:
        return whole_gpus(hesrpt_admitted(caps, asks, gpus, sigma), caps, int(gpus))

    def greedy(left: list[float], caps: tuple[float, ...], asks: tuple[float, ...], gpus: float) -> list[float]:
        return greedy_static_allocation(left, caps, int(gpus), sigma)

    shapes: dict[str, Callable[[list[TraceJob]], float]] = {
        "fluid SRPT to max": lambda jobs: fluid_srpt(jobs, sigma, None),
        "fluid SRPT 2x then leftovers": lambda jobs: fluid_srpt(jobs, sigma, 2.0),
        "fluid heSRPT, fractional GPUs": lambda jobs: fluid(jobs, sigma, hesrpt),
        "fluid heSRPT, whole GPUs": lambda jobs: fluid(jobs, sigma, hesrpt_whole),
        "fluid heSRPT, at least 1 GPU": lambda jobs: fluid(jobs, sigma, hesrpt_one),
        "fluid heSRPT, at least the ask": lambda jobs: fluid(jobs, sigma, hesrpt_ask),
        "fluid greedy static marginal": lambda jobs: fluid(jobs, sigma, greedy),
        "lower bound": lambda jobs: lower_bound(jobs, sigma),
    }
    rows: dict[str, list[float]] = {name: [] for name in shapes}
    for w in WORKLOADS:
        jobs = load_trace("pollux_sia_workloads.csv", sources=[w], time_scale=args.time_scale).jobs
        for name, run in shapes.items():
            rows[name].append(run(jobs))
        if args.per_workload:
            print(w, " ".join(f"{v[-1]:.0f}" for v in rows.values()), flush=True)
    for name, values in rows.items():
        print(f"{name:32s} mean avg JCT {statistics.mean(values):8.0f} s")

if __name__ == "__main__":
    main()
