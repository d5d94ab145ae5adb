"""A small Lightning job on the pool: leases a slice, trains, survives preemption.

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

import pytorch_lightning as pl
import torch

from gpupool_sdk.demo.job import TinyRegressor  # a two-layer MLP on synthetic data
from gpupool_sdk.integrations.lightning import GpuPoolCallback


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
        accelerator=pool.accelerator,
        devices=pool.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=[pool],
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
