"""``EtcdStore``: the one object through which the pool reads and writes etcd.

Every call goes through :meth:`EtcdStore._call`, which applies the deadline, maps gRPC errors to
typed errors (:mod:`gpupool_sdk.store.transport`), retries idempotent reads with backoff and
fails over to the next endpoint when one is unreachable.

A lost compare in a transaction is a normal result (``False``), never an exception.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from etcd3 import etcdrpc
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpupool_sdk.errors import (
    ConfigError,
    GpupoolError,
    LeaseLostError,
    SchemaError,
    StoreAuthError,
    StoreError,
    StoreTLSError,
    StoreUnavailableError,
)
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.security import EtcdSecurity
from gpupool_sdk.store.transport import (
    Stubs,
    map_grpc_error,
    parse_endpoints,
    prefix_range_end,
    token_rejected,
)
from gpupool_sdk.store.types import Compare, Delete, KeyValue, LeaseInfo, Put, Value, WatchEvent, to_bytes

log = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")

_RESULTS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}
_TARGETS = {
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
    "version": etcdrpc.Compare.VERSION,
    "value": etcdrpc.Compare.VALUE,
    "lease": etcdrpc.Compare.LEASE,
}


class EtcdStore:
    """Typed access to etcd: reads, fenced writes, leases and watches.

    Args:
        endpoints: ``"h1:p1,h2:p2"`` or a list; default ``$GPUPOOL_ENDPOINTS`` or ``127.0.0.1:2379``.
            Calls go to one endpoint and move to the next when it is unreachable.
        keyspace: the pool's keys (default prefix ``/gpupool/v1`` or ``$GPUPOOL_PREFIX``).
        timeout_s: deadline of one etcd call; idempotent reads retry for up to this long in total.
        security: TLS and etcd-auth settings; None: :meth:`EtcdSecurity.from_env`
            (``GPUPOOL_ETCD_*``, then ``ETCDCTL_*``). ``https://`` endpoints switch TLS on.
            Certificate files are read and checked here, so a bad path fails at once.

    Raises:
        ConfigError: bad endpoints, timeout or security settings (the message names the setting).

    The gRPC channel is opened on first use and belongs to the process that created the store:
    using it in a ``fork()``-ed child raises :class:`GpupoolError` (create a new store there).

    Example:
        >>> with EtcdStore("127.0.0.1:2379") as store:          # doctest: +SKIP
        ...     created = store.create(store.keys.job_spec("bert"), spec, lease=lease_id)
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | None = None,
        keyspace: Keyspace | None = None,
        timeout_s: float = 5.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError("timeout_s", f"must be a positive number of seconds, got {timeout_s!r}")
        self.endpoints = parse_endpoints(endpoints)
        if security is not None and not isinstance(security, EtcdSecurity):
            raise ConfigError("security", f"expected an EtcdSecurity, got {type(security).__name__}")
        self.security = (security if security is not None else EtcdSecurity.from_env()).for_endpoints(endpoints)
        self._tls = self.security.load()
        self.keys = keyspace if keyspace is not None else Keyspace.from_env()
        self.timeout_s = float(timeout_s)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stubs: Stubs | None = None
        self._current = 0
        self._closed = False
        self._watchers: list[Any] = []

    # ------------------------------------------------------------------ plumbing

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise GpupoolError(
                f"this EtcdStore was created in process {self._pid} and cannot be used in forked child "
                f"{os.getpid()} (gRPC state does not survive fork); create a new EtcdStore in the child"
            )
        if self._closed:
            raise StoreError("the EtcdStore is closed; create a new one")

    def stubs(self) -> Stubs:
        """The stubs of the current endpoint's channel (opened lazily)."""
        self._check_process()
        with self._lock:
            if self._stubs is None:
                self._stubs = Stubs.open(self.endpoints[self._current], self.security, self._tls)
            return self._stubs

    def connected_stubs(self, timeout_s: float | None = None) -> Stubs:
        """The current stubs, authenticated (etcd auth token) when a user is set; for watch streams.

        Raises:
            StoreAuthError: etcd refused the credentials.
            StoreTLSError / StoreUnavailableError: etcd could not be reached.
        """
        return self._call("connect", lambda s, t: s, idempotent=True, timeout_s=timeout_s)

    @property
    def endpoint(self) -> str:
        """The endpoint calls currently go to."""
        return self.endpoints[self._current]

    def _failover(self, failed: Stubs) -> None:
        if len(self.endpoints) == 1:
            return
        with self._lock:
            if self._stubs is failed:
                self._current = (self._current + 1) % len(self.endpoints)
                self._stubs = None
                old = failed
            else:
                return  # another thread already moved on
        log.warning("etcd endpoint %s unreachable; failing over to %s", old.endpoint, self.endpoint)
        old.close()

    def _call(self, op: str, fn: Callable[[Stubs, float], T], idempotent: bool = False, timeout_s: float | None = None) -> T:
        """Run ``fn(stubs, deadline_s)`` with error mapping, failover and retry, within ``timeout_s``.

        Reads (``idempotent``) retry any unavailability with backoff. Writes retry only when the
        connection was never made (the request provably did not reach etcd): a write that timed
        out or broke mid-flight may have been applied, so it surfaces as StoreUnavailableError.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        errors: list[str] = []

        def attempt() -> T:
            st = self.stubs()
            try:
                st.authenticate(max(0.05, deadline - time.monotonic()))
                return fn(st, max(0.05, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                err = map_grpc_error(exc, op, st.endpoint, self.security)
                if token_rejected(exc) and st.token:
                    # etcd checks the token before applying anything: safe to retry with a new one.
                    st.forget_token()
                    errors.append(str(err))
                    raise _Retry(err) from None
                if isinstance(err, (StoreTLSError, StoreAuthError)):
                    raise err from None  # a settings problem: retrying cannot help
                if isinstance(err, StoreUnavailableError):
                    errors.append(str(err))
                    self._failover(st)
                    if idempotent or _not_sent(exc):
                        raise _Retry(err) from None
                raise err from None

        retrying = Retrying(
            stop=stop_after_delay(timeout),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception_type(_Retry),
            reraise=True,
        )
        try:
            return retrying(attempt)
        except _Retry as exc:
            distinct = list(dict.fromkeys(errors))
            if len(self.endpoints) > 1 and len(distinct) > 1:
                raise StoreUnavailableError(f"no etcd endpoint reachable during {op}: " + " | ".join(distinct[-len(self.endpoints):])) from None
            raise exc.error from None

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> KeyValue | None:
        """The key's current value and revisions, or None if absent."""
        resp = self._call("get", lambda s, t: s.kv.Range(etcdrpc.RangeRequest(key=key.encode()), t), idempotent=True)
        return KeyValue.from_proto(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str, skip: Sequence[str] = ()) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, sorted by key, and the revision they were read at.

        Args:
            prefix: key prefix.
            skip: prefixes under ``prefix`` whose keys are not read at all (etcd sends none of
                them): the rest is read as the ranges between them, in one read-only transaction,
                so every key is still from one revision.
        """
        ranges = _ranges_without(prefix.encode(), sorted({p.encode() for p in skip}))
        if len(ranges) == 1:
            req = _range(*ranges[0])
            resp = self._call("get_prefix", lambda s, t: s.kv.Range(req, t), idempotent=True)
            return [KeyValue.from_proto(kv) for kv in resp.kvs], int(resp.header.revision)
        txn = etcdrpc.TxnRequest(success=[etcdrpc.RequestOp(request_range=_range(a, b)) for a, b in ranges])
        tresp = self._call("get_prefix", lambda s, t: s.kv.Txn(txn, t), idempotent=True)
        kvs = [KeyValue.from_proto(kv) for r in tresp.responses for kv in r.response_range.kvs]
        return kvs, int(tresp.header.revision)

    def revision(self) -> int:
        """The store's current revision."""
        req = etcdrpc.RangeRequest(key=b"\0", count_only=True)
        resp = self._call("revision", lambda s, t: s.kv.Range(req, t), idempotent=True)
        return int(resp.header.revision)

    def get_record(self, key: str, cls: type[R]) -> tuple[R, KeyValue] | None:
        """The key decoded as ``cls``, with its metadata; None if absent.

        Raises:
            SchemaError: the value is not valid JSON of ``cls``; names the key.
        """
        kv = self.get(key)
        if kv is None:
            return None
        return decode(key, kv.value, cls), kv

    def list_records(
        self, prefix: str, cls: type[R], on_error: Callable[[SchemaError], None] | None = None
    ) -> list[tuple[R, KeyValue]]:
        """Every key under ``prefix`` decoded as ``cls``, sorted by key.

        A malformed value is passed to ``on_error`` (or logged as a warning) and skipped: this
        never raises :class:`SchemaError`.
        """
        kvs, _ = self.get_prefix(prefix)
        return decode_all(kvs, cls, on_error)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, value: Value, lease: int | None = None) -> int:
        """Write ``value`` (bytes, str, record or mapping); returns the revision of the write."""
        req = etcdrpc.PutRequest(key=key.encode(), value=to_bytes(value), lease=lease or 0)
        resp = self._call("put", lambda s, t: s.kv.Put(req, t))
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        """Delete one key; True if it existed."""
        req = etcdrpc.DeleteRangeRequest(key=key.encode())
        return int(self._call("delete", lambda s, t: s.kv.DeleteRange(req, t)).deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (which must name at least one path segment); returns the count."""
        if len(prefix.strip("/")) == 0:
            raise ConfigError("prefix", f"{prefix!r} would delete the whole store; name a key prefix such as '/gpupool/v1/'")
        p = prefix.encode()
        req = etcdrpc.DeleteRangeRequest(key=p, range_end=prefix_range_end(p))
        return int(self._call("delete_prefix", lambda s, t: s.kv.DeleteRange(req, t)).deleted)

    def create(self, key: str, value: Value, lease: int | None = None) -> bool:
        """Create ``key`` only if it does not exist; False if it already does."""
        return self.txn([Compare(key, "create", "==", 0)], [Put(key, value, lease)])

    def replace(self, key: str, value: Value, mod_revision: int, lease: int | None = None) -> bool:
        """Compare-and-swap: write only if the key's mod revision is still ``mod_revision``."""
        return self.txn([Compare(key, "mod", "==", mod_revision)], [Put(key, value, lease)])

    def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete], failure: Sequence[Put | Delete] = ()) -> bool:
        """Atomically: if every compare holds, apply ``success``, else ``failure``.

        Returns:
            True if the compares held. A lost compare is ``False``, not an exception.
        """
        return self.txn_at(compares, success, failure)[0]

    def txn_at(
        self, compares: Sequence[Compare], success: Sequence[Put | Delete], failure: Sequence[Put | Delete] = ()
    ) -> tuple[bool, int]:
        """:meth:`txn`, and the store's revision after it: the revision of its writes when it wrote any.

        Returns:
            ``(compares held, revision)``. A lost compare is ``False``, not an exception.
        """
        req = etcdrpc.TxnRequest(
            compare=[_compare_proto(c) for c in compares],
            success=[_op_proto(o) for o in success],
            failure=[_op_proto(o) for o in failure],
        )
        resp = self._call("txn", lambda s, t: s.kv.Txn(req, t))
        return bool(resp.succeeded), int(resp.header.revision)

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches starting earlier get a resync)."""
        req = etcdrpc.CompactionRequest(revision=revision, physical=True)
        self._call("compact", lambda s, t: s.kv.Compact(req, t))

    # ------------------------------------------------------------------ leases

    def grant_lease(self, ttl_s: float) -> int:
        """Grant a lease of ``ttl_s`` seconds (rounded up to whole seconds); returns its id."""
        ttl = math.ceil(ttl_s)
        if ttl < 1:
            raise ConfigError("ttl_s", f"must be at least 1 second, got {ttl_s}")
        resp = self._call("grant_lease", lambda s, t: s.lease.LeaseGrant(etcdrpc.LeaseGrantRequest(TTL=ttl), t))
        if resp.error:
            raise StoreError(f"grant_lease: etcd refused the lease: {resp.error}")
        return int(resp.ID)

    def revoke_lease(self, lease_id: int) -> bool:
        """Revoke a lease: every key attached to it is deleted at once. False if already gone."""
        req = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call("revoke_lease", lambda s, t: s.lease.LeaseRevoke(req, t))
        except LeaseLostError:
            return False
        return True

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Send one keepalive; returns the remaining TTL in seconds.

        Raises:
            LeaseLostError: the lease expired or was revoked.
            StoreUnavailableError: etcd could not be reached.
        """

        def keepalive(s: Stubs, t: float) -> int:
            responses = s.lease.LeaseKeepAlive(iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), t)
            for resp in responses:
                return int(resp.TTL)
            raise StoreUnavailableError(f"refresh_lease: etcd at {s.endpoint} closed the keepalive stream without answering")

        ttl = self._call("refresh_lease", keepalive, timeout_s=timeout_s)
        if ttl <= 0:
            raise LeaseLostError(f"lease {lease_id:x} is gone (expired or revoked); everything attached to it was deleted")
        return ttl

    def lease_info(self, lease_id: int) -> LeaseInfo | None:
        """Remaining TTL, granted TTL and attached keys of a lease; None if it no longer exists."""
        req = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id, keys=True)
        try:
            resp = self._call("lease_info", lambda s, t: s.lease.LeaseTimeToLive(req, t), idempotent=True)
        except LeaseLostError:
            return None
        if resp.TTL < 0:
            return None
        return LeaseInfo(ttl_remaining=int(resp.TTL), granted_ttl=int(resp.grantedTTL), keys=sorted(k.decode() for k in resp.keys))

    # ------------------------------------------------------------------ watches and status

    def watch_prefix(
        self,
        prefix: str,
        on_events: Callable[[list[WatchEvent]], None],
        start_revision: int | None = None,
        on_resync: Callable[[], int | None] | None = None,
        skip: Sequence[str] = (),
    ) -> Any:
        """Watch every key under ``prefix`` in a thread of its own; see :class:`~gpupool_sdk.store.watch.Watcher`.

        Args:
            prefix: key prefix.
            on_events: called from the watch thread with each batch of events, in revision order.
            start_revision: first revision to deliver (e.g. the revision of a listing + 1);
                None: changes after now.
            on_resync: called when the wanted revision was compacted away; the consumer re-lists.
                Delivery then resumes right after the revision read *before* the call (or after the
                revision ``on_resync`` returns, if it returns one), so nothing is lost.
            skip: prefixes whose events are dropped by the watch thread: ``on_events`` never sees
                them and is not called for a batch of nothing else.

        Returns:
            The running :class:`~gpupool_sdk.store.watch.Watcher` (``cancel()`` to stop).
        """
        from gpupool_sdk.store.watch import Watcher

        self._check_process()
        w = Watcher(self, prefix, on_events, start_revision=start_revision, on_resync=on_resync, skip=skip)
        self._watchers.append(w)
        w.start()
        return w

    def cluster_status(self) -> dict[str, Any]:
        """Status of the member in use: version, db size, leader, raft index and term, revision."""
        resp = self._call("status", lambda s, t: s.maintenance.Status(etcdrpc.StatusRequest(), t), idempotent=True)
        return {
            "endpoint": self.endpoint,
            "version": resp.version,
            "db_size_bytes": int(resp.dbSize),
            "leader": int(resp.leader),
            "member_id": int(resp.header.member_id),
            "raft_index": int(resp.raftIndex),
            "raft_term": int(resp.raftTerm),
            "revision": int(resp.header.revision),
            "is_leader": int(resp.leader) == int(resp.header.member_id),
        }

    def close(self) -> None:
        """Cancel this store's watches and close its channel. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            self._closed = True
            return
        for w in list(self._watchers):
            w.cancel()
        self._watchers.clear()
        with self._lock:
            if self._stubs is not None:
                self._stubs.close()
                self._stubs = None
        self._closed = True

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdStore(endpoints={','.join(self.endpoints)!r}, prefix={self.keys.prefix!r}, {self.security.summary()})"


class _Retry(Exception):
    """Internal: an unavailability worth retrying (carries the typed error to raise in the end)."""

    def __init__(self, error: StoreError) -> None:
        super().__init__(str(error))
        self.error = error


def _not_sent(exc: grpc.RpcError) -> bool:
    """True when gRPC failed before the request left (no connection could be made)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = ((exc.details() if hasattr(exc, "details") else "") or "").lower()
    return code == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in details or "connection refused" in details)


