"""Fenced writes: every write of the leader compares the leader key in the same transaction.

The coordinator plans its writes as plain data (:class:`PutOp`, :class:`DeleteOp`, guarded by
:class:`SameIncarnation`) so that planning is pure and testable; :class:`FencedWriter` is the one
place that turns a plan into an etcd transaction, adding the compare on the leader key's create
revision and value. A transaction that loses the leader compare demotes the coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpupool_sdk.errors import NotLeaderError
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.types import Compare, Delete, KeyValue, Put

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PutOp:
    """Write ``value`` at ``key``, attached to etcd lease ``lease`` (0 = no lease)."""

    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class DeleteOp:
    """Delete ``key`` (or every key under it when ``prefix``)."""

    key: str
    prefix: bool = False


@dataclass(frozen=True)
class SameIncarnation:
    """Guard: ``key`` still exists with this create revision (the job was not restarted or removed)."""

    key: str
    create_revision: int


@dataclass(frozen=True)
class Absent:
    """Guard: ``key`` does not exist."""

    key: str


@dataclass(frozen=True)
class Unchanged:
    """Guard: ``key`` exists and was not written since ``mod_revision`` (garbage collection)."""

    key: str
    mod_revision: int


@dataclass(frozen=True)
class UnchangedSince:
    """Guard: no key under ``prefix`` was created or rewritten after ``revision`` (deleted ones pass).

    On a GPU's allocations (``Keyspace.allocations_prefix(node, gpu)``): nobody added to the GPU
    since the state a grant was decided on. Only the leader writes allocations, so this fails only
    on garbage written into etcd, or on the leader's own earlier write in the same cycle, which
    the :class:`~gpupool_sdk.coordinator.apply.Applier` accounts for by raising ``revision``.
    """

    prefix: str
    revision: int


Guard = SameIncarnation | Absent | Unchanged | UnchangedSince
Op = PutOp | DeleteOp


@dataclass(frozen=True)
class Fence:
    """Proof of leadership: the leader key as this replica created it.

    Attributes:
        key: the leader key.
        create_revision: its create revision (a new leader's key always has a higher one).
        value: its exact value (names this replica and its term).
        term: the term the value carries.
    """

    key: str
    create_revision: int
    value: bytes
    term: int


def fence_compares(fence: Fence) -> list[Compare]:
    """The compares that make a transaction fail once ``fence`` no longer holds."""
    return [
        Compare(fence.key, "create", "==", fence.create_revision),
        Compare(fence.key, "value", "==", fence.value),
    ]


def _guard(g: Guard) -> Compare:
    if isinstance(g, SameIncarnation):
        return Compare(g.key, "create", "==", g.create_revision)
    if isinstance(g, Unchanged):
        return Compare(g.key, "mod", "==", g.mod_revision)
    if isinstance(g, UnchangedSince):
        return Compare(g.prefix, "mod", "<", g.revision + 1, prefix=True)
    return Compare(g.key, "create", "==", 0)


def _op(o: Op) -> Put | Delete:
    if isinstance(o, PutOp):
        return Put(o.key, o.value, lease=o.lease or None)
    return Delete(o.key, prefix=o.prefix)


class FencedWriter:
    """Executes planned writes as transactions fenced on the leader key.

    Args:
        store: the etcd store.
        fence_source: returns the current :class:`Fence`, or None when this replica does not lead
            (or can no longer be sure it does); no transaction is sent then.
        on_fence_lost: called (with a reason) when a transaction failed because the leader key is no
            longer ours; the coordinator demotes itself there.

    Example:
        >>> writer = FencedWriter(store, election.fence, election.demote)   # doctest: +SKIP
        >>> writer.write([PutOp(ks.job_status("a"), b"...", lease=0x1234)])  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        store: EtcdStore,
        fence_source: Callable[[], Fence | None],
        on_fence_lost: Callable[[str], None],
    ) -> None:
        self._store = store
        self._fence_source = fence_source
        self._on_fence_lost = on_fence_lost
        self.transactions = 0
        self.failed = 0

    def write(self, ops: Sequence[Op], guards: Sequence[Guard] = ()) -> bool:
        """Apply ``ops`` atomically if this replica still leads and every guard holds.

        Returns:
            True when written. False when a guard failed (the job changed under us: a normal
            outcome) or when the fence was lost (then ``on_fence_lost`` has been called).

        Raises:
            NotLeaderError: this replica does not lead (nothing was sent).
            StoreError: etcd could not be reached.
        """
        return self.commit(ops, guards) is not None

    def commit(self, ops: Sequence[Op], guards: Sequence[Guard] = ()) -> int | None:
        """:meth:`write`, returning the etcd revision of the writes (0 when ``ops`` is empty), None when not written.

        Raises:
            NotLeaderError: this replica does not lead (nothing was sent).
            StoreError: etcd could not be reached.
        """
        fence = self._fence_source()
        if fence is None:
            raise NotLeaderError("this coordinator does not lead (or cannot confirm it does); write not sent")
        if not ops:
            return 0
        compares = fence_compares(fence) + [_guard(g) for g in guards]
        self.transactions += 1
        ok, revision = self._store.txn_at(compares, [_op(o) for o in ops], [])
        if ok:
            return revision
        self.failed += 1
        # Was it the fence or a guard? Only the fence demotes; a vanished job is routine.
        if not self._store.txn(fence_compares(fence), [], []):
            log.warning("leader key changed under us (term %d); demoting", fence.term)
            self._on_fence_lost(f"leader key changed (term {fence.term} fenced out)")
        return None

    def changed_since(self, guard: UnchangedSince) -> list[KeyValue]:
        """The keys under ``guard.prefix`` created or rewritten after ``guard.revision`` (read now).

        For the log line of a refused write: which key broke the guard. Empty when the key is gone
        again by the time of the read.
        """
        kvs, _ = self._store.get_prefix(guard.prefix)
        return [kv for kv in kvs if kv.mod_revision > guard.revision]

    def check(self) -> bool:
        """True when the leader key is still ours (an empty fenced transaction)."""
        fence = self._fence_source()
        if fence is None:
            return False
        return bool(self._store.txn(fence_compares(fence), [], []))
