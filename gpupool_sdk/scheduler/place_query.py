"""Which nodes could take a shape now (pure): the answer behind ``gpupool place``.

A launcher (a Slurm or Kubernetes wrapper) chooses machines; the pool knows which of them have
room. :func:`query_placement` runs the scheduler's own ledger and placement code on a snapshot:
for every node, could ``gpus_per_node`` slices of the shape be granted there now (no preemption,
no waiting)? Nodes that can are ranked best fit first (fewest slots left for the shape after it,
so large holes stay whole for large jobs; then by node name); the first ``nodes`` of them are
the suggestion. A shape no GPU of the pool could ever hold gets the scheduler's reject reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpupool_sdk.resources import JobSpec
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.filter import matches_static, request_for, unschedulable_reason
from gpupool_sdk.scheduler.placement import place
from gpupool_sdk.scheduler.policy import build_ledger
from gpupool_sdk.scheduler.reject import reject_reason, summarize
from gpupool_sdk.scheduler.types import ClusterSnapshot, JobView, SchedulerConfig


@dataclass(frozen=True)
class NodeFit:
    """One node's answer.

    Attributes:
        node: the node.
        fits: its part could be granted now.
        slots: how many GPUs of the node could take one slice of the shape now.
        gpus: the GPU UUIDs a grant would take (when it fits).
        reason: why it does not fit (when it does not).
    """

    node: str
    fits: bool
    slots: int
    gpus: tuple[str, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "fits": self.fits, "slots": self.slots}
        if self.fits:
            out["gpus"] = list(self.gpus)
        else:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class PlacementAnswer:
    """The answer for a shape: ranked nodes with room, the suggestion, and why not when it does not fit.

    Attributes:
        fits: ``nodes`` nodes could take their part now.
        chosen: the suggested nodes (the first ``nodes`` that fit, best fit first).
        ranked: every node that fits, best fit first.
        unfit: every other node, with its reason.
        reason: why the shape does not fit now (empty when it does).
        impossible: True when no GPU of the pool could ever hold it (the scheduler would reject it).
    """

    fits: bool
    chosen: tuple[str, ...]
    ranked: tuple[NodeFit, ...]
    unfit: tuple[NodeFit, ...]
    reason: str = ""
    impossible: bool = False


def query_placement(snapshot: ClusterSnapshot, spec: JobSpec, config: SchedulerConfig | None = None) -> PlacementAnswer:
    """Which nodes could take ``spec`` now: ``spec.gpus_per_node`` slices on each of ``spec.nodes`` nodes.

    Args:
        snapshot: the pool now (``coordinator.snapshot.build_state(...).snapshot``).
        spec: the shape (name unused; ``node`` restricts the question to that node).
        config: the scheduler settings (overcommit ratio, ...); None: ``DEFAULT_SCHEDULER``.

    Example:
        >>> from gpupool_sdk.resources import GiB, GpuInfo
        >>> g = {f"G{i}": GpuInfo(uuid=f"G{i}", node=f"n{i}", index=0, model="H100-80GB", memory_bytes=80 * GiB)
        ...      for i in range(2)}
        >>> query_placement(ClusterSnapshot(now=0.0, gpus=g, jobs={}), JobSpec(name="q", memory="40GiB")).chosen
        ('n0',)
    """
    config = config or DEFAULT_SCHEDULER
    per = spec.gpus_per_node
    want = spec.nodes
    # The question is asked per node: one node's part, as a one-node job pinned there.
    probe = replace(spec, gpus=per, nodes=1, node=None, min_gpus=None, max_gpus=None)
    view = JobView(spec=probe)
    ledger = build_ledger(snapshot, config)
    req = request_for(view, config)
    why_never = reject_reason(
        replace(req, count=per * want, min_count=per * want), summarize(snapshot.gpus.values()), config.overcommit_ratio
    )
    all_nodes = sorted({g.node for g in snapshot.gpus.values()})
    if spec.node is not None:
        all_nodes = [spec.node]
    fits: list[NodeFit] = []
    unfit: list[NodeFit] = []
    for node in all_nodes:
        nreq = replace(req, nodes=(node,))
        slots = sum(1 for _ in ledger.candidates(nreq))
        gpus = place(ledger, nreq)
        if gpus is not None and len(gpus) >= per:
            fits.append(NodeFit(node, True, slots, tuple(ledger.gpus[i].uuid for i in gpus)))
        else:
            unfit.append(NodeFit(node, False, slots, reason=_node_reason(snapshot, node, spec, per, slots)))
    ranked = tuple(sorted(fits, key=lambda f: (f.slots - per, f.node)))
    chosen = tuple(f.node for f in ranked[:want])
    if why_never is not None:
        return PlacementAnswer(False, (), ranked, tuple(unfit), f"impossible: {why_never}", impossible=True)
    if not all_nodes:
        return PlacementAnswer(False, (), (), (), "no node: no agent publishes GPUs in this pool")
    if len(ranked) >= want:
        return PlacementAnswer(True, chosen, ranked, tuple(unfit))
    have = f"only {len(ranked)} of {want} nodes" if want > 1 else "no node"
    mem = "whole GPU" if probe.memory_bytes == 0 else format_size(probe.memory_bytes)
    return PlacementAnswer(
        False, (), ranked, tuple(unfit),
        f"{have} could take {per} x {mem} {probe.qos_class.value} slice(s) now",
    )


def _node_reason(snapshot: ClusterSnapshot, node: str, spec: JobSpec, per: int, slots: int) -> str:
    gpus = [g for g in snapshot.gpus.values() if g.node == node]
    if not gpus:
        return "no GPU published (is its agent running?)"
    matching = [g for g in gpus if matches_static(g, spec.features, spec.gpu_model)]
    if not matching:
        return "no GPU of the model / features asked"
    usable = [g for g in matching if unschedulable_reason(g, snapshot.cordoned, snapshot.draining) is None]
    if not usable:
        why = unschedulable_reason(matching[0], snapshot.cordoned, snapshot.draining)
        return f"no schedulable matching GPU ({why})"
    return f"{slots} of {len(usable)} matching GPUs have room for a slice, {per} needed"
