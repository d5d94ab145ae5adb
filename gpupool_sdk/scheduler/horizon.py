"""How long a cycle's decisions stay valid when nothing but the clock changes.

A cycle is a pure function of its snapshot, and ``snapshot.now`` enters it only through a few
time-dependent rules. With the snapshot otherwise unchanged (no arrival, completion, ack, new
telemetry or GPU change), a later cycle decides the same as this one until the first of:

* a directive's deadline passes (a missed ack becomes a Revoke or a Preempt);
* a running job's minimum run time ends (it becomes a possible victim), or, with
  ``migrate_for_fragmentation``, a running shared job reaches ``migrate_min_run_s`` since its
  grant (it may be moved);
* with LAS, a running job crosses a queue threshold: its attained service grows by the compute
  it holds per second; a job ranked by its remaining service (``JobView.remaining_s``,
  ``use_remaining``) loses as much per second (an honest estimate counts down while it runs);
* a pending job that failed to be placed reaches ``reserve_after_s`` of waiting (it gets a
  reservation), while the cycle still had reservations to give;
* a moved job's landing room lapses (``migrate_hold_s``): the scheduler keeps the hold from
  cycle to cycle, and drops it otherwise only for a change in the snapshot;
* with aging, ``max_wait_s`` or LAS starvation promotion, every instant (the order moves with time).

:attr:`~gpupool_sdk.scheduler.types.ScheduleResult.valid_until` carries that instant. A driver
that knows nothing else changed may skip cycles before it (the simulator does; the coordinator
may): the decisions it would get are the ones it already applied.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from gpupool_sdk.resources import JobState, QoS
from gpupool_sdk.scheduler.ordering import remaining_gpu_s
from gpupool_sdk.scheduler.types import ClusterSnapshot, JobView, SchedulerConfig


def time_dependent_order(config: SchedulerConfig) -> bool:
    """True when the pending order itself moves with time (aging, ``max_wait_s``, LAS promotion)."""
    return config.aging_s_per_priority > 0 or config.max_wait_s > 0 or config.las_promote_after_factor > 0


class HorizonMemo:
    """What :func:`running_horizon` computes per job that does not depend on ``now``, kept from
    cycle to cycle while the job's view is the same object and the config is the same (a memo of
    a pure function: the horizon is the same with or without it)."""

    def __init__(self) -> None:
        self.config: SchedulerConfig | None = None
        #: per job: (its view, directive deadline, granted_at, minimum run time, LAS delta,
        #: run time after which it may be moved: 0 when never).
        self.parts: dict[str, _Parts] = {}


_Parts = tuple[JobView, float | None, float | None, float, float | None, float]


def _parts(view: JobView, config: SchedulerConfig) -> _Parts:
    """``view``'s timed rules: directive deadline, grant time and minimum run time (when it runs),
    the seconds until its next LAS queue crossing from any ``now`` (None: none), and the run
    time after which it may be moved for fragmentation (0: never, or migration off)."""
    d = view.directive
    deadline = d.deadline if d is not None else None
    if deadline is None and view.resize_retry_at is not None:
        deadline = view.resize_retry_at  # a refused resize: a resize may be proposed again from then
    if not view.allocations or view.state is not JobState.GRANTED:
        return (view, deadline, None, 0.0, None, 0.0)
    guard = max(view.spec.min_runtime_s, config.min_runtime_s)
    thresholds = config.las_threshold_gpu_s
    delta = None
    if thresholds:
        compute = sum(a.compute_share for a in view.allocations)
        if compute > 0:
            rem = remaining_gpu_s(view) if config.use_remaining else None
            if rem is not None:
                q = bisect.bisect_right(thresholds, rem)
                if q > 0:
                    delta = (rem - thresholds[q - 1]) / compute
            else:
                q = bisect.bisect_right(thresholds, view.attained_gpu_s)
                if q < len(thresholds):
                    delta = (thresholds[q] - view.attained_gpu_s) / compute
    movable = config.migrate_for_fragmentation and view.spec.qos_class is QoS.SHARED
    return (view, deadline, view.granted_at, guard, delta, config.migrate_min_run_s if movable else 0.0)


def running_horizon(
    snapshot: ClusterSnapshot, config: SchedulerConfig, names: Iterable[str] | None = None, memo: HorizonMemo | None = None
) -> float:
    """The first instant after ``snapshot.now`` at which a rule about running jobs or directives
    changes its answer (deadlines, minimum run times, LAS queue crossings); ``math.inf`` if none.

    ``names``: the jobs to look at (the scheduler passes those holding allocations, which are the
    only ones with directives or run times); default every job of the snapshot. ``memo`` (kept by
    a :class:`~gpupool_sdk.scheduler.policy.Scheduler`) reuses each unchanged view's parts.

    Example:
        >>> from gpupool_sdk.resources import Allocation, JobSpec, QoS
        >>> from gpupool_sdk.scheduler.types import JobView
        >>> a = Allocation("a", "n", "GPU-0", 0, 1, 1.0, QoS.GUARANTEED, granted_at=0.0)
        >>> v = JobView(spec=JobSpec(name="a", memory="1GiB"), state=JobState.GRANTED, allocations=(a,),
        ...             granted_at=0.0, attained_gpu_s=600.0)
        >>> snap = ClusterSnapshot(now=600.0, gpus={}, jobs={"a": v})
        >>> running_horizon(snap, SchedulerConfig(las_threshold_gpu_s=(3600.0,), aging_s_per_priority=0, max_wait_s=0))
        3600.0
    """
    now = snapshot.now
    if time_dependent_order(config):
        return now
    memo = memo if memo is not None else HorizonMemo()
    old = memo.parts if memo.config is config else {}
    new: dict[str, _Parts] = {}
    until = math.inf
    delta = math.inf
    jobs = snapshot.jobs
    for name in jobs if names is None else names:
        view = jobs.get(name)
        if view is None:
            continue
        p = old.get(name)
        if p is None or p[0] is not view:
            p = _parts(view, config)
        new[name] = p
        _v, deadline, granted_at, guard, step, move = p
        if deadline is not None and deadline > now:
            until = min(until, deadline)
        if granted_at is not None and guard > 0 and now - granted_at < guard:
            until = min(until, granted_at + guard)
        if granted_at is not None and move > 0 and now - granted_at < move:
            until = min(until, granted_at + move)
        if step is not None and step < delta:
            delta = step
    memo.config, memo.parts = config, new
    if delta < math.inf:
        until = min(until, now + delta)
    return max(until, now)
