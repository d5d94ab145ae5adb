"""A member of a multi-node gang: one node's part of a job (``jobs/{job}/members/{node}``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources._fields import check, opt, req


@dataclass(frozen=True)
class GangMember:
    """One node of a multi-node gang, written by the process that leases that node's part.

    On each node the launcher's local rank 0 (or ``gpupool run``) writes
    ``jobs/{job}/members/{node}`` on its own etcd lease when it joins
    (:meth:`PoolClient.join <gpupool_sdk.client.PoolClient.join>`). The coordinator grants the
    gang once ``nnodes`` consistent members joined, and releases every node's slices when one
    member's key vanishes (its process died or its lease expired).

    Attributes:
        job: the job name.
        node: the pool node this member runs on (its slices are granted there).
        node_rank: the launcher's node rank (torchrun ``GROUP_RANK``, Slurm ``SLURM_NODEID``).
        nnodes: the number of nodes the launcher started (must equal the spec's ``nodes``).
        hostname: the host the member process runs on (for operators).
        pid: the member process id (for operators).
        joined_at: wall-clock time of the join.
        acked_seq: the last directive seq this node acknowledged (0: none). Node rank 0 acks in
            ``acks/{job}``; every other node here, once its ranks stopped at the directive's step:
            the leader releases a preempted gang when every node has acked.

    Raises:
        SpecError: a field is invalid; the message names it.

    Example:
        >>> GangMember(job="llm", node="node-b", node_rank=1, nnodes=2).node_rank
        1
    """

    job: str
    node: str
    node_rank: int
    nnodes: int
    hostname: str = ""
    pid: int = 0
    joined_at: float = 0.0
    acked_seq: int = 0

    def __post_init__(self) -> None:
        check(self.job, str, "job")
        check(self.node, str, "node")
        check(self.node_rank, int, "node_rank")
        check(self.nnodes, int, "nnodes")
        if self.nnodes < 1:
            raise SpecError("nnodes", f"must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise SpecError("node_rank", f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "node": self.node,
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "hostname": self.hostname,
            "pid": self.pid,
            "joined_at": self.joined_at,
            "acked_seq": self.acked_seq,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "member") -> GangMember:
        return cls(
            job=req(d, "job", str, where),
            node=req(d, "node", str, where),
            node_rank=req(d, "node_rank", int, where),
            nnodes=req(d, "nnodes", int, where),
            hostname=opt(d, "hostname", str, where, ""),
            pid=opt(d, "pid", int, where, 0),
            joined_at=opt(d, "joined_at", float, where, 0.0),
            acked_seq=opt(d, "acked_seq", int, where, 0),
        )
