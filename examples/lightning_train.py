"""A small Lightning job on the pool: leases a slice, trains, survives preemption.

Run it against a pool (``gpupool demo`` starts one; or etcd + coordinator + agent)::

    python examples/lightning_train.py --name tiny --memory 1GiB --epochs 3
    gpupool run --memory 1GiB -- python examples/lightning_train.py --epochs 3   # re-runs after preemption

Exit codes: 0 finished, 75 preempted (checkpointed; run it again to resume), other: failed.
Deterministic for a fixed ``--seed`` (the tests compare an interrupted run with an uninterrupted one).
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
import torch

from gpupool_lightning import GpuPoolCallback

# The model and data, the command line and the result lines are shared with `gpupool demo`'s job.
from gpupool_lightning.demo.job import TinyRegressor, job_arguments, report_result


def main(argv: list[str] | None = None) -> int:
    args = job_arguments(__doc__).parse_args(argv)

    # Takes the lease before the Trainer touches CUDA: waits in the queue, then sets CUDA_VISIBLE_DEVICES.
    pool = GpuPoolCallback(
        gpus=args.gpus,
        memory=args.memory,
        qos=args.qos,
        priority=args.priority,
        name=args.name,
        checkpoint_dir=args.checkpoint_dir,
        allocator="none",
        telemetry_interval_s=1.0,
        # fit returns after a preemption so that this script can print its GPUPOOL_RESULT line for
        # the tests; without it (the default) the process exits 75 right after the checkpoint.
        exit_on_preempt=False,
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
    trainer.fit(model, ckpt_path=pool.resume_from)  # None on a first run; the last preemption checkpoint after
    report_result(pool, trainer, model, args.out)  # GPUPOOL_RESULT line for the tests; weights to --out
    pool.exit_if_preempted()  # exit code 75 when preempted: `gpupool run` runs the script again
    return 0


if __name__ == "__main__":
    sys.exit(main())
