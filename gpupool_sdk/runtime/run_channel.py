"""The local channel between ``gpupool run`` (which holds the lease) and the training script.

**Decision:** under ``gpupool run`` the launcher, not the script, holds the job's lease. It
listens on a Unix socket (path in ``$GPUPOOL_RUN_SOCKET``, mode 0600, in a private temp dir)
and the script's :class:`GpuPoolCallback` / :class:`PoolSession` connect to it instead of
submitting a second spec. The lease therefore survives the script's exit 75 only as long as
the launcher wants (it releases it and queues again), and a crashing script never leaves a
half-registered job behind. The script side sees a :class:`ChannelLease`, which has the parts of
the client's ``Lease`` interface that a training process uses.

Wire format: one JSON object per line.

* script -> launcher: ``{"op": "hello", "pid": ...}``, ``{"op": "ack", ...}``,
  ``{"op": "telemetry", "summary": {...}}``, ``{"op": "release"}``, ``{"op": "refused", "field",
  "message"}`` (the script's own arguments contradict the launcher's spec: running it again cannot help),
  ``{"op": "stopped", "checkpoint", "reason"}`` (a signal stopped the script at a step boundary, after
  that checkpoint: what the launcher reports, whatever a launcher in between, such as torchrun, exits with).
* launcher -> script: ``{"op": "grant", "job", "visible_devices", "resume_from"}`` (answer to
  hello), ``{"op": "directive", "directive": {...}}``, ``{"op": "released", "ok": bool}``,
  ``{"op": "lost", "reason": str}``.

Only plain sockets and threads are used (no gRPC), so the script may fork DataLoader workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import Directive, DirectiveKind

log = logging.getLogger("gpupool_sdk.runtime.run_channel")


def _send(sock: socket.socket, lock: threading.Lock, obj: dict[str, Any]) -> None:
    data = (json.dumps(obj, default=str) + "\n").encode()
    with lock:
        sock.sendall(data)


def _lines(sock: socket.socket) -> Any:
    buf = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


class ChannelLease:
    """The script's view of a lease held by ``gpupool run`` (see module docstring).

    Not constructed directly: :meth:`connect` dials ``$GPUPOOL_RUN_SOCKET``.
    """

    def __init__(self, sock: socket.socket, grant: dict[str, Any]) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.job: str = grant["job"]
        self.visible_devices: list[str] = [str(x) for x in grant.get("visible_devices", [])]
        self.resume_from: str | None = grant.get("resume_from")
        self.etcd_lease_hex: str = str(grant.get("lease_hex", ""))
        #: The launcher's job spec (``JobSpec.to_dict()``), the source of truth under ``gpupool run``.
        self.spec: dict[str, Any] | None = grant.get("spec")
        self.lost = False
        self.lost_reason = ""
        self._directive: Directive | None = None
        self._queue: queue.Queue[Directive | None] = queue.Queue()
        self._released = threading.Event()
        self._lost_cbs: list[Callable[[str], None]] = []
        self._pid = os.getpid()
        self._reader = threading.Thread(target=self._read, name="gpupool-run-channel", daemon=True)
        self._reader.start()

    @classmethod
    def connect(cls, path: str, timeout: float = 30.0) -> ChannelLease:
        """Connect to the launcher at ``path`` and receive the grant.

        Raises:
            ConfigError: ``$GPUPOOL_RUN_SOCKET`` names no live launcher.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            _send(sock, threading.Lock(), {"op": "hello", "pid": os.getpid()})
            buf = b""
            while b"\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("launcher closed the channel")
                buf += chunk
        except OSError as exc:
            sock.close()
            raise ConfigError(
                "GPUPOOL_RUN_SOCKET",
                f"cannot reach the gpupool run launcher at {path!r} ({exc}); unset it to lease directly",
            ) from exc
        line, rest = buf.split(b"\n", 1)
        grant = json.loads(line)
        if grant.get("op") != "grant":
            sock.close()
            raise GpupoolError(f"gpupool run launcher answered {grant.get('op')!r} instead of a grant")
        sock.settimeout(None)
        lease = cls(sock, grant)
        if rest.strip():
            for ln in rest.split(b"\n"):
                if ln.strip():
                    lease._handle(json.loads(ln))
        return lease

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "directive":
            self._directive = Directive.from_dict(msg["directive"], unknown_ok=True)
            self._queue.put(self._directive)
        elif op == "released":
            self._released.set()
        elif op == "lost":
            self._mark_lost(str(msg.get("reason", "lease lost")))

    def _mark_lost(self, reason: str) -> None:
        if self.lost:
            return
        self.lost_reason = reason
        self.lost = True
        for cb in list(self._lost_cbs):
            try:
                cb(reason)
            except Exception:  # noqa: BLE001
                log.exception("lost callback failed")

    def _read(self) -> None:
        for msg in _lines(self._sock):
            self._handle(msg)
        if not self._released.is_set():
            self._mark_lost("gpupool run launcher went away")
        self._queue.put(None)  # ends directives()

    # -- the JobLease interface (gpupool_sdk.runtime.leases) ------------------------------------
    def device_indices(self) -> list[str]:
        """Local device indices of the grant (for ``CUDA_VISIBLE_DEVICES``)."""
        return list(self.visible_devices)

    def directives(self) -> Iterator[Directive]:
        """Yield directives as the launcher pushes them (blocking); ends when the channel ends."""
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.put(None)
                return
            yield item

    def poll_directive(self) -> Directive | None:
        """The latest directive pushed by the launcher (no I/O)."""
        return self._directive

    def ack(
        self,
        directive: Directive,
        step: int = 0,
        checkpoint: str | None = None,
        reached_bytes: int | None = None,
        ok: bool = True,
        message: str = "",
    ) -> None:
        """Forward an ack to the launcher, which writes it under the job's lease."""
        _send(
            self._sock,
            self._lock,
            {
                "op": "ack",
                "directive": directive.to_dict(),
                "step": step,
                "checkpoint": checkpoint,
                "reached_bytes": reached_bytes,
                "ok": ok,
                "message": message,
            },
        )

    def publish_telemetry(self, summary: Mapping[str, Any]) -> None:
        """Forward a telemetry summary (a local socket write of a few hundred bytes)."""
        with contextlib.suppress(OSError):
            _send(self._sock, self._lock, {"op": "telemetry", "summary": summary})

    def add_lost_callback(self, cb: Callable[[str], None]) -> None:
        self._lost_cbs.append(cb)
        if self.lost:
            cb(self.lost_reason)

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait until the launcher reports the slices taken back after a preempt ack."""
        return self._released.wait(timeout)

    def refuse(self, field: str, message: str) -> None:
        """Tell the launcher the script cannot run on this grant as written (a ``ConfigError`` of ``field``).

        The script exits with the error; the launcher then gives up instead of restarting it.
        """
        with contextlib.suppress(OSError):
            _send(self._sock, self._lock, {"op": "refused", "field": field, "message": message})

    def stopped(self, checkpoint: str, reason: str) -> None:
        """Tell the launcher a signal stopped the script after ``checkpoint`` (no directive to ack)."""
        with contextlib.suppress(OSError):
            _send(self._sock, self._lock, {"op": "stopped", "checkpoint": checkpoint, "reason": reason})

    def release(self) -> None:
        """Tell the launcher this process is done with the lease (it decides what happens next)."""
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(OSError):
            _send(self._sock, self._lock, {"op": "release"})


class RunChannelServer:
    """The launcher side: serves one training process at a time for one held lease.

    Args:
        lease: the client's ``Lease`` for the job.
        path: Unix socket path to listen on.
        resume_from: checkpoint path the script should resume from.
        spec: the launcher's JobSpec (sent to the script, which checks its own arguments against it).
        on_event: called with ``(op, message)`` for acks and telemetry (for the CLI's output).
    """

    def __init__(
        self,
        lease: Any,
        path: str,
        resume_from: str | None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        spec: Any = None,
    ) -> None:
        self.lease = lease
        self.spec = spec
        self.path = path
        self.resume_from = resume_from
        self.on_event = on_event
        self.released_by_child = threading.Event()
        self.preempt_acked = threading.Event()
        #: Set when the script acked a resize: the launcher keeps the lease and waits for the re-grant.
        self.resize_acked = threading.Event()
        self.acked_at = 0.0
        #: The script's ``ConfigError`` (``"field: message"``) when it refused the launcher's spec.
        self.refused: str | None = None
        #: The checkpoint a signal stopped the script after (``stopped``), or None.
        self.stopped_checkpoint: str | None = None
        #: The script's connection ended without a ``release`` (and not because the launcher closed
        #: it): the process died without its exit-time cleanup, by a signal or SIGKILL. A Python
        #: exception still releases (at exit), so this tells a killed script from one that raised.
        self.hung_up = threading.Event()
        self._conn_threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        os.chmod(path, 0o600)
        self._srv.listen(4)
        self._srv.settimeout(0.2)
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        t = threading.Thread(target=self._accept, name="gpupool-run-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), name="gpupool-run-conn", daemon=True)
            t.start()
            self._threads.append(t)
            self._conn_threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        lock = threading.Lock()
        forwarder: threading.Thread | None = None
        greeted = released = False
        try:
            for msg in _lines(conn):
                op = msg.get("op")
                if op == "hello":
                    greeted = True
                    grant = {
                        "op": "grant",
                        "job": self.lease.job,
                        "visible_devices": self.lease.device_indices(),
                        "resume_from": self.resume_from,
                        "lease_hex": self.lease.etcd_lease_hex,
                        "spec": self.spec.to_dict() if self.spec is not None else None,
                    }
                    _send(conn, lock, grant)
                    forwarder = threading.Thread(
                        target=self._forward, args=(conn, lock), name="gpupool-run-fwd", daemon=True
                    )
                    forwarder.start()
                elif op == "ack":
                    d = Directive.from_dict(msg["directive"], unknown_ok=True)
                    self.lease.ack(
                        d,
                        step=int(msg.get("step", 0)),
                        checkpoint=msg.get("checkpoint"),
                        reached_bytes=msg.get("reached_bytes"),
                        ok=bool(msg.get("ok", True)),
                        message=str(msg.get("message", "")),
                    )
                    if self.on_event:
                        self.on_event("ack", msg)
                    self.acked_at = time.time()
                    if d.kind is DirectiveKind.RESIZE:
                        self.resize_acked.set()
                    elif d.kind is DirectiveKind.PREEMPT:
                        self.preempt_acked.set()
                        threading.Thread(
                            target=self._wait_released, args=(conn, lock), name="gpupool-run-rel", daemon=True
                        ).start()
                elif op == "telemetry":
                    self.lease.publish_telemetry(msg.get("summary", {}))
                    if self.on_event:
                        self.on_event("telemetry", msg)
                elif op == "release":
                    released = True
                    self.released_by_child.set()
                elif op == "refused":
                    self.refused = str(msg.get("message") or msg.get("field") or "refused")
                elif op == "stopped":
                    self.stopped_checkpoint = str(msg.get("checkpoint") or "") or None
            if greeted and not released and not self._stop.is_set():
                self.hung_up.set()
        finally:
            conn.close()

    def _wait_released(self, conn: socket.socket, lock: threading.Lock) -> None:
        ok = bool(self.lease.wait_released(timeout=60.0))
        with contextlib.suppress(OSError):
            _send(conn, lock, {"op": "released", "ok": ok})

    def _forward(self, conn: socket.socket, lock: threading.Lock) -> None:
        last_seq = -1
        lost_sent = False
        while not self._stop.is_set():
            try:
                if not lost_sent and self.lease.lost:
                    _send(conn, lock, {"op": "lost", "reason": str(self.lease.lost_reason or "lease lost")})
                    lost_sent = True
                d = self.lease.poll_directive()
                if d is not None and d.seq != last_seq:
                    last_seq = d.seq
                    _send(conn, lock, {"op": "directive", "directive": d.to_dict()})
                    if self.on_event:
                        self.on_event("directive", d.to_dict())
            except OSError:
                return
            time.sleep(0.02)

    def wait_hang_ups(self, timeout: float) -> None:
        """Once the script exited: wait (at most ``timeout`` s) until its connections are read to their end.

        The kernel closed a dead script's socket; what it sent before (a release, a checkpoint) is
        read first, so :attr:`hung_up` and :attr:`stopped_checkpoint` are final afterwards. A
        process the script left behind may hold the socket open: then the wait ends at ``timeout``.
        """
        deadline = time.monotonic() + timeout
        for t in list(self._conn_threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop serving, close every connection (the script sees the launcher go) and remove the socket file."""
        self._stop.set()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        try:
            self._srv.close()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

