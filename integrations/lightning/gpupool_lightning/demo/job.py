"""The demo's training job (``python -m gpupool_lightning.demo.job``): a small Lightning job on the pool.

``examples/lightning_train.py`` with ``--cpu`` and ``--progress``, shipped inside the package so
``gpupool demo`` works from an installed wheel. Both scripts use the pieces defined here:
:class:`TinyRegressor` (the model and its synthetic data), :func:`job_arguments` (their command
line) and :func:`report_result` (the lines that ``gpupool demo`` and the tests read).

Run it against a pool (``gpupool demo`` starts one; or etcd + coordinator + agent)::

    python -m gpupool_lightning.demo.job --name tiny --memory 1GiB --epochs 3
    gpupool run --memory 1GiB -- python -m gpupool_lightning.demo.job --epochs 3   # re-runs after preemption

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

from gpupool_lightning import GpuPoolCallback, ResumableDataLoader
from gpupool_sdk.runtime import CKPT_DIR_ENV


class TinyRegressor(pl.LightningModule):
    """A two-layer MLP on synthetic data; ``step_sleep`` stands in for real GPU work.

    The pretend work is split as a real step's would be, so the phase breakdown that ``gpupool
    top`` and the demo summary show has something to show: a third in the forward pass, half in
    the backward pass and the rest in the optimizer step.

    The data (``samples`` rows of 16 features, a noisy linear target) is drawn from ``seed``, and
    the loader is a :class:`~gpupool_lightning.ResumableDataLoader`, so a run
    resumed from a preemption checkpoint sees the same batches as an uninterrupted one.

    Example:
        >>> model = TinyRegressor(seed=7, samples=64, batch_size=8, num_workers=0, step_sleep=0.0)
        >>> len(model.train_dataloader())
        8
    """

    def __init__(self, seed: int, samples: int, batch_size: int, num_workers: int, step_sleep: float) -> None:
        super().__init__()
        self.seed, self.samples, self.batch_size = seed, samples, batch_size
        self.num_workers, self.step_sleep = num_workers, step_sleep
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep / 3)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().backward(loss, *args, **kwargs)
        if self.step_sleep:
            time.sleep(self.step_sleep / 2)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.step_sleep:
            time.sleep(self.step_sleep / 6)

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


def job_arguments(description: str | None = None) -> argparse.ArgumentParser:
    """The command line of the example jobs: the slice to ask for, the training run, where results go.

    Example:
        >>> job_arguments().parse_args(["--memory", "2GiB"]).memory
        '2GiB'
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None, help="job name (default: $GPUPOOL_JOB or the script name)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--memory", default=None, help="memory per slice, e.g. 1GiB (under gpupool run: its --memory)")
    p.add_argument("--qos", default="shared")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of pretend work per step")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--checkpoint-dir", default=os.environ.get(CKPT_DIR_ENV, "gpupool-checkpoints"))
    p.add_argument("--strategy", default="auto", help="Lightning strategy (e.g. ddp for one process per slice)")
    p.add_argument("--out", default=None, help="write final weights and step count here (torch.save)")
    return p


def report_result(pool: GpuPoolCallback, trainer: pl.Trainer, model: pl.LightningModule, out: str | None) -> None:
    """Print how the run ended, for ``gpupool demo`` and the tests; save the final weights to ``out``.

    Every preempted rank prints ``GPUPOOL_PREEMPTED rank=R step=S``; rank 0 prints
    ``GPUPOOL_RESULT {json}`` (job, steps, preemptions, lease generation, checkpoints, phase
    totals) and, when the run finished, writes ``{"state_dict", "global_step"}`` to ``out``.
    """
    if pool.preempted:
        print(f"GPUPOOL_PREEMPTED rank={trainer.global_rank} step={trainer.global_step}", flush=True)
    if not trainer.is_global_zero:
        return
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
    if out and not pool.preempted:
        torch.save({"state_dict": model.state_dict(), "global_step": trainer.global_step}, out)


def main(argv: list[str] | None = None) -> int:
    p = job_arguments(__doc__)
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when the leased GPUs are real")
    p.add_argument("--progress", action="store_true", help="print GPUPOOL_PROGRESS lines (for gpupool demo)")
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
        exit_on_preempt=False,  # fit returns after a preemption: the result line is printed first
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
    report_result(pool, trainer, model, args.out)
    pool.exit_if_preempted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
