"""Health / drain stage: jobs on a GPU that turned unhealthy, vanished, or sits on a draining node
are preempted (checkpoint first) so that they can be placed elsewhere.

Cordoned GPUs keep their running jobs (a cordon only stops new grants).
"""

from __future__ import annotations

from collections.abc import Collection

from gpupool_sdk.resources import JobState
from gpupool_sdk.scheduler.protocol import preempt_deadline
from gpupool_sdk.scheduler.types import ClusterSnapshot, Preempt, SchedulerConfig


def health_reason(snapshot: ClusterSnapshot, gpu_uuid: str, node: str) -> str | None:
    """Why a slice on ``gpu_uuid`` must be vacated, or None when it may stay."""
    gpu = snapshot.gpus.get(gpu_uuid)
    if gpu is None:
        return f"GPU {gpu_uuid} on {node} is no longer published (agent gone)"
    if not gpu.health.healthy:
        why = "; ".join(gpu.health.reasons) or "unhealthy"
        return f"GPU {gpu_uuid} on {gpu.node} unhealthy: {why}"
    if gpu.node in snapshot.draining:
        return f"node {gpu.node} is draining"
    return None


def health_preemptions(
    snapshot: ClusterSnapshot, config: SchedulerConfig, busy: Collection[str] = ()
) -> list[Preempt]:
    """Preempt every granted job holding a slice that must be vacated (jobs in ``busy`` already have a directive)."""
    out: list[Preempt] = []
    for name in sorted(snapshot.jobs):
        view = snapshot.jobs[name]
        if not view.allocations or name in busy or view.directive is not None:
            continue
        if view.state not in (JobState.GRANTED,):
            continue
        reasons = []
        for a in view.allocations:
            why = health_reason(snapshot, a.gpu_uuid, a.node)
            if why is not None and why not in reasons:
                reasons.append(why)
        if reasons:
            out.append(
                Preempt(name, "; ".join(reasons) + "; checkpoint and move", deadline=preempt_deadline(view, snapshot.now, config))
            )
    return out
