"""Helpers shared by the harnesses that run real processes (``scenarios/``, ``integrations/``).

``tests/`` is on ``sys.path`` (its ``conftest.py`` puts it there), so ``from testkit import ...``
works from any test folder; ``from conftest import ...`` would not, because several folders have
a ``conftest`` module and the first one imported wins.

* ``wait_for``: poll a condition with a generous bound, failing with what was awaited.
* ``dump_logs_if_failed``: print the tail of the process logs of a failed test (needs the
  ``pytest_runtest_makereport`` hook of ``tests/conftest.py``).
* ``stop_groups``: SIGTERM the process groups of processes started with
  ``start_new_session=True``, then SIGKILL the ones still there after a grace period.
* ``start_gpupool_etcd``: ``gpupool etcd`` in the foreground on free ports (picked again when a
  parallel test takes one first).
* ``mps_control_daemon``: a real CUDA MPS control daemon for a GPU test (skips without one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy (and return it); fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def dump_logs_if_failed(request: pytest.FixtureRequest, log_dir: Path, tail_chars: int = 5000) -> None:
    """Print the tail of every ``*.log`` in ``log_dir`` when the test's call phase failed."""
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for f in sorted(log_dir.glob("*.log")):
            sys.stderr.write(f"\n----- {f.name} (tail) -----\n{f.read_text(errors='replace')[-tail_chars:]}\n")


def stop_groups(procs: Sequence[subprocess.Popen[Any]], grace_s: float = 10.0) -> None:
    """SIGTERM every live process group in ``procs`` (last started first), wait ``grace_s`` each, SIGKILL the rest."""
    for p in reversed(procs):
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def start_gpupool_etcd(
    args: Sequence[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int, str]:
    """``gpupool etcd`` on two free ports, picked again while another process takes one first.

    The ports are free when picked, but a parallel test may bind one before etcd does; the command
    then refuses with "already in use" (the operator's contract), and only that is retried here.
    Returns the running process, its client port and the first line it printed ("... ready on ...").
    """
    from gpupool_sdk.store.launcher import free_port

    root = Path(__file__).resolve().parents[1]
    for _ in range(5):
        port, peer = free_port(), free_port()
        if port == peer:
            continue
        p = subprocess.Popen(
            [sys.executable, "-m", "gpupool_sdk.cli.main", "etcd", "--port", str(port), "--peer-port", str(peer), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
        )  # fmt: skip
        assert p.stdout is not None and p.stderr is not None
        first = p.stdout.readline()
        if "ready on" in first:
            return p, port, first
        p.wait(30)
        err = p.stderr.read()
        assert "already in use" in err, (first, err)
    raise AssertionError("no two free ports stayed free long enough for etcd to bind them")


def publish_gpus(store: Any, gpus: Sequence[Any], lease: int | None = None, ttl_s: int = 600) -> int:
    """Publish ``gpus`` (``GpuInfo``) as an agent would: each node key and its GPUs on one lease.

    The coordinator acts only on GPUs whose node key is present on the same lease (issue 12), so a
    test that writes GPUs by hand writes the node keys too. Returns the lease (granted when None).
    """
    from gpupool_sdk.resources import NodeInfo

    if lease is None:
        lease = store.grant_lease(ttl_s)
    counts: dict[str, int] = {}
    for g in gpus:
        store.put(store.keys.gpu(g.node, g.uuid), g, lease=lease)
        counts[g.node] = counts.get(g.node, 0) + 1
    for node, n in counts.items():
        info = NodeInfo(name=node, hostname="test", agent_pid=os.getpid(), gpu_count=n, backend="simulated",
                        started_at=time.time())
        store.put(store.keys.node(node), info, lease=lease)
    return lease


def build_fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """Compile ``tests/memory/fake_cudart.c`` (a libcudart stand-in for CPU tests); skip without a C compiler.

    Returns:
        ``(path, ctypes.CDLL)`` of the built library.
    """
    import ctypes
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    source = Path(__file__).resolve().parent / "memory" / "fake_cudart.c"
    out = tmp_path_factory.mktemp("fake_cudart") / "libcudart_fake.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.fake_set_limit.argtypes = [ctypes.c_longlong]
    lib.fake_in_use.restype = ctypes.c_longlong
    return str(out), lib


@contextlib.contextmanager
def loop_in_thread(loop: Any) -> Iterator[None]:
    """Run ``loop.run()`` (a coordinator's, an agent's) in a daemon thread; ``stop()`` it and join on exit.

    Fails the test when the loop does not end within 20 s of its ``stop()``.
    """
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    try:
        yield
    finally:
        loop.stop()
        t.join(20)
        assert not t.is_alive(), f"{loop!r} did not stop within 20 s"


@contextlib.contextmanager
def mps_control_daemon(tmp_path: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """A real CUDA MPS control daemon on pipe and log folders under ``tmp_path``, quit on exit.

    Yields ``(pipe_dir, log_dir, env)``, ``env`` being ``os.environ`` with the daemon's
    ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``. Skips the test where there is no CUDA
    GPU, no ``nvidia-cuda-mps-control``, or the daemon does not start.
    """
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    log.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if started.returncode != 0:
        pytest.skip(f"cannot start an MPS control daemon here: {started.stderr.strip()}")
    try:
        yield str(pipe), str(log), env
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
