"""``PoolClient``: the training process's handle on the pool.

All etcd/gRPC I/O runs in an I/O helper process (:mod:`gpupool_sdk.client.helper`) started as a
fresh interpreter, never forked; this process only exchanges small pickled messages with it over
a local pipe. So the training process never loads gRPC, forks DataLoader workers safely, and the
lease stays alive even while the training thread holds the GIL.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from gpupool_sdk.client.lease import Lease
from gpupool_sdk.client.node import ANY_NODE
from gpupool_sdk.client.protocol import HelperDiedError, unpack_error
from gpupool_sdk.client.waiting import WaitReporter
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import Checkpoint, GpuInfo, JobSpec, JobStatus
from gpupool_sdk.store.endpoints import parse_endpoints
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.records import TelemetryRecord
from gpupool_sdk.store.security import EtcdSecurity

log = logging.getLogger(__name__)

NODE_ENV = "GPUPOOL_NODE"

# Forked children (DataLoader workers) must not keep the helper's pipe open: the helper treats
# EOF as "the training process died". Close the inherited copies right after fork.
_LIVE_CLIENTS: weakref.WeakSet[PoolClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_LIVE_CLIENTS):
        client._drop_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class _Pending:
    event: threading.Event
    result: Any = None
    error: GpupoolError | None = None


class _QueueConn:
    """One end of an in-process channel, with the Connection methods the helper uses."""

    def __init__(self, inbox: _Box, outbox: _Box) -> None:
        self._in, self._out = inbox, outbox

    def send(self, obj: Any) -> None:
        self._out.put(obj)

    def recv(self) -> Any:
        return self._in.get()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self._in.wait(timeout)

    def close(self) -> None:
        self._out.close()
        self._in.close()


class _Box:
    """A closable FIFO: ``get`` raises EOFError once closed and drained."""

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, obj: Any) -> None:
        with self._cond:
            if self._closed:
                raise OSError("channel closed")
            self._items.append(obj)
            self._cond.notify_all()

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._items) or self._closed, timeout)

    def get(self) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items) or self._closed)
            if self._items:
                return self._items.popleft()
            raise EOFError

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class PoolClient:
    """Submit jobs to the pool and hold their leases.

    Args:
        endpoints: etcd endpoints (``"h1:p1,h2:p2"``); default ``$GPUPOOL_ENDPOINTS`` or ``127.0.0.1:2379``.
        prefix: key prefix of the pool; default ``$GPUPOOL_PREFIX`` or ``/gpupool/v1``.
        timing: lease TTL, keepalive interval and retry deadline (default :meth:`LeaseTiming.from_env`).
        in_process: run the I/O side in threads of this process instead of a helper process.
            For the coordinator's tests and benchmarks only: it loads gRPC here and is not fork-safe.
        node: the pool node this process runs on: every spec it submits is granted only there
            (``JobSpec.node``), and :attr:`Lease.visible_devices` picks that node's slices.
            Default ``$GPUPOOL_NODE``, else found at the first acquire from the node-local
            agent (:meth:`local_node`, :mod:`gpupool_sdk.client.node`). ``"*"``
            (:data:`~gpupool_sdk.client.node.ANY_NODE`): specs are submitted without a node
            and may be granted anywhere, for tools and tests that hold slices without running
            on them; never for a training process.
        timeout_s: deadline of one etcd call and of a request to the helper.
        telemetry_interval_s: at most one telemetry write per job per this many seconds.
        security: TLS and etcd-auth settings; default :meth:`EtcdSecurity.from_env`
            (``GPUPOOL_ETCD_CACERT`` / ``_CERT`` / ``_KEY`` / ``_USER`` / ``_PASSWORD``, else the
            ``ETCDCTL_*`` ones), so a training script needs no change. The files are checked
            here; the settings travel to the I/O helper as a plain value.

    Raises:
        ConfigError: a bad argument or security setting (missing certificate file...), naming it.

    Example:
        >>> from gpupool_sdk import PoolClient, JobSpec
        >>> with PoolClient(endpoints="127.0.0.1:2379") as pool:                  # doctest: +SKIP
        ...     lease = pool.acquire(JobSpec(name="bert-ft", gpus=2, memory="30GiB"), timeout=600)
        ...     print(lease.allocations, lease.etcd_lease_hex)  # etcdctl lease timetolive <hex> --keys
        ...     lease.release()
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | None = None,
        prefix: str | None = None,
        timing: LeaseTiming | None = None,
        in_process: bool = False,
        node: str | None = None,
        timeout_s: float = 5.0,
        telemetry_interval_s: float = 1.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if security is not None and not isinstance(security, EtcdSecurity):
            raise ConfigError("security", f"expected an EtcdSecurity, got {type(security).__name__}")
        self.security = (security if security is not None else EtcdSecurity.from_env()).for_endpoints(endpoints)
        # Read the certificate files now: a bad path fails here, naming the setting, not in the helper.
        self.security.load()
        self.keys = Keyspace.from_env(prefix)
        if timing is not None and not isinstance(timing, LeaseTiming):
            raise ConfigError("timing", f"expected a LeaseTiming, got {type(timing).__name__}")
        self.timing = timing if timing is not None else LeaseTiming.from_env()
        if not 0 < timeout_s < math.inf:
            raise ConfigError("timeout_s", f"must be a finite number of seconds > 0, got {timeout_s}")
        if not 0 <= telemetry_interval_s < math.inf:
            raise ConfigError("telemetry_interval_s", f"must be a finite number of seconds >= 0, got {telemetry_interval_s}")
        self.timeout_s = float(timeout_s)
        self.telemetry_interval_s = float(telemetry_interval_s)
        self.in_process = in_process
        #: the node this process runs on; None until :meth:`local_node` found it.
        self.node: str | None = node or os.environ.get(NODE_ENV) or None
        self._joining: dict[str, str] = {}  # gang jobs node rank 0 is joining -> its node
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._helper_thread: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._leases: dict[str, Lease] = {}  # granted and held
        self._routes: dict[str, Lease] = {}  # every job messages may be about (acquiring or held)
        self._telemetry: dict[str, TelemetryRecord] = {}
        self._telemetry_wake = threading.Event()
        self._telemetry_thread: threading.Thread | None = None
        self._closed = False
        self._helper_revoking = False
        self.helper_pid: int | None = None

    # ------------------------------------------------------------------ helper lifecycle

    def _ensure_helper(self) -> None:
        if os.getpid() != self._pid:
            raise GpupoolError(
                "this PoolClient belongs to the process that created it; a forked child cannot use it "
                "(create a new PoolClient in the child if it really needs the pool)"
            )
        if self._closed:
            raise GpupoolError("the PoolClient is closed; create a new one")
        with self._lock:
            if self._conn is not None:
                return
            cfg = {
                "endpoints": list(self.endpoints),
                "prefix": self.keys.prefix,
                "timing": self.timing,
                "timeout_s": self.timeout_s,
                "security": self.security,
                "parent_pid": None if self.in_process else os.getpid(),
                "log_level": os.environ.get("GPUPOOL_HELPER_LOG_LEVEL"),
            }
            if self.in_process:
                self._start_in_process(cfg)
            else:
                self._start_process(cfg)
            self._reader = threading.Thread(target=self._read_loop, name="gpupool-client-reader", daemon=True)
            self._reader.start()
            self._telemetry_thread = threading.Thread(target=self._telemetry_loop, name="gpupool-client-telemetry", daemon=True)
            self._telemetry_thread.start()
        _LIVE_CLIENTS.add(self)

    def _start_process(self, cfg: dict[str, Any]) -> None:
        ours, theirs = Pipe(duplex=True)
        fd = theirs.fileno()
        # A fresh interpreter (fork+exec, no Python runs in between): nothing of this process's
        # state, gRPC or otherwise, reaches the helper, and the user's __main__ is not re-imported.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gpupool_sdk.client.helper", str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        ours.send(cfg)
        deadline = time.monotonic() + max(60.0, self.timeout_s)
        while not ours.poll(0.1):
            if self._proc.poll() is not None:
                raise HelperDiedError(f"the client's I/O helper exited with code {self._proc.returncode} while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise HelperDiedError("the client's I/O helper did not start in time")
        hello = ours.recv()
        self.helper_pid = int(hello["pid"])
        self._conn = ours

    def _start_in_process(self, cfg: dict[str, Any]) -> None:
        from gpupool_sdk.client.helper import Helper
        from gpupool_sdk.store.etcd_store import EtcdStore

        a, b = _Box(), _Box()
        ours, theirs = _QueueConn(a, b), _QueueConn(b, a)
        store = EtcdStore(
            cfg["endpoints"], keyspace=Keyspace(cfg["prefix"]), timeout_s=cfg["timeout_s"], security=cfg["security"]
        )
        helper = Helper(theirs, store, cfg["timing"], parent_pid=None)

        def run() -> None:
            try:
                helper.run()
            finally:
                store.close()
                theirs.close()

        self._helper_thread = threading.Thread(target=run, name="gpupool-client-io", daemon=True)
        self._helper_thread.start()
        self.helper_pid = os.getpid()
        self._conn = ours

    def _drop_after_fork(self) -> None:
        # In a forked child: forget the parent's helper without telling it anything.
        conn, self._conn = self._conn, None
        self._closed = True
        if isinstance(conn, Connection):
            with contextlib.suppress(OSError):
                os.close(conn.fileno())

    # ------------------------------------------------------------------ messaging

    def _send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            conn = self._conn
            if conn is None:
                raise HelperDiedError("the client's I/O helper is not running")
            try:
                conn.send(msg)
            except (OSError, EOFError, BrokenPipeError) as exc:
                raise HelperDiedError(f"the client's I/O helper is gone ({exc})") from None

    def _request(self, msg: dict[str, Any], timeout: float | None = -1.0) -> Any:
        """Send a request and wait for its reply (``timeout`` -1: the client's timeout_s; None: forever)."""
        self._ensure_helper()
        req_id = next(self._ids)
        pending = _Pending(threading.Event())
        self._pending[req_id] = pending
        try:
            self._send({**msg, "id": req_id})
            limit = self.timeout_s * 3 if timeout == -1.0 else timeout
            if not pending.event.wait(limit):
                raise GpupoolError(f"the client's I/O helper did not answer {msg['op']} within {limit:g}s")
        finally:
            self._pending.pop(req_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _read_loop(self) -> None:
        conn = self._conn
        reason: GpupoolError | None = None
        while True:
            try:
                msg = conn.recv()
            except (OSError, EOFError):
                break
            try:
                self._dispatch(msg)
            except Exception:
                log.exception("client failed to handle %s", msg.get("op"))
        if not self._closed:
            code = self._proc.poll() if self._proc is not None else None
            reason = HelperDiedError(
                f"the client's I/O helper exited (code {code}); nothing keeps the leases alive, treating them as lost"
            )
            for lease in list(self._routes.values()):
                lease._mark_lost(reason)
            for p in list(self._pending.values()):
                p.error = reason
                p.event.set()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "revoking":
            # The helper is finishing revocations etcd could not take during an outage: closing
            # must not kill it (it exits by itself once done, see helper.REVOKE_RETRY_S).
            self._helper_revoking = True
            return
        if op == "reply":
            p = self._pending.get(msg["id"])
            if p is None:
                return
            if msg["error"] is not None:
                p.error = unpack_error(msg["error"])
            else:
                p.result = msg["result"]
            p.event.set()
            return
        lease = self._routes.get(msg["job"])
        if lease is None:
            return
        if op == "state":
            lease._update(msg["status"], msg["allocations"])
        elif op == "directive":
            lease._push_directive(msg["directive"])
        elif op == "lost":
            lost_id = msg.get("lease_id")
            if lost_id and lease.etcd_lease_id and lost_id != lease.etcd_lease_id:
                return  # about an earlier lease of the same name, not this one
            lease._mark_lost(unpack_error(msg["error"]))

    def _publish_telemetry(self, job: str, summary: dict[str, Any]) -> None:
        self._telemetry[job] = TelemetryRecord(job=job, at=time.time(), summary=summary)
        self._telemetry_wake.set()

    def _telemetry_loop(self) -> None:
        while not self._closed:
            self._telemetry_wake.wait()
            self._telemetry_wake.clear()
            if self._closed:
                return
            for job in list(self._telemetry):
                record = self._telemetry.pop(job, None)
                if record is not None and job in self._leases:
                    try:
                        self._send({"op": "telemetry", "job": job, "record": record})
                    except GpupoolError:
                        return
            # Coalesce: summaries published during this pause replace each other.
            time.sleep(self.telemetry_interval_s)

    def _forget(self, lease: Lease) -> None:
        """Drop ``lease`` (released or lost) so its job's name can be acquired again.

        Only this very lease is dropped: a lease lost earlier and released later must not take a
        newer lease of the same name with it.
        """
        if self._leases.get(lease.job) is lease:
            self._leases.pop(lease.job, None)
        if self._routes.get(lease.job) is lease:
            self._routes.pop(lease.job, None)

    # ------------------------------------------------------------------ public API

    def acquire(
        self,
        spec: JobSpec,
        timeout: float | None = None,
        on_status: Callable[[JobStatus], None] | None = None,
    ) -> Lease:
        """Submit ``spec`` under a new etcd lease and wait until the pool grants it.

        Args:
            spec: what the job needs.
            timeout: seconds to wait for the grant (None: as long as it takes).
            on_status: called with every status the leader writes for the job (queued reasons,
                grant, preemption...), from the client's reader thread.

        Returns:
            The granted :class:`Lease`.

        Raises:
            JobAlreadyRunningError: a live job of the same name exists (the message names its lease).
                A lease of this client that was lost (revoked, expired, stepped down) is not
                live: the name can be acquired again at once, without calling ``release()``.
            JobRejectedError: the pool rejected the spec as impossible (the reason says why).
            AcquireTimeoutError: not granted in time; the lease was revoked, nothing is left behind.
            StoreUnavailableError: etcd stayed unreachable until ``timeout`` ran out. Shorter
                outages (an etcd restart, a member election, a fail-over between endpoints) are
                retried with backoff, and a lease lost to one before the grant is replaced by a
                new submission, all within ``timeout``.

        A spec left under the same name by this host's own earlier run (its I/O helper is gone,
        for example after a kill or a release during an etcd outage) is taken over, not an error.
        """
        if not isinstance(spec, JobSpec):
            raise ConfigError("spec", f"expected a JobSpec, got {type(spec).__name__}")
        if timeout is not None and not 0 <= timeout < math.inf:
            raise ConfigError(
                "timeout", f"must be a finite number of seconds >= 0, or None to wait as long as it takes; got {timeout}"
            )
        if spec.is_gang and spec.name not in self._joining:
            return self.join(spec, timeout=timeout, on_status=on_status)
        if not spec.is_gang and spec.node is None:
            # Node-local leasing: a process only ever uses its own machine's GPUs.
            here = self.local_node()
            if here != ANY_NODE:
                spec = replace(spec, node=here)
        if spec.name in self._routes:
            from gpupool_sdk.client.protocol import JobAlreadyRunningError

            raise JobAlreadyRunningError(f"job {spec.name!r} is already held by this client; release() it first")
        self._ensure_helper()
        mine = spec.node or self._joining.get(spec.name) or self.node
        lease = Lease(self, spec, lease_id=0, node="" if mine in (None, ANY_NODE) else mine)
        lease._on_status = on_status
        self._routes[spec.name] = lease
        reporter = self._explain_waiting(lease)
        try:
            # The helper enforces the grant timeout (and revokes); allow it time to answer.
            # (One etcd call in flight at the deadline may still take up to a few timeout_s.)
            wait = None if timeout is None else timeout + self.timeout_s * 6
            result = self._request({"op": "acquire", "spec": spec, "timeout": timeout}, timeout=wait)
        except BaseException as exc:
            self._routes.pop(spec.name, None)
            if not isinstance(exc, GpupoolError):
                # Interrupted (Ctrl-C): make sure the helper drops the half-acquired job.
                with contextlib.suppress(GpupoolError):
                    self._send({"op": "release", "job": spec.name, "id": -1})
            raise
        finally:
            reporter.stop()
        # The helper sent the granted state before this reply, so the lease already holds it.
        lease._granted(int(result["lease_id"]))
        self._leases[spec.name] = lease
        if lease.lost:
            self._forget(lease)  # lost between the grant and here: the name is free again
        return lease

    def _explain_waiting(self, lease: Lease) -> WaitReporter:
        """Log why ``lease``'s job waits (no GPUs, no leader, the PENDING reason) until it is granted."""

        def nodes() -> list[str]:
            return [n.name for n in self._request({"op": "nodes"}, timeout=max(5.0, self.timeout_s))]

        return WaitReporter(lease.job, lambda: lease.status, nodes).start()

    def local_node(self) -> str:
        """The pool node this process runs on (see :mod:`gpupool_sdk.client.node`); found once.

        Raises:
            ConfigError: no agent on this machine names a node, or several do; the message names
                ``GPUPOOL_NODE`` and the agent's runtime directory.
        """
        if self.node:
            return self.node
        from gpupool_sdk.client.node import candidate_dirs, read_agent_files, resolve_node

        dirs = candidate_dirs()
        published = self._request({"op": "nodes"})
        node, how = resolve_node(
            explicit=None,
            env_node=None,
            agent_files=read_agent_files(dirs),
            published=published,
            hostname=socket.gethostname(),
            dirs=[str(d) for d in dirs],
        )
        log.info("this process runs on pool node %s (from %s)", node, how)
        self.node = node
        return node

    def join(
        self,
        spec: JobSpec,
        *,
        node_rank: int | None = None,
        nnodes: int | None = None,
        node: str | None = None,
        timeout: float | None = None,
        on_status: Callable[[JobStatus], None] | None = None,
    ) -> Lease:
        """Join a multi-node gang with this node's part, and wait until the whole gang is granted.

        Call it once per node, from the process that leases the node's GPUs (the launcher's
        local rank 0, or ``gpupool run`` on that node). Every node writes
        ``jobs/{job}/members/{node}`` on its own etcd lease; node rank 0 also submits the spec
        (its lease carries the gang's allocations, status and directives, and it writes the
        acks). The leader grants ``spec.gpus_per_node`` slices on every member's node at once
        when all ``spec.nodes`` members joined, and releases every node when one member leaves:
        the other members' leases are then lost (their launcher restarts them and they join
        again). A preemption directive reaches every member: every node acks it with
        :meth:`Lease.ack` once its ranks stopped (node rank 0 with the checkpoint), and the
        leader releases every node's slices together once all did.

        Args:
            spec: the gang's spec (``nodes`` > 1; ``gpus`` is the total). A one-node spec is
                simply acquired.
            node_rank: this node's rank; default from the launcher's environment
                (:func:`~gpupool_sdk.client.launch.launch_info`: torchrun ``GROUP_RANK``, Slurm
                ``SLURM_NODEID``, Kubeflow ``PET_NODE_RANK``).
            nnodes: nodes the launcher started; default from the environment likewise. Must
                equal ``spec.nodes``.
            node: the pool node this process runs on; default :meth:`local_node`.
            timeout: seconds to wait for the gang's grant (None: as long as it takes).
            on_status: called with every status the leader writes for the job.

        Returns:
            The granted :class:`Lease`: :attr:`Lease.allocations` lists the whole gang,
            :attr:`Lease.visible_devices` this node's GPUs.

        Raises:
            ConfigError: not local rank 0, a node count that differs from ``spec.nodes``, or
                no node found; the message names the variable.
            JobAlreadyRunningError: another process already joined for this node.
            JobRejectedError, AcquireTimeoutError, StoreUnavailableError: as :meth:`acquire`.

        Example:
            >>> spec = JobSpec(name="llm", gpus=16, nodes=2, memory="70GiB")    # doctest: +SKIP
            >>> lease = pool.join(spec, timeout=3600)   # under torchrun, on LOCAL_RANK 0 of each node   # doctest: +SKIP
        """
        from gpupool_sdk.client.launch import launch_info

        if not isinstance(spec, JobSpec):
            raise ConfigError("spec", f"expected a JobSpec, got {type(spec).__name__}")
        if not spec.is_gang:
            return self.acquire(replace(spec, node=spec.node or node), timeout=timeout, on_status=on_status)
        if node_rank is None or nnodes is None:
            info = launch_info(os.environ)
            if not info.leases:
                raise ConfigError(
                    "LOCAL_RANK",
                    f"only local rank 0 of each node joins a gang; this process has local rank {info.local_rank} "
                    "(it uses the devices its node's local rank 0 leased)",
                )
            node_rank = info.node_rank if node_rank is None else node_rank
            nnodes = info.nnodes if nnodes is None else nnodes
        if nnodes != spec.nodes:
            raise ConfigError(
                "nnodes",
                f"the launcher started {nnodes} node(s) but the spec says nodes={spec.nodes}; "
                "start the job on as many nodes as its spec declares (torchrun --nnodes, srun -N)",
            )
        if not 0 <= node_rank < nnodes:
            raise ConfigError("node_rank", f"must be in [0, {nnodes}), got {node_rank}")
        if timeout is not None and not 0 <= timeout < math.inf:
            raise ConfigError("timeout", f"must be a finite number of seconds >= 0, or None; got {timeout}")
        if spec.name in self._routes:
            from gpupool_sdk.client.protocol import JobAlreadyRunningError

            raise JobAlreadyRunningError(f"job {spec.name!r} is already held by this client; release() it first")
        where = node or self.local_node()
        msg = {"op": "member", "spec": spec, "node": where, "node_rank": node_rank, "nnodes": nnodes, "pid": os.getpid()}
        wait = None if timeout is None else timeout + self.timeout_s * 6
        if node_rank == 0:
            self._request({**msg, "follow": False})
            self._joining[spec.name] = where
            try:
                return self.acquire(spec, timeout=timeout, on_status=on_status)
            except BaseException:
                with contextlib.suppress(GpupoolError):
                    self._send({"op": "release", "job": spec.name, "id": -1})  # leave the gang too
                raise
            finally:
                self._joining.pop(spec.name, None)
        lease = Lease(self, spec, lease_id=0, node=where)
        lease._on_status = on_status
        self._routes[spec.name] = lease
        try:
            result = self._request({**msg, "follow": True, "timeout": timeout}, timeout=wait)
        except BaseException as exc:
            self._routes.pop(spec.name, None)
            if not isinstance(exc, GpupoolError):
                with contextlib.suppress(GpupoolError):
                    self._send({"op": "release", "job": spec.name, "id": -1})
            raise
        lease._granted(int(result["lease_id"]))
        self._leases[spec.name] = lease
        if lease.lost:
            self._forget(lease)
        return lease

    def resume_info(self, job: str) -> Checkpoint | None:
        """The last checkpoint the pool recorded for ``job`` (``checkpoints/{job}``), or None."""
        record = self._request({"op": "resume_info", "job": job})
        return record.last_checkpoint if record is not None else None

    def gpus(self, node: str | None = None) -> list[GpuInfo]:
        """The GPU records agents publish (``gpus/{node}/``), of ``node`` or of every node.

        The training-side integration reads its granted GPUs' ``mps_pipe_dir`` here (sharing).
        """
        return list(self._request({"op": "gpus", "node": node}))

    def resume_record(self, job: str) -> Any:
        """The whole :class:`~gpupool_sdk.store.records.ResumeRecord` of ``job``, or None."""
        return self._request({"op": "resume_info", "job": job})

    @property
    def leases(self) -> tuple[Lease, ...]:
        """Leases held by this client now (neither released nor lost)."""
        return tuple(self._leases.values())

    def close(self) -> None:
        """Release every lease and stop the helper. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        for lease in list(self._leases.values()):
            lease.release()
        self._closed = True
        self._telemetry_wake.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(GpupoolError):
                self._send({"op": "close"})
            if self._proc is not None:
                try:
                    # Until it exits, or says it stays on to finish revocations (no point waiting then).
                    deadline = time.monotonic() + self.timeout_s + self.timing.retry_timeout_s + 5
                    while self._proc.poll() is None and not self._helper_revoking:
                        if time.monotonic() > deadline:
                            raise subprocess.TimeoutExpired(self._proc.args, self.timeout_s)
                        time.sleep(0.02)
                except subprocess.TimeoutExpired:
                    pass
                if self._proc.poll() is None:
                    if self._helper_revoking:
                        log.warning("the client's I/O helper (pid %s) keeps retrying revocations etcd could not "
                                    "take; leaving it to finish", self._proc.pid)
                    else:
                        self._proc.kill()
                        self._proc.wait()
            if self._helper_thread is not None:
                self._helper_thread.join(self.timeout_s + 5)
            conn.close()
        _LIVE_CLIENTS.discard(self)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None and getattr(self, "_pid", None) == os.getpid():
            with contextlib.suppress(Exception):
                self._conn.close()
