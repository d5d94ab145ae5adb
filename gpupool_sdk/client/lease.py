"""``Lease``: what a training job holds, as seen from the training process.

Every method here is local: state arrives from the I/O helper on the client's reader thread,
directives wait in a local queue. Nothing on the training thread touches the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gpupool_sdk.errors import GpupoolError, LeaseLostError
from gpupool_sdk.resources import Ack, Allocation, Directive, JobSpec, JobStatus

if TYPE_CHECKING:
    from gpupool_sdk.client.pool import PoolClient

log = logging.getLogger(__name__)

_END = object()  # sentinel in the directive queue: the lease ended (lost or released)


class Lease:
    """A job's hold on its GPU slices, fenced by its etcd lease.

    Created by :meth:`PoolClient.acquire`. When the lease is lost (keepalive failed beyond the
    TTL, or revoked by the pool) :attr:`lost` turns True, the lost callbacks fire at once and
    :attr:`allocations` reports nothing: the job never believes it holds a slice it lost.
    A lost lease no longer holds the job's name: the job may call :meth:`PoolClient.acquire`
    again at once (with or without :meth:`release`, which is then a no-op).

    Example:
        >>> lease = pool.acquire(JobSpec(name="bert", memory="20GiB"), timeout=600)   # doctest: +SKIP
        >>> for directive in lease.directives():                                      # doctest: +SKIP
        ...     lease.ack(directive, step=step, checkpoint=save())
        >>> lease.release()                                                           # doctest: +SKIP

    Attributes:
        etcd_lease_id: the job's etcd lease id as an int (for code).
        etcd_lease_hex: the same id in hex, the form ``etcdctl`` takes: ``etcdctl lease
            timetolive <etcd_lease_hex> --keys`` lists every key the job holds (its spec, status,
            allocations, directive, ack and telemetry).
    """

    def __init__(self, client: PoolClient, spec: JobSpec, lease_id: int, node: str) -> None:
        self._client = client
        self.spec = spec
        self.etcd_lease_id = lease_id
        self.node = node
        self._cond = threading.Condition()
        self._status: JobStatus | None = None
        self._allocations: tuple[Allocation, ...] = ()
        self._lost_reason: GpupoolError | None = None
        self._released = False
        self._directives: queue.Queue[Any] = queue.Queue()
        self._callbacks: list[Callable[[GpupoolError], None]] = []
        self._on_status: Callable[[JobStatus], None] | None = None

    # ------------------------------------------------------------------ views

    @property
    def job(self) -> str:
        return self.spec.name

    @property
    def etcd_lease_hex(self) -> str:
        """The etcd lease id in hex, as ``etcdctl lease timetolive`` / ``revoke`` take it (``"694d9a1c2e3b4f10"``)."""
        return format(self.etcd_lease_id, "x")

    @property
    def status(self) -> JobStatus | None:
        """The job's latest status as written by the leader."""
        return self._status

    @property
    def term(self) -> int:
        """Leader term of the latest status (0 before any)."""
        return self._status.term if self._status is not None else 0

    @property
    def allocations(self) -> tuple[Allocation, ...]:
        """The slices held now; empty once the lease is lost or released."""
        with self._cond:
            if self._lost_reason is not None or self._released:
                return ()
            return self._allocations

    @property
    def visible_devices(self) -> str:
        """Comma-separated ``CUDA_VISIBLE_DEVICES`` entries of this node's slices.

        GPU indices in order; a MIG instance by its ``MIG-`` UUID (CUDA addresses MIG instances
        only by UUID). See :func:`gpupool_sdk.client.mps.visible_devices`.
        """
        from gpupool_sdk.client.mps import visible_devices

        return ",".join(visible_devices(self.allocations, self.node))

    def device_indices(self) -> list[str]:
        """:attr:`visible_devices` as a list (``["0", "2"]``; empty when no local device is known)."""
        return [x for x in self.visible_devices.split(",") if x]

    @property
    def lost(self) -> bool:
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> GpupoolError | None:
        return self._lost_reason

    @property
    def released(self) -> bool:
        return self._released

    @property
    def active(self) -> bool:
        """Neither lost nor released."""
        return self._lost_reason is None and not self._released

    # ------------------------------------------------------------------ directives

    def directives(self, timeout: float | None = None) -> Iterator[Directive]:
        """Yield directives as they arrive (blocking); ends when the lease ends.

        Args:
            timeout: stop iterating after this many seconds without a directive (None: never).
        """
        while True:
            try:
                item = self._directives.get(timeout=timeout)
            except queue.Empty:
                return
            if item is _END:
                self._directives.put(_END)  # keep ending other iterators
                return
            yield item

    def poll_directive(self) -> Directive | None:
        """The next directive if one is waiting, else None. Never blocks, no I/O."""
        try:
            item = self._directives.get_nowait()
        except queue.Empty:
            return None
        if item is _END:
            self._directives.put(_END)
            return None
        return item  # type: ignore[no-any-return]

    def ack(
        self,
        directive: Directive,
        step: int = 0,
        checkpoint: str | None = None,
        reached_bytes: int | None = None,
        ok: bool = True,
        message: str = "",
    ) -> None:
        """Answer a directive: writes ``acks/{job}`` (waits until it is in etcd).

        Raises:
            LeaseLostError: the lease is gone; nothing was written.
        """
        self._check_active("ack")
        ack = Ack(seq=directive.seq, step=step, checkpoint=checkpoint, reached_bytes=reached_bytes, ok=ok, message=message, at=time.time())
        self._client._request({"op": "ack", "job": self.job, "ack": ack})

    def publish_telemetry(self, summary: Mapping[str, Any]) -> None:
        """Queue a telemetry summary for ``telemetry/{job}``; never blocks. Only the latest is written."""
        if self.active:
            self._client._publish_telemetry(self.job, dict(summary))

    def add_lost_callback(self, cb: Callable[[GpupoolError], None]) -> None:
        """Call ``cb(reason)`` when the lease is lost (at once if it already is), from the client's reader thread."""
        with self._cond:
            reason = self._lost_reason
            if reason is None:
                self._callbacks.append(cb)
                return
        cb(reason)

    def wait_released(self, timeout: float | None = None) -> bool:
        """After acking a preempt: wait until the leader has deleted this job's allocations.

        Returns:
            True when no allocation remains (or the lease ended), False on timeout.
        """
        with self._cond:
            return self._cond.wait_for(lambda: not self._allocations or not self.active, timeout)

    def wait_for(self, predicate: Callable[[Lease], bool], timeout: float | None = None) -> bool:
        """Wait until ``predicate(self)`` holds after some state change; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def release(self) -> None:
        """Give everything back: revoke the etcd lease, so every key of the job vanishes. Idempotent."""
        if self._released:
            return
        if self._lost_reason is None:
            try:
                self._client._request({"op": "release", "job": self.job})
            except GpupoolError as exc:
                log.warning("release of job %s: %s (its lease expires after the TTL)", self.job, exc)
        self._mark_released()

    def _check_active(self, what: str) -> None:
        if self._lost_reason is not None:
            raise LeaseLostError(f"cannot {what}: the lease of job {self.job!r} is lost ({self._lost_reason})")
        if self._released:
            raise LeaseLostError(f"cannot {what}: the lease of job {self.job!r} was released")

    # ------------------------------------------------------------------ fed by the reader thread

    def _granted(self, lease_id: int) -> None:
        """Record the etcd lease the grant is attached to, and log how to inspect it."""
        self.etcd_lease_id = lease_id
        log.info(
            "job %s granted %d slice(s) on etcd lease %s; inspect with: etcdctl lease timetolive %s --keys",
            self.job, len(self.allocations), self.etcd_lease_hex, self.etcd_lease_hex,
        )

    def _update(self, status: JobStatus | None, allocations: tuple[Allocation, ...]) -> None:
        with self._cond:
            changed = status != self._status
            self._status = status
            self._allocations = allocations
            self._cond.notify_all()
        if changed and status is not None and self._on_status is not None:
            try:
                self._on_status(status)
            except Exception:
                log.exception("on_status callback raised")

    def _push_directive(self, directive: Directive) -> None:
        if self.active:
            self._directives.put(directive)

    def _mark_lost(self, reason: GpupoolError) -> None:
        with self._cond:
            if self._lost_reason is not None or self._released:
                return
            # The helper has ended the job's session: free the name before anyone can see the
            # loss, so a job that re-acquires on noticing it is not refused as "already held".
            self._client._forget(self)
            self._lost_reason = reason
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        self._directives.put(_END)
        log.warning("etcd lease %s of job %s lost: %s", self.etcd_lease_hex, self.job, reason)
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:
                log.exception("lost callback of job %s raised", self.job)

    def _mark_released(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()
        self._directives.put(_END)
        self._client._forget(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else (self._status.state.value if self._status else "?")
        return f"Lease(job={self.job!r}, etcd_lease={self.etcd_lease_hex}, {state}, slices={len(self.allocations)})"
