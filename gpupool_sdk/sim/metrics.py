"""Metrics of one simulated run.

Definitions (also in ``docs/simulation.md``):

* JCT (job completion time) = end - arrival, over finished jobs; ``avg``, ``p50``, ``p99``
  (nearest-rank percentiles).
* ``avg_queue_s``: mean time a finished job spent pending, re-queues after preemption included;
  ``avg_first_start_s``: mean arrival-to-first-grant delay.
* ``makespan_s``: first arrival (0) to the last completion.
* ``gpu_alloc_util``: time-average over the makespan of the allocated compute share per GPU
  (capped at 1 per GPU), divided by the GPU count.
* ``gpu_used_util``: the same with what jobs actually keep busy: share x profile GPU
  utilization (idle phases included) x current speed (colocation slowdown), capped at 1 per GPU.
* ``mem_util``: time-average of the GPU memory jobs actually hold (their demand, or less when
  ballooned) / physical memory; ``mem_granted_util``: the same with granted quotas.
* ``stranded_gpu_fraction`` (FGD-style): time-average fraction of GPUs' capacity that is free
  (partly or wholly) but cannot host one slice of the next pending job (the longest-waiting one),
  sampled over the run; 0 while nothing waits. ``free_gpu_fraction_while_pending`` counts all
  free capacity while a job waits.
* ``by_class``: per trace priority class (``"LS"``, ``"BE"``...; ``"-"`` for untagged rows), the
  number of finished jobs and their average JCT and queueing: where a policy's gain or loss lands.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gpupool_sdk.sim.engine import DONE, REJECTED, SimJob, SimResult


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; 0.0 for an empty list.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
        2.0
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def compute_metrics(result: SimResult) -> dict[str, Any]:
    """The metrics of one run (see the module docstring); every value is JSON-serialisable."""
    done = [j for j in result.jobs if j.state == DONE and j.end is not None]
    jct = [j.end - j.submit for j in done if j.end is not None]
    queue = [j.pending_s for j in done]
    first = [j.first_start - j.submit for j in done if j.first_start is not None]
    span = result.makespan_s
    n = result.num_gpus
    denom = span * n
    return {
        "avg_jct_s": sum(jct) / len(jct) if jct else 0.0,
        "p50_jct_s": percentile(jct, 50),
        "p99_jct_s": percentile(jct, 99),
        "avg_queue_s": sum(queue) / len(queue) if queue else 0.0,
        "avg_first_start_s": sum(first) / len(first) if first else 0.0,
        "makespan_s": span,
        "gpu_alloc_util": result.alloc_gpu_s / denom,
        "gpu_used_util": result.used_gpu_s / denom,
        "mem_util": result.used_mem_byte_s / (span * result.total_memory),
        "mem_granted_util": result.granted_mem_byte_s / (span * result.total_memory),
        "preemptions": result.preemptions,
        "stranded_gpu_fraction": result.stranded_gpu_s / denom,
        "free_gpu_fraction_while_pending": result.free_while_pending_gpu_s / denom,
        "finished": len(done),
        "unfinished": sum(1 for j in result.jobs if j.state not in (DONE, REJECTED)),
        "rejected": sum(1 for j in result.jobs if j.state == REJECTED),
        "failures": result.failures,
        "revokes": result.revokes,
        "balloons": result.balloons,
        "cycles": result.cycles,
        "wall_s": result.wall_s,
        "by_class": _by_class(done),
    }


def _by_class(done: Sequence[SimJob]) -> dict[str, dict[str, float]]:
    groups: dict[str, list[SimJob]] = {}
    for j in done:
        groups.setdefault(j.tj.priority or "-", []).append(j)
    out = {}
    for name in sorted(groups):
        jobs = groups[name]
        jct = [j.end - j.submit for j in jobs if j.end is not None]
        out[name] = {
            "jobs": len(jobs),
            "avg_jct_s": sum(jct) / len(jct) if jct else 0.0,
            "avg_queue_s": sum(j.pending_s for j in jobs) / len(jobs),
        }
    return out
