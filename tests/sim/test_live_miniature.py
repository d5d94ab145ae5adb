"""A live pool in miniature orders jobs the way the simulator does (issue 14, ``benchmarks/live_miniature.py``).

The end-to-end test runs the 30 jobs of ``tests/data/live_miniature.csv`` as real processes
against a real coordinator and agent (one trace hour = 5 s) and the same compressed trace
through the simulator with the same policy file. The bounds are rank agreements and counts, not
times, set from the runs measured in ``docs/simulation.md`` section 8 (7 runs at this compression
on the shared 2-core machine at load 8-20: finish-order Kendall tau 0.70-0.95, start-order tau
>= 0.97, pairs finishing more than an hour apart in the simulator in the same order 0.88-0.99,
16-22 preemptions against the simulator's 17). The coordinator as it was before a preempted job's
estimate was kept measured tau 0.68 and 91 preemptions: the preemption bound catches that.

The other tests check the pieces without processes: the compression of the trace and of the
policy file, the job processes' estimate formula against the simulator's, and the rank statistics.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import uuid
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    name = "live_miniature"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "live_miniature.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


lm = _runner()


def test_rank_agreement_counts_pairs_ties_and_reversals() -> None:
    same = lm.rank_agreement({"a": 1, "b": 2, "c": 3}, {"a": 5, "b": 6, "c": 7})
    assert same == {"kendall_tau": 1.0, "spearman_rho": 1.0, "pairs_same": 1.0, "pairs": 3.0}
    rev = lm.rank_agreement({"a": 1, "b": 2, "c": 3}, {"a": 3, "b": 2, "c": 1})
    assert rev["kendall_tau"] == -1.0 and rev["pairs_same"] == 0.0 and math.isclose(rev["spearman_rho"], -1.0)
    one_swap = lm.rank_agreement({"a": 1, "b": 2, "c": 3, "d": 4}, {"a": 1, "b": 3, "c": 2, "d": 4})
    assert one_swap["pairs_same"] == 5 / 6 and math.isclose(one_swap["kendall_tau"], 4 / 6)
    tied = lm.rank_agreement({"a": 1, "b": 1, "c": 2}, {"a": 1, "b": 2, "c": 3})
    assert tied["pairs"] == 2.0 and tied["pairs_same"] == 1.0 and tied["kendall_tau"] < 1.0


def test_the_scaled_policy_file_reads_back_exactly_with_only_durations_divided(tmp_path: Path) -> None:
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER, load_policy_config

    scaled = lm.scale_policy(DEFAULT_SCHEDULER, 720.0)
    path = tmp_path / "p.toml"
    lm.write_policy_file(scaled, path, "comment\nlines")
    back = load_policy_config(path).scheduler
    assert back == scaled
    assert back.las_threshold_gpu_s == tuple(t / 720 for t in DEFAULT_SCHEDULER.las_threshold_gpu_s)
    assert back.reserve_after_s == DEFAULT_SCHEDULER.reserve_after_s / 720
    assert back.preempt_grace_s == DEFAULT_SCHEDULER.preempt_grace_s  # a real process's deadline: not scaled


def test_a_trace_the_job_processes_cannot_run_is_refused_naming_row_and_column(tmp_path: Path) -> None:
    from gpupool_sdk.errors import ConfigError

    shared = tmp_path / "shared.csv"
    shared.write_text("job_id,submit_s,duration_s,num_gpu,gpu_fraction\na,0,60,1,1.0\nb,5,60,1,0.5\n")
    with pytest.raises(ConfigError, match=r"row 3, column 'gpu_fraction'.*whole-GPU"):
        lm.compress_trace(shared, tmp_path / "out.csv", 720.0)
    elastic = tmp_path / "elastic.csv"
    elastic.write_text("job_id,submit_s,duration_s,num_gpu,gpu_fraction,extra\na,0,60,2,1.0,min_gpu=1\n")
    with pytest.raises(ConfigError, match=r"row 2, column 'extra'.*elastic"):
        lm.compress_trace(elastic, tmp_path / "out.csv", 720.0)
    with pytest.raises(ConfigError, match="--hour-s"):
        lm.run(hour_s=0.0, workdir=tmp_path)


def test_the_job_processes_estimate_is_the_simulators(tmp_path: Path) -> None:
    from gpupool_sdk.inventory.simulated import parse_cluster_spec
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
    from gpupool_sdk.sim import PoolPolicy, Simulator, WorkloadModel, load_trace
    from gpupool_sdk.sim.engine import RUNNING
    from gpupool_sdk.sim.estimates import JobEstimates

    small = tmp_path / "c.csv"
    lm.compress_trace(lm.DEFAULT_TRACE, small, 720.0)
    trace = load_trace(small)
    original = load_trace(lm.DEFAULT_TRACE)
    assert [round(j.duration_s * 720, 6) for j in trace.jobs] == [j.duration_s for j in original.jobs]
    times = lm.EngineTimes().scaled(720.0)
    plans = lm.plan_jobs(trace, lm.DEFAULT_CLUSTER, lm.scale_policy(DEFAULT_SCHEDULER, 720.0), times, seed=0)
    assert [p.name for p in plans] == [j.name for j in trace.jobs]
    assert any(p.declared_s is None for p in plans) and any(p.declared_s is not None for p in plans)
    policy = PoolPolicy(DEFAULT_SCHEDULER, estimates=times.estimates())
    sim = Simulator(trace.jobs, parse_cluster_spec(lm.DEFAULT_CLUSTER), policy, WorkloadModel(seed=0),
                    times.sim_config(0))
    draws = JobEstimates(times.estimates(), 0)
    for plan, job in zip(plans, sim.jobs, strict=True):
        for ran, left in ((0.1, plan.duration_s), (1.0, plan.duration_s * 0.7), (5.0, 0.2), (9.0, -0.01)):
            job.state, job.run_s, job.last, job.remaining, job.rate, job.scale = RUNNING, ran, 100.0, left, 1.0, 1.0
            assert plan.remaining_s(ran, left) == draws.remaining_s(job, 100.0), (plan.name, ran, left)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_live_pool_in_miniature_orders_jobs_like_the_simulator(etcd_endpoint: str, tmp_path: Path) -> None:
    prefix = f"/gpupool-test/{uuid.uuid4().hex}"
    try:
        report = lm.run(hour_s=5.0, endpoint=etcd_endpoint, prefix=prefix, workdir=tmp_path)
    except (TimeoutError, RuntimeError):
        for log in sorted(tmp_path.glob("*.log")):
            if log.name in ("coordinator.log", "agent.log") or "error" in log.read_text(errors="replace").lower():
                sys.stderr.write(f"\n----- {log.name} -----\n{log.read_text(errors='replace')[-3000:]}\n")
        raise
    # The compression itself changes nothing in the simulator: same order, same preemptions.
    exact = report["compressed_sim_vs_sim"]
    assert exact["finish_order"]["kendall_tau"] == 1.0 and exact["start_order"]["kendall_tau"] == 1.0
    assert exact["preemptions_live"] == exact["preemptions_sim"]
    c = report["live_vs_sim"]
    summary = "\n".join(lm.summary_lines(report))
    print(summary)  # shown with -s, and with the failure
    assert c["finished_both"] == c["jobs"] == 30, summary
    assert c["finish_order"]["kendall_tau"] >= 0.6, summary
    assert c["start_order"]["kendall_tau"] >= 0.9, summary
    assert c["finish_pairs_separated"]["same"] >= 0.8, summary
    # Preemptions: as many as the simulator's within a factor of 2 (no back-and-forth preempting).
    assert c["preemptions_sim"] / 2 <= c["preemptions_live"] <= 2 * c["preemptions_sim"], summary
    # The live order is the simulated gpupool's, not another policy's: closer to it (Kendall tau)
    # than to the order FIFO, Tiresias (LAS without estimates) or best-fit give in the simulator.
    # Smallest margins over 16 runs: FIFO 0.34, best-fit 0.30, Tiresias 0.14. Gandiva's (0.08) and
    # gpupool's on other information (0.06) are closer: reported, not asserted (docs section 8).
    tau = c["finish_order"]["kendall_tau"]
    closest = max(((k, report["live_vs_others_tau"][k]) for k in ("fifo", "tiresias", "bestfit")), key=lambda kv: kv[1])
    assert tau > closest[1], f"{summary}\nlive order closer to simulated {closest}"
