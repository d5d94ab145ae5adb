"""What every rank does at one step boundary: a typed decision, broadcast from rank 0."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.resources import Directive, DirectiveKind


class DecisionKind(str, enum.Enum):
    """The action of a step boundary.

    * ``PREEMPT``: checkpoint, ack, release, stop (a preempt directive or a preemption signal).
    * ``RESIZE``: an elastic resize; handled as a checkpoint and restart.
    * ``BALLOON`` / ``DEFLATE``: inflate or deflate the memory balloon, ack the bytes reached.
    * ``REFUSE``: a directive this SDK does not know (from a newer coordinator): acked as refused.
    * ``LOST``: the lease is gone: emergency checkpoint, stop.
    """

    PREEMPT = "preempt"
    RESIZE = "resize"
    BALLOON = "balloon"
    DEFLATE = "deflate"
    REFUSE = "refuse"
    LOST = "lost"

    @property
    def stops(self) -> bool:
        """True for the kinds after which this process stops training."""
        return self in (DecisionKind.PREEMPT, DecisionKind.RESIZE, DecisionKind.LOST)


_FROM_DIRECTIVE = {
    DirectiveKind.PREEMPT: DecisionKind.PREEMPT,
    DirectiveKind.RESIZE: DecisionKind.RESIZE,
    DirectiveKind.BALLOON: DecisionKind.BALLOON,
    DirectiveKind.DEFLATE: DecisionKind.DEFLATE,
}


@dataclass(frozen=True)
class Decision:
    """What every rank does at one step boundary; ``kind`` None means carry on.

    Attributes:
        kind: the action.
        seq: the directive's sequence number (0 for signals and losses).
        target: the directive's parameters.
        reason: why (the directive's reason, the signal's name, the loss's cause).
        issued_at: wall-clock time the leader issued the directive (0 when unknown).
        directive_kind: the directive's kind as written by the coordinator (for acks; also
            the unknown kind of a ``REFUSE``).
    """

    kind: DecisionKind | None = None
    seq: int = 0
    target: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    issued_at: float = 0.0
    directive_kind: str = ""

    @classmethod
    def from_directive(cls, d: Directive) -> Decision:
        """The decision for a directive; an unknown kind becomes ``REFUSE`` (never another action)."""
        kind = _FROM_DIRECTIVE.get(d.kind) if isinstance(d.kind, DirectiveKind) else None
        raw = d.kind.value if isinstance(d.kind, DirectiveKind) else str(d.kind)
        return cls(kind=kind or DecisionKind.REFUSE, seq=d.seq, target=dict(d.target), reason=d.reason,
                   issued_at=float(d.issued_at or 0.0), directive_kind=raw)

    def directive(self) -> Directive:
        """The directive this decision answers (for the ack)."""
        try:
            kind = DirectiveKind(self.directive_kind)
        except ValueError:
            kind = DirectiveKind.PREEMPT  # never sent: refusals ack with their own seq only
        return Directive(kind=kind, seq=self.seq, deadline=0.0, target=dict(self.target), reason=self.reason)

    def to_wire(self) -> dict[str, Any] | None:
        """A plain object for the framework's broadcast (None: carry on)."""
        if self.kind is None:
            return None
        return {"kind": self.kind.value, "seq": self.seq, "target": dict(self.target), "reason": self.reason,
                "issued_at": self.issued_at, "directive_kind": self.directive_kind}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any] | None) -> Decision:
        """Inverse of :meth:`to_wire`.

        Raises:
            GpupoolError: the object names a kind this SDK does not know (ranks of different versions).
        """
        if not obj:
            return CARRY_ON
        try:
            kind = DecisionKind(obj["kind"])
        except (KeyError, ValueError):
            raise GpupoolError(f"rank 0 broadcast an unknown decision {obj!r}: every rank must run the same "
                               "gpupool-sdk version") from None
        return cls(kind=kind, seq=int(obj.get("seq", 0)), target=dict(obj.get("target", {})),
                   reason=str(obj.get("reason", "")), issued_at=float(obj.get("issued_at", 0.0)),
                   directive_kind=str(obj.get("directive_kind", "")))


#: Carry on (the per-step fast path returns this one object).
CARRY_ON = Decision()
