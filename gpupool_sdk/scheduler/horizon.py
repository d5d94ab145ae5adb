"""How long a cycle's decisions stay valid when nothing but the clock changes.

A cycle is a pure function of its snapshot, and ``snapshot.now`` enters it only through a few
time-dependent rules. With the snapshot otherwise unchanged (no arrival, completion, ack, new
telemetry or GPU change), a later cycle decides the same as this one until the first of:

* a directive's deadline passes (a missed ack becomes a Revoke or a Preempt);
* a running job's minimum run time ends (it becomes a possible victim);
* with LAS, a running job crosses a queue threshold: its attained service grows by the compute
  it holds per second; a job ranked by its remaining service (``JobView.remaining_s``,
  ``use_remaining``) loses as much per second (an honest estimate counts down while it runs);
* a pending job that failed to be placed reaches ``reserve_after_s`` of waiting (it gets a
  reservation), while the cycle still had reservations to give;
* with aging, ``max_wait_s`` or LAS starvation promotion, every instant (the order moves with time).

:attr:`~gpupool_sdk.scheduler.types.ScheduleResult.valid_until` carries that instant. A driver
that knows nothing else changed may skip cycles before it (the simulator does; the coordinator
may): the decisions it would get are the ones it already applied.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from gpupool_sdk.resources import JobState
from gpupool_sdk.scheduler.ordering import remaining_gpu_s
from gpupool_sdk.scheduler.types import ClusterSnapshot, SchedulerConfig


def time_dependent_order(config: SchedulerConfig) -> bool:
    """True when the pending order itself moves with time (aging, ``max_wait_s``, LAS promotion)."""
    return config.aging_s_per_priority > 0 or config.max_wait_s > 0 or config.las_promote_after_factor > 0


def running_horizon(snapshot: ClusterSnapshot, config: SchedulerConfig, names: Iterable[str] | None = None) -> float:
    """The first instant after ``snapshot.now`` at which a rule about running jobs or directives
    changes its answer (deadlines, minimum run times, LAS queue crossings); ``math.inf`` if none.

    ``names``: the jobs to look at (the scheduler passes those holding allocations, which are the
    only ones with directives or run times); default every job of the snapshot.

    Example:
        >>> from gpupool_sdk.resources import Allocation, JobSpec, QoS
        >>> from gpupool_sdk.scheduler.types import JobView
        >>> a = Allocation("a", "n", "GPU-0", 0, 1, 1.0, QoS.GUARANTEED, granted_at=0.0)
        >>> v = JobView(spec=JobSpec(name="a", memory="1GiB"), state=JobState.GRANTED, allocations=(a,),
        ...             granted_at=0.0, attained_gpu_s=600.0)
        >>> snap = ClusterSnapshot(now=600.0, gpus={}, jobs={"a": v})
        >>> running_horizon(snap, SchedulerConfig(las_threshold_gpu_s=(3600.0,)))
        3600.0
    """
    now = snapshot.now
    if time_dependent_order(config):
        return now
    thresholds = config.las_threshold_gpu_s
    until = math.inf
    jobs = snapshot.jobs
    for view in jobs.values() if names is None else (jobs[n] for n in names if n in jobs):
        d = view.directive
        if d is not None and d.deadline > now:
            until = min(until, d.deadline)
        if not view.allocations or view.state is not JobState.GRANTED:
            continue
        if view.granted_at is not None:
            guard = max(view.spec.min_runtime_s, config.min_runtime_s)
            if guard > 0 and now - view.granted_at < guard:
                until = min(until, view.granted_at + guard)
        if not thresholds:
            continue
        compute = sum(a.compute_share for a in view.allocations)
        if compute <= 0:
            continue
        rem = remaining_gpu_s(view) if config.use_remaining else None
        if rem is not None:
            q = bisect.bisect_right(thresholds, rem)
            if q > 0:
                until = min(until, now + (rem - thresholds[q - 1]) / compute)
        else:
            q = bisect.bisect_right(thresholds, view.attained_gpu_s)
            if q < len(thresholds):
                until = min(until, now + (thresholds[q] - view.attained_gpu_s) / compute)
    return max(until, now)
