"""The demo's training job (``python -m gpupool_sdk.demo.job``): a small Lightning job on the pool.

Same as ``examples/lightning_train.py``, shipped inside the package so ``gpupool demo`` works
from an installed wheel.

Run it against a pool (``gpupool demo`` starts one; or etcd + coordinator + agent)::

    python examples/lightning_train.py --name tiny --memory 1GiB --epochs 3
    gpupool run --memory 1GiB -- python examples/lightning_train.py --epochs 3   # re-runs after preemption

Exit codes: 0 finished, 75 preempted (checkpointed; run it again to resume), other: failed.
Deterministic for a fixed ``--seed`` (the tests compare an interrupted run with an uninterrupted one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from gpupool_sdk.integrations.lightning import GpuPoolCallback, ResumableDataLoader


class TinyRegressor(pl.LightningModule):
    """A two-layer MLP on synthetic data; ``step_sleep`` stands in for real GPU work."""

    def __init__(self, seed: int, samples: int, batch_size: int, num_workers: int, step_sleep: float) -> None:
        super().__init__()
        self.seed, self.samples, self.batch_size = seed, samples, batch_size
        self.num_workers, self.step_sleep = num_workers, step_sleep
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> ResumableDataLoader:
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, 16, generator=g)
        y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(self.samples, 1, generator=g)
        kwargs: dict[str, Any] = {}
        if self.num_workers:
            kwargs["multiprocessing_context"] = "fork"
        return ResumableDataLoader(
            TensorDataset(x, y), batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers, **kwargs
        )


class _Progress(pl.Callback):
    """Prints one machine-readable line when training starts (``gpupool demo`` reads it)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            print("GPUPOOL_PROGRESS " + json.dumps({"event": "train_start", "step": trainer.global_step}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None, help="job name (default: $GPUPOOL_JOB or the script name)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--memory", default="1GiB")
    p.add_argument("--qos", default="shared")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend work per step")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--checkpoint-dir", default=os.environ.get("GPUPOOL_CHECKPOINT_DIR", "gpupool-checkpoints"))
    p.add_argument("--strategy", default="auto", help="Lightning strategy (e.g. ddp for one process per slice)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when the leased GPUs are real")
    p.add_argument("--progress", action="store_true", help="print GPUPOOL_PROGRESS lines (for gpupool demo)")
    p.add_argument("--out", default=None, help="write final weights and step count here (torch.save)")
    args = p.parse_args(argv)

    pool = GpuPoolCallback(
        gpus=args.gpus,
        memory=args.memory,
        qos=args.qos,
        priority=args.priority,
        name=args.name,
        checkpoint_dir=args.checkpoint_dir,
        allocator="none",
        telemetry_interval_s=1.0,
    )
    torch.manual_seed(args.seed)
    model = TinyRegressor(args.seed, args.samples, args.batch_size, args.num_workers, args.step_sleep)
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else pool.accelerator,
        devices=pool.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=[pool, _Progress()] if args.progress else [pool],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.checkpoint_dir,
    )
    trainer.fit(model, ckpt_path=pool.resume_from)
    if pool.preempted:
        print(f"GPUPOOL_PREEMPTED rank={trainer.global_rank} step={trainer.global_step}", flush=True)
    if trainer.is_global_zero:
        result = {
            "job": pool.job,
            "global_step": trainer.global_step,
            "preempted": pool.preempted,
            "preemptions": pool.preemptions,
            "lease_generation": pool.lease_generation,
            "resumed_from": pool.resume_from,
            "checkpoint": pool.last_checkpoint,
            "phases": pool.phase_timer.lifetime(),
        }
        print("GPUPOOL_RESULT " + json.dumps(result), flush=True)
        if args.out and not pool.preempted:
            torch.save({"state_dict": model.state_dict(), "global_step": trainer.global_step}, args.out)
    pool.exit_if_preempted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
