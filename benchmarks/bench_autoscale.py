"""Autoscaled node pool against fixed clusters on the Alibaba trace: GPU-hours and JCT.

The autoscaled pool (:class:`gpupool_sdk.sim.autoscale_pool.AutoscaledPolicy`) starts with one
8-GPU node, may grow to ``max_nodes`` and follows the coordinator's autoscale rule (demand
pending over 60 s scales up, nodes idle 600 s with nothing pending are released, 300 s boot).
Then the same trace runs on fixed clusters of the autoscaled run's **peak** node count and of
its time-weighted **mean** node count. Fixed clusters pay for every GPU from 0 to the makespan;
the autoscaled pool pays for what it provisioned (booting nodes included).

Trace settings as in ``docs/simulation.md`` section 1: ``alibaba_v2023_default.csv``, arrivals
compressed 50x (``time_scale=0.02``), run times clipped at one day, V100-32GB nodes of 8 GPUs,
seed 0.

Run: ``python benchmarks/bench_autoscale.py [--policy gpupool] [--max-nodes 32] [--max-jobs N]``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.autoscale import AutoscaleSettings
from gpupool_sdk.sim.autoscale_pool import AutoscaledPolicy
from gpupool_sdk.sim.engine import SimConfig, Simulator
from gpupool_sdk.sim.metrics import compute_metrics
from gpupool_sdk.sim.runner import make_policy
from gpupool_sdk.sim.trace import load_trace
from gpupool_sdk.sim.workload import WorkloadModel

MODEL = "V100-32GB"


def _policy(name: str, max_pending: int | None) -> Any:
    """``name`` with its defaults (for ``gpupool``: the coordinator's, the whole queue in every snapshot
    unless ``max_pending``)."""
    return make_policy(name, None, max_pending_in_snapshot=max_pending if name == "gpupool" else None)


def _row(m: dict[str, Any], gpu_hours: float, nodes: float, cpu_s: float) -> dict[str, Any]:
    return {
        "nodes": nodes,
        "gpu_hours": round(gpu_hours, 1),
        "avg_jct_s": round(m["avg_jct_s"]),
        "p50_jct_s": round(m["p50_jct_s"]),
        "p99_jct_s": round(m["p99_jct_s"]),
        "avg_queue_s": round(m["avg_queue_s"]),
        "makespan_s": round(m["makespan_s"]),
        "finished": m["finished"],
        "cpu_s": round(cpu_s, 1),
    }


def run(
    policy: str = "gpupool",
    max_nodes: int = 32,
    max_jobs: int | None = None,
    max_pending: int | None = None,
    boot_s: float = 300.0,
    settings: AutoscaleSettings | None = None,
) -> dict[str, Any]:
    trace = load_trace("alibaba_v2023_default.csv", seed=0, time_scale=0.02, max_duration_s=86400, max_jobs=max_jobs)
    settings = settings or AutoscaleSettings(scale_up_after_s=60, scale_down_idle_s=600, min_nodes=1, max_nodes=max_nodes)
    out: dict[str, Any] = {"policy": policy, "jobs": len(trace), "settings": {
        "scale_up_after_s": settings.scale_up_after_s, "scale_down_idle_s": settings.scale_down_idle_s,
        "min_nodes": settings.min_nodes, "max_nodes": settings.max_nodes, "boot_s": boot_s}}
    wrapped = AutoscaledPolicy(_policy(policy, max_pending), settings, initial_nodes=1, boot_s=boot_s)
    t0 = time.process_time()
    result = Simulator(trace.jobs, parse_cluster_spec(f"{max_nodes}*8x{MODEL}"), wrapped, WorkloadModel(seed=0), SimConfig(seed=0)).run()
    usage = wrapped.finish(result.makespan_s)
    out["autoscaled"] = {
        **_row(compute_metrics(result), usage.gpu_hours, round(usage.mean_nodes, 2), time.process_time() - t0),
        "peak_nodes": usage.peak_nodes, "scale_ups": usage.scale_ups, "scale_downs": usage.scale_downs,
    }
    for label, nodes in (("fixed_peak", usage.peak_nodes), ("fixed_mean", max(1, round(usage.mean_nodes)))):
        t0 = time.process_time()
        res = Simulator(trace.jobs, parse_cluster_spec(f"{nodes}*8x{MODEL}"), _policy(policy, max_pending), WorkloadModel(seed=0),
                        SimConfig(seed=0)).run()
        out[label] = _row(compute_metrics(res), res.num_gpus * res.makespan_s / 3600.0, nodes, time.process_time() - t0)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="gpupool")
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--max-jobs", type=int, default=None)
    ap.add_argument("--max-pending", type=int, default=None,
                    help="gpupool only: the head of the queue in each snapshot (default: the whole queue, as the coordinator)")
    args = ap.parse_args()
    print(json.dumps(run(args.policy, args.max_nodes, args.max_jobs, args.max_pending), indent=2))
