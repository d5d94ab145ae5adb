"""``LeaseKeeper``: keep one etcd lease alive from a thread of its own, and step down in time.

The keeper refreshes every ``keepalive_interval_s``; one refresh retries an unreachable etcd with
backoff for up to ``retry_timeout_s``. The lease is declared lost (``on_lost`` is called once,
from the keeper thread) as soon as etcd says it is gone, or when no refresh has succeeded for
``ttl_s - keepalive_interval_s``: the holder steps down before etcd can expire the lease, so it
never believes it holds what it has lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import GpupoolError, LeaseLostError, StoreError, StoreUnavailableError
from gpupool_sdk.store.etcd_store import EtcdStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Grants (or adopts) an etcd lease and keeps it alive until stopped or lost.

    Args:
        store: the store to refresh through.
        timing: TTL, keepalive interval and retry deadline (validated relation).
        on_lost: called once, from the keeper thread, with the reason, when the lease is lost.
        lease_id: adopt this existing lease instead of granting one.

    Example:
        >>> keeper = LeaseKeeper(store, LeaseTiming(), on_lost=lambda e: print("lost:", e))  # doctest: +SKIP
        >>> lease_id = keeper.start()                                                        # doctest: +SKIP
        >>> keeper.stop(revoke=True)                                                         # doctest: +SKIP
    """

    def __init__(
        self,
        store: EtcdStore,
        timing: LeaseTiming,
        on_lost: Callable[[GpupoolError], None],
        lease_id: int | None = None,
    ) -> None:
        self.store = store
        self.timing = timing
        self._on_lost = on_lost
        self._lease_id = lease_id
        self._stop = threading.Event()
        self._lost = threading.Event()
        # etcd itself said the lease is gone (as opposed to a step-down before it could expire).
        self._gone = False
        self._lost_reason: GpupoolError | None = None
        self._thread: threading.Thread | None = None
        self._last_ok = 0.0
        self.refreshes = 0
        self.remaining_ttl: int | None = None

    @property
    def lease_id(self) -> int:
        if self._lease_id is None:
            raise GpupoolError("the lease keeper has not been started; call start() first")
        return self._lease_id

    @property
    def lost(self) -> bool:
        """True once the lease is lost (after ``on_lost`` was called)."""
        return self._lost.is_set()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called (the lease is no longer kept alive, maybe revoked)."""
        return self._stop.is_set()

    @property
    def lost_reason(self) -> GpupoolError | None:
        return self._lost_reason

    @property
    def last_refresh_age_s(self) -> float:
        """Seconds since the last successful refresh (or the grant)."""
        return time.monotonic() - self._last_ok

    def start(self) -> int:
        """Grant the lease (unless one was given) and start the keepalive thread; returns the lease id."""
        if self._thread is not None:
            return self.lease_id
        if self._lease_id is None:
            self._lease_id = self.store.grant_lease(self.timing.ttl_s)
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"gpupool-lease:{self._lease_id:x}", daemon=True)
        self._thread.start()
        return self._lease_id

    def _refresh(self, deadline: float) -> tuple[int, float]:
        """One refresh with backoff, never past ``deadline``; returns (remaining TTL, send time)."""
        budget = min(self.timing.retry_timeout_s, deadline - time.monotonic())
        retrying = Retrying(
            stop=stop_after_delay(max(budget, 0.0)),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception_type(StoreUnavailableError),
            reraise=True,
        )

        def attempt() -> tuple[int, float]:
            sent = time.monotonic()
            # etcd restarts the TTL when it receives the keepalive, so the send time is the safe mark.
            timeout = max(0.05, min(self.store.timeout_s, self.timing.retry_timeout_s, deadline - sent))
            return self.store.refresh_lease(self.lease_id, timeout_s=timeout), sent

        return retrying(attempt)

    def _declare_lost(self, reason: GpupoolError) -> None:
        if self._lost.is_set():
            return
        self._lost_reason = reason
        self._lost.set()
        log.warning("etcd lease %x lost: %s", self.lease_id, reason)
        try:
            self._on_lost(reason)
        except Exception:
            log.exception("on_lost callback of lease %x raised", self.lease_id)

    def _run(self) -> None:
        interval = self.timing.keepalive_interval_s
        step_down = self.timing.step_down_after_s
        next_at = self._last_ok + interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            deadline = self._last_ok + step_down
            try:
                if time.monotonic() >= deadline:
                    raise StoreUnavailableError("no time left to retry")
                self.remaining_ttl, sent = self._refresh(deadline)
                self._last_ok = sent
                self.refreshes += 1
                next_at = sent + interval
            except LeaseLostError as exc:
                self._gone = True
                if not self._stop.is_set():
                    self._declare_lost(exc)
                return
            except StoreError as exc:
                if self._stop.is_set():
                    return
                age = time.monotonic() - self._last_ok
                if age >= step_down:
                    self._declare_lost(
                        LeaseLostError(
                            f"no successful keepalive of lease {self.lease_id:x} for {age:.1f}s "
                            f"(>= ttl_s - keepalive_interval_s = {step_down:g}s): stepping down before it expires; "
                            f"last error: {exc}"
                        )
                    )
                    return
                log.warning("keepalive of lease %x failed (%s); last success %.1fs ago", self.lease_id, exc, age)
                next_at = time.monotonic() + min(0.2, interval)
            except GpupoolError as exc:  # e.g. the store was closed under us
                if not self._stop.is_set():
                    self._declare_lost(exc)
                return

    def stop(self, revoke: bool = True) -> bool:
        """Stop refreshing; with ``revoke`` also revoke the lease so its keys vanish at once.

        Never raises for an unreachable etcd: the lease then simply expires after its TTL (or
        the caller retries the revocation when etcd is back, as the client's helper does).

        Returns:
            False when a revocation was asked for and could not reach etcd; True otherwise.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timing.retry_timeout_s + self.store.timeout_s + 1.0)
        # A lease given up by a step-down may still live in etcd (an etcd restart even restarts its
        # TTL): revoke it too, unless etcd already said it is gone.
        if revoke and self._lease_id is not None and not self._gone:
            try:
                self.store.revoke_lease(self._lease_id)
            except GpupoolError as exc:
                log.warning("could not revoke lease %x (%s); it expires within %gs", self._lease_id, exc, self.timing.ttl_s)
                return False
        return True

    def __enter__(self) -> LeaseKeeper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(revoke=True)  # an unreachable etcd lets the lease expire (see stop)
