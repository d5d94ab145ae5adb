"""A Lightning job on the CPU for the time-slicing tests (``test_timeslice_sharing.py``).

Usage: ``python timeslice_job.py --name NAME --share S --ready FILE --window FILE --out FILE
[--offload auto|always|never] [--period-s P] [--step-s T]`` (the pool from ``$GPUPOOL_*``).

It trains a small MLP with Adam through :class:`~gpupool_lightning.GpuPoolCallback`
(``qos="guaranteed"``, 10 GiB, ``compute_share=S``), so the runtime plans the sharing of its grant
and runs the time-slicing gate itself. Each training step also sleeps ``--step-s`` (the GPU work of
a real step: the process does not compete for the CPU meanwhile, so the split measured is the
gate's, not the OS scheduler's). After its first step it creates ``--ready``; once ``--window``
exists (JSON ``{"start_at", "end_at"}``, wall clock, written by the test when every job is ready)
it counts the seconds spent in those sleeps inside the window, stops at ``end_at`` and writes
``--out`` (JSON): the busy seconds, steps, the gate's turns, the plan's mechanism and what the
hand-over offload moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpupool_lightning import GpuPoolCallback


class Net(pl.LightningModule):
    def __init__(self, meter: Meter) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 1))
        self.meter = meter

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.meter.work()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Meter(pl.Callback):
    """Times the stand-in GPU work inside the window and stops the run at its end."""

    def __init__(self, step_s: float, ready: Path, window: Path) -> None:
        self.step_s = step_s
        self.ready = ready
        self.window_file = window
        self.start_at: float | None = None
        self.end_at: float | None = None
        self.busy_s = 0.0
        self.steps = 0
        self.stats: dict[str, Any] = {}

    def work(self) -> None:
        t0 = time.monotonic()
        w0 = time.time()
        time.sleep(self.step_s)
        if self.start_at is not None and self.end_at is not None and self.start_at <= w0 < self.end_at:
            self.busy_s += time.monotonic() - t0
            self.steps += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.ready.exists():
            self.ready.write_text("1")
        if self.start_at is None and self.window_file.exists():
            w = json.loads(self.window_file.read_text())
            self.start_at, self.end_at = float(w["start_at"]), float(w["end_at"])
        if self.end_at is not None and time.time() >= self.end_at:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pool = next(c for c in trainer.callbacks if isinstance(c, GpuPoolCallback))
        sharing = pool.runtime.sharing
        gate = sharing.gate
        self.stats = {
            "mechanism": sharing.plan.mechanism,
            "gpu_uuid": sharing.plan.gpu_uuid,
            "turns": gate.turns if gate is not None else 0,
            "held_s": gate.held_s if gate is not None else 0.0,
            "waited_s": gate.waited_s if gate is not None else 0.0,
            "parks": sharing.parks,
            "parked_bytes": sharing.parked_bytes,
            "restored_bytes": sharing.restored_bytes,
        }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--share", type=float, required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--window", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--offload", default="auto")
    ap.add_argument("--period-s", type=float, default=1.0)
    ap.add_argument("--step-s", type=float, default=0.01)
    args = ap.parse_args()
    torch.set_num_threads(1)
    meter = Meter(args.step_s, Path(args.ready), Path(args.window))
    pool = GpuPoolCallback(name=args.name, memory="10GiB", qos="guaranteed", compute_share=args.share,
                           timeslice_period_s=args.period_s, handover_offload=args.offload,
                           checkpoint_dir=os.path.join(os.path.dirname(args.out), f"ckpt-{args.name}"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, 16, generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin())
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1000, callbacks=[pool, meter], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(Net(meter), DataLoader(data, batch_size=8))
    Path(args.out).write_text(json.dumps({"job": args.name, "busy_s": meter.busy_s, "steps": meter.steps,
                                          **meter.stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
