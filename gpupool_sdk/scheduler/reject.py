"""Reject stage: specs that no GPU of the pool could ever satisfy.

Judged against every published GPU, healthy or not and cordoned or not (those may come back),
so that a job is only rejected for what the hardware lacks: a model that is absent, a feature no
GPU offers, more memory per slice than any matching GPU has, more slices than matching GPUs
exist, or ``spread`` over more nodes than the matching GPUs span. An empty pool rejects nothing.

It also rejects a gang whose transactions would exceed etcd's cap on operations per transaction
(``--max-txn-ops``, 128 by default): the coordinator writes a grant, and later its release, in one
fenced transaction (all or nothing), so a job may never hold more slices than one transaction can
carry. The count is :func:`job_txn_ops`; the coordinator's apply step counts with the same
functions (:func:`txn_ops`, :data:`FENCE_COMPARES`) before it sends a transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpupool_sdk.resources import GpuInfo, JobSpec, QoS
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.filter import MIG_PROFILE_PREFIX, SliceRequest, features_match


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
    profiles = [f for f in req.features if f.startswith(MIG_PROFILE_PREFIX)]
    if profiles and profiles[0] not in offered:
        have = sorted(f[len(MIG_PROFILE_PREFIX) :] for f in offered if f.startswith(MIG_PROFILE_PREFIX))
        return (
            f"no MIG instance of profile {profiles[0][len(MIG_PROFILE_PREFIX):]} in the pool "
            f"(profiles: {', '.join(have) or 'none'}; an operator creates instances with `gpupool mig create`)"
        )
    missing = [f for f in req.features if f not in offered]
    if missing:
        return f"no GPU offers feature(s) {', '.join(missing)} (offered: {', '.join(sorted(offered)) or 'none'})"
    static = [
        c
        for c in pool
        if (req.gpu_model is None or c.model.lower() == req.gpu_model.lower())
        and features_match(c.features, req.features)
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


# ---------------------------------------------------------------- etcd transaction size
#
# etcd refuses a transaction when max(len(compare), len(success), len(failure)) exceeds its
# --max-txn-ops ("too many operations in txn request"); compares and operations are capped
# separately, not summed. What the coordinator's transactions hold (coordinator/apply.py):
#
# * compares: the fence (leader key create revision and value) plus one guard per plan (the
#   job's spec is the same incarnation); a grant, re-grant or deflate adds one compare per GPU it
#   adds to (no allocation on that GPU written since the snapshot: the GPU guard);
# * Grant: one put per slice, a delete per allocation the job held and does not keep, a delete of
#   its directive when it had one, the status put;
# * Release: a delete per held allocation, checkpoints/{job}, usage/{job}, a delete of the
#   directive when there is one, the status put;
# * Revoke: a delete per held allocation, checkpoints/{job}, usage/{job} (then the lease revoke);
# * Preempt / Resize: the directive and the status; Balloon: the directive; Deflate / Shrink: the
#   directive (or its delete) and a put per allocation whose size changes.

#: Compares on the leader key in every fenced transaction (``coordinator.fencing.fence_compares``).
FENCE_COMPARES = 2
#: Compares a decision's plan adds (``SameIncarnation`` on the job's spec).
JOB_GUARDS = 1
#: Operations a release adds to the allocation deletes: checkpoint, usage, directive delete, status.
RELEASE_EXTRA_OPS = 4


def txn_ops(writes: int, compares: int = FENCE_COMPARES + JOB_GUARDS) -> int:
    """Operations etcd counts against ``--max-txn-ops`` for one transaction (no failure branch).

    Example:
        >>> txn_ops(131, 3)
        131
    """
    return max(writes, compares)


def grant_txn_ops(slices: int, dropped: int = 0, directive: bool = False) -> int:
    """Operations of a grant of ``slices`` slices to a job that gives up ``dropped`` held allocations.

    Example:
        >>> grant_txn_ops(130)   # 130 allocation puts + the status; 3 + 130 compares (a guard per GPU)
        133
    """
    return txn_ops(slices + dropped + (1 if directive else 0) + 1, FENCE_COMPARES + JOB_GUARDS + slices)


def release_txn_ops(held: int, directive: bool = True, usage: bool = True) -> int:
    """Operations of releasing a job that holds ``held`` slices (``Release``)."""
    return txn_ops(held + 2 + (1 if directive else 0) + (1 if usage else 0))


def job_txn_ops(slices: int) -> int:
    """The most operations any one transaction about a job holding ``slices`` slices needs.

    Its release after a preemption is the largest: every allocation deleted, plus checkpoint,
    usage, directive and status (a fresh grant needs ``slices + 1``).

    Example:
        >>> job_txn_ops(128)
        132
    """
    return max(grant_txn_ops(slices), release_txn_ops(slices, directive=True, usage=True))


def max_slices_for(max_txn_ops: int) -> int:
    """The largest gang whose transactions all fit in ``max_txn_ops`` operations."""
    return max(0, max_txn_ops - RELEASE_EXTRA_OPS)


def slice_cap(spec: JobSpec, max_txn_ops: int) -> int:
    """The most slices ``spec`` may hold: ``max_gpus`` (else ``gpus``), capped so that every
    transaction about the job fits etcd's ``max_txn_ops`` (0 = no cap). An elastic job asking
    more than the cap is placed and grown up to it, not rejected (see :func:`txn_limit_reason`).

    Example:
        >>> slice_cap(JobSpec(name="a", gpus=64, min_gpus=32, max_gpus=256, memory="1GiB"), 128)
        124
    """
    most = spec.max_gpus or spec.gpus
    return most if max_txn_ops <= 0 else min(most, max_slices_for(max_txn_ops))


def txn_limit_message(what: str, ops: int, max_txn_ops: int, need: int | None = None) -> str:
    """The reason given when a job's transaction would exceed the coordinator's etcd limit.

    Args:
        what: what needs the transaction (``"a gang of 130 slices"``).
        ops: operations it needs.
        max_txn_ops: the coordinator's ``--etcd-max-txn-ops``.
        need: the value to advise for ``--max-txn-ops`` (default ``ops``).
    """
    need = ops if need is None else need
    return (
        f"{what} needs {ops} operations in one etcd transaction, above the coordinator's --etcd-max-txn-ops "
        f"{max_txn_ops}: start etcd with --max-txn-ops >= {need} and pass the same value to the coordinator's "
        f"--etcd-max-txn-ops (or ask for at most {max_slices_for(max_txn_ops)} slices)"
    )


def txn_limit_reason(spec: JobSpec, max_txn_ops: int) -> str | None:
    """Why ``spec`` can never be granted under an etcd cap of ``max_txn_ops`` operations (0 = no cap).

    Judged on the fewest slices the job accepts (``min_gpus``): an elastic job whose minimum fits
    is granted and grown up to :func:`slice_cap` instead.

    Example:
        >>> txn_limit_reason(JobSpec(name="a", gpus=100, memory="1GiB"), 128) is None
        True
        >>> txn_limit_reason(JobSpec(name="a", gpus=130, memory="1GiB"), 128)[:46]
        'a gang of 130 slices needs 134 operations in o'
        >>> txn_limit_reason(JobSpec(name="a", gpus=130, min_gpus=64, memory="1GiB"), 128) is None
        True
    """
    if max_txn_ops <= 0:
        return None
    least = spec.min_gpus or spec.gpus
    ops = job_txn_ops(least)
    if ops <= max_txn_ops:
        return None
    what = f"a gang of {least} slices" if least == spec.gpus else f"an elastic job needing at least min_gpus {least}"
    return txn_limit_message(what, ops, max_txn_ops)
