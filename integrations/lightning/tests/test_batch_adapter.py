"""BatchAdapter: a job whose memory limit is halved keeps training at the same global batch.

Real Lightning Trainers on the CPU; the pool is a FakeLease whose balloon directives are
delivered at chosen steps, the memory tier is the SDK allocator's host backend.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from gpupool_lightning import BatchAdapter, GpuPoolCallback
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Directive, DirectiveKind
from gpupool_torch import ElasticBatchSampler, elastic_dataloader, plan_micro_batch
from integrations.lightning.tests.test_callback_logic import FakeClient, FakeLease

GiB = 1 << 30


# -- the rule and the sampler (no Trainer) ---------------------------------------------------------
@pytest.mark.parametrize(
    ("limit", "base", "micro", "glob", "fixed", "want"),
    [
        (None, GiB, 8, 8, 0, 8),  # no limit: unchanged
        (GiB, GiB, 8, 8, 0, 8),
        (2 * GiB, GiB, 8, 32, 0, 8),  # never above the user's micro-batch
        (GiB // 2, GiB, 8, 8, 0, 4),  # halved
        (GiB // 3, GiB, 8, 8, 0, 2),  # 2.67 -> the divisor below
        (GiB // 2, GiB, 12, 24, 0, 6),
        (GiB // 2, GiB, 12, 36, 0, 6),
        (300, 1000, 12, 24, 100, 2),  # fixed part counted: 12 * 200 / 900 = 2.67 -> 2
        (50, 1000, 12, 24, 100, 1),  # below the fixed part: one sample at a time
        (GiB // 2, None, 8, 8, 0, 8),  # unknown base: unchanged
    ],
)
def test_plan_micro_batch(limit: Any, base: Any, micro: int, glob: int, fixed: int, want: int) -> None:
    assert plan_micro_batch(limit, base, micro, glob, fixed) == want


def test_plan_micro_batch_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="global_batch"):
        plan_micro_batch(1, 2, 3, 8)
    with pytest.raises(ConfigError, match="fixed_bytes"):
        plan_micro_batch(1, 2, 2, 8, fixed_bytes=5)


def test_sampler_switches_only_at_aligned_global_batches() -> None:
    s = ElasticBatchSampler(range(24), global_batch_size=4, micro_batch_size=2)
    assert len(s) == 12 and s.accumulation == 2
    it = iter(s)
    got = [next(it) for _ in range(2)]  # global batch 0: two micro-batches of 2
    s.request(1)  # 4 micro-batches per step: 2 yielded is not a multiple of 4 -> wait
    got += [next(it) for _ in range(2)]
    assert s.pending == 1 and s.switch_at is None
    got += list(it)
    assert s.switch_at == 4 and s.micro_batch_size == 1 and s.accumulation == 4
    assert [len(b) for b in got] == [2, 2, 2, 2] + [1] * 16
    assert sum(got, []) == list(range(24))  # same samples, same order
    assert s.epoch_length_after_switch() == len(got) == 20
    with pytest.raises(ConfigError, match="does not divide"):
        s.request(3)


def test_short_last_global_batch() -> None:
    s = ElasticBatchSampler(range(10), global_batch_size=4, micro_batch_size=2)
    assert [len(b) for b in s] == [2, 2, 2, 2, 2] and len(s) == 5
    s_drop = ElasticBatchSampler(range(10), global_batch_size=4, micro_batch_size=2, drop_last=True)
    assert len(list(s_drop)) == len(s_drop) == 4


# -- a real Trainer ----------------------------------------------------------------------------------
class Regressor(pl.LightningModule):
    """An MLP on fixed synthetic data, fed by an elastic dataloader; records each micro-batch size."""

    def __init__(self, samples: int = 64, global_batch: int = 8, micro: int = 8) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.samples, self.global_batch, self.micro = samples, global_batch, micro
        self.sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.sizes.append(len(x))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(self.samples, 16, generator=g, dtype=torch.float64).float()
        y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(self.samples, 1, generator=g)
        return elastic_dataloader(TensorDataset(x, y), global_batch_size=self.global_batch,
                                  micro_batch_size=self.micro)


class Schedule(pl.Callback):
    """Hands balloon / deflate directives to the pool at the start of chosen optimizer steps."""

    def __init__(self, pool: GpuPoolCallback, at: dict[int, tuple[str, int]]) -> None:
        self.pool, self.at = pool, dict(at)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1
        if step in self.at:
            kind, target = self.at.pop(step)
            self.pool.runtime.inbox.put(Directive(kind=DirectiveKind(kind), seq=step, deadline=time.time() + 60,
                                                  target={"memory_bytes": target}))


def trainer_for(tmp_path: Path, callbacks: list[Any], epochs: int = 2, **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, deterministic=True, **kw)


def uninterrupted(tmp_path: Path) -> Regressor:
    model = Regressor()
    trainer = trainer_for(tmp_path / "base", [])
    trainer.fit(model)
    assert trainer.global_step == 16 and model.sizes == [8] * 16
    return model


def adapted_run(tmp_path: Path, at: dict[int, tuple[str, int]]) -> tuple[Regressor, pl.Trainer, BatchAdapter, Any]:
    lease = FakeLease("adapt")
    pool = GpuPoolCallback(memory="1GiB", name="adapt", client=FakeClient(lease), checkpoint_dir=tmp_path / "ck")
    adapter = BatchAdapter()
    model = Regressor()
    trainer = trainer_for(tmp_path / "run", [pool, adapter, Schedule(pool, at)])
    trainer.fit(model)
    assert not pool.preempted and not lease.released  # no restart: the same process kept its lease
    pool.close()
    return model, trainer, adapter, lease


def assert_same_weights(a: Regressor, b: Regressor) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name


def test_halved_quota_halves_the_micro_batch_and_keeps_the_math(tmp_path: Path) -> None:
    base = uninterrupted(tmp_path)
    model, trainer, adapter, lease = adapted_run(tmp_path, {3: ("balloon", GiB // 2)})
    # The balloon is acked (host tier), training went on without a restart, same number of steps.
    assert [a["ok"] for a in lease.acks] == [True]
    assert trainer.global_step == 16
    assert adapter.micro_batch_size == 4 and adapter.accumulation == 2 and trainer.accumulate_grad_batches == 2
    # Step 3's boundary saw the directive; step 4 had been fetched at the old size; from step 5 on: 2 x 4.
    assert model.sizes == [8] * 4 + [4] * 24
    assert [(c.global_step, c.micro_batch_size, c.accumulation, c.limit_bytes) for c in adapter.changes] == [
        (4, 4, 2, GiB // 2)
    ]
    assert_same_weights(base, model)


def test_deflate_goes_back_to_the_users_micro_batch(tmp_path: Path) -> None:
    base = uninterrupted(tmp_path)
    model, trainer, adapter, lease = adapted_run(tmp_path, {3: ("balloon", GiB // 4), 10: ("deflate", 0)})
    assert [a["ok"] for a in lease.acks] == [True, True] and trainer.global_step == 16
    assert [(c.micro_batch_size, c.accumulation) for c in adapter.changes] == [(2, 4), (8, 1)]
    assert adapter.micro_batch_size == 8 and trainer.accumulate_grad_batches == 1
    assert sum(model.sizes) == 16 * 8 and set(model.sizes) == {2, 8}
    assert_same_weights(base, model)


def test_adapter_needs_an_elastic_dataloader(tmp_path: Path) -> None:
    from gpupool_lightning.demo.job import TinyRegressor

    lease = FakeLease("noelastic")
    pool = GpuPoolCallback(memory="1GiB", name="noelastic", client=FakeClient(lease), checkpoint_dir=tmp_path)
    trainer = trainer_for(tmp_path, [pool, BatchAdapter()], epochs=1)
    with pytest.raises(ConfigError, match="elastic_dataloader"):
        trainer.fit(TinyRegressor(seed=7, samples=16, batch_size=8, num_workers=0, step_sleep=0.0))
    pool.close()


def test_adapter_owns_accumulate_grad_batches(tmp_path: Path) -> None:
    lease = FakeLease("accum")
    pool = GpuPoolCallback(memory="1GiB", name="accum", client=FakeClient(lease), checkpoint_dir=tmp_path)
    trainer = trainer_for(tmp_path, [pool, BatchAdapter()], epochs=1, accumulate_grad_batches=3)
    with pytest.raises(ConfigError, match="accumulate_grad_batches"):
        trainer.fit(Regressor())
    pool.close()


def test_restart_under_a_smaller_quota_starts_at_the_smaller_micro_batch(tmp_path: Path) -> None:
    # A resize is a checkpoint and restart: the restarted job has half the quota (the spec's memory).
    base = uninterrupted(tmp_path)
    lease = FakeLease("resized")
    pool = GpuPoolCallback(memory="1GiB", name="resized", client=FakeClient(lease), checkpoint_dir=tmp_path / "ck")
    first, adapter = Regressor(), BatchAdapter()
    trainer = trainer_for(tmp_path / "a", [pool, adapter], epochs=1)
    trainer.fit(first)
    ckpt = str(tmp_path / "epoch1.ckpt")
    trainer.save_checkpoint(ckpt)
    pool.close()
    assert first.sizes == [8] * 8 and adapter.changes == []

    lease2 = FakeLease("resized")
    pool2 = GpuPoolCallback(memory="512MiB", name="resized", client=FakeClient(lease2),
                            checkpoint_dir=tmp_path / "ck")
    second, adapter2 = Regressor(), BatchAdapter()
    trainer2 = trainer_for(tmp_path / "b", [pool2, adapter2], epochs=2)
    trainer2.fit(second, ckpt_path=ckpt)
    pool2.close()
    assert trainer2.global_step == 16 and second.sizes == [4] * 16
    assert adapter2.micro_batch_size == 4 and trainer2.accumulate_grad_batches == 2
    assert [(c.global_step, c.micro_batch_size, c.limit_bytes) for c in adapter2.changes] == [(8, 4, GiB // 2)]
    assert_same_weights(base, second)
