"""What the simulated pool may know about a job's length (``sim/estimates.py``), and the adapter's
cycle skipping (``PoolPolicy(skip_unchanged=...)``) deciding exactly as running every cycle."""

from __future__ import annotations

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.sim import PoolPolicy, SimConfig, Simulator, WorkloadModel, load_trace
from gpupool_sdk.sim.engine import PENDING, RUNNING, SimJob
from gpupool_sdk.sim.estimates import EstimateModel, JobEstimates
from gpupool_sdk.sim.runner import DEFAULT_POOL_CONFIG
from gpupool_sdk.sim.trace import TraceJob


def _job(i: int, duration: float = 10_000.0) -> SimJob:
    tj = TraceJob(index=i, job_id=f"j{i}", source="t", submit_s=0.0, duration_s=duration, num_gpu=1, gpu_fraction=1.0)
    return SimJob(tj, demand=1, util=1.0, label=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"after_s": -1}, "after_s"), ({"undeclared": 1.5}, "undeclared"), ({"early_stop": -0.1}, "early_stop"),
     ({"early_stop_min": float("nan")}, "early_stop_min"), ({"sigma": 5}, "sigma")],
)
def test_model_is_validated(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        EstimateModel(**kwargs)
    assert err.value.field == field


def test_nothing_is_known_before_the_job_ran_long_enough() -> None:
    est = JobEstimates(EstimateModel(after_s=300.0, undeclared=0.0, early_stop=0.0, sigma=0.0))
    j = _job(0)
    j.state = PENDING
    assert est.remaining_s(j, 0.0) is None  # never ran: the trace's duration stays hidden
    j.state, j.last, j.rate, j.run_s = RUNNING, 0.0, 1.0, 0.0
    assert est.remaining_s(j, 299.0) is None
    assert est.remaining_s(j, 400.0) == pytest.approx(9_600.0)  # exact model: declared - done
    j.remaining, j.run_s, j.last, j.state = 9_000.0, 1_000.0, 1_000.0, PENDING  # preempted after 1,000 s
    assert est.remaining_s(j, 5_000.0) == pytest.approx(9_000.0)  # frozen while it waits


def test_error_model_is_seeded_and_shaped() -> None:
    model = EstimateModel(after_s=0.0, undeclared=0.25, early_stop=0.5, early_stop_min=0.3, sigma=0.2)
    jobs = [_job(i) for i in range(2000)]
    draws = [JobEstimates(model, seed=3).declared(j) for j in jobs]
    assert draws == [JobEstimates(model, seed=3).declared(j) for j in jobs]  # same seed, same draws
    assert draws != [JobEstimates(model, seed=4).declared(j) for j in jobs]
    undeclared = sum(d is None for d in draws) / len(draws)
    assert 0.2 < undeclared < 0.3
    lengths = [d[0] for d in draws if d is not None]
    early = sum(length > 10_000.0 + 1e-6 for length in lengths) / len(lengths)
    assert 0.45 < early < 0.55  # half of the declaring jobs stop before their declared length
    assert all(10_000.0 <= length <= 10_000.0 / 0.3 + 1e-6 for length in lengths)  # never shorter than the truth
    errors = sorted(d[1] for d in draws if d is not None)
    assert errors[len(errors) // 2] == pytest.approx(1.0, abs=0.05) and errors[0] < 0.8 < 1.25 < errors[-1]
    off = JobEstimates(EstimateModel(enabled=False))
    assert all(off.declared(j) is None for j in jobs[:50])


def test_skipping_unchanged_cycles_decides_exactly_the_same() -> None:
    trace = load_trace("pollux_sia_workloads.csv", sources=("sia_philly_workload-1",), max_jobs=100)
    results = {}
    for skip in (True, False):
        policy = PoolPolicy(DEFAULT_POOL_CONFIG, skip_unchanged=skip)
        res = Simulator(trace.jobs, parse_cluster_spec("2*8xV100-32GB"), policy, WorkloadModel(seed=0), SimConfig()).run()
        results[skip] = ([(j.name, j.end, j.preemptions) for j in res.jobs], policy.skipped, policy.cycles)
    assert results[True][0] == results[False][0]
    assert results[True][1] > 0 and results[False][1] == 0  # it did skip
    assert results[True][2] < results[False][2]
    assert sum(p for _, _, p in results[True][0]) > 0  # a congested run, with preemptions
