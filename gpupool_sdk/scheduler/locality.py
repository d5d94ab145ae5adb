"""Node locality: jobs that may only use some nodes, and multi-node gangs (pure).

A training process uses only its own machine's GPUs, so a job's spec names its node
(``JobSpec.node``) and the scheduler grants it only there (:meth:`Ledger.candidates` skips other
nodes). A multi-node gang (``JobSpec.nodes`` > 1) is granted ``gpus_per_node`` slices on each node
whose member joined (``JobView.members``), all or none, once every node joined; when a member
leaves, the whole gang is released (no half-gang keeps a slice).

* :func:`gang_problem`: why a gang cannot be placed yet (members missing or inconsistent).
* :func:`broken_gangs`: Release decisions for granted gangs that lost a member.
* :func:`members_acked`: every node of a gang acknowledged a directive (the protocol stage waits
  for it before releasing a preempted gang).
* :func:`node_wait_reason`: the PENDING reason of a node-restricted job that does not fit
  (``waiting for room on node X (N other nodes have room)``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import replace

from gpupool_sdk.resources import JobState
from gpupool_sdk.scheduler.filter import SliceRequest
from gpupool_sdk.scheduler.ledger import Ledger
from gpupool_sdk.scheduler.types import ClusterSnapshot, JobView, Release


def gang_problem(view: JobView) -> str | None:
    """Why the gang ``view`` cannot be placed now, or None (complete, or not a gang).

    Example:
        >>> from gpupool_sdk.resources import GangMember, JobSpec
        >>> spec = JobSpec(name="llm", gpus=2, nodes=2, memory="1GiB")
        >>> gang_problem(JobView(spec=spec, members=(GangMember("llm", "node-a", 0, 2),)))
        'waiting for 1 more gang member: 1 of 2 nodes joined (node-a as node rank 0)'
    """
    spec = view.spec
    if not spec.is_gang:
        return None
    for m in view.members:
        if m.nnodes != spec.nodes:
            return (
                f"the member on node {m.node} was started for {m.nnodes} node(s) but the spec says nodes={spec.nodes}: "
                "start every node with the same node count"
            )
    by_rank: dict[int, str] = {}
    for m in view.members:
        if m.node_rank in by_rank:
            return (
                f"nodes {by_rank[m.node_rank]} and {m.node} both joined as node rank {m.node_rank}: "
                "each node needs its own rank (the launcher's GROUP_RANK / SLURM_NODEID)"
            )
        by_rank[m.node_rank] = m.node
    missing = spec.nodes - len(view.members)
    if missing > 0:
        joined = ", ".join(f"{m.node} as node rank {m.node_rank}" for m in view.members) or "none yet"
        more = "member" if missing == 1 else "members"
        return f"waiting for {missing} more gang {more}: {len(view.members)} of {spec.nodes} nodes joined ({joined})"
    return None


def members_acked(view: JobView, seq: int) -> bool:
    """True when every node of the gang ``view`` other than node rank 0 acknowledged directive
    ``seq`` in its member key (node rank 0 acks in ``acks/{job}``); always True for a one-node job.

    A preempted gang is released only then: no node's slices go while its ranks may still run.
    """
    return all(m.acked_seq >= seq for m in view.members if m.node_rank != 0) if view.spec.is_gang else True


def _held_elsewhere(view: JobView) -> list[str]:
    """Nodes where ``view`` holds slices but has no member (a member left and came back elsewhere)."""
    mine = {m.node for m in view.members}
    return sorted({a.node for a in view.allocations} - mine)


def broken_gangs(
    snapshot: ClusterSnapshot, ledger: Ledger, skip: Collection[str] = (), holders: Iterable[str] | None = None
) -> list[Release]:
    """Release every gang that holds slices but lost a member (or whose members no longer match
    where its slices are); their slices are freed in ``ledger`` for this cycle.

    The job goes back to PENDING: its surviving members see their slices gone and fence
    themselves (their launcher restarts them, and they join again); jobs in ``skip`` (already
    released or revoked this cycle) are left alone. ``holders``: the jobs of the snapshot holding
    allocations, when the caller knows them (only they are looked at; default: every job).
    """
    out: list[Release] = []
    jobs = snapshot.jobs
    for name in sorted(n for n in (jobs if holders is None else holders) if jobs[n].spec.is_gang):
        view = jobs[name]
        if not view.allocations or name in skip:
            continue
        why = gang_problem(view)
        if why is None:
            stray = _held_elsewhere(view)
            if stray:
                why = f"slices on node(s) {', '.join(stray)} where no member runs"
        if why is None:
            continue
        ledger.unreserve(name)
        out.append(
            Release(name, JobState.PENDING, f"gang released on every node (no half-gang keeps a slice): {why}")
        )
    return out


def node_wait_reason(
    ledger: Ledger, req: SliceRequest, what: str, explain: Callable[[list[str]], str] | None = None
) -> str:
    """The PENDING reason of a job restricted to ``req.nodes`` that could not be placed.

    Args:
        ledger: the cycle's ledger.
        req: the job's request (``req.nodes`` non-empty).
        what: the slice it needs, in words (``"GPU with 20GiB free and full compute"``).
        explain: says why the given nodes (those of ``req.nodes`` with no schedulable GPU) take
            no new slices, naming GPUs and reasons
            (:func:`~gpupool_sdk.scheduler.health.unusable_gpus`); None: a generic hint.
    """
    mine = set(req.nodes)
    present = {ledger.nodes[i] for i in range(len(ledger)) if ledger.class_of(i) is not None}
    absent = sorted(mine - present)
    per = req.per_node or req.min_count
    # Other nodes that could take this node's part now (what the launcher could have chosen).
    free: dict[str, int] = {}
    for i in ledger.candidates(replace(req, nodes=())):
        node = ledger.nodes[i]
        if node not in mine:
            free[node] = free.get(node, 0) + 1
    others = sum(1 for n in free.values() if n >= per)
    where = ", ".join(sorted(mine))
    word = "node" if len(mine) == 1 else "nodes"
    have = "1 other node has room" if others == 1 else f"{others} other nodes have room"
    head = f"queued: waiting for room on {word} {where} ({have})"
    if absent:
        if explain is not None:
            return f"{head}: {explain(absent)}"
        return f"{head}: {', '.join(absent)} publishes no schedulable GPU (agent not running, drained or cordoned?)"
    want = f"{req.per_node} per node" if req.per_node else (
        f"{req.min_count}-{req.count}" if req.min_count < req.count else str(req.count)
    )
    return f"{head}: needs {want} x {what}"
