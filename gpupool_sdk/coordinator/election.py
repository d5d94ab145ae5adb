"""Leader election on etcd, in the manner of Patroni.

* The ``leader`` key (a :class:`~gpupool_sdk.resources.LeaderRecord`) is created only if absent,
  attached to the candidate's own etcd lease, kept alive by a
  :class:`~gpupool_sdk.store.lease.LeaseKeeper`. When the leader dies, its lease expires and the
  key vanishes; standbys see that on their watch and campaign at once.
* **Decision (terms):** the term is a counter in the ``term`` key (no lease). A campaign reads it
  and, in the same transaction that creates the leader key, writes ``term + 1`` guarded on the
  counter's mod revision, so two leaders can never share a term and terms only grow, even when
  leader keys come and go. (Deriving the term from the leader key's create revision would also be
  monotonic, but the value written in that same transaction could not carry it.)
* Renewing is an empty transaction that compares the leader key's create revision and value
  (still ours), preceded by a lease keepalive; releasing is a delete under the same compare.
* Step down before the lease can expire: leadership is trusted only for
  ``ttl - retry_timeout`` seconds after the start of the last successful renewal. Renewals happen
  every ``loop_wait`` and take at most ``retry_timeout``, so with
  ``loop_wait + 2 * retry_timeout <= ttl`` (validated) a healthy leader never lapses, and an
  unhealthy one stops writing while its key may still exist. Every write is fenced anyway
  (:mod:`~gpupool_sdk.coordinator.fencing`), so a deposed leader's writes fail regardless.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.fencing import Fence, fence_compares
from gpupool_sdk.errors import ConfigError, LeaseLostError, SchemaError, StoreError
from gpupool_sdk.resources import LeaderRecord
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode, decode_dict, encode
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.types import Compare, Delete, Put

log = logging.getLogger(__name__)


def default_coordinator_id() -> str:
    """``<hostname>-<pid>``: unique among live coordinators on one etcd."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ElectionTiming:
    """Timing of the election, validated like Patroni's.

    Args:
        lease: TTL, keepalive interval and retry deadline of the coordinator's lease.
        loop_wait_s: time between two renewals (and between two time-driven scheduling cycles).

    Raises:
        ConfigError: ``loop_wait_s`` is not positive or ``loop_wait_s + 2 * retry_timeout_s > ttl_s``.
    """

    lease: LeaseTiming
    loop_wait_s: float

    def __post_init__(self) -> None:
        lw = self.loop_wait_s
        if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not lw > 0:
            raise ConfigError("loop_wait_s", f"must be a positive number of seconds, got {lw!r}")
        need = lw + 2 * self.lease.retry_timeout_s
        if need > self.lease.ttl_s:
            raise ConfigError(
                "loop_wait_s",
                f"loop_wait_s + 2 * retry_timeout_s = {lw:g} + 2 * {self.lease.retry_timeout_s:g} = {need:g} "
                f"exceeds ttl_s = {self.lease.ttl_s:g}; raise --ttl or lower --loop-wait / --retry-timeout",
            )

    @property
    def trust_s(self) -> float:
        """How long a successful renewal keeps leadership trusted."""
        return self.lease.ttl_s - self.lease.retry_timeout_s


