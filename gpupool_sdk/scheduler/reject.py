"""Reject stage: specs that no GPU of the pool could ever satisfy.

Judged against every published GPU, healthy or not and cordoned or not (those may come back),
so that a job is only rejected for what the hardware lacks: a model that is absent, a feature no
GPU offers, more memory per slice than any matching GPU has, more slices than matching GPUs
exist, or ``spread`` over more nodes than the matching GPUs span. An empty pool rejects nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpupool_sdk.resources import GpuInfo, QoS
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.filter import SliceRequest


@dataclass(frozen=True)
class PoolClass:
    """GPUs of the pool with identical static properties (what the reject stage needs of them).

    Attributes:
        model: catalog model.
        features: capability tags.
        memory_bytes: physical memory.
        count: how many such GPUs are published.
        nodes: the nodes they are on.
    """

    model: str
    features: frozenset[str]
    memory_bytes: int
    count: int
    nodes: frozenset[str]


def summarize(gpus: Iterable[GpuInfo]) -> list[PoolClass]:
    """Group GPUs into :class:`PoolClass` entries (sorted, deterministic)."""
    groups: dict[tuple[str, tuple[str, ...], int], list[GpuInfo]] = {}
    for g in gpus:
        groups.setdefault((g.model, tuple(sorted(g.features)), g.memory_bytes), []).append(g)
    return [
        PoolClass(model, frozenset(feats), mem, len(members), frozenset(g.node for g in members))
        for (model, feats, mem), members in sorted(groups.items())
    ]


def reject_reason(req: SliceRequest, pool: Sequence[PoolClass], overcommit_ratio: float) -> str | None:
    """Why ``req`` can never run on the pool (None when it could, or when the pool is empty)."""
    if not pool:
        return None
    if req.gpu_model is not None and not any(c.model.lower() == req.gpu_model.lower() for c in pool):
        models = sorted({c.model for c in pool})
        return f"no GPU of model {req.gpu_model} in the pool (models: {', '.join(models)})"
    offered = {f for c in pool for f in c.features}
    missing = [f for f in req.features if f not in offered]
    if missing:
        return f"no GPU offers feature(s) {', '.join(missing)} (offered: {', '.join(sorted(offered)) or 'none'})"
    static = [
        c
        for c in pool
        if (req.gpu_model is None or c.model.lower() == req.gpu_model.lower())
        and all(f in c.features for f in req.features)
    ]
    if not static:
        return f"no single GPU offers all of {', '.join(req.features)}" + (
            f" on model {req.gpu_model}" if req.gpu_model else ""
        )
    big = [c for c in static if _memory_ok(c.memory_bytes, req, overcommit_ratio)]
    if not big:
        largest = max(c.memory_bytes for c in static)
        need = req.memory if req.qos is not QoS.SHARED else max(req.peak, int(req.memory / overcommit_ratio))
        return f"needs {format_size(need)} per slice; the largest matching GPU has {format_size(largest)}"
    total = sum(c.count for c in big)
    if total < req.min_count:
        return f"needs {req.min_count} GPU(s) but only {total} in the pool match"
    if req.topology == "spread":
        nodes = set().union(*(c.nodes for c in big))
        if len(nodes) < req.min_count:
            return f"spread over {req.min_count} nodes but matching GPUs are on only {len(nodes)} node(s)"
    return None


def _memory_ok(phys: int, req: SliceRequest, ratio: float) -> bool:
    if req.qos is QoS.SHARED:
        return req.memory <= ratio * phys and req.peak <= phys
    return req.memory <= phys