def decode_all(
    kvs: Sequence[KeyValue], cls: type[R], on_error: Callable[[SchemaError], None] | None = None
) -> list[tuple[R, KeyValue]]:
    """Decode listed keys as ``cls``; malformed values go to ``on_error`` (or a warning) and are skipped."""
    out: list[tuple[R, KeyValue]] = []
    for kv in kvs:
        try:
            out.append((decode(kv.key, kv.value, cls), kv))
        except SchemaError as exc:
            if on_error is not None:
                on_error(exc)
            else:
                log.warning("skipping malformed value: %s", exc)
    return out


def _range(key: bytes, end: bytes) -> Any:
    return etcdrpc.RangeRequest(key=key, range_end=end, sort_order=etcdrpc.RangeRequest.ASCEND, sort_target=etcdrpc.RangeRequest.KEY)


def _ranges_without(prefix: bytes, skip: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """The key ranges of ``prefix`` less the keys under each of ``skip`` (sorted), in key order.

    Example:
        >>> _ranges_without(b"/p/", [b"/p/r/"])
        [(b'/p/', b'/p/r/'), (b'/p/r0', b'/p0')]
    """
    out: list[tuple[bytes, bytes]] = []
    start, end = prefix, prefix_range_end(prefix)
    for p in skip:
        if not p.startswith(prefix) or p == prefix or p < start:
            continue  # outside the range, the whole of it, or inside a range already skipped
        if p > start:
            out.append((start, p))
        start = prefix_range_end(p)
    if start < end:
        out.append((start, end))
    return out


def iter_chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Split ``items`` into chunks of at most ``size`` (etcd caps operations per transaction at 128)."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _compare_proto(c: Compare) -> Any:
    key = c.key.encode()
    msg = etcdrpc.Compare(key=key, result=_RESULTS[c.op], target=_TARGETS[c.target])
    if c.prefix:
        msg.range_end = prefix_range_end(key)
    if c.target == "create":
        msg.create_revision = c.value
    elif c.target == "mod":
        msg.mod_revision = c.value
    elif c.target == "version":
        msg.version = c.value
    elif c.target == "lease":
        msg.lease = c.value
    else:
        msg.value = to_bytes(c.value)
    return msg


def _op_proto(op: Put | Delete) -> Any:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=op.key.encode(), value=to_bytes(op.value), lease=op.lease or 0)
        )
    if isinstance(op, Delete):
        k = op.key.encode()
        req = etcdrpc.DeleteRangeRequest(key=k, range_end=prefix_range_end(k) if op.prefix else b"")
        return etcdrpc.RequestOp(request_delete_range=req)
    raise ConfigError("success", f"transaction operations are Put or Delete, got {type(op).__name__}")
