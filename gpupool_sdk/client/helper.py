"""The client's I/O helper: every etcd call of a training job runs here, in a process of its own.

Started by :class:`~gpupool_sdk.client.PoolClient` as a fresh interpreter
(``python -m gpupool_sdk.client.helper FD``), never by ``fork()``: gRPC state never crosses a
fork, and the training process can fork DataLoader workers freely. The helper keeps the job's
lease alive even while the training thread holds the GIL (it has its own), forwards status,
allocations and directives, writes acks and telemetry, and revokes the lease at once when the
training process dies (pipe EOF or a changed parent pid), so a SIGKILLed trainer frees its
slices long before the TTL.

Riding out etcd faults (issue 12):

* **Acquire** retries an unreachable etcd (a restart, a member election, a fail-over between
  endpoints) with backoff until the caller's timeout: the lease grant, the spec's creation (a
  create whose reply was lost is recognised by its lease), and the first listings.
* **Release** during an outage: a revocation that cannot reach etcd is kept and retried in the
  background until etcd answers, also after the training process has gone (for up to
  :data:`REVOKE_RETRY_S`), so the job's name and slices are free as soon as etcd is back instead
  of one TTL later (etcd restarts the TTL of every lease when it restarts).
* **Restart under the same name**: the spec is created together with ``jobs/{job}/owner`` (host,
  pids and start times, and this helper's random id). A spec left by this host's own earlier
  holder whose helper is gone, or whose training process is gone (its helper is only releasing
  it), or on a lease this helper is still revoking, or written by this very helper for a session
  that has ended (a lease lost by a keepalive step-down that etcd still keeps, its revocation
  under way), is revoked and taken over instead of raising :class:`JobAlreadyRunningError`.
* **A lost lease frees the name**: the session ends (no more state reaches the job), the job is
  told ``lost`` with the lease id, and a new acquire of the name goes ahead at once; a report
  about an older lease of the job (a late keeper or watch) never ends a newer session.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from tenacity import Retrying, retry_if_exception_type, stop_never, wait_exponential

from gpupool_sdk.client import gang_member
from gpupool_sdk.client.protocol import JobAlreadyRunningError, pack_error
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import (
    AcquireTimeoutError,
    GpupoolError,
    JobRejectedError,
    LeaseLostError,
    SchemaError,
    SpecError,
    StoreUnavailableError,
)
from gpupool_sdk.resources import Allocation, Directive, GpuInfo, JobSpec, JobState, JobStatus
from gpupool_sdk.resources.grant import of_grant
from gpupool_sdk.store.codec import decode, decode_dict, encode
from gpupool_sdk.store.etcd_store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.records import ResumeRecord, TelemetryRecord
from gpupool_sdk.store.types import Compare, KeyValue, Put, WatchEvent
from gpupool_sdk.store.watch import Watcher

log = logging.getLogger(__name__)

#: After the training process has gone, the helper keeps retrying revocations that could not
#: reach etcd for this long (seconds), then exits and leaves the leases to expire.
REVOKE_RETRY_S = 120.0
#: Pause between two rounds of revocation retries (seconds).
REVOKE_RETRY_INTERVAL_S = 0.5


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), None if unknown or gone.

    Together with the pid it names one process: a recycled pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        # Field 22; the command name (field 2) may hold spaces, so split after its closing paren.
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """True when process ``pid`` exists and (when known) started at ``start_ticks``."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True  # no /proc: the signal test above is all there is
    if fields and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent
    if start_ticks is None:
        return True
    try:
        return int(fields[19]) == start_ticks
    except (ValueError, IndexError):
        return True


class Conn(Protocol):
    """What the helper needs of its channel (a multiprocessing Connection or an in-process pair)."""

    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float | None = ...) -> bool: ...
    def close(self) -> None: ...


