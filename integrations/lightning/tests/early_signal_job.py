"""A job for ``test_early_signals.py``: signals that land before a training loop has started, or in one.

``--case ddp_setup`` (2 ranks under torchrun, gloo): rank 0 takes the lease, writes
``{--dir}/rank0-fit`` and calls ``fit`` with ``strategy="ddp"``, whose rendezvous waits for rank 1;
rank 1 waits until ``{--dir}/release-rank1`` exists (the test writes it) and then builds the
callback. Under plain torchrun rank 1 finds no grant exported by rank 0 (a ``ConfigError``) and
exits 1, so torchrun SIGTERMs rank 0 while it is blocked in DDP's setup; under ``gpupool run`` the
test signals the launcher instead.

``--case train`` (1 process): fits the callback on the fake in-memory lease of
``test_callback_logic.py`` (what is tested is the process's signal dispositions, no pool needed) and
prints one ``SIGNALS {...}`` line at exit: the outcome, the step, and the SIGINT handler in place at
the first training step. At step 3 it sends itself what ``--send`` says: ``one`` SIGINT, ``two``
SIGINTs, the second once the first was recorded (a second Ctrl-C), or ``together`` two SIGINTs
sent to its main thread while that blocks SIGINT (one pending signal when it is unblocked).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def ddp_setup(args: argparse.Namespace) -> int:
    import pytorch_lightning as pl

    from gpupool_lightning import GpuPoolCallback
    from gpupool_lightning.demo.job import TinyRegressor

    d = Path(args.dir)
    if int(os.environ.get("RANK", "0")) != 0:
        deadline = time.monotonic() + 600  # a bound, so that a broken test cannot leave it behind
        while not (d / "release-rank1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    pool = GpuPoolCallback(gpus=2, memory="1GiB", name=args.name, allocator="none")
    model = TinyRegressor(seed=1, samples=64, batch_size=8, num_workers=0, step_sleep=0.0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, callbacks=[pool], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(d))
    (d / "rank0-fit").write_text(str(os.getpid()))
    trainer.fit(model)
    return 0


def train(args: argparse.Namespace) -> int:
    import pytorch_lightning as pl

    sys.path.insert(0, str(ROOT))
    from gpupool_lightning import GpuPoolCallback
    from gpupool_lightning.demo.job import TinyRegressor
    from integrations.lightning.tests.test_callback_logic import FakeClient, FakeLease

    pool = GpuPoolCallback(memory="1GiB", name="early", client=FakeClient(FakeLease("early")), checkpoint_dir=args.dir,
                           exit_on_preempt=False)
    seen: dict[str, Any] = {}

    class Send(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 0 and "sigint_handler" not in seen:
                h = signal.getsignal(signal.SIGINT)
                seen["sigint_handler"] = "watch" if pool.runtime.signals.owns(h) else repr(h)
            if trainer.global_step != 3:
                return
            if args.send == "together":
                # Both sent to this (main) thread while it blocks SIGINT: the second merges with the
                # pending first. (os.kill would let the kernel deliver each to another thread of the
                # process, one that does not block it, and Python might run the handler in between.)
                main = threading.main_thread().ident
                assert main is not None
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                signal.pthread_kill(main, signal.SIGINT)
                signal.pthread_kill(main, signal.SIGINT)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one SIGINT is delivered here
            elif args.send in ("one", "two"):
                os.kill(os.getpid(), signal.SIGINT)
                if args.send == "two":
                    deadline = time.monotonic() + 60
                    while pool.runtime.signals.received is None and time.monotonic() < deadline:
                        time.sleep(0.01)  # Python runs the handler between these bytecodes
                    seen["first_recorded"] = pool.runtime.signals.received == signal.SIGINT
                    os.kill(os.getpid(), signal.SIGINT)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=8, limit_val_batches=0,
                         callbacks=[pool, Send()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.dir)
    outcome = "finished"
    try:
        trainer.fit(TinyRegressor(seed=1, samples=64, batch_size=8, num_workers=0, step_sleep=0.0))
        if pool.preempted:
            outcome = "preempted"
    except KeyboardInterrupt:
        outcome = "interrupted"
    except SystemExit as exc:  # Lightning turns a KeyboardInterrupt into exit 1 after its graceful shutdown
        outcome = f"exit {exc.code}"
    print("SIGNALS " + json.dumps({**seen, "outcome": outcome, "step": trainer.global_step,
                                   "checkpoint": pool.last_checkpoint}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--case", choices=["ddp_setup", "train"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--name", default="early")
    p.add_argument("--send", choices=["none", "one", "two", "together"], default="none")
    args = p.parse_args(argv)
    return ddp_setup(args) if args.case == "ddp_setup" else train(args)


if __name__ == "__main__":
    sys.exit(main())
