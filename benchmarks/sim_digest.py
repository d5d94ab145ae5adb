"""Digest of a ``gpupool`` simulation's full output, to check that a speed-up decides the same.

Runs one simulation with the default policy and prints two hashes: of every cycle's decisions
(time and the whole decision list, ``Queue`` reasons included) and of every job's outcome (end,
first start, preemptions, resizes, restarts, final state), plus the headline metrics. Run it on
two trees (``PYTHONPATH=old`` / ``PYTHONPATH=new``): equal hashes mean identical decisions.

Usage::

    python benchmarks/sim_digest.py --trace pollux_sia_workloads.csv --source 'sia_philly_*' \\
        --max-jobs 1000 --cluster 6*8xV100-32GB                                    # 5a
    python benchmarks/sim_digest.py --trace pollux_sia_workloads.csv --source sia_philly_workload-1 \\
        --time-scale 0.5 --cluster 16*4xT4-16GB                                    # one of 5b
    python benchmarks/sim_digest.py --trace /tmp/alibaba_gpushare.csv --time-scale 0.2 \\
        --max-duration 86400 --cluster 1*8xT4-16GB                                 # 5c
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

from gpupool_sdk.sim.pool_policy import PoolPolicy
from gpupool_sdk.sim.runner import run_simulation
from gpupool_sdk.sim.trace import load_trace


def digest(trace_path: str, cluster: str, sources: tuple[str, ...] = (), max_jobs: int | None = None,
           time_scale: float = 1.0, max_duration_s: float | None = None) -> dict[str, Any]:
    """The decision and outcome hashes of one default-policy run (see the module docstring)."""
    trace = load_trace(trace_path, sources=sources, max_jobs=max_jobs, time_scale=time_scale,
                       max_duration_s=max_duration_s)
    decisions = hashlib.sha256()
    real = PoolPolicy.schedule

    def recording(self: PoolPolicy, sim: Any) -> Any:
        out = real(self, sim)
        decisions.update(repr((sim.now, out)).encode())
        return out

    PoolPolicy.schedule = recording  # type: ignore[method-assign]
    try:
        report = run_simulation(trace, cluster, ["gpupool"])
    finally:
        PoolPolicy.schedule = real  # type: ignore[method-assign]
    jobs = [(j.name, j.end, j.first_start, j.preemptions, j.resizes, j.restarts, j.state)
            for j in report.results["gpupool"].jobs]
    m = report.metrics["gpupool"]
    return {
        "decisions": decisions.hexdigest()[:16],
        "jobs": hashlib.sha256(repr(jobs).encode()).hexdigest()[:16],
        "avg_jct_s": m["avg_jct_s"],
        "preemptions": m["preemptions"],
        "resizes": m["resizes"],
        "cycles": m["cycles"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--source", action="append", default=[])
    ap.add_argument("--max-jobs", type=int)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-duration", type=float)
    a = ap.parse_args()
    print(json.dumps(digest(a.trace, a.cluster, tuple(a.source), a.max_jobs, a.time_scale, a.max_duration)))


if __name__ == "__main__":
    main()
