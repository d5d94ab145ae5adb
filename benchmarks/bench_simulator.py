"""Benchmark: simulate 8,000 jobs on 1,000 GPUs on one core (goal: under 60 s per policy).

The 8,000 jobs are drawn with a fixed seed from the Alibaba v2023 GPU pods (their GPU counts,
fractions, QoS classes and run times, clipped to one day) and given Poisson arrivals at a rate
that loads the 1,000 GPUs (125 nodes of 8 V100-32GB) to about 90 %: a busy cluster, with a queue
at times, as in production. CPU time is measured with ``time.process_time`` (one core).

A second figure, ``congested``: the cost of a decision under congestion, side by side in one
process: the first 1,000 Philly-derived jobs of the Sia workloads (``sia_philly_*``) on 48 GPUs
(6 x 8 V100-32GB; FIFO waits 2.4 days on average), ``gpupool`` with the default policy against
``tiresias``; goal: ``gpupool`` within 2x of Tiresias' CPU time. ``gpupool_bounds_off`` is the
default policy with the bounds on a cycle's work off (``max_considered`` 0, ``keep_reservations``
off), run in the same process.

Usage::

    python benchmarks/bench_simulator.py            # prints the result as JSON
"""

from __future__ import annotations

import csv
import json
import os
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.sim.runner import run_simulation
from gpupool_sdk.sim.trace import default_traces_dir, load_trace

JOBS = 8000
CLUSTER = "125*8xV100-32GB"
GPUS = 1000
TARGET_LOAD = 0.9
MAX_DURATION_S = 86400.0
POLICIES = ("fifo", "tiresias", "bestfit", "gpupool")
HEADER = ["job_id", "source", "submit_s", "start_s", "end_s", "duration_s", "num_gpu", "gpu_fraction", "priority",
          "status", "extra"]


def make_trace(path: Path, seed: int = 0) -> None:
    """Write the benchmark trace (unified schema) to ``path``."""
    rng = random.Random(seed)
    with (default_traces_dir() / "alibaba_v2023_default.csv").open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["num_gpu"] != "0" and r["duration_s"]]
    picked = [rng.choice(rows) for _ in range(JOBS)]
    work = sum(min(float(r["duration_s"]), MAX_DURATION_S) * int(r["num_gpu"]) * float(r["gpu_fraction"] or 1)
               for r in picked)
    mean_gap = work / (GPUS * TARGET_LOAD) / JOBS
    t = 0.0
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        for i, r in enumerate(picked):
            w.writerow([f"b{i}", "bench", f"{t:.1f}", "", "", min(float(r["duration_s"]), MAX_DURATION_S),
                        r["num_gpu"], r["gpu_fraction"], r["priority"], "", ""])
            t += rng.expovariate(1.0 / mean_gap)


CONGESTED_SOURCES = ("sia_philly_*",)
CONGESTED_JOBS = 1000
CONGESTED_CLUSTER = "6*8xV100-32GB"


def run_congested() -> dict[str, Any]:
    """CPU seconds of ``tiresias`` and ``gpupool`` (default policy) on the congested Philly-derived run."""
    trace = load_trace("pollux_sia_workloads.csv", sources=CONGESTED_SOURCES, max_jobs=CONGESTED_JOBS)
    out: dict[str, Any] = {"jobs": len(trace), "cluster": CONGESTED_CLUSTER, "goal": "gpupool cpu_s <= 2 x tiresias"}
    bounds_off = replace(DEFAULT_SCHEDULER, max_considered=0, keep_reservations=False)
    for label, name, config in (("fifo", "fifo", None), ("tiresias", "tiresias", None), ("gpupool", "gpupool", None),
                                ("gpupool_bounds_off", "gpupool", bounds_off)):
        t0 = time.process_time()
        report = run_simulation(trace, CONGESTED_CLUSTER, [name], pool_config=config)
        cpu = time.process_time() - t0
        m = report.metrics[name]
        out[label] = {"cpu_s": round(cpu, 2), "cycles": m["cycles"], "avg_jct_s": round(m["avg_jct_s"], 1),
                      "preemptions": m["preemptions"]}
    out["gpupool_over_tiresias_cpu"] = round(out["gpupool"]["cpu_s"] / max(out["tiresias"]["cpu_s"], 1e-9), 2)
    out["bounds_off_over_tiresias_cpu"] = round(
        out["gpupool_bounds_off"]["cpu_s"] / max(out["tiresias"]["cpu_s"], 1e-9), 2
    )
    out["goal_met"] = out["gpupool_over_tiresias_cpu"] <= 2.0
    return out


def run() -> dict[str, Any]:
    """Simulate the benchmark trace under every policy; CPU seconds and a few metrics per policy."""
    out: dict[str, Any] = {"jobs": JOBS, "gpus": GPUS, "cluster": CLUSTER, "goal_s": 60.0, "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_8000.csv"
        make_trace(path)
        t0 = time.process_time()
        trace = load_trace(path)
        out["load_s"] = round(time.process_time() - t0, 3)
        for name in POLICIES:
            t0 = time.process_time()
            report = run_simulation(trace, CLUSTER, [name])
            cpu = time.process_time() - t0
            m = report.metrics[name]
            out["policies"][name] = {
                "cpu_s": round(cpu, 2),
                "under_goal": cpu < 60.0,
                "cycles": m["cycles"],
                "avg_jct_s": round(m["avg_jct_s"], 1),
                "gpu_alloc_util": round(m["gpu_alloc_util"], 3),
            }
    out["congested"] = run_congested()
    out["load_avg_1m"] = round(os.getloadavg()[0], 1)  # other work on the machine while measuring
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
