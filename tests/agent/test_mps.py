"""MPS in the agent: the control daemon started, published on the GPUs, stopped at SIGTERM (fake control program)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import wait_for

from gpupool_sdk.agent.mps import MpsBackend, MpsDaemon, with_mps
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.base import simulated_backends
from gpupool_sdk.resources import GpuInfo
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

# Stands in for nvidia-cuda-mps-control: "-d" starts a background process and writes its pid
# into $CUDA_MPS_PIPE_DIRECTORY as the real daemon does; "quit" on stdin stops it.
FAKE = """#!/bin/sh
if [ "$1" = "-d" ]; then
  sleep 3600 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
  echo "-d $CUDA_MPS_PIPE_DIRECTORY" >> "$CUDA_MPS_LOG_DIRECTORY/calls"
  exit 0
fi
read cmd
if [ "$cmd" = "quit" ]; then
  kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"
  echo quit >> "$CUDA_MPS_LOG_DIRECTORY/calls"
fi
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "nvidia-cuda-mps-control"
    exe.write_text(FAKE)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our child's child, reaped by init later) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_daemon_start_adopt_stop(tmp_path: Path, fake_bin: Path) -> None:
    d = MpsDaemon(tmp_path / "mps", binary=str(fake_bin / "nvidia-cuda-mps-control"))
    assert not d.running()
    d.start()
    pid = int((d.pipe_dir / "nvidia-cuda-mps-control.pid").read_text())
    assert d.running() and _alive(pid)
    again = MpsDaemon(tmp_path / "mps", binary=str(fake_bin / "nvidia-cuda-mps-control"))
    again.start()  # adopts the running one, starts nothing
    assert not again.started and (d.log_dir / "calls").read_text().count("-d") == 1
    again.stop()  # not ours: left running
    assert _alive(pid)
    d.stop()
    wait_for(lambda: not _alive(pid), what="the daemon to quit")


def test_with_mps_modes(tmp_path: Path, fake_bin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (sim,) = simulated_backends("2xA100-80GB", default_node="n")
    assert with_mps(sim, "off") is sim
    assert with_mps(sim, "auto") is sim  # simulated GPUs: no MPS unless asked
    ext = with_mps(sim, "auto", pipe_dir="/run/mps-by-ops")
    assert isinstance(ext, MpsBackend) and ext.daemon is None
    assert {g.mps_pipe_dir for g in ext.gpus()} == {"/run/mps-by-ops"}
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control is not on the PATH"):
        with_mps(sim, "on", base_dir=str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="not a mode"):
        with_mps(sim, "sometimes")
    monkeypatch.setenv("PATH", f"{fake_bin}:/usr/bin:/bin")
    wrapped = with_mps(sim, "on", base_dir=str(tmp_path / "mps"))
    assert isinstance(wrapped, MpsBackend) and wrapped.daemon is not None and wrapped.daemon.started
    assert {g.mps_pipe_dir for g in wrapped.gpus()} == {str(tmp_path / "mps" / "pipe")}
    pid = int((tmp_path / "mps" / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    wrapped.close()
    wait_for(lambda: not _alive(pid), what="the daemon to quit with the backend")


def test_mig_instances_get_no_mps(tmp_path: Path) -> None:
    (sim,) = simulated_backends("1xA100-80GB:mig=3g.40gb+3g.40gb", default_node="n")
    assert all(g.mps_pipe_dir is None for g in MpsBackend(sim, "/p").gpus())


def test_agent_process_publishes_mps_and_stops_the_daemon(
    etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace, tmp_path: Path, fake_bin: Path
) -> None:
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "XDG_RUNTIME_DIR": str(tmp_path / "run"),
           "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "agent.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "agent", "--node", "mps-node", "--simulate", "2xA100-80GB",
         "--mps", "on", "--endpoints", etcd_endpoint, "--prefix", keyspace.prefix, "--ttl", "5"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    pipe = tmp_path / "run" / "gpupool-mps" / "mps-node" / "pipe"
    try:
        def published() -> list[GpuInfo]:
            recs = [g for g, _ in store.list_records(keyspace.gpus_prefix("mps-node"), GpuInfo)]
            return recs if len(recs) == 2 else []

        gpus = wait_for(published, timeout=120, what="the agent's GPUs")
        assert {g.mps_pipe_dir for g in gpus} == {str(pipe)}
        pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
        assert _alive(pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_for(lambda: not _alive(pid), what="the MPS daemon to quit with the agent")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        if (pipe / "nvidia-cuda-mps-control.pid").exists():
            pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
