"""The ``gpupool`` adapter's refreshed views are the views a full rebuild gives, and a run with
them decides exactly what a run that rebuilds every view decides.

``PoolPolicy`` refreshes a running job's view every ``view_refresh_s`` (its attained service and
remaining time move with the clock) by copying the last view with those fields replaced, so the
allocations tuple stays the same object and the scheduler's ledger keeps the job's holdings
(``policy._same_holdings``). That is only right while every other change of a job goes through
``_on_change`` (a full rebuild): checked here on a congested run, view by view.
"""

from __future__ import annotations

from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.types import JobView
from gpupool_sdk.sim.engine import SimConfig, SimJob, Simulator
from gpupool_sdk.sim.pool_policy import PoolPolicy
from gpupool_sdk.sim.runner import DEFAULT_POOL_CONFIG
from gpupool_sdk.sim.trace import load_trace
from gpupool_sdk.sim.workload import WorkloadModel


class _Checked(PoolPolicy):
    """Asserts each refreshed view equals a rebuilt one; records every decision."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_POOL_CONFIG)
        self.refreshes = 0
        self.log: list[object] = []

    def _refreshed(self, job: SimJob, old: JobView) -> JobView:
        new = super()._refreshed(job, old)
        assert new == self._view(job), job.name
        assert new.allocations is old.allocations
        self.refreshes += 1
        return new

    def schedule(self, sim: Simulator) -> list:  # type: ignore[override]
        out = super().schedule(sim)
        self.log.append((sim.now, out))
        return out


class _Rebuilt(_Checked):
    """The from-scratch path: every refresh rebuilds the view (new allocations, new holdings)."""

    def _refreshed(self, job: SimJob, old: JobView) -> JobView:
        self.refreshes += 1
        return self._view(job)


def test_refreshed_views_equal_rebuilt_ones_and_decide_the_same() -> None:
    trace = load_trace("pollux_sia_workloads.csv", sources=("sia_philly_workload-1",), max_jobs=120)
    runs = {}
    for cls in (_Checked, _Rebuilt):
        policy = cls()
        res = Simulator(trace.jobs, parse_cluster_spec("2*8xV100-32GB"), policy, WorkloadModel(seed=0), SimConfig()).run()
        runs[cls] = ([(j.name, j.end, j.preemptions, j.resizes) for j in res.jobs], policy.log, policy.refreshes)
    (jobs_a, log_a, n_a), (jobs_b, log_b, n_b) = runs[_Checked], runs[_Rebuilt]
    assert jobs_a == jobs_b
    assert log_a == log_b
    assert n_a == n_b and n_a > 200, (n_a, n_b)  # the run refreshed views, or this proves nothing
    assert sum(p for _, _, p, _ in jobs_a) > 0  # congested: preemptions
