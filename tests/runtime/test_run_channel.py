"""The gpupool run <-> script channel (pure logic: a fake lease on the launcher side, real Unix sockets)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from testkit import wait_for

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Directive, DirectiveKind
from gpupool_sdk.runtime.run_channel import ChannelLease, RunChannelServer


class FakeLease:
    job = "chan"
    visible_devices = "2,3"
    etcd_lease_hex = "694d9a1c2e3b4f10"

    def device_indices(self) -> list[str]:
        return self.visible_devices.split(",")

    def __init__(self) -> None:
        self.lost = False
        self.lost_reason = ""
        self.directive: Directive | None = None
        self.acks: list[dict[str, Any]] = []
        self.telemetry: list[dict[str, Any]] = []
        self.released = threading.Event()

    def poll_directive(self) -> Directive | None:
        d, self.directive = self.directive, None
        return d

    def ack(self, directive: Directive, **kw: Any) -> None:
        self.acks.append({"seq": directive.seq, **kw})

    def publish_telemetry(self, summary: dict[str, Any]) -> None:
        self.telemetry.append(summary)

    def wait_released(self, timeout: float | None = None) -> bool:
        return self.released.wait(timeout)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    lease = FakeLease()
    srv = RunChannelServer(lease, str(tmp_path / "run.sock"), resume_from="/ck/chan.ckpt")
    yield srv, lease
    srv.close()


def test_grant_directive_ack_release_round_trip(server: Any) -> None:
    srv, lease = server
    child = ChannelLease.connect(srv.path)
    assert child.job == "chan" and child.visible_devices == ["2", "3"] and child.resume_from == "/ck/chan.ckpt"
    lease.directive = Directive(kind=DirectiveKind.PREEMPT, seq=4, deadline=time.time() + 60)
    got = wait_for(child.poll_directive, timeout=10, what="the directive to reach the script")
    assert got.seq == 4 and got.kind is DirectiveKind.PREEMPT
    child.ack(got, step=12, checkpoint="/ck/x.ckpt")
    wait_for(lambda: lease.acks, timeout=10, what="the ack to reach the launcher")
    assert lease.acks == [{"seq": 4, "step": 12, "checkpoint": "/ck/x.ckpt", "reached_bytes": None, "ok": True,
                           "message": ""}]
    assert not child.wait_released(timeout=0.05)
    lease.released.set()
    assert child.wait_released(timeout=10)
    child.publish_telemetry({"step": 12})
    wait_for(lambda: lease.telemetry, timeout=10, what="telemetry to reach the launcher")
    child.release()
    assert srv.released_by_child.wait(10)


def test_lease_loss_reaches_the_script(server: Any) -> None:
    srv, lease = server
    child = ChannelLease.connect(srv.path)
    seen: list[str] = []
    child.add_lost_callback(seen.append)
    lease.lost, lease.lost_reason = True, "revoked"
    wait_for(lambda: child.lost, timeout=10, what="the loss to reach the script")
    assert seen == ["revoked"]


def test_launcher_going_away_counts_as_lost(server: Any) -> None:
    srv, _ = server
    child = ChannelLease.connect(srv.path)
    srv.close()  # what the OS does to the connection when the launcher process dies
    wait_for(lambda: child.lost, timeout=10, what="the script to notice")
    assert "went away" in child.lost_reason


def test_no_launcher_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="GPUPOOL_RUN_SOCKET"):
        ChannelLease.connect(str(tmp_path / "nothing.sock"), timeout=1.0)


def test_script_arguments_that_contradict_the_launcher_are_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11, finding 9: `gpupool run --gpus 1` around a callback that says gpus=2 is refused."""
    from gpupool_sdk.resources import JobSpec
    from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions

    launched = JobSpec(name="chan", gpus=1, memory="30GiB", priority=0)
    srv = RunChannelServer(FakeLease(), str(tmp_path / "run.sock"), resume_from=None, spec=launched)
    from gpupool_sdk.runtime import GRANT_ENV

    # acquire() exports the grant into os.environ: registered here so that it is undone after the test.
    for var in (*GRANT_ENV, "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUPOOL_RUN_SOCKET", srv.path)
    try:
        rt = PoolRuntime(RuntimeOptions(gpus=2, memory="30GiB", name="chan", checkpoint_dir=tmp_path))
        with pytest.raises(ConfigError, match=r"gpus=2.*--gpus.*leased 1") as exc:
            rt.acquire()
        assert exc.value.field == "gpus"
        rt = PoolRuntime(RuntimeOptions(memory="1GiB", name="chan", checkpoint_dir=tmp_path))
        with pytest.raises(ConfigError, match="--memory"):
            rt.acquire()
        # Values left at their defaults (and no memory) follow the launcher: the spec is the launcher's.
        rt = PoolRuntime(RuntimeOptions(name="chan", checkpoint_dir=tmp_path))
        rt.acquire()
        assert rt.spec.memory_bytes == launched.memory_bytes and rt.spec.gpus == 1
        rt.close()
    finally:
        srv.close()
