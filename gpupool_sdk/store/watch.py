"""A prefix watch that survives reconnects and compaction without losing or repeating events.

The watcher remembers the revision of the last event it delivered. When the stream breaks
(etcd restarted, network blip, endpoint failover) it opens a new one starting at that revision
+ 1. When the wanted revision has been compacted away, it reads the current revision, calls
``on_resync`` (the consumer re-lists), and continues right after that revision.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from etcd3 import etcdrpc

from gpupool_sdk.errors import StoreAuthError, StoreError, StoreTLSError
from gpupool_sdk.store.transport import map_grpc_error, prefix_range_end
from gpupool_sdk.store.types import KeyValue, WatchEvent

if TYPE_CHECKING:
    from gpupool_sdk.store.etcd_store import EtcdStore

log = logging.getLogger(__name__)

_PUT = 0  # mvccpb.Event.EventType.PUT
_MAX_BACKOFF_S = 2.0


class Watcher:
    """A running prefix watch (created by :meth:`EtcdStore.watch_prefix`); runs in its own thread.

    Attributes:
        prefix: the watched prefix.
        next_revision: the first revision not yet delivered (None before the first stream opens).
        reconnects: how many times the stream was re-opened after a failure.
        resyncs: how many times the wanted revision was compacted and ``on_resync`` was called.

    Events of keys under one of the ``skip`` prefixes are dropped here: the consumer never sees them.
    """

    def __init__(
        self,
        store: EtcdStore,
        prefix: str,
        on_events: Callable[[list[WatchEvent]], None],
        start_revision: int | None = None,
        on_resync: Callable[[], int | None] | None = None,
        skip: Sequence[str] = (),
    ) -> None:
        self._store = store
        self.prefix = prefix
        self._skip = tuple(p.encode() for p in skip)
        self._on_events = on_events
        self._on_resync = on_resync
        self.next_revision: int | None = start_revision
        self.reconnects = 0
        self.resyncs = 0
        self._cancelled = threading.Event()
        self._ready = threading.Event()
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"gpupool-watch:{prefix}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first stream is established (events after this point are delivered)."""
        return self._ready.wait(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop watching; no callback runs after this returns (unless called from a callback)."""
        self._cancelled.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ thread

    def _requests(self, create: Any, stop: threading.Event) -> Iterator[Any]:
        yield create
        # Keep the send side open: closing it would end the stream.
        stop.wait()

    def _run(self) -> None:
        backoff = 0.05
        while not self._cancelled.is_set():
            try:
                outcome = self._stream()
                backoff = 0.05
            except (StoreAuthError, StoreTLSError) as exc:
                if self._cancelled.is_set():
                    break
                # A settings problem does not fix itself: say so where an operator looks.
                log.warning("watch on %s cannot connect (%s); retrying", self.prefix, exc)
                outcome = "reconnect"
            except StoreError as exc:
                if self._cancelled.is_set():
                    break
                log.debug("watch on %s broke (%s); reconnecting from revision %s", self.prefix, exc, self.next_revision)
                outcome = "reconnect"
            except Exception:  # a bug must not kill the watch silently
                log.exception("watch on %s failed; reconnecting", self.prefix)
                outcome = "reconnect"
            if self._cancelled.is_set():
                break
            if outcome == "reconnect":
                self.reconnects += 1
                self._cancelled.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def _stream(self) -> str:
        """Run one watch stream until it ends; returns ``"reconnect"`` or ``"resync"`` (reopen at once)."""
        stubs = self._store.connected_stubs()
        p = self.prefix.encode()
        create = etcdrpc.WatchCreateRequest(key=p, range_end=prefix_range_end(p), prev_kv=True)
        if self.next_revision is not None:
            create.start_revision = self.next_revision
        stop = threading.Event()
        call = stubs.watch.Watch(self._requests(etcdrpc.WatchRequest(create_request=create), stop))
        with self._call_lock:
            self._call = call
            if self._cancelled.is_set():
                call.cancel()
        try:
            for resp in call:
                if resp.compact_revision:
                    self._resync(int(resp.compact_revision))
                    return "resync"
                if resp.created and not resp.canceled:
                    if self.next_revision is None:
                        self.next_revision = int(resp.header.revision) + 1
                    self._ready.set()
                if resp.canceled:
                    if "permission denied" in resp.cancel_reason and stubs.token:
                        # etcd reports an expired token on a watch as "permission denied":
                        # authenticate again before the next attempt (a real denial stays denied).
                        stubs.forget_token()
                        log.warning("etcd refused the watch on %s: %s", self.prefix, resp.cancel_reason)
                    else:
                        log.debug("etcd cancelled the watch on %s: %s", self.prefix, resp.cancel_reason)
                    return "reconnect"
                if resp.events:
                    self._deliver(resp.events)
            return "reconnect"
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return "reconnect"
            err = map_grpc_error(exc, "watch", stubs.endpoint, self._store.security)
            # Let the store move to another endpoint for everyone if this one is gone.
            self._store._failover(stubs)
            raise err from None
        finally:
            stop.set()
            with self._call_lock:
                self._call = None
            call.cancel()

    def _deliver(self, raw_events: Any) -> None:
        events = []
        last = int(raw_events[-1].kv.mod_revision)
        for ev in raw_events:
            if self._skip and bytes(ev.kv.key).startswith(self._skip):
                continue
            kv = KeyValue.from_proto(ev.kv)
            prev = KeyValue.from_proto(ev.prev_kv) if ev.HasField("prev_kv") else None
            events.append(WatchEvent("put" if ev.type == _PUT else "delete", kv, prev))
        if self._cancelled.is_set():
            return
        if events:
            try:
                self._on_events(events)
            except Exception:
                log.exception("watch callback for %s raised; events up to revision %d are considered delivered", self.prefix, last)
        self.next_revision = last + 1

    def _resync(self, compact_revision: int) -> None:
        self.resyncs += 1
        # Read the revision first: everything after it will be watched, so a re-list done by the
        # consumer afterwards can only see more, never less.
        current = _retry_forever(self._store.revision, self._cancelled)
        if current is None:
            return
        log.warning(
            "watch on %s: revision %s was compacted (oldest kept %d); resyncing from %d",
            self.prefix,
            self.next_revision,
            compact_revision,
            current,
        )
        resume = current
        if self._on_resync is not None:
            try:
                given = self._on_resync()
            except Exception:
                log.exception("on_resync for %s raised", self.prefix)
                given = None
            if isinstance(given, int) and not isinstance(given, bool) and given >= compact_revision:
                resume = given
        else:
            log.error("watch on %s lost events to compaction and has no on_resync to re-list", self.prefix)
        self.next_revision = resume + 1
        self._ready.set()


def _retry_forever(fn: Callable[[], int], cancelled: threading.Event) -> int | None:
    delay = 0.05
    while not cancelled.is_set():
        try:
            return fn()
        except StoreError as exc:
            log.debug("resync: %s", exc)
            cancelled.wait(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)
    return None

