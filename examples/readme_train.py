"""The README's Lightning script, as a user writes it: fit, then save the model, nothing else.

No ``exit_if_preempted``, no pool-specific code after ``fit``: a preempted (or SIGTERM'd) run
exits 75 right after its checkpoint, so the save below only ever runs for a finished model.
``EarlyStopping(strict=True)`` and ``ModelCheckpoint(monitor=...)`` sit beside the callback.

Usage::

    python examples/readme_train.py --name demo --memory 1GiB --out model.pt
    gpupool run --memory 1GiB -- python examples/readme_train.py --out model.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import TensorDataset

from gpupool_lightning import GpuPoolCallback, ResumableDataLoader


class Regressor(pl.LightningModule):
    """A small MLP on fixed synthetic data, with a validation loop that logs ``val_loss``."""

    def __init__(self, step_sleep: float, crash_at: int, crash_marker: str | None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.step_sleep, self.crash_at, self.crash_marker = step_sleep, crash_at, crash_marker
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x[:, :1] - 0.5 * self.x[:, 1:2] + 0.05 * torch.randn(256, 1, generator=g)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.crash_at and self.global_step == self.crash_at and self.crash_marker:
            marker = Path(self.crash_marker)
            if not marker.exists():  # crash once: the restart resumes and goes on
                marker.write_text("crashed")
                raise RuntimeError(f"injected crash at step {self.global_step}")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(TensorDataset(self.x[:192], self.y[:192]), batch_size=8)

    def val_dataloader(self) -> ResumableDataLoader:
        return ResumableDataLoader(TensorDataset(self.x[192:], self.y[192:]), batch_size=16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--name", default=None)
    p.add_argument("--memory", default=None, help="memory per slice (under gpupool run: its --memory)")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--num-nodes", type=int, default=1, help="nodes of a multi-node run (torchrun --nnodes)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--crash-at", type=int, default=0, help="raise once at this global step (restart tests)")
    p.add_argument("--crash-marker", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    pool = GpuPoolCallback(memory=args.memory, name=args.name, priority=args.priority, telemetry_interval_s=0.5)
    ckdir = os.environ.get("GPUPOOL_CHECKPOINT_DIR", "gpupool-checkpoints")
    torch.manual_seed(0)
    model = Regressor(args.step_sleep, args.crash_at, args.crash_marker)
    trainer = pl.Trainer(
        accelerator=pool.accelerator,
        devices=pool.devices,
        num_nodes=args.num_nodes,
        strategy="ddp" if args.num_nodes > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[
            pool,
            EarlyStopping(monitor="val_loss", patience=100, strict=True),
            # In {checkpoint_dir}/{job}/ with save_last: its last.ckpt is a resume point too (after a crash).
            ModelCheckpoint(dirpath=Path(ckdir) / pool.job, monitor="val_loss", save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, ckpt_path=pool.resume_from)
    if trainer.is_global_zero:
        torch.save({"global_step": trainer.global_step, "state_dict": model.state_dict()}, args.out)
        print(f"SAVED step={trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