@dataclass
class _Session:
    """One acquired (or acquiring) job."""

    spec: JobSpec
    keeper: LeaseKeeper
    lease_id: int
    status: JobStatus | None = None
    allocations: dict[str, Allocation] = field(default_factory=dict)
    last_seq: int = -1
    watchers: list[Watcher] = field(default_factory=list)
    pending_id: int | None = None
    deadline: float | None = None
    ended: bool = False
    ever_granted: bool = False
    spec_gone: bool = False
    #: its acquire is still setting up (listings, watches): no reply yet, its thread decides.
    starting: bool = False

    @property
    def job(self) -> str:
        return self.spec.name

    def cancel_watches(self) -> None:
        """Stop every watch this session started."""
        for w in self.watchers:
            w.cancel()
        self.watchers.clear()

    def granted(self) -> bool:
        st = self.status
        if st is None or st.state is not JobState.GRANTED:
            return False
        need = max(st.gpus, 1)
        return sum(1 for a in of_grant(st, self.allocations.values()) if a.term == st.term) >= need


class Helper:
    """The helper's logic; runs ``run()`` on its main thread, callbacks on store threads."""

    def __init__(self, conn: Conn, store: EtcdStore, timing: LeaseTiming, parent_pid: int | None) -> None:
        self.conn = conn
        self.store = store
        self.keys = store.keys
        self.timing = timing
        self.parent_pid = parent_pid
        self.sessions: dict[str, _Session] = {}
        self.gang_members: dict[str, Any] = {}  # job -> gang_member.MemberSession (multi-node gangs)
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        #: acquires to submit again: (request id, spec, seconds left or None), see :meth:`lost`.
        self._resubmit: list[tuple[int, JobSpec, float | None]] = []
        #: leases of the keepers acquires started whose session has not ended (a spec of this
        #: helper on one of them is in use, never a leftover to take over).
        self._keeper_leases: set[int] = set()
        #: leases whose revocation could not reach etcd (lease id -> job), retried in the background.
        self.pending_revokes: dict[int, str] = {}
        self._revoker: threading.Thread | None = None
        self._revoke_wake = threading.Event()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.start_ticks = process_start_ticks(self.pid)
        #: names this helper in the owner records it writes (in-process helpers share a pid).
        self.helper_id = uuid.uuid4().hex
        self.parent_start_ticks = process_start_ticks(parent_pid) if parent_pid else None

    # ------------------------------------------------------------------ plumbing

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                self._stop.set()  # the training process is gone

    def reply(self, req_id: int, result: Any = None, error: BaseException | None = None) -> None:
        self.send({"op": "reply", "id": req_id, "result": result, "error": pack_error(error) if error else None})

    def parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def run(self) -> None:
        """Serve requests until the training process closes the pipe, asks to close, or dies."""
        try:
            while not self._stop.is_set():
                if not self.parent_alive():
                    log.warning("training process %s died; revoking its leases", self.parent_pid)
                    break
                try:
                    ready = self.conn.poll(0.1)
                except (OSError, EOFError):
                    break
                if ready:
                    try:
                        msg = self.conn.recv()
                    except (OSError, EOFError):
                        break  # parent closed its end or died
                    if msg.get("op") == "close":
                        break
                    self.dispatch(msg)
                self.check_deadlines()
                self.resubmit_lost()
        finally:
            self.shutdown()

    def dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        req_id = msg.get("id", -1)
        try:
            if op == "acquire":
                # In a thread of its own: it may retry an unreachable etcd until the caller's
                # timeout, and the loop must keep serving releases, acks and deadlines meanwhile.
                threading.Thread(target=self._acquire_thread, args=(req_id, msg["spec"], msg.get("timeout")),
                                 name=f"gpupool-acquire:{msg['spec'].name}", daemon=True).start()
            elif op == "ack":
                self.reply(req_id, self.write_ack(msg["job"], msg["ack"]))
            elif op == "release":
                self.release(msg["job"])
                self.reply(req_id, True)
            elif op == "resume_info":
                self.reply(req_id, self.resume_info(msg["job"]))
            elif op == "gpus":
                self.reply(req_id, self.list_gpus(msg.get("node")))
            elif op == "telemetry":
                self.write_telemetry(msg["job"], msg["record"])
            elif op in ("member", "nodes"):
                gang_member.handle_request(self, op, req_id, msg)
            else:
                self.reply(req_id, error=GpupoolError(f"unknown request {op!r}"))
        except GpupoolError as exc:
            if op != "telemetry":
                self.reply(req_id, error=exc)
        except Exception as exc:  # never let a bug kill the helper: the lease would go with it
            log.exception("helper request %s failed", op)
            if op != "telemetry":
                self.reply(req_id, error=exc)

    # ------------------------------------------------------------------ acquire

    def _acquire_thread(self, req_id: int, spec: JobSpec, timeout: float | None) -> None:
        try:
            self.acquire(req_id, spec, timeout)
        except GpupoolError as exc:
            self.reply(req_id, error=exc)
        except Exception as exc:  # never let a bug kill the helper: the lease would go with it
            log.exception("helper request acquire failed")
            self.reply(req_id, error=exc)

    def acquire(self, req_id: int, spec: JobSpec, timeout: float | None) -> None:
        job = spec.name
        with self._lock:
            old = self.sessions.get(job)
            if old is not None and not old.ended:
                raise JobAlreadyRunningError(f"job {job!r} is already acquired by this client; release() it first")
        deadline = None if timeout is None else time.monotonic() + timeout
        session: _Session | None = None
        keeper: LeaseKeeper | None = None
        created = False

        def attempt() -> _Session:
            # One try; an unreachable etcd (StoreUnavailableError) makes the caller try again.
            nonlocal keeper, created, session
            if self._stop.is_set() or not self.parent_alive():
                raise GpupoolError(f"acquire of {job!r} abandoned: the training process is gone")
            if keeper is not None and (keeper.lost or keeper.stopped):
                # A keeper whose lease was lost, or stopped because its session ended (the spec
                # vanished while starting: lost() revoked it), cannot carry the job any more.
                self._stop_keeper(keeper, job)
                keeper = None
            if keeper is None:
                fresh = LeaseKeeper(self.store, self.timing,
                                    on_lost=lambda exc: self.lost(job, exc, lease_id=fresh.lease_id))
                fresh.start()
                with self._lock:
                    self._keeper_leases.add(fresh.lease_id)
                keeper, created = fresh, False
            if not created:
                self._create_spec(spec, keeper.lease_id)
                created = True
            if session is None or session.keeper is not keeper:
                session = _Session(spec=spec, keeper=keeper, lease_id=keeper.lease_id, pending_id=req_id)
                session.deadline = deadline
            session.starting = True
            with self._lock:
                self.sessions[job] = session
            try:
                self._start_watches(session)
            except BaseException:
                session.cancel_watches()
                raise
            with self._lock:
                # Checked and cleared under the lock lost() reads ``starting`` under: a loss that
                # lands in between must either see the session starting (this thread goes again)
                # or not (lost() resubmits it); else nobody would answer the acquire.
                if not (keeper.lost or session.ended):
                    session.starting = False
                    return session
            # Lost while setting up (an outage past the TTL): go again with a new lease. Watches
            # started after lost() ended the session would outlive it: cancel them too.
            session.cancel_watches()
            raise StoreUnavailableError(f"the lease of {job!r} was lost while its acquire was starting")

        def give_up(state: Any) -> bool:
            return deadline is not None and time.monotonic() >= deadline

        def before_sleep(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            left = "" if deadline is None else f" for {max(0.0, deadline - time.monotonic()):.1f}s more"
            log.warning("acquire of %s: etcd unavailable (%s); retrying%s", job, exc, left)

        retrying = Retrying(
            stop=give_up if deadline is not None else stop_never,
            wait=wait_exponential(multiplier=0.1, max=1.0),
            retry=retry_if_exception_type(StoreUnavailableError),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            started = retrying(attempt)
            self.evaluate(started)
        except BaseException:
            with self._lock:
                if session is not None and self.sessions.get(job) is session:
                    self.sessions.pop(job, None)
            if session is not None:
                self._end(session, revoke=True)
            if keeper is not None and (session is None or session.keeper is not keeper):
                # A newer lease than the session's (its spec create may have landed with the reply
                # lost): left running, it would hold the job's name for ever.
                self._stop_keeper(keeper, job)
            raise

    def _create_spec(self, spec: JobSpec, lease_id: int) -> None:
        """Create ``jobs/{job}/spec`` and ``jobs/{job}/owner`` on ``lease_id``, taking over a stale own spec.

        Raises:
            JobAlreadyRunningError: another live holder has the name.
            StoreUnavailableError: etcd could not be reached (the caller retries).
        """
        job = spec.name
        spec_key, owner_key = self.keys.job_spec(job), self.keys.job_owner(job)
        owner = encode({"host": self.host, "helper_pid": self.pid, "helper_start": self.start_ticks,
                        "helper_id": self.helper_id,
                        "parent_pid": self.parent_pid, "parent_start": self.parent_start_ticks, "lease": lease_id,
                        "at": time.time()}, kind="JobOwner")
        for _ in range(3):
            try:
                created = self.store.txn(
                    [Compare(spec_key, "create", "==", 0)], [Put(spec_key, spec, lease_id), Put(owner_key, owner, lease_id)]
                )
            except StoreUnavailableError:
                # The transaction may have been applied with its reply lost: a spec on our lease says so.
                kv = self.store.get(spec_key)
                if kv is not None and kv.lease == lease_id:
                    return
                raise
            if created:
                return
            kv = self.store.get(spec_key)
            if kv is None:
                continue  # gone in between: try again
            if kv.lease == lease_id:
                return  # our own create, applied by an earlier attempt whose reply was lost
            stale = self._stale_own(job, kv)
            if stale is None:
                again = self.store.get(spec_key)
                if again is None or again.lease != kv.lease:
                    continue  # revoked or replaced while we looked (its owner record with it): try again
                holder = f"etcd lease {kv.lease:x}" if kv.lease else "no lease"
                raise JobAlreadyRunningError(
                    f"job {job!r} is already running: {spec_key} is held by {holder}; "
                    f"see `etcdctl lease timetolive {kv.lease:x} --keys`; stop that job or choose another name"
                )
            log.warning("job %s: taking over its own stale spec on etcd lease %x (%s)", job, kv.lease, stale)
            self.store.revoke_lease(kv.lease)
            with self._lock:
                self.pending_revokes.pop(kv.lease, None)
        raise JobAlreadyRunningError(f"job {job!r}: {spec_key} keeps reappearing; another process is submitting it")

    def _stale_own(self, job: str, kv: KeyValue) -> str | None:
        """Why the spec in ``kv`` is this host's own leftover; None when it may belong to a live holder."""
        if not kv.lease:
            return None  # not written by a PoolClient: never ours to take
        with self._lock:
            if kv.lease in self.pending_revokes:
                return "this helper released it while etcd was unreachable"
        got = self.store.get(self.keys.job_owner(job))
        if got is None or got.lease != kv.lease:
            return None
        try:
            owner = decode_dict(got.key, got.value)
        except SchemaError:
            return None
        pid, start = owner.get("helper_pid"), owner.get("helper_start")
        if owner.get("host") != self.host or not isinstance(pid, int) or isinstance(pid, bool):
            return None
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            return None
        if owner.get("helper_id") == self.helper_id:
            # This very helper wrote it. A leftover when no acquire of it still keeps that lease:
            # a session that lost its lease (its revocation may still be under way, or the
            # step-down came before etcd expired it) or a keeper an interrupted acquire stopped.
            with self._lock:
                in_use = kv.lease in self._keeper_leases or any(
                    x.lease_id == kv.lease and not x.ended for x in self.sessions.values())
            return None if in_use else "this helper's own earlier session of the job has ended"
        if not process_alive(pid, start):
            return f"the I/O helper that held it (pid {pid} on {self.host}) is gone"
        # The helper lives on, but its training process is gone: it is only revoking (or about to).
        ppid, pstart = owner.get("parent_pid"), owner.get("parent_start")
        if (isinstance(ppid, int) and not isinstance(ppid, bool) and isinstance(pstart, int)
                and not isinstance(pstart, bool) and not process_alive(ppid, pstart)):
            return f"the training process that held it (pid {ppid} on {self.host}) is gone; its helper is releasing it"
        return None

    def _stop_keeper(self, keeper: LeaseKeeper, job: str) -> None:
        """Stop ``keeper`` and revoke its lease; one etcd could not take is retried in the background."""
        with self._lock:
            self._keeper_leases.discard(keeper.lease_id)
        if not keeper.stop(revoke=True):
            with self._lock:
                self.pending_revokes[keeper.lease_id] = job
            self._start_revoker()

    def _start_revoker(self) -> None:
        with self._lock:
            if self._revoker is not None and self._revoker.is_alive():
                self._revoke_wake.set()
                return
            self._revoker = threading.Thread(target=self._revoke_loop, name="gpupool-revoker", daemon=True)
            self._revoker.start()

    def retry_revokes(self) -> int:
        """Try every pending revocation once; returns how many are still pending."""
        with self._lock:
            pending = list(self.pending_revokes.items())
        for lease_id, job in pending:
            try:
                self.store.revoke_lease(lease_id)  # False (already gone) is success too
            except GpupoolError as exc:
                log.debug("revocation of lease %x (%s) still pending: %s", lease_id, job, exc)
                continue
            log.warning("released job %s: etcd lease %x revoked now that etcd answers again", job, lease_id)
            with self._lock:
                self.pending_revokes.pop(lease_id, None)
        with self._lock:
            return len(self.pending_revokes)

    def _revoke_loop(self) -> None:
        while self.retry_revokes():
            self._revoke_wake.wait(REVOKE_RETRY_INTERVAL_S)
            self._revoke_wake.clear()

    def drain_revokes(self, limit_s: float = REVOKE_RETRY_S) -> int:
        """Retry pending revocations until none is left or ``limit_s`` passed; returns how many remain."""
        deadline = time.monotonic() + limit_s
        left = self.retry_revokes()
        while left and time.monotonic() < deadline:
            time.sleep(REVOKE_RETRY_INTERVAL_S)
            left = self.retry_revokes()
        if left:
            log.warning("gave up revoking %d lease(s) after %.0fs; they expire after their TTL", left, limit_s)
        return left

    def _start_watches(self, s: _Session) -> None:
        job = s.job
        jobs_prefix = self.keys.job_status(job).rsplit("/", 1)[0] + "/"
        directive_key = self.keys.directive(job)
        alloc_prefix = self.keys.allocations_prefix()

        # Each range: list it, then watch from the listing's revision + 1 (nothing lost in between).
        def list_jobs() -> int:
            kvs, rev = self.store.get_prefix(jobs_prefix)
            with self._lock:
                s.status = None
                for kv in kvs:
                    self._apply_job_key(s, kv, deleted=False)
                if all(kv.key != self.keys.job_spec(job) for kv in kvs):
                    s.spec_gone = True
            if s.spec_gone:
                self.lost(job, LeaseLostError(f"etcd lease {s.lease_id:x} of job {job!r} is gone: its spec key vanished"),
                          lease_id=s.lease_id)
            else:
                self.evaluate(s)
            return rev

        def list_allocs() -> int:
            kvs, rev = self.store.get_prefix(alloc_prefix)
            with self._lock:
                s.allocations.clear()
                for kv in kvs:
                    self._apply_alloc(s, kv, deleted=False)
            self.evaluate(s)
            return rev

        def list_directive() -> int:
            kvs, rev = self.store.get_prefix(directive_key)
            for kv in kvs:
                if kv.key == directive_key:
                    self._apply_directive(s, kv)
            return rev

        def on_jobs(events: list[WatchEvent]) -> None:
            with self._lock:
                for ev in events:
                    self._apply_job_key(s, ev.kv, deleted=ev.type == "delete")
            if s.spec_gone:
                reason = f"etcd lease {s.lease_id:x} of job {s.job!r} was revoked or expired: its spec key is gone"
                self.lost(job, LeaseLostError(reason), lease_id=s.lease_id)
                return
            self.evaluate(s)

        def on_allocs(events: list[WatchEvent]) -> None:
            with self._lock:
                for ev in events:
                    self._apply_alloc(s, ev.kv, deleted=ev.type == "delete")
            self.evaluate(s)

        def on_directive(events: list[WatchEvent]) -> None:
            for ev in events:
                if ev.kv.key == directive_key and ev.type == "put":
                    self._apply_directive(s, ev.kv)

        for lister, handler, prefix in (
            (list_jobs, on_jobs, jobs_prefix),
            (list_allocs, on_allocs, alloc_prefix),
            (list_directive, on_directive, directive_key),
        ):
            rev = lister()
            s.watchers.append(self.store.watch_prefix(prefix, handler, start_revision=rev + 1, on_resync=lister))

    def _apply_job_key(self, s: _Session, kv: KeyValue, deleted: bool) -> None:
        if kv.key == self.keys.job_status(s.job):
            if deleted:
                s.status = None
                return
            try:
                s.status = decode(kv.key, kv.value, JobStatus)
            except SchemaError as exc:
                log.warning("ignoring malformed status: %s", exc)
        elif kv.key == self.keys.job_spec(s.job) and deleted and not s.ended:
            # The spec lives on our lease: it vanishes only when the lease is revoked or expired.
            s.spec_gone = True

    def _apply_alloc(self, s: _Session, kv: KeyValue, deleted: bool) -> None:
        parsed = self.keys.parse(kv.key)
        if parsed is None or parsed.kind != "allocations" or parsed.parts[2] != s.job:
            return
        if deleted:
            s.allocations.pop(kv.key, None)
            return
        if kv.lease != s.lease_id:
            return  # left over from another incarnation of the job
        try:
            s.allocations[kv.key] = decode(kv.key, kv.value, Allocation)
        except SchemaError as exc:
            log.warning("ignoring malformed allocation: %s", exc)

    def _apply_directive(self, s: _Session, kv: KeyValue) -> None:
        try:
            d = decode(kv.key, kv.value, Directive)
        except SchemaError as exc:
            # A kind from a newer coordinator reaches the job, which acks it as refused.
            try:
                d = Directive.from_dict(decode_dict(kv.key, kv.value, keep_kind=True), unknown_ok=True)
            except (SchemaError, SpecError, TypeError, ValueError):
                log.warning("ignoring malformed directive: %s", exc)
                return
        with self._lock:
            if d.seq <= s.last_seq or s.ended:
                return
            s.last_seq = d.seq
        self.send({"op": "directive", "job": s.job, "directive": d})

    def evaluate(self, s: _Session) -> None:
        """Push the job's state to the training process; answer a pending acquire when decided."""
        with self._lock:
            if s.ended:
                return
            allocs = of_grant(s.status, s.allocations.values())
            self.send({"op": "state", "job": s.job, "lease_id": s.lease_id, "status": s.status, "allocations": allocs})
            if s.spec.is_gang and s.ever_granted and s.status is not None and s.status.state is JobState.PENDING:
                # Another node of the gang left: the leader released every node (no half-gang trains).
                self.lost(s.job, LeaseLostError(f"gang {s.job!r} was released on every node: {s.status.reason}"),
                          lease_id=s.lease_id)
                return
            if s.pending_id is None or s.starting:
                return
            if s.granted():
                req_id, s.pending_id = s.pending_id, None
                s.ever_granted = True
                self.reply(req_id, {"lease_id": s.lease_id, "status": s.status, "allocations": allocs})
            elif s.status is not None and s.status.state is JobState.REJECTED:
                req_id, s.pending_id = s.pending_id, None
                self.reply(req_id, error=JobRejectedError(f"job {s.job!r} rejected by the pool: {s.status.reason or 'no reason given'}"))
                self.sessions.pop(s.job, None)
                self._end(s, revoke=True)

    def check_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [s for s in self.sessions.values()
                       if s.pending_id is not None and not s.starting and s.deadline is not None and now > s.deadline]
        for s in expired:
            with self._lock:
                if s.pending_id is None:
                    continue
                req_id, s.pending_id = s.pending_id, None
                st = s.status
                where = f"{st.state.value}: {st.reason}" if st is not None else "no status yet (is a coordinator running?)"
                self.sessions.pop(s.job, None)
            self._end(s, revoke=True)
            self.reply(req_id, error=AcquireTimeoutError(f"job {s.job!r} was not granted in time; last status {where}; its lease was revoked"))

    # ------------------------------------------------------------------ running job

    def _session(self, job: str) -> _Session:
        with self._lock:
            s = self.sessions.get(job)
        if s is None or s.ended:
            raise LeaseLostError(f"job {job!r} holds no lease in this client (lost or released)")
        return s

    def write_ack(self, job: str, ack: Any) -> int:
        member = self.gang_members.get(job)
        if member is not None and member.follow and job not in self.sessions:
            return int(member.ack(ack))  # a gang's node other than rank 0 acks in its member key
        s = self._session(job)
        return self.store.put(self.keys.ack(job), ack, lease=s.lease_id)

    def write_telemetry(self, job: str, record: TelemetryRecord) -> None:
        s = self._session(job)
        self.store.put(self.keys.telemetry(job), record, lease=s.lease_id)

    def resume_info(self, job: str) -> ResumeRecord | None:
        try:
            got = self.store.get_record(self.keys.checkpoint(job), ResumeRecord)
        except SchemaError as exc:
            log.warning("ignoring malformed resume record: %s", exc)
            return None
        return got[0] if got else None

    def list_gpus(self, node: str | None) -> list[GpuInfo]:
        """The published GPU records of ``node`` (every node when None); malformed ones skipped."""
        out: list[GpuInfo] = []
        kvs, _ = self.store.get_prefix(self.keys.gpus_prefix(node))
        for kv in kvs:
            try:
                out.append(decode(kv.key, kv.value, GpuInfo))
            except SchemaError as exc:
                log.warning("ignoring malformed GPU record: %s", exc)
        return out

    def release(self, job: str) -> None:
        gang_member.end_member(self, job)
        with self._lock:
            s = self.sessions.pop(job, None)
        if s is not None:
            self._end(s, revoke=True)

    def lost(self, job: str, exc: GpupoolError, lease_id: int | None = None) -> None:
        """End ``job``'s session after its lease was lost; resubmit it if it was still waiting.

        Args:
            job: the job's name.
            exc: why (sent to the training process).
            lease_id: the lease that was lost; a report about another lease than the session's
                (an older session's keeper or watch, late) is ignored.
        """
        with self._lock:
            s = self.sessions.get(job)
            if s is None or s.ended or (lease_id is not None and s.lease_id != lease_id):
                return
            self.sessions.pop(job, None)
            # Ended now, not after the revocation below: no state of this session may reach the
            # job after its "lost", when the job may already be acquiring the name again (and
            # its spec, if etcd still keeps it, is a leftover that acquire may take over).
            s.ended = True
            self._keeper_leases.discard(s.lease_id)
            pending, s.pending_id = s.pending_id, None
            left = None if s.deadline is None else s.deadline - time.monotonic()
            if s.starting:
                # Its acquire thread is still setting up and retries with a new lease itself.
                s.pending_id = pending
                resubmit = True
            elif pending is not None and not s.ever_granted and (left is None or left > 0):
                # Still waiting for its grant: an outage cost it its lease, not its place in line.
                # Submit again under a new lease within what is left of the caller's timeout.
                log.warning("job %s lost its lease while waiting for a grant (%s); submitting it again", job, exc)
                self._resubmit.append((pending, s.spec, left))
                resubmit = True
            else:
                resubmit = False
        if not resubmit:
            self.send({"op": "lost", "job": job, "lease_id": s.lease_id, "error": pack_error(exc)})
            if pending is not None:
                self.reply(pending, error=exc)
        self._end(s, revoke=True)

    def resubmit_lost(self) -> None:
        """Submit again the acquires whose lease was lost before their grant (main thread)."""
        with self._lock:
            todo, self._resubmit = self._resubmit, []
        for req_id, spec, left in todo:
            self.dispatch({"op": "acquire", "id": req_id, "spec": spec,
                           "timeout": None if left is None else max(0.0, left)})

    def _end(self, s: _Session, revoke: bool) -> None:
        with self._lock:
            s.ended = True
            self._keeper_leases.discard(s.lease_id)
        s.cancel_watches()
        if revoke:
            self._stop_keeper(s.keeper, s.job)
        else:
            s.keeper.stop(revoke=False)

    def shutdown(self, revoke_retry_s: float = REVOKE_RETRY_S) -> None:
        """End every session (revoking its lease); finish revocations etcd could not take yet.

        The training process may be gone already: the helper then stays up to ``revoke_retry_s``
        to revoke what it released during an outage, so names and slices free up as soon as etcd
        is back. It says so first (``revoking``), so a closing client does not kill it.
        """
        gang_member.end_all(self)
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            self._end(s, revoke=True)
        with self._lock:
            left = len(self.pending_revokes)
        if left:
            self.send({"op": "revoking", "leases": left})
            log.warning("%d lease(s) released while etcd was unreachable: retrying their revocation for up to %.0fs",
                        left, revoke_retry_s)
            self.drain_revokes(revoke_retry_s)


def _alive(parent_pid: int) -> bool:
    # Same test as Helper.parent_alive: re-parented means the training process is gone.
    return os.getppid() == parent_pid


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m gpupool_sdk.client.helper FD`` with the config as first message."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m gpupool_sdk.client.helper FD (started by PoolClient, not by hand)", file=sys.stderr)
        return 2
    # Ctrl-C in the terminal reaches the whole process group: the helper leaves the decision to
    # the training process (it closes the pipe), so an interrupted job can still checkpoint and ack.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(args[0]))
    cfg = conn.recv()
    level = cfg.get("log_level")
    if level is not None:
        logging.basicConfig(level=level, format="gpupool-helper %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    parent_pid = cfg["parent_pid"]

    def on_term(signum: int, frame: object) -> None:
        # A SIGTERM sent to the whole process group (scancel, `kill -TERM -PGID`) reaches the
        # helper too: while the training process lives it decides (it checkpoints, acks through
        # this helper, then closes the pipe), so the lease must outlive the signal.
        if parent_pid is not None and _alive(int(parent_pid)):
            log.info("SIGTERM ignored: the training process %d is alive and will release the lease", parent_pid)
            return
        stop.set()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    store = EtcdStore(cfg["endpoints"], keyspace=Keyspace(cfg["prefix"]), timeout_s=cfg["timeout_s"], security=cfg["security"])
    helper = Helper(conn, store, cfg["timing"], parent_pid=cfg["parent_pid"])
    conn.send({"op": "ready", "pid": os.getpid()})
    try:
        helper.run()
    finally:
        store.close()
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
