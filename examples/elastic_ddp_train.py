"""An elastic plain-PyTorch DDP job: one rank per leased slice, re-formed at every resize.

Run it under ``gpupool run`` with torchrun, one rank per slice of the current grant
(``$GPUPOOL_DEVICES``, re-read at every restart)::

    gpupool run --gpus 2 --min-gpus 1 --max-gpus 2 --memory 20GiB -- \\
        sh -c 'exec torchrun --standalone --nproc-per-node "$GPUPOOL_DEVICES" \\
               examples/elastic_ddp_train.py --steps 500 --out model.pt'

When the pool grows or shrinks the job, every rank checkpoints at the same step, rank 0 acks,
the ranks exit 75, and ``gpupool run`` (which keeps the job's lease) starts torchrun again with
the new slice count; the ranks resume from the checkpoint. The batch rule is the default of
:mod:`gpupool_sdk.runtime.elastic` (``keep_global``): every step trains on the same
``--global-batch`` samples whatever the world size, each rank on ``global_batch / W`` of them,
with the same learning rate.

``--no-pool`` runs the same loop without the pool (``--resume``, ``--stop-at``, ``--save``): the
tests use it to replay by hand the sequence of world sizes the pool chose.

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

import torch
import torch.distributed as dist

from gpupool_sdk.runtime.elastic import rank_slice, scaled_lr


def batch(seed: int, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same samples whatever the world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(global_batch, 16, generator=g)
    return x, x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(global_batch, 1, generator=g)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--rule", default="keep_global", help="batch/learning-rate rule on a resize (keep_global, linear)")
    p.add_argument("--seed", type=int, default=7)
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
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        if args.no_pool:
            return train(args, None, rank, world)
        from gpupool_torch import PoolSession

        with PoolSession(name=args.name, checkpoint_dir=args.checkpoint_dir, allocator="none",
                         telemetry_interval_s=0.5) as pool:
            return train(args, pool, rank, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, pool: Any, rank: int, world: int) -> int:
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=scaled_lr(args.lr, world, rule=args.rule), momentum=0.9)
    step = 0
    resume = pool.resume_from if pool is not None else args.resume
    if resume:
        state = torch.load(resume, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        for group in opt.param_groups:  # the rule decides the rate at this world size
            group["lr"] = scaled_lr(args.lr, world, rule=args.rule)
        if pool is not None and state.get("pool"):
            pool.load_state_dict(state["pool"])
        step = int(state["step"])
    model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    lo, hi = rank_slice(args.global_batch, world, rank)
    if rank == 0:
        print("ELASTIC " + json.dumps({"segment": True, "world": world, "start": step,
                                       "lease": pool.lease_id if pool is not None else ""}), flush=True)

    def save(path: str) -> None:
        if rank == 0:  # every rank holds the same weights: rank 0 writes
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step,
                        "pool": pool.state_dict() if pool is not None else {}}, path)

    stop_at = args.stop_at if args.stop_at is not None else args.steps
    finished = False
    while step < min(stop_at, args.steps):
        if pool is not None:
            pool.step_begin()
        x, y = batch(args.seed, step, args.global_batch)
        loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        opt.zero_grad()
        loss.backward()  # DDP averages the ranks' gradients: the global batch's mean gradient
        opt.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if pool is not None and pool.step_end(step, save):
            break  # resized or preempted: checkpointed and acked
        if args.finish_file and finish_requested(args.finish_file, rank, world):
            finished = True
            break
    done = finished or step >= min(stop_at, args.steps)
    if pool is None and args.save and rank == 0:
        save(args.save)
    if rank == 0:
        stopped = bool(pool is not None and pool.preempted)
        print("ELASTIC " + json.dumps({"segment": False, "world": world, "end": step, "stopped": stopped}), flush=True)
        if args.out and done and not stopped:
            torch.save({"state_dict": net.state_dict(), "step": step}, args.out)
    return 0


def finish_requested(path: str, rank: int, world: int) -> bool:
    """Rank 0 looks for the file; every rank gets its answer (the ranks stop at the same step)."""
    flag = torch.tensor([1 if rank == 0 and Path(path).exists() else 0])
    if world > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
