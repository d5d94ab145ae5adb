"""The client's I/O helper: every etcd call of a training job runs here, in a process of its own.

Started by :class:`~gpupool_sdk.client.PoolClient` as a fresh interpreter
(``python -m gpupool_sdk.client.helper FD``), never by ``fork()``: gRPC state never crosses a
fork, and the training process can fork DataLoader workers freely. The helper keeps the job's
lease alive even while the training thread holds the GIL (it has its own), forwards status,
allocations and directives, writes acks and telemetry, and revokes the lease at once when the
training process dies (pipe EOF or a changed parent pid), so a SIGKILLed trainer frees its
slices long before the TTL.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from gpupool_sdk.client.protocol import JobAlreadyRunningError, pack_error
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import (
    AcquireTimeoutError,
    GpupoolError,
    JobRejectedError,
    LeaseLostError,
    SchemaError,
    SpecError,
)
from gpupool_sdk.resources import Allocation, Directive, JobSpec, JobState, JobStatus
from gpupool_sdk.store.codec import decode, decode_dict
from gpupool_sdk.store.etcd_store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.records import ResumeRecord, TelemetryRecord
from gpupool_sdk.store.types import KeyValue, WatchEvent
from gpupool_sdk.store.watch import Watcher

log = logging.getLogger(__name__)


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

    @property
    def job(self) -> str:
        return self.spec.name

    def granted(self) -> bool:
        st = self.status
        if st is None or st.state is not JobState.GRANTED:
            return False
        need = max(st.gpus, 1)
        return sum(1 for a in self.allocations.values() if a.term == st.term) >= need


class Helper:
    """The helper's logic; runs ``run()`` on its main thread, callbacks on store threads."""

    def __init__(self, conn: Conn, store: EtcdStore, timing: LeaseTiming, parent_pid: int | None) -> None:
        self.conn = conn
        self.store = store
        self.keys = store.keys
        self.timing = timing
        self.parent_pid = parent_pid
        self.sessions: dict[str, _Session] = {}
        self._lock = threading.RLock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()

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
        finally:
            self.shutdown()

    def dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        req_id = msg.get("id", -1)
        try:
            if op == "acquire":
                self.acquire(req_id, msg["spec"], msg.get("timeout"))
            elif op == "ack":
                self.reply(req_id, self.write_ack(msg["job"], msg["ack"]))
            elif op == "release":
                self.release(msg["job"])
                self.reply(req_id, True)
            elif op == "resume_info":
                self.reply(req_id, self.resume_info(msg["job"]))
            elif op == "telemetry":
                self.write_telemetry(msg["job"], msg["record"])
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

    def acquire(self, req_id: int, spec: JobSpec, timeout: float | None) -> None:
        job = spec.name
        with self._lock:
            old = self.sessions.get(job)
            if old is not None and not old.ended:
                raise JobAlreadyRunningError(f"job {job!r} is already acquired by this client; release() it first")
        session: _Session | None = None
        keeper = LeaseKeeper(self.store, self.timing, on_lost=lambda exc: self.lost(job, exc))
        lease_id = keeper.start()
        try:
            spec_key = self.keys.job_spec(job)
            if not self.store.create(spec_key, spec, lease=lease_id):
                kv = self.store.get(spec_key)
                holder = f"etcd lease {kv.lease:x}" if kv is not None and kv.lease else "no lease"
                raise JobAlreadyRunningError(
                    f"job {job!r} is already running: {spec_key} is held by {holder}; "
                    f"see `etcdctl lease timetolive {kv.lease if kv else 0:x} --keys`; stop that job or choose another name"
                )
            session = _Session(spec=spec, keeper=keeper, lease_id=lease_id, pending_id=req_id)
            session.deadline = None if timeout is None else time.monotonic() + timeout
            with self._lock:
                self.sessions[job] = session
            self._start_watches(session)
            self.evaluate(session)
        except BaseException:
            if session is not None:
                with self._lock:
                    self.sessions.pop(job, None)
                self._end(session, revoke=True)
            else:
                keeper.stop(revoke=True)
            raise

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
                self.lost(job, LeaseLostError(f"etcd lease {s.lease_id:x} of job {job!r} is gone: its spec key vanished"))
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
                self.lost(job, LeaseLostError(reason))
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
            allocs = tuple(sorted(s.allocations.values(), key=lambda a: (a.node, a.gpu_index, a.gpu_uuid)))
            self.send({"op": "state", "job": s.job, "lease_id": s.lease_id, "status": s.status, "allocations": allocs})
            if s.pending_id is None:
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
            expired = [s for s in self.sessions.values() if s.pending_id is not None and s.deadline is not None and now > s.deadline]
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

    def release(self, job: str) -> None:
        with self._lock:
            s = self.sessions.pop(job, None)
        if s is not None:
            self._end(s, revoke=True)

    def lost(self, job: str, exc: GpupoolError) -> None:
        with self._lock:
            s = self.sessions.get(job)
            if s is None or s.ended:
                return
            self.sessions.pop(job, None)
            pending, s.pending_id = s.pending_id, None
        self.send({"op": "lost", "job": job, "error": pack_error(exc)})
        if pending is not None:
            self.reply(pending, error=exc)
        self._end(s, revoke=True)

    def _end(self, s: _Session, revoke: bool) -> None:
        with self._lock:
            s.ended = True
        for w in s.watchers:
            w.cancel()
        s.keeper.stop(revoke=revoke)

    def shutdown(self) -> None:
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            self._end(s, revoke=True)


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
