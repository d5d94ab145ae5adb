"""An elastic Lightning job: one DDP rank per leased slice, resumed mid-epoch at each new world size.

Run it under ``gpupool run`` with torchrun, one rank per slice of the current grant
(``$GPUPOOL_DEVICES``, re-read at every restart)::

    gpupool run --gpus 2 --min-gpus 1 --max-gpus 2 --memory 20GiB -- \\
        sh -c 'exec torchrun --standalone --max-restarts 0 --nproc-per-node "$GPUPOOL_DEVICES" \\
               examples/elastic_lightning_train.py --steps 500 --out model.pt'

When the pool grows or shrinks the job, ``GpuPoolCallback`` makes every rank checkpoint at the
same step, rank 0 acks, the ranks exit 75, and ``gpupool run`` (which keeps the job's lease)
starts torchrun again with the new slice count; ``trainer.fit(ckpt_path=pool.resume_from)``
resumes in the middle of the epoch. The data come from
``ResumableDataLoader(dataset, global_batch_size=G, shuffle=True, seed=S)``: at every world size
``W`` each rank trains on ``G / W`` samples of the same global batch of a world-size-independent
order, and the loader's state (kept in Lightning's checkpoint) is the position in that order, so
the run sees the batches of an uninterrupted run with the same global batch (the default rule of
:mod:`gpupool_sdk.runtime.elastic`, ``keep_global``: same global batch, same learning rate).

``--no-pool`` runs the same training without the pool (``--resume``, ``--stop-at``, ``--save``):
the tests use it to replay by hand the sequence of world sizes the pool chose.

Exit codes: 0 finished, 75 preempted or resized (checkpointed; run it again to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

from gpupool_lightning import GpuPoolCallback, ResumableDataLoader
from gpupool_sdk.runtime.elastic import scaled_lr


class Regressor(pl.LightningModule):
    """A small MLP on fixed synthetic data (``samples`` rows), SGD with momentum."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        torch.manual_seed(args.seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        g = torch.Generator().manual_seed(args.seed)
        self.x = torch.randn(args.samples, 16, generator=g)
        self.y = self.x[:, :1] * 2.0 - self.x[:, 1:2] + 0.1 * torch.randn(args.samples, 1, generator=g)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        # The mean over this rank's G / W samples; DDP averages the ranks: the global batch's mean.
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        world = int(self.trainer.world_size)
        return torch.optim.SGD(self.parameters(), lr=scaled_lr(self.args.lr, world, rule=self.args.rule), momentum=0.9)

    def on_train_start(self) -> None:
        # A resume restored the optimizer with the rate of the world size it was saved at: the
        # rule decides the rate at this one.
        lr = scaled_lr(self.args.lr, int(self.trainer.world_size), rule=self.args.rule)
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def train_dataloader(self) -> ResumableDataLoader:
        # Built here, where the process group exists: the loader reads the world size from it.
        return ResumableDataLoader(TensorDataset(self.x, self.y), global_batch_size=self.args.global_batch,
                                   shuffle=True, seed=self.args.seed, num_workers=self.args.workers)


class Segments(pl.Callback):
    """Prints ``ELASTIC {...}`` lines (rank 0), sleeps per step, stops at ``--stop-at`` or the finish file."""

    def __init__(self, args: argparse.Namespace, pool: GpuPoolCallback | None) -> None:
        self.args, self.pool = args, pool

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            lease = self.pool.lease_id if self.pool is not None else ""
            print("ELASTIC " + json.dumps({"segment": True, "world": trainer.world_size, "start": trainer.global_step,
                                           "lease": lease or ""}), flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)
        if self.args.stop_at is not None and trainer.global_step >= self.args.stop_at:
            if self.args.save:
                trainer.save_checkpoint(self.args.save)  # every rank calls it (rank 0 writes)
            trainer.should_stop = True
        elif self.args.finish_file:
            flag = trainer.is_global_zero and Path(self.args.finish_file).exists()
            if trainer.strategy.broadcast(flag, src=0):  # every rank stops at the same step
                trainer.should_stop = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--samples", type=int, default=72, help="dataset size (several epochs run)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--rule", default="keep_global", help="learning-rate rule on a resize (keep_global, linear)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--finish-file", default=None, help="stop (finished) at the first step boundary where this file exists")
    p.add_argument("--checkpoint-dir", default=os.environ.get("GPUPOOL_CHECKPOINT_DIR", "gpupool-checkpoints"))
    p.add_argument("--out", default=None, help="rank 0 writes the final weights here (torch.save)")
    p.add_argument("--no-pool", action="store_true", help="train without the pool (replays by hand)")
    p.add_argument("--resume", default=None, help="--no-pool: checkpoint to start from")
    p.add_argument("--stop-at", type=int, default=None, help="--no-pool: stop after this step and --save")
    p.add_argument("--save", default=None, help="--no-pool: checkpoint written at --stop-at")
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pool = None
    callbacks: list[Any] = []
    if not args.no_pool:
        pool = GpuPoolCallback(name=args.name, checkpoint_dir=args.checkpoint_dir, allocator="none",
                               telemetry_interval_s=0.5)
        callbacks.append(pool)
    callbacks.append(Segments(args, pool))
    devices = pool.devices if pool is not None else world
    trainer = pl.Trainer(
        accelerator=pool.accelerator if pool is not None else "cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=args.steps,
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Regressor(args)
    trainer.fit(model, ckpt_path=pool.resume_from if pool is not None else args.resume)
    if trainer.is_global_zero:
        print("ELASTIC " + json.dumps({"segment": False, "world": trainer.world_size, "end": trainer.global_step,
                                       "stopped": False}), flush=True)
        if args.out:
            torch.save({"state_dict": model.net.state_dict(), "step": trainer.global_step}, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
