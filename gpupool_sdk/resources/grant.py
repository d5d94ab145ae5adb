"""What the coordinator grants and asks (:class:`Allocation`, :class:`Directive`) and how jobs answer (:class:`Ack`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources._fields import opt, req
from gpupool_sdk.resources.job import JobStatus, QoS


@dataclass(frozen=True)
class Allocation:
    """One granted slice: a share of one GPU held by one job.

    Attributes:
        job: the job name.
        node: node of the GPU.
        gpu_uuid: the GPU.
        gpu_index: device index on the node (for ``CUDA_VISIBLE_DEVICES``).
        memory_bytes: memory quota of the slice.
        compute_share: share of the GPU's compute, in (0, 1].
        mode: the QoS class it was granted under.
        term: the leader term (fencing epoch) that wrote it.
        granted_at: wall-clock time of the grant.
    """

    job: str
    node: str
    gpu_uuid: str
    gpu_index: int
    memory_bytes: int
    compute_share: float
    mode: QoS
    term: int = 0
    granted_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "node": self.node,
            "gpu_uuid": self.gpu_uuid,
            "gpu_index": self.gpu_index,
            "memory_bytes": self.memory_bytes,
            "compute_share": self.compute_share,
            "mode": self.mode.value,
            "term": self.term,
            "granted_at": self.granted_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "allocation") -> Allocation:
        mode = req(d, "mode", str, where)
        try:
            qos = QoS(mode)
        except ValueError:
            raise SpecError(f"{where}.mode", f"unknown QoS {mode!r}") from None
        return cls(
            job=req(d, "job", str, where),
            node=req(d, "node", str, where),
            gpu_uuid=req(d, "gpu_uuid", str, where),
            gpu_index=opt(d, "gpu_index", int, where, 0),
            memory_bytes=req(d, "memory_bytes", int, where),
            compute_share=req(d, "compute_share", float, where),
            mode=qos,
            term=opt(d, "term", int, where, 0),
            granted_at=opt(d, "granted_at", float, where, 0.0),
        )


class DirectiveKind(str, enum.Enum):
    """What the coordinator asks a running job to do.

    * ``preempt``: checkpoint at the next step boundary, ack, release, stop.
    * ``resize``: elastic change of slice count (``target["gpus"]``); needs a restart, handled like preempt
      with an immediate re-grant.
    * ``balloon``: shrink the memory footprint to ``target["memory_bytes"]`` per slice and ack the bytes reached.
    * ``deflate``: the quota is back to the granted size; restore offloaded state.
    """

    PREEMPT = "preempt"
    RESIZE = "resize"
    BALLOON = "balloon"
    DEFLATE = "deflate"


@dataclass(frozen=True)
class Directive:
    """A request from the leader to one job (``directives/{job}``).

    Attributes:
        kind: what to do (a plain string only for a kind this release does not know, parsed
            with ``unknown_ok`` on the training side).
        seq: increases with every directive to the job; acks name it.
        deadline: wall-clock time by which the ack must arrive (a preempt past it is forced).
        target: kind-specific parameters (``{"memory_bytes": ...}`` or ``{"gpus": ...}``).
        reason: why (``"preempted by llm-pretrain (priority 10)"``).
        issued_at: wall-clock time the directive was written.
        term: leader term that wrote it.
    """

    kind: DirectiveKind | str
    seq: int
    deadline: float
    target: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    issued_at: float = 0.0
    term: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value if isinstance(self.kind, DirectiveKind) else str(self.kind),
            "seq": self.seq,
            "deadline": self.deadline,
            "target": dict(self.target),
            "reason": self.reason,
            "issued_at": self.issued_at,
            "term": self.term,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "directive", unknown_ok: bool = False) -> Directive:
        """Parse a directive; an unknown ``kind`` is a SpecError unless ``unknown_ok``.

        With ``unknown_ok`` (the training side), an unknown kind (from a newer coordinator) is
        kept as its string, so that the job can ack it as refused instead of dropping it.
        """
        kind = req(d, "kind", str, where)
        k: DirectiveKind | str
        try:
            k = DirectiveKind(kind)
        except ValueError:
            if not unknown_ok:
                raise SpecError(f"{where}.kind", f"unknown directive {kind!r}") from None
            k = kind
        return cls(
            kind=k,
            seq=req(d, "seq", int, where),
            deadline=req(d, "deadline", float, where),
            target=opt(d, "target", dict, where, {}),
            reason=opt(d, "reason", str, where, ""),
            issued_at=opt(d, "issued_at", float, where, 0.0),
            term=opt(d, "term", int, where, 0),
        )


@dataclass(frozen=True)
class Ack:
    """A job's answer to a directive (``acks/{job}``).

    Attributes:
        seq: the directive's seq.
        step: the global step at which the job acted.
        checkpoint: path of the checkpoint written (preempt/resize), or None.
        reached_bytes: for balloon/deflate, the per-slice footprint actually reached.
        ok: False when the job could not comply (``message`` says why).
        message: detail for operators.
        at: wall-clock time of the ack.
    """

    seq: int
    step: int = 0
    checkpoint: str | None = None
    reached_bytes: int | None = None
    ok: bool = True
    message: str = ""
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "step": self.step,
            "checkpoint": self.checkpoint,
            "reached_bytes": self.reached_bytes,
            "ok": self.ok,
            "message": self.message,
            "at": self.at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "ack") -> Ack:
        return cls(
            seq=req(d, "seq", int, where),
            step=opt(d, "step", int, where, 0),
            checkpoint=opt(d, "checkpoint", str, where, None),
            reached_bytes=opt(d, "reached_bytes", int, where, None),
            ok=opt(d, "ok", bool, where, True),
            message=opt(d, "message", str, where, ""),
            at=opt(d, "at", float, where, 0.0),
        )


@dataclass(frozen=True)
class LeaderRecord:
    """The value of the ``leader`` key: who leads and in which term."""

    id: str
    term: int
    since: float

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "term": self.term, "since": self.since}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "leader") -> LeaderRecord:
        return cls(id=req(d, "id", str, where), term=req(d, "term", int, where), since=opt(d, "since", float, where, 0.0))


def of_grant(status: JobStatus | None, allocations: Iterable[Allocation]) -> tuple[Allocation, ...]:
    """The allocations ``status``'s grant wrote (all of them without a status), in device order
    (node, GPU index, uuid): one written beside the grant on the job's lease, by hand, is not a
    device of the job; the leader counts it as an orphan too (:meth:`JobStatus.wrote`).

    Example:
        >>> from gpupool_sdk.resources import JobState
        >>> mine = Allocation("j", "n", "GPU-1", 1, 1 << 30, 1.0, QoS.GUARANTEED, granted_at=5.0)
        >>> other = Allocation("j", "n", "GPU-0", 0, 1 << 30, 1.0, QoS.GUARANTEED, granted_at=7.0)
        >>> [a.gpu_uuid for a in of_grant(JobStatus(JobState.GRANTED, granted_at=5.0), [other, mine])]
        ['GPU-1']
    """
    kept = [a for a in allocations if status is None or status.wrote(a.granted_at)]
    return tuple(sorted(kept, key=lambda a: (a.node, a.gpu_index, a.gpu_uuid)))
