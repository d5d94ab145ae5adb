"""A plain PyTorch loop on the pool (no Lightning): lease, train, checkpoint on preemption, resume.

Run it against a pool::

    python examples/torch_loop_train.py --name loop --memory 1GiB --steps 200
    gpupool run --memory 1GiB -- python examples/torch_loop_train.py --steps 200

Exit codes: 0 finished, 75 preempted (checkpointed; run it again to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from gpupool_sdk.telemetry.phases import Phase
from gpupool_torch import PoolSession


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None)
    p.add_argument("--memory", default=None, help="memory per slice, e.g. 1GiB (under gpupool run: its --memory)")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--checkpoint-dir", default=os.environ.get("GPUPOOL_CHECKPOINT_DIR", "gpupool-checkpoints"))
    p.add_argument("--out", default=None, help="write final weights here (torch.save)")
    args = p.parse_args(argv)

    with PoolSession(memory=args.memory, priority=args.priority, name=args.name,
                     checkpoint_dir=args.checkpoint_dir, allocator="none") as pool:
        torch.manual_seed(args.seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(pool.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(args.seed)
        data_x = torch.randn(args.steps, 8, 16, generator=g)
        data_y = data_x[:, :, :1] * 2.0 - data_x[:, :, 1:2]
        step = 0
        if pool.resume_from:
            state = torch.load(pool.resume_from, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            pool.load_state_dict(state["pool"])
            step = state["step"]

        def save(path: str) -> None:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "pool": pool.state_dict(),
                        "step": step}, path)

        while step < args.steps:
            pool.step_begin()
            with pool.phase(Phase.DATA):
                x, y = data_x[step].to(pool.device), data_y[step].to(pool.device)
            with pool.phase(Phase.FORWARD):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            with pool.phase(Phase.BACKWARD):
                opt.zero_grad()
                loss.backward()
            with pool.phase(Phase.OPTIMIZER):
                opt.step()
            step += 1
            if pool.step_end(step, save):
                break
        print("GPUPOOL_RESULT " + json.dumps({"job": pool.job, "step": step, "preempted": pool.preempted}), flush=True)
        if args.out and not pool.preempted:
            torch.save({"state_dict": model.state_dict(), "step": step}, args.out)
    return 0  # leaving the `with` block after a preemption exits with code 75


if __name__ == "__main__":
    sys.exit(main())
