"""Elastic jobs in the runtime: the batch/learning-rate rule, the resize under ``gpupool run`` (the
lease is kept), and a direct lease, which cannot keep its grant across a resize, refused up front.

The live grow/shrink with real processes is ``integrations/lightning/tests/test_elastic_resize.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from testkit import wait_for

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Directive, DirectiveKind, JobSpec
from gpupool_sdk.runtime import GRANT_ENV, PoolRuntime, RuntimeOptions
from gpupool_sdk.runtime.decision import DecisionKind
from gpupool_sdk.runtime.elastic import rank_slice, scaled_lr
from gpupool_sdk.runtime.run_channel import RunChannelServer


@pytest.mark.parametrize(
    ("batch", "world", "rank", "want"),
    [(8, 1, 0, (0, 8)), (8, 2, 0, (0, 4)), (8, 2, 1, (4, 8)), (12, 3, 2, (8, 12))],
)
def test_rank_slices_cover_the_global_batch_once(batch: int, world: int, rank: int, want: tuple[int, int]) -> None:
    assert rank_slice(batch, world, rank) == want
    covered = [i for r in range(world) for i in range(*rank_slice(batch, world, r))]
    assert covered == list(range(batch))


def test_a_global_batch_that_does_not_split_names_the_field_and_a_fix() -> None:
    with pytest.raises(ConfigError, match=r"global_batch: 6 samples cannot be split evenly over 4 ranks") as exc:
        rank_slice(6, 4, 0)
    assert exc.value.field == "global_batch"
    with pytest.raises(ConfigError, match="rank"):
        rank_slice(8, 2, 2)
    with pytest.raises(ConfigError, match="world_size"):
        rank_slice(8, 0, 0)


def test_learning_rate_rules() -> None:
    assert scaled_lr(0.1, 2) == 0.1  # the default keeps the global batch, so the rate stays
    assert scaled_lr(0.1, 4, base_world=2, rule="linear") == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="rule: unknown resize rule 'sqrt'"):
        scaled_lr(0.1, 2, rule="sqrt")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # acquire() exports the grant into os.environ: registered here so that it is undone after the test.
    for var in (*GRANT_ENV, "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK", "PET_NNODES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_an_elastic_job_on_a_direct_lease_is_refused_naming_gpupool_run(clean_env: Any, tmp_path: Path) -> None:
    """A direct lease ends with its process, so a resize (a restart) would lose the grant: refused up front."""
    with pytest.raises(ConfigError, match=r"min_gpus: an elastic job \(min_gpus=1, max_gpus=2\) must run under "
                                          r"`gpupool run --min-gpus 1 --max-gpus 2") as exc:
        PoolRuntime(RuntimeOptions.from_kwargs(gpus=2, memory="1GiB", min_gpus=1, max_gpus=2, name="el",
                                              checkpoint_dir=tmp_path),
                    client=object())
    assert exc.value.field == "min_gpus"
    # A rigid job leases directly as before.
    PoolRuntime(RuntimeOptions(gpus=2, memory="1GiB", name="el", checkpoint_dir=tmp_path), client=object())


class LauncherLease:
    """The launcher's side of a held lease (what RunChannelServer uses), recording acks and releases."""

    job = "el"
    etcd_lease_hex = "694d9a1c2e3b4f10"

    def __init__(self) -> None:
        self.lost = False
        self.lost_reason = ""
        self.directive: Directive | None = None
        self.acks: list[dict[str, Any]] = []
        self.telemetry: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def device_indices(self) -> list[str]:
        return ["0"]

    def poll_directive(self) -> Directive | None:
        with self.lock:
            d, self.directive = self.directive, None
        return d

    def ack(self, directive: Directive, **kw: Any) -> None:
        self.acks.append({"seq": directive.seq, "kind": directive.kind, **kw})

    def publish_telemetry(self, summary: dict[str, Any]) -> None:
        self.telemetry.append(summary)

    def wait_released(self, timeout: float | None = None) -> bool:
        raise AssertionError("a resize under gpupool run never waits for a release")


