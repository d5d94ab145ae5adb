"""GpuPoolCallback logic with a fake lease (pure unit tests; the real pool is in test_preempt_resume.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from gpupool_lightning import GpuPoolCallback, PoolLeaseLostError
from gpupool_lightning.demo.job import TinyRegressor
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Checkpoint, Directive, DirectiveKind


class FakeLease:
    def __init__(self, job: str, directive_at_poll: int | None = None, kind: str = "preempt") -> None:
        self.job = job
        self.visible_devices = ["0"]
        self.lost = False
        self.lost_reason = ""
        self.polls = 0
        self.directive_at_poll = directive_at_poll
        self.kind = kind
        self.acks: list[dict[str, Any]] = []
        self.telemetry: list[dict[str, Any]] = []
        self.released = False

    def poll_directive(self) -> Directive | None:
        self.polls += 1
        if self.directive_at_poll is not None and self.polls >= self.directive_at_poll:
            return Directive(kind=DirectiveKind(self.kind), seq=3, deadline=time.time() + 60, target={"memory_bytes": 0})
        return None

    def ack(self, directive: Directive, **kw: Any) -> None:
        self.acks.append({"seq": directive.seq, **kw})

    def publish_telemetry(self, summary: dict[str, Any]) -> None:
        self.telemetry.append(summary)

    def wait_released(self, timeout: float | None = None) -> bool:
        return True

    def release(self) -> None:
        self.released = True


class FakeClient:
    def __init__(self, lease: FakeLease, resume: str | None = None) -> None:
        self.lease = lease
        self.resume = resume
        self.specs: list[Any] = []

    def acquire(self, spec: Any, timeout: float | None = None, on_status: Any = None) -> FakeLease:
        self.specs.append(spec)
        return self.lease

    def resume_info(self, job: str) -> Checkpoint | None:
        return Checkpoint(path=self.resume, step=0, at=0.0) if self.resume else None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_DEVICES", "GPUPOOL_RESUME_FROM", "GPUPOOL_JOB",
                "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def fit(pool: GpuPoolCallback, tmp_path: Path, ckpt: str | None = None, epochs: int = 2) -> tuple[pl.Trainer, Any]:
    torch.manual_seed(7)
    model = TinyRegressor(seed=7, samples=64, batch_size=8, num_workers=0, step_sleep=0.0)
    trainer = pl.Trainer(
        accelerator=pool.accelerator, devices=pool.devices, max_epochs=epochs, callbacks=[pool], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(model, ckpt_path=ckpt)
    return trainer, model


def test_preempt_checkpoints_acks_stops_and_resume_matches(tmp_path: Path) -> None:
    base_pool = GpuPoolCallback(memory="1GiB", name="base", client=FakeClient(FakeLease("base")), checkpoint_dir=tmp_path)
    base_trainer, base_model = fit(base_pool, tmp_path)
    assert base_trainer.global_step == 16

    lease = FakeLease("job", directive_at_poll=5)
    pool = GpuPoolCallback(memory="1GiB", name="job", client=FakeClient(lease), checkpoint_dir=tmp_path / "ck")
    trainer, _ = fit(pool, tmp_path)
    assert pool.preempted and lease.released
    assert trainer.global_step == 5
    assert lease.acks == [{"seq": 3, "step": 5, "checkpoint": pool.last_checkpoint, "ok": True, "message": "checkpointed"}]
    assert Path(pool.last_checkpoint).exists()
    with pytest.raises(SystemExit) as exc:
        pool.exit_if_preempted()
    assert exc.value.code == 75

    lease2 = FakeLease("job")
    pool2 = GpuPoolCallback(memory="1GiB", name="job", client=FakeClient(lease2, resume=pool.last_checkpoint),
                            checkpoint_dir=tmp_path / "ck")
    assert pool2.resume_from == pool.last_checkpoint
    trainer2, model2 = fit(pool2, tmp_path, ckpt=pool2.resume_from)
    assert trainer2.global_step == 16
    assert pool2.preemptions == 1 and pool2.lease_generation == 2
    for a, b in zip(base_model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.allclose(a, b)
    assert pool2.phase_timer.lifetime()["steps"] == 16


def test_lease_loss_raises_after_emergency_checkpoint(tmp_path: Path) -> None:
    lease = FakeLease("lost")
    pool = GpuPoolCallback(memory="1GiB", name="lost", client=FakeClient(lease), checkpoint_dir=tmp_path)
    lease.lost, lease.lost_reason = True, "revoked by coordinator"
    with pytest.raises(PoolLeaseLostError, match="revoked by coordinator") as exc:
        fit(pool, tmp_path)
    assert exc.value.emergency_checkpoint and Path(exc.value.emergency_checkpoint).exists()


def test_telemetry_is_published_with_phases(tmp_path: Path) -> None:
    lease = FakeLease("tele")
    pool = GpuPoolCallback(memory="1GiB", name="tele", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           telemetry_interval_s=0.001)
    fit(pool, tmp_path, epochs=1)
    assert lease.telemetry
    last = lease.telemetry[-1]
    assert last["job"] == "tele" and last["step"] > 0
    assert set(last["phase_fraction"]) == {"data", "forward", "backward", "optimizer", "checkpoint", "other"}
    life = pool.phase_timer.lifetime()["phase_s"]
    assert life["forward"] > 0 and life["backward"] > 0 and life["optimizer"] > 0


def test_balloon_directive_is_acked_with_reached_bytes(tmp_path: Path) -> None:
    lease = FakeLease("bal", directive_at_poll=2, kind="balloon")
    pool = GpuPoolCallback(memory="1GiB", name="bal", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           allocator="torch")
    trainer, _ = fit(pool, tmp_path, epochs=1)
    assert trainer.global_step == 8 and not pool.preempted
    assert len(lease.acks) == 1
    ack = lease.acks[0]
    assert ack["step"] == 2 and ack["reached_bytes"] is not None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory": None}, "memory"),
        ({"memory": "1GiB", "allocator": "jemalloc"}, "allocator"),
        ({"memory": "1GiB", "check_every_n_steps": 0}, "check_every_n_steps"),
        ({"memory": "1GiB", "telemetry_interval_s": -1}, "telemetry_interval_s"),
        ({"memory": "1GiB", "gpus": 0}, "gpus"),
        ({"memory": "1GiB", "name": "Bad Name"}, "name"),
        ({"memory": "lots"}, "memory"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GpuPoolCallback(client=FakeClient(FakeLease("x")), **kwargs)
    assert exc.value.field == field


def test_follower_rank_reads_rank0_grant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="GPUPOOL_LEASED"):
        GpuPoolCallback(memory="1GiB", name="f", checkpoint_dir=tmp_path)
    monkeypatch.setenv("GPUPOOL_LEASED", "1")
    monkeypatch.setenv("GPUPOOL_DEVICES", "2")
    monkeypatch.setenv("GPUPOOL_RESUME_FROM", "/x.ckpt")
    pool = GpuPoolCallback(memory="1GiB", name="f", checkpoint_dir=tmp_path)
    assert pool.devices == 2 and pool.resume_from == "/x.ckpt" and pool.runtime.lease is None


@pytest.mark.gpu
def test_cuda_events_time_device_phases_on_a_gpu(tmp_path: Path) -> None:
    lease = FakeLease("gpu")
    pool = GpuPoolCallback(memory="1GiB", name="gpu", client=FakeClient(lease), checkpoint_dir=tmp_path)
    assert pool.accelerator == "gpu"
    fit(pool, tmp_path, epochs=1)
    assert pool.phase_timer.uses_cuda_events
    life = pool.phase_timer.lifetime()
    assert life["steps"] >= 1 and life["phase_s"]["forward"] > 0


def test_directive_check_between_directives_reads_a_flag(tmp_path: Path) -> None:
    from gpupool_sdk.runtime.runtime import PoolRuntime

    class WatchedLease(FakeLease):
        def __init__(self, job: str) -> None:
            super().__init__(job)
            import queue

            self.q: queue.Queue[Directive] = queue.Queue()
            self.lost_cbs: list[Any] = []

        def add_lost_callback(self, cb: Any) -> None:
            self.lost_cbs.append(cb)

        def directives(self) -> Any:
            while True:
                yield self.q.get()

    lease = WatchedLease("w")
    rt = PoolRuntime(memory="1GiB", name="w", client=FakeClient(lease), checkpoint_dir=tmp_path)
    rt.acquire()
    try:
        for _ in range(100):
            assert rt.decide().kind is None
        assert lease.polls == 0  # no queue call between directives
        lease.q.put(Directive(kind=DirectiveKind.BALLOON, seq=4, deadline=0.0, target={"memory_bytes": 1}))
        lease.q.put(Directive(kind=DirectiveKind.PREEMPT, seq=5, deadline=0.0))
        deadline = time.monotonic() + 5
        while len(rt._inbox) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rt.decide().kind == "balloon"
        assert rt.decide().kind == "preempt"  # the flag stays up while the inbox holds more
        assert rt.decide().kind is None
        for cb in lease.lost_cbs:
            cb("revoked")
        assert rt.lease_lost() and rt.decide().kind == "lost"
        assert rt.decide().kind == "lost"
    finally:
        rt.close()
