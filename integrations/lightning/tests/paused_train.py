"""``examples/readme_train.py``, held at chosen training steps until the pool's callback has something to act on.

A live test that signals or preempts a running job needs the job to be training, and still
training, when the signal or the directive lands. ``--pause-at STEP`` (repeatable) holds the script
inside that optimizer step, after the callback's handlers are in place, until the callback
recorded a signal, a directive or a lease loss (its attention flag); the file
``{--pause-dir}/paused-at-STEP`` says that it is held. The step then ends and the callback acts at
that boundary: a signal checkpoints at STEP + 1. ``--pause-in-validation EPOCH`` holds the first
batch of that epoch's validation loop inside ``fit`` the same way (file ``paused-in-validation-EPOCH``):
the callback acts after that batch. With several ranks, global rank 0 is held (the
others wait for it in the step's all-reduce). The pause changes no computation (the weights equal
an unpaused run's); ``--pause-limit`` bounds it so that a broken test cannot hang the job.

Usage (the test harness's, not a user's)::

    python paused_train.py --pause-dir DIR --pause-at 10 [readme_train.py's arguments]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _readme_train() -> Any:
    spec = importlib.util.spec_from_file_location("readme_train", ROOT / "examples" / "readme_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pause-at", type=int, action="append", default=[], help="hold inside this training step")
    p.add_argument("--pause-in-validation", type=int, action="append", default=[],
                   help="hold inside the first validation batch of this epoch (not the sanity check)")
    p.add_argument("--validation-sleep", type=float, default=0.0,
                   help="seconds each validation batch of fit takes (a long validation)")
    p.add_argument("--pause-dir", required=True, help="where paused-at-STEP files are written")
    p.add_argument("--pause-limit", type=float, default=600.0, help="seconds a pause lasts at most")
    ours, rest = p.parse_known_args(argv)
    readme = _readme_train()
    original = readme.Regressor.training_step
    original_validation = readme.Regressor.validation_step
    pending = set(ours.pause_at)
    pending_validation = set(ours.pause_in_validation)

    def hold(self: Any, marker: str) -> None:
        pool = next(cb for cb in self.trainer.callbacks if isinstance(cb, readme.GpuPoolCallback))
        Path(ours.pause_dir, marker).write_text("held\n")
        deadline = time.monotonic() + ours.pause_limit
        while not pool.runtime.inbox.attention and time.monotonic() < deadline:
            time.sleep(0.02)

    def training_step(self: Any, batch: Any, batch_idx: int) -> Any:
        step = int(self.global_step)
        if step in pending and self.trainer.is_global_zero:  # other ranks wait in the step's all-reduce
            pending.discard(step)
            hold(self, f"paused-at-{step}")
        return original(self, batch, batch_idx)

    def validation_step(self: Any, batch: Any, batch_idx: int) -> Any:
        epoch = int(self.current_epoch)
        trainer = self.trainer
        marker = f"paused-in-validation-{epoch}"
        if (epoch in pending_validation and batch_idx == 0 and not trainer.sanity_checking
                and trainer.is_global_zero and not Path(ours.pause_dir, marker).exists()):  # once, not on a resume
            pending_validation.discard(epoch)
            hold(self, marker)
        if ours.validation_sleep and not trainer.sanity_checking:
            time.sleep(ours.validation_sleep)
        return original_validation(self, batch, batch_idx)

    readme.Regressor.training_step = training_step
    readme.Regressor.validation_step = validation_step
    return int(readme.main(rest))


if __name__ == "__main__":
    sys.exit(main())
