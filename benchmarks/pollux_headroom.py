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
* ``lower bound``: per workload the larger of (a) each job alone on its ``max_gpu`` from its
  arrival and (b) preemptive shortest-first on one machine as fast as the 64 GPUs together, each
  job needing its GPU-seconds at its ask (no allocation of at least the ask spends fewer, the
  efficiency falling with more GPUs). Any schedule's mean JCT is at least this.

The two fluid figures are heuristics, not bounds: a real scheduler can beat them (at
``--sigma 0.2`` the pool does). Usage: ``python benchmarks/pollux_headroom.py [--sigma 0.05]``.
"""

from __future__ import annotations

import argparse
import heapq
import statistics

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
    args = parser.parse_args()
    rows = {"fluid SRPT to max": [], "fluid SRPT 2x then leftovers": [], "lower bound": []}
    for w in WORKLOADS:
        jobs = load_trace("pollux_sia_workloads.csv", sources=[w], time_scale=args.time_scale).jobs
        rows["fluid SRPT to max"].append(fluid_srpt(jobs, args.sigma, None))
        rows["fluid SRPT 2x then leftovers"].append(fluid_srpt(jobs, args.sigma, 2.0))
        rows["lower bound"].append(lower_bound(jobs, args.sigma))
    for name, values in rows.items():
        print(f"{name:30s} mean avg JCT {statistics.mean(values):8.0f} s")


if __name__ == "__main__":
    main()
