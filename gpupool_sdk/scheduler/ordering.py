"""Queue ordering and anti-starvation.

Pending jobs are considered in this order:

1. jobs that waited at least ``max_wait_s`` (starved), longest wait first;
2. higher *effective priority* first: ``priority + waited_s / aging_s_per_priority``, where
   ``waited_s`` counts time since ``queued_at`` not spent running (:func:`waited_s`);
3. with ``las_threshold_gpu_s`` set (Tiresias-like least attained service), the priority
   level is the integer part of the effective priority and, within a level, jobs in a lower
   attained-service queue go first (:func:`las_rank`: the queue of ``attained_gpu_s``, or 0
   for a job promoted after waiting ``las_promote_after_factor`` times its run so far);
   **progress-aware** (``use_remaining``, on by default): a job that reports how long it has left
   (``JobView.remaining_s``, from its telemetry) is ranked by its *remaining* service instead of
   the service it attained (:func:`service_gpu_s`), and inside one queue jobs that know their
   remaining service go shortest first, ahead of jobs that do not (ranked as if they needed the
   queue's upper bound): shortest-remaining-first for jobs that know their length,
   least-attained-service for jobs that do not (:func:`within_queue`);
4. FIFO by ``JobView.order``, then by name.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from gpupool_sdk.scheduler.types import JobView, SchedulerConfig


def run_s(view: JobView) -> float:
    """Seconds the job has run in all: ``attained_gpu_s`` over the compute it holds (or asks for).

    ``attained_gpu_s`` counts compute share x seconds per slice, so it is divided by the sum of
    the shares, not the slice count: a half-GPU job that ran an hour ran 3,600 s, not 1,800 s.

    Example:
        >>> from gpupool_sdk.resources import JobSpec
        >>> run_s(JobView(spec=JobSpec(name="a", memory="4GiB", compute_share=0.5), attained_gpu_s=1800.0))
        3600.0
    """
    if view.allocations:
        compute = sum(a.compute_share for a in view.allocations)
    else:
        compute = view.spec.gpus * view.spec.compute_share
    return max(0.0, view.attained_gpu_s) / max(compute, 1e-9)


def waited_s(view: JobView, now: float) -> float:
    """Seconds ``view`` has spent waiting since ``queued_at`` (never negative).

    Time it ran does not count: a job preempted and queued again keeps its first queue time
    (``checkpoints/{job}``) but not credit for the time it held GPUs. For a granted job this is the
    wait it had accumulated when granted, frozen while it runs.
    """
    waited = now - view.queued_at - run_s(view)
    if view.granted_at is not None:
        waited = min(waited, view.granted_at - view.queued_at)
    return max(0.0, waited)


def effective_priority(view: JobView, now: float, config: SchedulerConfig) -> float:
    """``priority + waited / aging_s_per_priority`` (no aging when the knob is 0)."""
    prio = float(view.spec.priority)
    if config.aging_s_per_priority > 0:
        prio += waited_s(view, now) / config.aging_s_per_priority
    return prio


def is_starved(view: JobView, now: float, config: SchedulerConfig) -> bool:
    """True when the job waited at least ``max_wait_s`` (it goes ahead of everyone)."""
    return config.max_wait_s > 0 and waited_s(view, now) >= config.max_wait_s


def remaining_gpu_s(view: JobView) -> float | None:
    """The job's estimate of the service it still needs, GPU-seconds: ``remaining_s`` times the
    compute it holds (or asks for); None when it reported no estimate.

    Example:
        >>> from gpupool_sdk.resources import JobSpec
        >>> remaining_gpu_s(JobView(spec=JobSpec(name="a", gpus=4, memory="4GiB"), remaining_s=100.0))
        400.0
    """
    if view.remaining_s is None:
        return None
    if view.allocations:
        compute = sum(a.compute_share for a in view.allocations)
    else:
        compute = view.spec.gpus * view.spec.compute_share
    return max(0.0, view.remaining_s) * compute


def service_gpu_s(view: JobView, config: SchedulerConfig) -> float:
    """What LAS ranks ``view`` by: its remaining service (:func:`remaining_gpu_s`) when it reports
    one and ``use_remaining`` is on, else the service it attained (``attained_gpu_s``)."""
    if config.use_remaining:
        rem = remaining_gpu_s(view)
        if rem is not None:
            return rem
    return view.attained_gpu_s


def las_queue(view: JobView, config: SchedulerConfig) -> int:
    """Index of the least-attained-service queue of ``view`` (0 when LAS is off).

    The queue of :func:`service_gpu_s`: of the remaining service for a job that reports it
    (``use_remaining``), else of the attained service.
    """
    if not config.las_threshold_gpu_s:
        return 0
    return bisect.bisect_right(config.las_threshold_gpu_s, service_gpu_s(view, config))


def within_queue(view: JobView, queue: int, config: SchedulerConfig) -> float:
    """Order inside one LAS queue (smaller first): the remaining service of a job that reports it
    (``use_remaining``), else the queue's upper threshold (infinity for the last queue), so jobs
    that know they are short go first and the others keep FIFO among themselves."""
    if config.use_remaining:
        rem = remaining_gpu_s(view)
        if rem is not None:
            return rem
    thresholds = config.las_threshold_gpu_s
    return thresholds[queue] if queue < len(thresholds) else math.inf


def las_rank(view: JobView, now: float, config: SchedulerConfig) -> int:
    """The LAS queue ``view`` competes in: :func:`las_queue`, or 0 while it is promoted.

    Tiresias' starvation promotion: a job whose wait (:func:`waited_s`) reached
    ``las_promote_after_factor`` times its run so far (:func:`run_s`) is back in queue 0. A granted
    job's wait is frozen at its grant, so a promoted job keeps queue 0 while it runs until its
    run exceeds that wait over the factor, then returns to its attained-service queue.
    """
    queue = las_queue(view, config)
    factor = config.las_promote_after_factor
    if queue and factor > 0 and waited_s(view, now) >= factor * run_s(view):
        return 0
    return queue


def las_level(priority: float) -> int:
    """The priority level LAS ranks within: the integer part of an effective priority."""
    return math.floor(priority)


def sort_key(view: JobView, now: float, config: SchedulerConfig) -> tuple[float, float, int, float, float, int, str]:
    """The key :func:`order_pending` sorts by (smaller goes first)."""
    waited = waited_s(view, now)
    starved = is_starved(view, now, config)
    prio = effective_priority(view, now, config)
    if config.las_threshold_gpu_s:
        level = float(las_level(prio))
        rank = las_rank(view, now, config)
        inner = within_queue(view, rank, config)
        return (0.0 if starved else 1.0, -waited if starved else -level, rank, -prio, inner, view.order, view.name)
    return (0.0 if starved else 1.0, -waited if starved else -prio, 0, 0.0, 0.0, view.order, view.name)


def static_key(view: JobView, config: SchedulerConfig) -> tuple[int, int, float, int]:
    """The pending order as a key that does not depend on time, for a pending job (its attained
    and remaining service do not change while it waits): valid only when aging, ``max_wait_s``
    and LAS promotion are off, where it sorts like :func:`sort_key` up to the name.

    The simulator keeps its queue sorted by it (``PoolPolicy``)."""
    queue = las_queue(view, config)
    inner = within_queue(view, queue, config) if config.las_threshold_gpu_s else 0.0
    return (-view.spec.priority, queue, inner, view.order)


def order_pending(views: Iterable[JobView], now: float, config: SchedulerConfig) -> list[JobView]:
    """Pending jobs in the order the scheduler considers them."""
    return sorted(views, key=lambda v: sort_key(v, now, config))