def test_a_resize_under_gpupool_run_checkpoints_acks_and_keeps_the_lease(clean_env: Any, tmp_path: Path) -> None:
    lease = LauncherLease()
    spec = JobSpec(name="el", gpus=2, min_gpus=1, max_gpus=2, memory="1GiB")
    srv = RunChannelServer(lease, str(tmp_path / "run.sock"), resume_from=None, spec=spec)
    clean_env.setenv("GPUPOOL_RUN_SOCKET", srv.path)
    try:
        rt = PoolRuntime(RuntimeOptions(name="el", checkpoint_dir=tmp_path / "ck"))
        rt.acquire()
        assert rt.spec.is_elastic
        with lease.lock:
            lease.directive = Directive(kind=DirectiveKind.RESIZE, seq=3, deadline=time.time() + 60,
                                        target={"gpus": 2}, reason="grow from 1 to 2")
        wait_for(lambda: rt.inbox.attention, 10.0, what="the resize to reach the script")
        saved: list[str] = []
        sent: list[Any] = []

        def broadcast(obj: Any) -> Any:  # one rank: what rank 0 sends is what every rank gets
            sent.append(obj)
            return obj

        def save(path: str) -> None:
            Path(path).write_text("ckpt")
            saved.append(path)

        dec = rt.step_boundary(lambda: 17, save, broadcast)
        assert dec.kind is DecisionKind.RESIZE and dec.kind.stops and rt.preempted
        # The decision, then the rank barrier after rank 0's ack (torchrun stops the other ranks
        # as soon as one exits: none may exit before the ack).
        assert len(sent) == 2 and sent[0]["kind"] == "resize" and sent[1] is None
        wait_for(lambda: srv.resize_acked.is_set(), 10.0, what="the launcher to see the resize ack")
        assert lease.acks[0]["seq"] == 3 and lease.acks[0]["kind"] is DirectiveKind.RESIZE
        assert lease.acks[0]["step"] == 17 and lease.acks[0]["checkpoint"] == rt.resume_from
        assert Path(rt.resume_from or "").read_text() == "ckpt" and len(saved) == 1
        channel = rt.lease
        rt.close()  # at exit: nothing is released, the launcher keeps the lease for the re-grant
        assert channel is not None
        channel.publish_telemetry({"marker": 1})  # the channel is ordered: a release would arrive first
        wait_for(lambda: lease.telemetry, 10.0, what="the marker to reach the launcher")
        assert not srv.released_by_child.is_set()
    finally:
        srv.close()


class DirectLease:
    """A lease the process holds itself (what ``PoolClient.acquire`` returns), recording what it is asked."""

    job = "el"
    etcd_lease_hex = "5ceda23bdfd11253"
    lost = False
    allocations = ()

    def __init__(self) -> None:
        self.queue: list[Directive] = []
        self.ready = threading.Event()
        self.acks: list[dict[str, Any]] = []
        self.released = False

    def device_indices(self) -> list[str]:
        return []

    def directives(self) -> Any:
        self.ready.wait()
        yield from self.queue

    def add_lost_callback(self, cb: Any) -> None:
        pass

    def ack(self, directive: Directive, **kw: Any) -> None:
        self.acks.append({"seq": directive.seq, "kind": directive.kind, **kw})

    def publish_telemetry(self, summary: Any) -> None:
        pass

    def wait_released(self, timeout: float | None = None) -> bool:
        return True

    def release(self) -> None:
        self.released = True


class DirectClient:
    def __init__(self, lease: DirectLease) -> None:
        self.lease = lease

    def acquire(self, spec: JobSpec, timeout: float | None = None, on_status: Any = None) -> DirectLease:
        assert not spec.is_elastic
        return self.lease

    def resume_info(self, job: str) -> None:
        return None


def test_a_resize_written_by_hand_to_a_direct_lease_is_a_preemption(clean_env: Any, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator never resizes a rigid job; a resize that reaches a direct lease anyway can only
    end with the process (its lease with it): checkpoint, ack, release, stop, with a warning."""
    lease = DirectLease()
    rt = PoolRuntime(RuntimeOptions(memory="1GiB", name="el", checkpoint_dir=tmp_path), client=DirectClient(lease))
    rt.acquire()
    lease.queue.append(Directive(kind=DirectiveKind.RESIZE, seq=5, deadline=time.time() + 60, target={"gpus": 2}))
    lease.ready.set()
    wait_for(lambda: rt.inbox.attention, 10.0, what="the resize to reach the runtime")
    with caplog.at_level("WARNING", logger="gpupool_sdk.runtime"):
        dec = rt.step_boundary(lambda: 4, lambda p: Path(p).write_text("ckpt"))
    assert dec.kind is DecisionKind.RESIZE and rt.preempted
    assert lease.acks and lease.acks[0]["seq"] == 5 and lease.acks[0]["checkpoint"] == rt.resume_from
    assert lease.released
    assert "resize directive on a direct lease; handled as a preemption" in caplog.text
