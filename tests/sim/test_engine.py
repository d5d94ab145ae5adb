"""The simulator reproduces hand-computed schedules exactly, for fifo and for gpupool."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GiB
from gpupool_sdk.sim.baselines import BestFitPolicy, FifoPolicy, TiresiasPolicy
from gpupool_sdk.sim.engine import DONE, SimConfig, SimulationError, Simulator
from gpupool_sdk.sim.metrics import compute_metrics
from gpupool_sdk.sim.pool_policy import RANKED_CLASS_PRIORITY, PoolMapping, PoolPolicy, parse_class_priority
from gpupool_sdk.sim.runner import DEFAULT_POOL_CONFIG
from gpupool_sdk.sim.trace import load_trace
from gpupool_sdk.sim.workload import Profile, WorkloadModel

HEADER = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n"

# One profile (50 % GPU busy, class 1) and a flat colocation speed of 0.5, so hand arithmetic is exact.
WORKLOAD = WorkloadModel(profiles=[Profile("p", 0.5, 4096.0, 1)], slowdown=[[0.5] * 3] * 3)
CONFIG = SimConfig(checkpoint_s=10.0, restart_s=20.0, tick_s=0.0)
RANKED = PoolMapping(class_priority=RANKED_CLASS_PRIORITY)


def _trace(tmp_path: Path, rows: str):
    path = tmp_path / "tiny.csv"
    path.write_text(HEADER + rows)
    return load_trace(path)


def _run(tmp_path: Path, rows: str, policy, cluster: str = "2xV100-32GB"):
    trace = _trace(tmp_path, rows)
    result = Simulator(trace.jobs, parse_cluster_spec(cluster), policy, WORKLOAD, CONFIG).run()
    return {j.tj.job_id: (j.first_start, j.end) for j in result.jobs}, result


FIVE_JOBS = (
    "a,t,0,,,100,2,1.0,,,gpu_mem_gib=4\n"
    "b,t,10,,,50,1,1.0,,,gpu_mem_gib=4\n"
    "c,t,20,,,30,1,1.0,,,gpu_mem_gib=4\n"
    "d,t,30,,,40,2,1.0,,,gpu_mem_gib=4\n"
    "e,t,40,,,10,1,1.0,,,gpu_mem_gib=4\n"
)


def test_fifo_reproduces_hand_schedule(tmp_path: Path) -> None:
    # 2 GPUs, strict FIFO, whole GPUs:
    #   a (2 GPUs) runs 0-100; b, c, d, e queue behind it.
    #   t=100: b and c start (one GPU each); c ends 130, b ends 150.
    #   t=130: d needs 2 GPUs, only 1 free -> waits; e is behind d (head-of-line blocking).
    #   t=150: d runs 150-190; t=190: e runs 190-200.
    times, _ = _run(tmp_path, FIVE_JOBS, FifoPolicy())
    assert times == {
        "a": (0.0, 100.0),
        "b": (100.0, 150.0),
        "c": (100.0, 130.0),
        "d": (150.0, 190.0),
        "e": (190.0, 200.0),
    }


def test_gpupool_reproduces_hand_schedule(tmp_path: Path) -> None:
    # Same trace under the pool's scheduler (untagged rows = guaranteed, priority 0, compute 1.0):
    #   a 0-100; t=100: b and c start; t=130: c ends, d (2 GPUs) cannot fit, e backfills 130-140
    #   (d waited 100 s < reserve_after_s, so no GPUs are held for it); t=150: b ends, d runs 150-190.
    times, _ = _run(tmp_path, FIVE_JOBS, PoolPolicy(DEFAULT_POOL_CONFIG))
    assert times == {
        "a": (0.0, 100.0),
        "b": (100.0, 150.0),
        "c": (100.0, 130.0),
        "d": (150.0, 190.0),
        "e": (130.0, 140.0),
    }


def test_gpupool_packs_fractional_jobs_with_colocation_slowdown(tmp_path: Path) -> None:
    # Two half-GPU jobs on one GPU: fifo gives each a whole GPU in turn (0-100, 100-200);
    # gpupool packs both at t=0 (compute 0.5 + 0.5), each at colocation speed 0.5: both end at 200.
    rows = "x,t,0,,,100,1,0.5,LS,,gpu_mem_gib=4\ny,t,0,,,100,1,0.5,LS,,gpu_mem_gib=4\n"
    fifo, _ = _run(tmp_path, rows, FifoPolicy(), cluster="1xV100-32GB")
    assert fifo == {"x": (0.0, 100.0), "y": (100.0, 200.0)}
    pool, _ = _run(tmp_path, rows, PoolPolicy(DEFAULT_POOL_CONFIG), cluster="1xV100-32GB")
    assert pool == {"x": (0.0, 200.0), "y": (0.0, 200.0)}


def test_gpupool_preempts_best_effort_for_latency_sensitive(tmp_path: Path) -> None:
    # One 32 GiB GPU. x (BE -> shared, 20 GiB used, 25 GiB asked) runs from 0.
    # y (LS -> guaranteed, ranked priority 10, 25 GiB asked) arrives at 50: 25 + 25 > 32 and ballooning x
    # to its predicted peak (22 GiB) is not enough, so x is preempted at 50, checkpoints 10 s, acks at 60,
    # is released; y runs 60-100. x had 50 s of work left + 20 s restart = 70 s: it runs 100-170.
    rows = "x,t,0,,,100,1,1.0,BE,,gpu_mem_gib=20\ny,t,50,,,40,1,1.0,LS,,gpu_mem_gib=20\n"
    times, result = _run(tmp_path, rows, PoolPolicy(DEFAULT_POOL_CONFIG, RANKED), cluster="1xV100-32GB")
    assert times == {"x": (0.0, 170.0), "y": (60.0, 100.0)}
    assert result.preemptions == 1
    x = next(j for j in result.jobs if j.tj.job_id == "x")
    assert x.preemptions == 1 and x.pending_s == pytest.approx(40.0)


def test_tiresias_preempts_job_past_its_queue_threshold(tmp_path: Path) -> None:
    # 1 GPU, threshold 50 GPU-s. a (0, 200 s) crosses into queue 1 at t=50; b (arrived 20) is in queue 0
    # and takes the GPU: a is preempted at 50, acks at 60; b runs 60-90; a resumes at 90 with
    # 150 s + 20 s restart left and ends at 260.
    rows = "a,t,0,,,200,1,1.0,,,gpu_mem_gib=4\nb,t,20,,,30,1,1.0,,,gpu_mem_gib=4\n"
    times, _ = _run(tmp_path, rows, TiresiasPolicy(thresholds_gpu_s=(50.0,), starve_ratio=0), cluster="1xV100-32GB")
    assert times == {"a": (0.0, 260.0), "b": (60.0, 90.0)}


def test_bestfit_packs_fractions_on_the_fullest_gpu(tmp_path: Path) -> None:
    # 2 GPUs; p (0.6) lands on GPU 0, q (0.3) best-fits next to it (leftover 0.1), r (0.5) needs GPU 1.
    rows = (
        "p,t,0,,,100,1,0.6,,,gpu_mem_gib=4\n"
        "q,t,1,,,100,1,0.3,,,gpu_mem_gib=4\n"
        "r,t,2,,,100,1,0.5,,,gpu_mem_gib=4\n"
    )
    trace = _trace(tmp_path, rows)
    sim = Simulator(trace.jobs, parse_cluster_spec("2xV100-32GB"), BestFitPolicy(), WORKLOAD, CONFIG)
    placed: dict[str, list[int]] = {}
    sim.listeners.append(lambda j: placed.setdefault(j.tj.job_id, list(j.gpus)) if j.gpus else None)
    sim.run()
    assert placed["p"] == placed["q"] and placed["r"] != placed["p"]


def test_failures_requeue_jobs_and_everything_finishes(tmp_path: Path) -> None:
    trace = _trace(tmp_path, "".join(f"j{i},t,{i * 5},,,300,1,1.0,,,gpu_mem_gib=4\n" for i in range(20)))
    cfg = SimConfig(failure_mtbf_h=0.5, repair_s=100.0, checkpoint_interval_s=60.0, tick_s=0.0, seed=3)
    result = Simulator(trace.jobs, parse_cluster_spec("4xV100-32GB"), FifoPolicy(), WORKLOAD, cfg).run()
    assert result.failures > 0
    assert all(j.state == DONE for j in result.jobs)
    assert sum(j.failures for j in result.jobs) > 0


def test_thrashing_policy_is_stopped_with_a_clear_error(tmp_path: Path) -> None:
    trace = _trace(tmp_path, "".join(f"j{i},t,0,,,300,1,1.0,,,gpu_mem_gib=4\n" for i in range(3)))
    cfg = SimConfig(failure_mtbf_h=0.001, repair_s=1.0, tick_s=0.0, max_cycles=500)
    with pytest.raises(SimulationError, match="no end after"):
        Simulator(trace.jobs, parse_cluster_spec("1xV100-32GB"), FifoPolicy(), WORKLOAD, cfg).run()


def test_metrics_of_the_fifo_schedule(tmp_path: Path) -> None:
    # FIFO schedule above: JCTs a 100, b 140, c 110, d 160, e 160; queueing 0, 90, 80, 120, 150.
    # Allocated GPU-seconds 200 + 50 + 30 + 80 + 10 = 370 over makespan 200 on 2 GPUs -> 0.925.
    # Used compute = 0.5 (profile) x 0.925; memory used = 4 GiB of 32 GiB on every busy GPU.
    _, result = _run(tmp_path, FIVE_JOBS, FifoPolicy())
    m = compute_metrics(result)
    assert m["avg_jct_s"] == pytest.approx(134.0)
    assert m["p50_jct_s"] == 140.0
    assert m["p99_jct_s"] == 160.0
    assert m["avg_queue_s"] == pytest.approx(88.0)
    assert m["makespan_s"] == 200.0
    assert m["gpu_alloc_util"] == pytest.approx(0.925)
    assert m["gpu_used_util"] == pytest.approx(0.4625)
    assert m["mem_util"] == pytest.approx(0.925 * 4 * GiB / (32 * GiB))
    assert m["mem_granted_util"] == pytest.approx(0.925)
    assert m["preemptions"] == 0 and m["finished"] == 5


def test_stranded_fraction_counts_free_share_the_next_job_cannot_use(tmp_path: Path) -> None:
    # 1 GPU under bestfit: p (0.7) runs 0-100; q (0.5) arrives at 1 and cannot use the 0.3 left, so
    # 0.3 GPU is stranded from 1 to 100; q then runs 100-110. Fraction = 0.3 * 99 / 110.
    rows = "p,t,0,,,100,1,0.7,,,gpu_mem_gib=4\nq,t,1,,,10,1,0.5,,,gpu_mem_gib=4\n"
    times, result = _run(tmp_path, rows, BestFitPolicy(), cluster="1xV100-32GB")
    assert times == {"p": (0.0, 100.0), "q": (100.0, 110.0)}
    m = compute_metrics(result)
    assert m["stranded_gpu_fraction"] == pytest.approx(0.3 * 99 / 110)
    assert m["gpu_alloc_util"] == pytest.approx((0.7 * 100 + 0.5 * 10) / 110)


def test_per_job_preemption_cost_from_extra(tmp_path: Path) -> None:
    # As the BE/LS case above, but x declares checkpoint_s=5 and restart_s=50 in extra:
    # preempted at 50, acks at 55; y runs 55-95; x has 50 + 50 s left and runs 95-195.
    rows = (
        "x,t,0,,,100,1,1.0,BE,,gpu_mem_gib=20;checkpoint_s=5;restart_s=50\n"
        "y,t,50,,,40,1,1.0,LS,,gpu_mem_gib=20\n"
    )
    times, _ = _run(tmp_path, rows, PoolPolicy(DEFAULT_POOL_CONFIG, RANKED), cluster="1xV100-32GB")
    assert times == {"x": (0.0, 195.0), "y": (55.0, 95.0)}


def test_classes_choose_qos_not_priority_by_default(tmp_path: Path) -> None:
    # The BE/LS pair again with the default mapping: both priority 0, so y (LS) does not preempt x (BE);
    # x runs 0-100, y waits and runs 100-140. The classes still choose the QoS.
    rows = "x,t,0,,,100,1,1.0,BE,,gpu_mem_gib=20\ny,t,50,,,40,1,1.0,LS,,gpu_mem_gib=20\n"
    policy = PoolPolicy(DEFAULT_POOL_CONFIG)
    times, result = _run(tmp_path, rows, policy, cluster="1xV100-32GB")
    assert times == {"x": (0.0, 100.0), "y": (100.0, 140.0)}
    assert result.preemptions == 0
    specs = {j.tj.job_id: policy.spec_for(j) for j in result.jobs}
    assert (specs["x"].qos, specs["x"].priority) == ("shared", 0)
    assert (specs["y"].qos, specs["y"].priority) == ("guaranteed", 0)
    # Per-class metrics: y waited 50 s, x none.
    by_class = compute_metrics(result)["by_class"]
    assert by_class == {
        "BE": {"jobs": 1, "avg_jct_s": 100.0, "avg_queue_s": 0.0},
        "LS": {"jobs": 1, "avg_jct_s": 90.0, "avg_queue_s": 50.0},
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [("LS=10, be=0", {"ls": 10, "be": 0}), ("", {}), ("Guaranteed=-3,", {"guaranteed": -3})],
)
def test_class_priority_parses(text: str, expected: dict[str, int]) -> None:
    assert parse_class_priority(text) == expected


@pytest.mark.parametrize("text", ["LS", "LS=ten", "=3", "LS=1.5"])
def test_bad_class_priority_names_the_field_and_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"class_priority: expected CLASS=INT pairs .*LS=10,BE=0"):
        parse_class_priority(text)
