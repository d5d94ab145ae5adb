"""Health / drain stage: jobs on a GPU that turned unhealthy, vanished, or sits on a draining node
are preempted (checkpoint first) so that they can be placed elsewhere.

Cordoned GPUs keep their running jobs (a cordon only stops new grants).

:func:`unusable_gpus` says, for a queue reason, which matching GPUs take no new slices and why.
"""

from __future__ import annotations

from collections.abc import Collection

from gpupool_sdk.resources import JobState
from gpupool_sdk.scheduler.filter import matches_static
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


#: Items a queue reason names before "+N more" (``gpupool status`` lists every GPU).
UNUSABLE_SHOWN = 4
#: Longest health text quoted per GPU in a queue reason.
HEALTH_TEXT_MAX = 60


def unusable_gpus(
    snapshot: ClusterSnapshot,
    features: Collection[str] = (),
    gpu_model: str | None = None,
    nodes: Collection[str] = (),
    limit: int = UNUSABLE_SHOWN,
) -> str:
    """Which GPUs matching ``features`` / ``gpu_model`` (on ``nodes``, when given) take no new
    slices, and why, for a queue reason: a draining node once for all its GPUs, then each
    unhealthy (with its health reasons) or cordoned GPU, by node and index; the first ``limit``
    items, then ``+N more``. A node of ``nodes`` with no such GPU says so.

    Example:
        >>> from gpupool_sdk.resources import GpuHealth, GpuInfo, GiB
        >>> bad = GpuInfo("GPU-ab12", "node-a", 0, "H100-80GB", 80 * GiB, health=GpuHealth(False, ("xid 79",)))
        >>> ok = GpuInfo("GPU-cd34", "node-b", 0, "H100-80GB", 80 * GiB)
        >>> unusable_gpus(ClusterSnapshot(0.0, {g.uuid: g for g in (bad, ok)}, {}, draining=frozenset({"node-b"})))
        'GPU-ab12 on node-a: unhealthy (xid 79); node-b: draining (1 GPU)'
    """
    wanted = set(nodes)
    matching = sorted(
        (
            g
            for g in snapshot.gpus.values()
            if (not wanted or g.node in wanted) and matches_static(g, features, gpu_model)
        ),
        key=lambda g: (g.node, g.index, g.uuid),
    )
    items: list[str] = []
    drained: dict[str, int] = {}
    for g in matching:
        if g.node in snapshot.draining:
            if g.node not in drained:
                items.append(g.node)  # filled in below, once the node's GPUs are counted
            drained[g.node] = drained.get(g.node, 0) + 1
        elif not g.health.healthy:
            why = ", ".join(g.health.reasons) or "no reason given"
            if len(why) > HEALTH_TEXT_MAX:
                why = why[: HEALTH_TEXT_MAX - 3] + "..."
            items.append(f"{g.uuid} on {g.node}: unhealthy ({why})")
        elif g.uuid in snapshot.cordoned:
            items.append(f"{g.uuid} on {g.node}: cordoned")
    items = [
        f"{i}: draining ({drained[i]} GPU{'' if drained[i] == 1 else 's'})" if i in drained else i for i in items
    ]
    have = {g.node for g in matching}
    published = {g.node for g in snapshot.gpus.values()}
    for node in sorted(wanted - have):
        items.append(
            f"{node}: no matching GPU published" if node in published else f"{node}: no GPU published (is its agent running?)"
        )
    if not items:
        return "no GPU is published yet (start `gpupool agent` on each GPU machine)" if not snapshot.gpus else (
            "no published GPU matches"
        )
    shown = "; ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}; +{len(items) - limit} more (see `gpupool status`)"


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
