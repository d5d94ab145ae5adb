"""A shared-QoS Lightning job on the CPU for the balloon scenario (``test_balloon_training.py``).

Usage: ``python balloon_job.py --name NAME --memory 30GiB --peak-bytes N --stop-file PATH``
(the pool comes from ``$GPUPOOL_ENDPOINTS`` / ``$GPUPOOL_PREFIX``).

It trains a small MLP with Adam through :class:`~gpupool_lightning.GpuPoolCallback`
(``qos="shared"``, default memory tier, which is the host tier on a machine without CUDA), so balloon
and deflate directives reach it the real way: etcd -> client helper process -> callback -> balloon
controller -> ack. It trains until ``--stop-file`` exists, then ``--extra-steps`` more optimizer steps.

The memory peak: on the CPU the callback measures the host tier's footprint (Adam's state, about
316 KiB) and publishes it as ``memory_peak_bytes``. The script passes ``--peak-bytes`` through the
callback's ``memory_peak_fn`` hook instead, which wins over the measured figure: the test picks a peak
below the Adam state size, so the balloon target it leads to can only be reached by offloading the
optimizer state.

Output lines:
    ``STOP_SEEN <step>``: the step at which the stop file was first seen.
    ``RESULT <json>``: global step, optimizer steps counted by hooks, Adam's own step counters, the
    size of the optimizer state, and whether the final weights equal (bit for bit) those of an
    identical model trained for the same number of steps by a plain loop without any balloon.

Exit codes: 0 done, 75 preempted (the test expects a balloon, never a preemption), other: failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpupool_lightning import GpuPoolCallback

SAMPLES = 64
BATCH = 8
WIDTH = 192


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )


def make_data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


class Regressor(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_model(seed)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.net)


class Driver(pl.Callback):
    """Paces the steps, counts them, and stops after the stop file."""

    def __init__(self, stop_file: Path, extra_steps: int, step_sleep: float) -> None:
        self.stop_file = stop_file
        self.extra_steps = extra_steps
        self.step_sleep = step_sleep
        self.optimizer_steps = 0
        self.stop_at: int | None = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.optimizer_steps += 1

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if self.stop_at is None and self.stop_file.exists():
            self.stop_at = step + self.extra_steps
            print(f"STOP_SEEN {step}", flush=True)
        if self.stop_at is not None and step >= self.stop_at:
            trainer.should_stop = True
        # Pretend work: keeps a 2-core machine usable by etcd and the coordinator.
        time.sleep(self.step_sleep)


def reference_weights(seed: int, steps: int) -> dict[str, torch.Tensor]:
    """The same model, data order and optimizer, trained ``steps`` steps by a plain loop, no pool."""
    model = make_model(seed)
    opt = make_optimizer(model)
    loader = DataLoader(make_data(seed), batch_size=BATCH, shuffle=False)
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return model.state_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True)
    p.add_argument("--memory", required=True)
    p.add_argument("--peak-bytes", type=int, required=True)
    p.add_argument("--stop-file", type=Path, required=True)
    p.add_argument("--extra-steps", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--checkpoint-dir", default="gpupool-checkpoints")
    args = p.parse_args(argv)

    pool = GpuPoolCallback(
        gpus=1,
        memory=args.memory,
        qos="shared",
        priority=0,
        name=args.name,
        checkpoint_dir=args.checkpoint_dir,
        telemetry_interval_s=1.0,
        memory_peak_fn=lambda: args.peak_bytes,
    )
    driver = Driver(args.stop_file, args.extra_steps, args.step_sleep)
    module = Regressor(args.seed)
    trainer = pl.Trainer(
        accelerator=pool.accelerator,
        devices=pool.devices,
        max_epochs=-1,
        callbacks=[pool, driver],  # the driver runs after the pool callback at each hook
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.checkpoint_dir,
    )
    loader = DataLoader(make_data(args.seed), batch_size=BATCH, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    pool.exit_if_preempted()
    opt = trainer.optimizers[0]
    adam_steps = sorted({int(s["step"].item()) for s in opt.state.values()})
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    ref = reference_weights(args.seed, int(trainer.global_step))
    got = module.net.state_dict()
    result = {
        "global_step": int(trainer.global_step),
        "optimizer_steps": driver.optimizer_steps,
        "stop_seen_at": None if driver.stop_at is None else driver.stop_at - args.extra_steps,
        "adam_steps": adam_steps,
        "optimizer_state_bytes": state_bytes,
        "matches_reference": all(torch.equal(got[k], ref[k]) for k in ref),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
