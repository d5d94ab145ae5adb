"""Trace-driven simulator: the pool's pure scheduler against FIFO, Tiresias, best-fit and Gandiva.

Example:
    >>> from gpupool_sdk.sim import load_trace, run_simulation  # doctest: +SKIP
    >>> report = run_simulation(load_trace("tiresias_60job.csv"), "2*8xV100-32GB", ["fifo", "gpupool"])  # doctest: +SKIP
    >>> sorted(report.to_json()["policies"])  # doctest: +SKIP
    ['fifo', 'gpupool']

See ``docs/simulation.md`` for the model, the policies, the metrics and the results.
"""

from gpupool_sdk.sim.baselines import BestFitPolicy, FifoPolicy, GandivaPolicy, TiresiasPolicy
from gpupool_sdk.sim.engine import SimConfig, SimResult, SimulationError, Simulator
from gpupool_sdk.sim.metrics import compute_metrics, percentile
from gpupool_sdk.sim.pool_policy import PoolMapping, PoolPolicy
from gpupool_sdk.sim.runner import (
    DEFAULT_POOL_CONFIG,
    GandivaSettings,
    SimReport,
    make_policy,
    render_table,
    run_simulation,
    write_plot,
)
from gpupool_sdk.sim.trace import Trace, TraceError, TraceJob, load_trace
from gpupool_sdk.sim.workload import Profile, WorkloadModel

__all__ = [
    "DEFAULT_POOL_CONFIG",
    "BestFitPolicy",
    "FifoPolicy",
    "GandivaPolicy",
    "GandivaSettings",
    "PoolMapping",
    "PoolPolicy",
    "Profile",
    "SimConfig",
    "SimReport",
    "SimResult",
    "SimulationError",
    "Simulator",
    "TiresiasPolicy",
    "Trace",
    "TraceError",
    "TraceJob",
    "WorkloadModel",
    "compute_metrics",
    "load_trace",
    "make_policy",
    "percentile",
    "render_table",
    "run_simulation",
    "write_plot",
]