class Election:
    """One replica's part in the leader election.

    Args:
        store: the etcd store (its keyspace names the ``leader`` and ``term`` keys).
        coordinator_id: this replica's id (default ``<hostname>-<pid>``).
        timing: election timing.
        on_demoted: called with a reason whenever this replica stops leading (from any thread).
        clock: monotonic clock, for tests.

    Example:
        >>> election = Election(store, "coord-a", ElectionTiming(LeaseTiming(3, 0.5, 1), 0.5))  # doctest: +SKIP
        >>> election.step()          # campaign or renew; True while this replica leads   # doctest: +SKIP
        True
    """

    def __init__(
        self,
        store: EtcdStore,
        coordinator_id: str | None,
        timing: ElectionTiming,
        on_demoted: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._ks = store.keys
        self.id = coordinator_id or default_coordinator_id()
        self.timing = timing
        self._on_demoted = on_demoted
        self._clock = clock
        self._lock = threading.RLock()
        self._fence: Fence | None = None
        self._confirmed_at = 0.0
        self._keeper: LeaseKeeper | None = None
        self.observed_leader: LeaderRecord | None = None
        self.terms_won = 0

    # ------------------------------------------------------------------ state

    @property
    def term(self) -> int:
        """The term this replica leads in, or 0."""
        f = self._fence
        return f.term if f is not None else 0

    def fence(self) -> Fence | None:
        """The fence to write under, or None when not leading or when leadership is no longer trusted."""
        with self._lock:
            f = self._fence
            if f is None:
                return None
            if self._clock() - self._confirmed_at >= self.timing.trust_s:
                self._demote_locked(f"no successful renewal for {self.timing.trust_s:g}s; stepping down before the lease can expire")
                return None
            return f

    def is_leader(self) -> bool:
        """True while this replica leads and its leadership is trusted."""
        return self.fence() is not None

    def confirm(self, started_at: float) -> None:
        """Record a successful fenced write started at ``started_at`` (monotonic) as a renewal."""
        with self._lock:
            if self._fence is not None and started_at > self._confirmed_at:
                self._confirmed_at = started_at

    # ------------------------------------------------------------------ steps

    def step(self) -> bool:
        """Renew if leading, else campaign if the leader key is absent. Returns whether this replica leads.

        Raises:
            StoreError: etcd could not be reached while campaigning (renewal failures are absorbed
                until leadership can no longer be trusted).
        """
        if self._fence is not None:
            return self._renew()
        return self._campaign()

    def _ensure_lease(self) -> int:
        with self._lock:
            if self._keeper is not None and not self._keeper.lost:
                return self._keeper.lease_id
            holder: list[LeaseKeeper] = []
            keeper = LeaseKeeper(self._store, self.timing.lease, on_lost=lambda r: self._lease_lost(holder, r))
            holder.append(keeper)
            keeper.start()
            self._keeper = keeper
            return keeper.lease_id

    def _lease_lost(self, holder: list[LeaseKeeper], reason: object) -> None:
        with self._lock:
            if not holder or holder[0] is not self._keeper:
                return  # an older keeper, already replaced
            self._keeper = None
            if self._fence is not None:
                self._demote_locked(f"the coordinator's etcd lease was lost: {reason}")

    def read_leader(self) -> tuple[LeaderRecord, int] | None:
        """The current leader record and its key's create revision, or None (malformed counts as none)."""
        kv = self._store.get(self._ks.leader())
        if kv is None:
            self.observed_leader = None
            return None
        try:
            rec = decode(kv.key, kv.value, LeaderRecord)
        except SchemaError as exc:
            log.warning("leader key unreadable: %s", exc)
            self.observed_leader = None
            return None
        self.observed_leader = rec
        return rec, kv.create_revision

    def _read_term(self) -> tuple[int, int]:
        kv = self._store.get(self._ks.term())
        if kv is None:
            return 0, 0
        try:
            body = decode_dict(kv.key, kv.value)
            term = body.get("term")
            if isinstance(term, int) and not isinstance(term, bool) and term >= 0:
                return term, kv.mod_revision
            raise SchemaError(kv.key, f"'term' must be a non-negative integer, got {term!r}")
        except SchemaError as exc:
            # Keep terms monotonic even then: count on from the revision, which only grows.
            log.warning("term counter unreadable (%s); continuing from revision %d", exc, kv.mod_revision)
            return kv.mod_revision, kv.mod_revision

    def _campaign(self) -> bool:
        kv = self._store.get(self._ks.leader())
        if kv is not None:
            if kv.lease == 0:
                # No coordinator writes it without a lease: hand-written, it would block every
                # election forever. Remove that exact version of it; campaign on the next step.
                log.warning("deleting a leader key on no lease (hand-written?): %r", kv.value[:200])
                self._store.txn([Compare(kv.key, "mod", "==", kv.mod_revision)], [Delete(kv.key)])
                return False
            try:
                self.observed_leader = decode(kv.key, kv.value, LeaderRecord)
            except SchemaError as exc:
                self.observed_leader = None
                log.warning("leader key unreadable (%s); waiting for its lease %x to expire", exc, kv.lease)
            return False
        lease = self._ensure_lease()
        last, term_rev = self._read_term()
        term = last + 1
        rec = LeaderRecord(id=self.id, term=term, since=time.time())
        value = encode(rec)
        started = self._clock()
        try:
            ok = self._store.txn(
                [Compare(self._ks.leader(), "create", "==", 0), Compare(self._ks.term(), "mod", "==", term_rev)],
                [
                    Put(self._ks.leader(), value, lease),
                    Put(self._ks.term(), encode({"term": term, "leader": self.id, "at": rec.since}, kind="Term")),
                ],
            )
        except LeaseLostError:
            # Our lease expired before its keeper noticed: drop it; the next step grants a new one.
            with self._lock:
                keeper, self._keeper = self._keeper, None
            if keeper is not None:
                keeper.stop(revoke=False)
            return False
        if not ok:
            return False
        kv = self._store.get(self._ks.leader())
        if kv is None or kv.value != value:
            return False  # lost already (our lease expired in between)
        with self._lock:
            self._fence = Fence(self._ks.leader(), kv.create_revision, value, term)
            self._confirmed_at = started
            self.observed_leader = rec
            self.terms_won += 1
        log.info("%s leads in term %d", self.id, term)
        return True

    def _renew(self) -> bool:
        fence = self.fence()
        if fence is None:
            return False
        started = self._clock()
        try:
            keeper = self._keeper
            if keeper is not None:
                self._store.refresh_lease(keeper.lease_id, timeout_s=self.timing.lease.retry_timeout_s)
            ok = self._store.txn(fence_compares(fence), [], [])
        except LeaseLostError:
            self.demote("the coordinator's etcd lease expired")
            return False
        except StoreError as exc:
            log.warning("renewal failed: %s (leadership trusted for %.1fs more)", exc,
                        max(0.0, self.timing.trust_s - (self._clock() - self._confirmed_at)))
            return self.is_leader()
        if not ok:
            self.demote("the leader key is no longer ours")
            return False
        self.confirm(started)
        return self.is_leader()

    # ------------------------------------------------------------------ leaving

    def demote(self, reason: str) -> None:
        """Stop leading at once (stop writing); the lease is revoked so a standby can take over."""
        with self._lock:
            self._demote_locked(reason)

    def _demote_locked(self, reason: str) -> None:
        if self._fence is None:
            return
        log.warning("%s steps down from term %d: %s", self.id, self._fence.term, reason)
        self._fence = None
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            threading.Thread(target=self._drop_keeper, args=(keeper,), daemon=True, name="gpupool-election-drop").start()
        if self._on_demoted is not None:
            self._on_demoted(reason)

    @staticmethod
    def _drop_keeper(keeper: LeaseKeeper) -> None:
        # Revoking frees the leader key at once if it is still ours; done off-thread because the
        # demotion may come from inside the keeper's own callback.
        keeper.stop(revoke=True)

    def resign(self) -> bool:
        """Give up leadership now: delete the leader key if it is still ours, then revoke the lease.

        Returns:
            True if this replica led and deleted its key.
        """
        with self._lock:
            fence, self._fence = self._fence, None
            keeper, self._keeper = self._keeper, None
        deleted = False
        if fence is not None:
            try:
                deleted = self._store.txn(fence_compares(fence), [Delete(fence.key)], [])
            except StoreError as exc:
                log.warning("could not delete the leader key: %s", exc)
            log.info("%s resigned from term %d", self.id, fence.term)
        if keeper is not None:
            keeper.stop(revoke=True)
        return deleted
