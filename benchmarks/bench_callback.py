"""GpuPoolCallback cost: step-time overhead and preemption latency, on a real local pool.

``run()`` starts a real etcd, a coordinator and a simulated agent, then:

1. **Step overhead**, on two CPU models (one torch thread, batch 64, data in memory):

   * ``small``: an MNIST-sized classifier, MLP 784-512-512-10 (669,706 parameters), cross-entropy,
     SGD with momentum: a small real training job (step ~2-4 ms here);
   * ``toy``: the worst case, MLP 256-256-1 (66,049 parameters), MSE, SGD (step ~1 ms).

   Three figures per model, from the most to the least robust on a shared machine:

   a. **hook cost, tight loop**: after a short real ``fit`` (so the Trainer, the module, the
      optimizer and the callback are in their training state, with a real lease), the five
      per-step hooks are called in a loop exactly as Lightning calls them, one optimizer step per
      iteration; seconds per step by ``time.thread_time`` (CPU time of this thread: time other
      processes take is not counted), median of repetitions.
   b. **hook cost inside fit**: the same hooks, timed (``perf_counter``) inside real ``fit`` runs;
      the median over steps (a step that lost the CPU to another process is an outlier, not the
      typical cost). Includes the timing wrapper itself (10 clock readings per step).
   c. **side-by-side ratio**: many short ``fit`` runs, with and without the callback, interleaved
      in pairs (AB, BA, AB...) so that both halves of a pair see the same machine load; each run's
      step time is its median step; the figure is the median of the per-pair ratios, by thread CPU
      time and by wall time, with their inter-quartile range.

2. **Preemption latency**: a job trains with the callback; a priority-10 job arrives; the callback
   checkpoints at the next step boundary, acks and releases. Reported split: waiting for the
   step boundary (from the leader's ``issued_at``), checkpoint write, protocol (ack write), and
   the release (coordinator taking the slices back).

Run: ``python benchmarks/bench_callback.py`` (or through ``benchmarks/run_all.py``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpupool_lightning import GpuPoolCallback
from gpupool_sdk.client import PoolClient
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


@dataclass(frozen=True)
class ModelSize:
    """A benchmark model: an MLP ``inputs -> hidden... -> outputs`` trained on in-memory data."""

    name: str
    inputs: int
    hidden: tuple[int, ...]
    outputs: int
    classify: bool
    momentum: float
    batch: int = 64

    def build(self) -> torch.nn.Sequential:
        layers: list[torch.nn.Module] = []
        width = self.inputs
        for h in self.hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, self.outputs))
        return torch.nn.Sequential(*layers)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.build().parameters())

    def loader(self, batches: int = 32) -> DataLoader:  # type: ignore[type-arg]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batches * self.batch, self.inputs, generator=g)
        if self.classify:
            y: torch.Tensor = torch.randint(0, self.outputs, (batches * self.batch,), generator=g)
        else:
            y = torch.randn(batches * self.batch, self.outputs, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch)


SMALL = ModelSize("small", 784, (512, 512), 10, classify=True, momentum=0.9)
TOY = ModelSize("toy", 256, (256,), 1, classify=False, momentum=0.0)


class _Model(pl.LightningModule):
    def __init__(self, size: ModelSize, sleep_s: float = 0.0) -> None:
        super().__init__()
        self.size = size
        self.net = size.build()
        self.sleep_s = sleep_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x, y = batch
        out = self.net(x)
        if self.size.classify:
            return torch.nn.functional.cross_entropy(out, y)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=self.size.momentum)


_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
               "on_train_batch_end")


class _TimedCallback(GpuPoolCallback):
    """GpuPoolCallback whose per-step hooks are timed; ``step_s`` holds the in-hook seconds of each step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_s: list[float] = []
        self._acc = 0.0

    def _timed(name: str, closes_step: bool = False) -> Any:  # type: ignore[misc]  # noqa: N805 - decorator factory
        base = getattr(GpuPoolCallback, name)

        def hook(self: _TimedCallback, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return base(self, *args, **kwargs)
            finally:
                self._acc += time.perf_counter() - t
                if closes_step:
                    self.step_s.append(self._acc)
                    self._acc = 0.0

        return hook

    on_train_batch_start = _timed("on_train_batch_start")
    on_before_backward = _timed("on_before_backward")
    on_after_backward = _timed("on_after_backward")
    on_before_optimizer_step = _timed("on_before_optimizer_step")
    on_train_batch_end = _timed("on_train_batch_end", closes_step=True)


class _Toggled(GpuPoolCallback):
    """GpuPoolCallback whose per-step hooks run only while ``on``; alternates every ``block`` steps.

    Both states pay the same wrapper and the same Lightning dispatch, so the difference between
    them is the callback's own per-step work, measured side by side within one ``fit``.
    ``steps[state]`` holds ``(cpu_s, wall_s)`` lists of the steps that began in that state, one
    list per block.
    """

    def __init__(self, block: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block = block
        self.on = True
        self.blocks: list[tuple[bool, list[float], list[float]]] = []
        self._marks: tuple[float, float] | None = None
        self._n = 0

    def _forward(name: str) -> Any:  # type: ignore[misc]  # noqa: N805 - decorator factory
        base = getattr(GpuPoolCallback, name)

        def hook(self: _Toggled, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                return base(self, *args, **kwargs)
            return None

        return hook

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        if self._marks is not None and self.blocks:
            self.blocks[-1][1].append(cpu - self._marks[0])
            self.blocks[-1][2].append(wall - self._marks[1])
        if self._n % self.block == 0:
            # The step that begins now is the first of a block: switch, start a new block.
            pair = self._n // self.block // 2
            first = pair % 2 == 0  # AB, BA, AB, ...: neither state always goes first
            self.on = first if (self._n // self.block) % 2 == 0 else not first
            self.blocks.append((self.on, [], []))
        self._n += 1
        self._marks = (cpu, wall)
        if self.on:
            GpuPoolCallback.on_train_batch_start(self, trainer, pl_module, batch, batch_idx)

    on_before_backward = _forward("on_before_backward")
    on_after_backward = _forward("on_after_backward")
    on_before_optimizer_step = _forward("on_before_optimizer_step")
    on_train_batch_end = _forward("on_train_batch_end")

    def pairs(self, skip: int = 1) -> list[tuple[float, float, float, float]]:
        """Per block pair: (on cpu, off cpu, on wall, off wall) median step seconds."""
        out = []
        full = [b for b in self.blocks if len(b[1]) > skip]
        for a, b in zip(full[0::2], full[1::2], strict=False):
            on, off = (a, b) if a[0] else (b, a)
            if on[0] == off[0]:
                continue
            out.append((statistics.median(on[1][skip:]), statistics.median(off[1][skip:]),
                        statistics.median(on[2][skip:]), statistics.median(off[2][skip:])))
        return out


class _StepClock(pl.Callback):
    """Per-step time (batch start to next batch start) by wall clock and by this thread's CPU time."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    @staticmethod
    def _median_step(marks: list[float], skip: int) -> float:
        return statistics.median(b - a for a, b in zip(marks[skip:], marks[skip + 1 :], strict=False))

    def median_step(self, skip: int = 5) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of the run's median step, after ``skip`` warm-up steps."""
        return self._median_step(self.cpu, skip), self._median_step(self.wall, skip)


def _trainer(callbacks: list[Any], steps: int, root: str) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, num_sanity_val_steps=0)


def _fit(callbacks: list[Any], loader: DataLoader, size: ModelSize, steps: int, root: str,  # type: ignore[type-arg]
         sleep_s: float = 0.0) -> tuple[pl.Trainer, _Model]:
    torch.manual_seed(0)
    trainer = _trainer(callbacks, steps, root)
    model = _Model(size, sleep_s)
    trainer.fit(model, loader)
    return trainer, model


def _quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else [0.0, 0.0]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def hook_cost_tight_loop(pool: GpuPoolCallback, trainer: pl.Trainer, model: _Model, steps: int = 2000,
                         reps: int = 15) -> dict[str, float]:
    """Seconds per step of the five per-step hooks, called in a loop as Lightning calls them.

    ``trainer`` and ``model`` come from a finished ``fit`` with ``pool`` (training state, real lease).
    """
    opt = trainer.optimizers[0]
    loss = torch.zeros(())
    batch: Any = None
    pool.on_train_start(trainer, model)
    pool.on_train_epoch_start(trainer, model)
    start, before_bwd, after_bwd, before_opt, end = (getattr(pool, h) for h in _STEP_HOOKS)

    def loop(clock: Callable[[], float]) -> float:
        t = clock()
        for i in range(steps):
            start(trainer, model, batch, i)
            before_bwd(trainer, model, loss)
            after_bwd(trainer, model)
            before_opt(trainer, model, opt)
            end(trainer, model, None, batch, i)
        return (clock() - t) / steps

    def empty_loop(clock: Callable[[], float]) -> float:
        t = clock()
        for _ in range(steps):
            pass
        return (clock() - t) / steps

    loop(time.thread_time)  # warm up
    cpu = [loop(time.thread_time) - empty_loop(time.thread_time) for _ in range(reps)]
    wall = [loop(time.perf_counter) - empty_loop(time.perf_counter) for _ in range(reps)]
    return {"cpu_s_median": statistics.median(cpu), "cpu_s_min": min(cpu), "wall_s_median": statistics.median(wall)}


def bench_overhead(ep: str, prefix: str, size: ModelSize, pairs: int = 12, steps: int = 120,
                   block_pairs: int = 150, block: int = 8) -> dict[str, Any]:
    loader = size.loader()
    root = tempfile.mkdtemp(prefix="bench-cb-")
    common: dict[str, Any] = {"memory": "1GiB", "endpoints": ep, "prefix": prefix, "checkpoint_dir": root,
                              "allocator": "none", "acquire_timeout": 60}
    pool = GpuPoolCallback(name=f"bench-overhead-{size.name}", **common)
    timed = _TimedCallback(name=f"bench-overhead-{size.name}-timed", **common)
    toggled = _Toggled(block, name=f"bench-overhead-{size.name}-toggled", **common)
    try:
        # (a) the hooks in a tight loop, in the training state a real fit leaves behind.
        trainer, model = _fit([pool], loader, size, 20, root)
        tight = hook_cost_tight_loop(pool, trainer, model)
        # (b) the hooks timed inside real fits.
        for _ in range(3):
            _fit([timed], loader, size, steps, root)
        in_fit = timed.step_s
        # (c) interleaved pairs, with (A) and without (B) the callback.
        cpu_ratio: list[float] = []
        wall_ratio: list[float] = []
        cpu_step: dict[bool, list[float]] = {True: [], False: []}
        wall_step: dict[bool, list[float]] = {True: [], False: []}
        for r in range(pairs):
            got: dict[bool, tuple[float, float]] = {}
            for use in ((True, False) if r % 2 == 0 else (False, True)):
                clock = _StepClock()
                _fit([pool, clock] if use else [clock], loader, size, steps, root)
                got[use] = clock.median_step()
                cpu_step[use].append(got[use][0])
                wall_step[use].append(got[use][1])
            cpu_ratio.append(got[True][0] / got[False][0])
            wall_ratio.append(got[True][1] / got[False][1])
        # (d) one long fit, the callback's hooks on and off in alternating blocks of steps.
        _fit([toggled], size.loader(), size, 2 * block_pairs * block + 1, root)
        blocks = toggled.pairs()
    finally:
        pool.close()
        timed.close()
        toggled.close()
    block_ratio = [on / off for on, off, _, _ in blocks]
    block_diff = [on - off for on, off, _, _ in blocks]
    block_wall_ratio = [on / off for _, _, on, off in blocks]
    step_cpu = statistics.median(cpu_step[False])
    step_wall = statistics.median(wall_step[False])
    ratio_cpu = statistics.median(cpu_ratio)
    return {
        "model": f"MLP {'-'.join(map(str, (size.inputs, *size.hidden, size.outputs)))}",
        "parameters": size.parameters(),
        "batch": size.batch,
        "step_s_without_callback_cpu": step_cpu,
        "step_s_without_callback_wall": step_wall,
        "hook_us_per_step_tight_loop": 1e6 * tight["cpu_s_median"],
        "hook_us_per_step_tight_loop_min": 1e6 * tight["cpu_s_min"],
        "hook_us_per_step_tight_loop_wall": 1e6 * tight["wall_s_median"],
        "hook_share_of_step_pct": 100.0 * tight["cpu_s_median"] / step_cpu,
        "hook_us_per_step_in_fit_median": 1e6 * statistics.median(in_fit),
        "hook_us_per_step_in_fit_mean": 1e6 * statistics.fmean(in_fit),
        "ratio_cpu_median_of_pairs": ratio_cpu,
        "ratio_cpu_iqr": [round(x, 4) for x in _quartiles(cpu_ratio)],
        "ratio_wall_median_of_pairs": statistics.median(wall_ratio),
        "ratio_wall_iqr": [round(x, 4) for x in _quartiles(wall_ratio)],
        "overhead_pct_cpu": 100.0 * (ratio_cpu - 1.0),
        "pairs": pairs,
        "steps_per_run": steps,
        "block_ratio_cpu_median": statistics.median(block_ratio),
        "block_ratio_cpu_iqr": [round(x, 4) for x in _quartiles(block_ratio)],
        "block_ratio_wall_median": statistics.median(block_wall_ratio),
        "block_diff_us_per_step_cpu_median": 1e6 * statistics.median(block_diff),
        "block_pairs": len(blocks),
        "block_steps": block,
        "goal_pct": 1.0,
    }


def bench_preempt(ep: str, prefix: str, trials: int = 3, step_s: float = 0.05) -> dict[str, Any]:
    loader = TOY.loader(batches=400)
    rows: list[dict[str, float]] = []
    for i in range(trials):
        root = tempfile.mkdtemp(prefix="bench-pre-")
        pool = GpuPoolCallback(memory="30GiB", name=f"bench-low-{i}", endpoints=ep, prefix=prefix, checkpoint_dir=root,
                               allocator="none", acquire_timeout=60, exit_on_preempt=False)
        client = PoolClient(endpoints=ep, prefix=prefix)
        holder: dict[str, Any] = {}

        def arrive(client: PoolClient = client, holder: dict[str, Any] = holder, i: int = i) -> None:
            time.sleep(3.0)  # let the low job train a while
            holder["lease"] = client.acquire(
                JobSpec(name=f"bench-high-{i}", memory="30GiB", qos="guaranteed", priority=10), timeout=60)

        t = threading.Thread(target=arrive, daemon=True)
        t.start()
        try:
            _fit([pool], loader, TOY, 10_000, root, sleep_s=step_s)
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
            "overhead": bench_overhead(ep, prefix, SMALL),
            "overhead_toy_model": bench_overhead(ep, prefix, TOY),
            "preemption": bench_preempt(ep, prefix),
        }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
