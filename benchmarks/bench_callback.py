"""GpuPoolCallback cost: step-time overhead and preemption latency, on a real local pool.

``run()`` starts a real etcd, a coordinator and a simulated agent, then:

1. **Step overhead**: the same small CPU model is trained with and without the callback,
   interleaved (A, B, A, B...) so both see the same machine load; the per-step time of each run
   is the median step of that run, and the ratio compares the medians of the two variants.
2. **Preemption latency**: a job trains with the callback; a priority-10 job arrives; the callback
   checkpoints at the next step boundary, acks and releases. Reported split: waiting for the
   step boundary (from the leader's ``issued_at``), checkpoint write, protocol (ack write), and
   the release (coordinator taking the slices back).

Run: ``python benchmarks/bench_callback.py`` (or through ``benchmarks/run_all.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpupool_sdk.client import PoolClient
from gpupool_sdk.integrations.lightning import GpuPoolCallback
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store.launcher import EtcdServer


@contextmanager
def local_pool(simulate: str = "bench-node:1xA100-40GB") -> Iterator[tuple[str, str]]:
    """A real etcd + coordinator + agent on loopback; yields (endpoint, prefix)."""
    prefix = f"/gpupool-bench/{uuid.uuid4().hex[:8]}"
    etcd = EtcdServer(data_dir=None, name="gpupool-bench")
    etcd.start(timeout=60)
    ep = str(etcd.endpoint)
    gp = [sys.executable, "-m", "gpupool_sdk.cli.main"]
    common = ["--endpoints", ep, "--prefix", prefix]
    procs = [
        subprocess.Popen([*gp, "coordinator", *common, "--ttl", "3", "--loop-wait", "0.1", "--aging", "100000",
                          "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([*gp, "agent", *common, "--simulate", simulate, "--ttl", "3"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    try:
        yield ep, prefix
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        etcd.stop()


class _Model(pl.LightningModule):
    def __init__(self, width: int, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.sleep_s = sleep_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _TimedCallback(GpuPoolCallback):
    """GpuPoolCallback whose per-step hooks are timed: the callback's own cost, free of machine noise."""

    in_hooks_s = 0.0

    def _timed(name: str) -> Any:  # type: ignore[misc]  # noqa: N805 - a decorator factory in the class body
        def hook(self: _TimedCallback, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return getattr(GpuPoolCallback, name)(self, *args, **kwargs)
            finally:
                self.in_hooks_s += time.perf_counter() - t

        return hook

    on_train_batch_start = _timed("on_train_batch_start")
    on_before_backward = _timed("on_before_backward")
    on_after_backward = _timed("on_after_backward")
    on_before_optimizer_step = _timed("on_before_optimizer_step")
    on_train_batch_end = _timed("on_train_batch_end")


class _StepClock(pl.Callback):
    """Per-step wall time (batch start to next batch start), the same in both variants."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def median_step_s(self, skip: int = 10) -> float:
        d = [b - a for a, b in zip(self.starts[skip:], self.starts[skip + 1 :], strict=False)]
        return statistics.median(d)


def _fit(callbacks: list[Any], loader: DataLoader, width: int, steps: int, root: str, sleep_s: float = 0.0) -> Any:
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, num_sanity_val_steps=0)
    trainer.fit(_Model(width, sleep_s), loader)
    return trainer


def bench_overhead(ep: str, prefix: str, rounds: int = 6, steps: int = 300, width: int = 256) -> dict[str, Any]:
    ds = TensorDataset(torch.randn(64 * 32, width), torch.randn(64 * 32, 1))
    loader = DataLoader(ds, batch_size=64)
    root = tempfile.mkdtemp(prefix="bench-cb-")
    os.environ["GPUPOOL_JOB"] = "bench-overhead"
    pool = _TimedCallback(memory="1GiB", endpoints=ep, prefix=prefix, checkpoint_dir=root, allocator="none",
                          acquire_timeout=60)
    with_cb: list[float] = []
    without: list[float] = []
    ratios: list[float] = []
    try:
        for r in range(rounds):
            # ABBA order: neither variant always runs first (warm caches, load drift).
            order = (True, False) if r % 2 == 0 else (False, True)
            got: dict[bool, float] = {}
            for use in order:
                clock = _StepClock()
                _fit([pool, clock] if use else [clock], loader, width, steps, root)
                got[use] = clock.median_step_s()
            with_cb.append(got[True])
            without.append(got[False])
            ratios.append(got[True] / got[False])
    finally:
        pool.close()
        os.environ.pop("GPUPOOL_JOB", None)
    a, b = statistics.median(with_cb), statistics.median(without)
    hook_s_per_step = pool.in_hooks_s / (rounds * steps)
    return {
        "callback_hook_s_per_step": hook_s_per_step,
        "callback_hook_fraction_of_step_pct": 100.0 * hook_s_per_step / b,
        "per_round_ratio": [round(x, 4) for x in ratios],
        "median_of_round_ratios": statistics.median(ratios),
        "step_s_with_callback": a,
        "step_s_without_callback": b,
        "overhead_ratio": a / b,
        "overhead_pct": 100.0 * (a / b - 1.0),
        "rounds": rounds,
        "steps_per_run": steps,
        "goal_pct": 1.0,
    }


def bench_preempt(ep: str, prefix: str, trials: int = 3, step_s: float = 0.05) -> dict[str, Any]:
    width = 256
    ds = TensorDataset(torch.randn(64 * 400, width), torch.randn(64 * 400, 1))
    loader = DataLoader(ds, batch_size=64)
    rows: list[dict[str, float]] = []
    for i in range(trials):
        root = tempfile.mkdtemp(prefix="bench-pre-")
        pool = GpuPoolCallback(memory="30GiB", name=f"bench-low-{i}", endpoints=ep, prefix=prefix, checkpoint_dir=root,
                               allocator="none", acquire_timeout=60)
        client = PoolClient(endpoints=ep, prefix=prefix)
        holder: dict[str, Any] = {}

        def arrive(client: PoolClient = client, holder: dict[str, Any] = holder, i: int = i) -> None:
            time.sleep(3.0)  # let the low job train a while
            holder["lease"] = client.acquire(
                JobSpec(name=f"bench-high-{i}", memory="30GiB", qos="guaranteed", priority=10), timeout=60)

        t = threading.Thread(target=arrive, daemon=True)
        t.start()
        try:
            _fit([pool], loader, width, 10_000, root, sleep_s=step_s)
            t.join(60)
            timing = pool.preempt_timing
            if timing is None:
                raise RuntimeError("the job was not preempted")
            rows.append({k: float(v) for k, v in vars(timing).items()})
        finally:
            if "lease" in holder:
                holder["lease"].release()
            client.close()
            pool.close()
    out: dict[str, Any] = {f"{k}_median": statistics.median(r[k] for r in rows) for k in rows[0]}
    out["directive_to_ack_s_median"] = statistics.median(
        r["boundary_wait_s"] + r["checkpoint_s"] + r["protocol_s"] for r in rows)
    out["trials"] = trials
    out["step_s"] = step_s
    out["goal_protocol_s"] = 0.2
    return out


def run() -> dict[str, Any]:
    """Both measurements on one local pool; returns a flat-able dict for ``run_all.py``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the benchmark's own process: one thread steadies a shared 2-core box
    try:
        return _run()
    finally:
        torch.set_num_threads(threads)


def _run() -> dict[str, Any]:
    with local_pool() as (ep, prefix):
        time.sleep(2.0)  # agent registration
        return {
            "overhead": bench_overhead(ep, prefix),
            "overhead_wide_model": bench_overhead(ep, prefix, rounds=4, steps=200, width=1024),
            "preemption": bench_preempt(ep, prefix),
        }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
