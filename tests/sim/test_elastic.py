"""Elastic jobs in the simulator: hand-computed schedules of the pool's grow-by-Resize and
shrink-for-a-pending-job, and bad bounds.

Speed model (``gpupool_sdk.sim.engine``): on ``k`` slices a job asking ``n`` runs at
``throughput(k) / throughput(n)`` with ``throughput(k) = k / (1 + sigma * (k - 1))``. With
``sigma = 0.25``: throughput(1) = 1, throughput(2) = 1.6, so one slice of a 2-GPU job runs at
0.625 and a 1-GPU job on two slices at 1.6 (both exact in binary, so the schedules are exact).
A resize costs what a preemption costs: 10 s checkpoint (no progress) + 20 s restart work.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpupool_sdk.cli.simulate_cmd import simulate
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.types import Decision, Grant, SliceGrant
from gpupool_sdk.sim.baselines import FifoPolicy
from gpupool_sdk.sim.engine import (
    DONE,
    REJECTED,
    SimConfig,
    SimResult,
    SimulationError,
    Simulator,
    elastic_scale,
    elastic_throughput,
)
from gpupool_sdk.sim.pool_policy import PoolMapping, PoolPolicy, parse_elastic
from gpupool_sdk.sim.runner import DEFAULT_POOL_CONFIG
from gpupool_sdk.sim.trace import TraceError, load_trace
from gpupool_sdk.sim.workload import Profile, WorkloadModel

HEADER = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n"

# As tests/sim/test_engine.py: one profile, flat colocation speed 0.5 (no job here shares a GPU).
WORKLOAD = WorkloadModel(profiles=[Profile("p", 0.5, 4096.0, 1)], slowdown=[[0.5] * 3] * 3)
CONFIG = SimConfig(checkpoint_s=10.0, restart_s=20.0, tick_s=0.0, elastic_sigma=0.25)

# a: rigid, 1 GPU, 100 s. b: 2 GPUs for 200 s, may run on 1 (min_gpu=1).
ELASTIC_B = "a,t,0,,,100,1,1.0,,,gpu_mem_gib=4\nb,t,0,,,200,2,1.0,,,gpu_mem_gib=4;min_gpu=1\n"
RIGID_B = "a,t,0,,,100,1,1.0,,,gpu_mem_gib=4\nb,t,0,,,200,2,1.0,,,gpu_mem_gib=4\n"


def _run(
    tmp_path: Path, rows: str, policy: object, cluster: str = "2xV100-32GB", config: SimConfig = CONFIG
) -> tuple[dict[str, tuple[float | None, float | None]], SimResult]:
    path = tmp_path / "tiny.csv"
    path.write_text(HEADER + rows)
    trace = load_trace(path)
    result = Simulator(trace.jobs, parse_cluster_spec(cluster), policy, WORKLOAD, config).run()  # type: ignore[arg-type]
    return {j.tj.job_id: (j.first_start, j.end) for j in result.jobs}, result


def _pool(mapping: PoolMapping | None = None) -> PoolPolicy:
    return PoolPolicy(DEFAULT_POOL_CONFIG, mapping)


def test_scaling_model_values() -> None:
    assert elastic_throughput(2, 0.25) == 1.6
    assert elastic_scale(1, 2, 0.25) == 0.625
    assert elastic_scale(2, 1, 0.25) == 1.6
    assert elastic_scale(4, 2, 0.0) == 2.0  # sigma 0: linear
    assert elastic_scale(8, 1, 1.0) == 1.0  # sigma 1: no speed-up at all
    assert elastic_scale(3, 3, 0.05) == 1.0  # exactly 1 on the count asked for


def test_elastic_job_starts_on_fewer_gpus_then_grows(tmp_path: Path) -> None:
    # 2 GPUs. t=0: a takes one GPU; b (2 GPUs wanted, min 1) starts at once on the other at 0.625.
    # t=100: a ends; b has done 62.5 s of its 200, 137.5 left. Nothing pending: the scheduler resizes b
    # to 2; b checkpoints 100-110 (no progress), acks, is released and granted 2 slices at 110 with
    # 137.5 + 20 restart = 157.5 s of work at speed 1: ends at 267.5 (rigid: 300, see below).
    times, result = _run(tmp_path, ELASTIC_B, _pool())
    assert times == {"a": (0.0, 100.0), "b": (0.0, 267.5)}
    assert result.resizes == 1 and result.preemptions == 0
    b = next(j for j in result.jobs if j.tj.job_id == "b")
    assert (b.resizes, b.preemptions, b.restarts) == (1, 0, 1)
    assert b.pending_s == 0.0


def test_rigid_job_schedule_is_unchanged(tmp_path: Path) -> None:
    # Same trace without min_gpu: b waits for a (100) and runs 100-300; no resize.
    times, result = _run(tmp_path, RIGID_B, _pool())
    assert times == {"a": (0.0, 100.0), "b": (100.0, 300.0)}
    assert result.resizes == 0


def test_baselines_keep_elastic_rows_rigid(tmp_path: Path) -> None:
    # fifo grants num_gpu GPUs whatever the row says: b waits for a, as in the rigid case.
    times, result = _run(tmp_path, ELASTIC_B, FifoPolicy())
    assert times == {"a": (0.0, 100.0), "b": (100.0, 300.0)}
    assert result.resizes == 0


def test_elastic_flag_grows_a_lone_job_at_once(tmp_path: Path) -> None:
    # --elastic 0.5,2: the 1-GPU job may use 1-2 GPUs. t=0: nothing else waits, so its grant is
    # enlarged to 2 slices in the same cycle (no resize, no checkpoint): 100 s of work at 1.6 = 62.5 s.
    # (Before: granted 1 slice, resized to 2 by the follow-up cycle at t=0, checkpoint 0-10, then
    # 100 + 20 s of work at 1.6 = 75 s: ended at 85, 1 resize.)
    policy = _pool(PoolMapping(elastic=(0.5, 2.0)))
    times, result = _run(tmp_path, "a,t,0,,,100,1,1.0,,,gpu_mem_gib=4\n", policy)
    assert times == {"a": (0.0, 62.5)}
    assert result.resizes == 0
    a = result.jobs[0]
    assert (a.resizes, a.restarts) == (0, 0)
    assert (policy.spec_for(a).min_gpus, policy.spec_for(a).max_gpus) == (1, 2)


def test_resize_holds_the_room_it_grows_into(tmp_path: Path) -> None:
    # r (rigid, 1 GPU, 50 s) and x (1 GPU, 100 s, elastic 1-2) arrive at 0 on 2 GPUs: each gets one
    # (x cannot grow). t=50: r ends, x (50 s done, 50 left) is resized to 2 and checkpoints 50-60.
    # y (rigid, 1 GPU, 50 s) arrives at 55: the free GPU is held for x's resize, so y queues.
    # t=60: x acks and is re-granted 2 slices: 50 + 20 restart = 70 s of work at 1.6 = 43.75 s, ends
    # at 103.75; y starts then and ends at 153.75. One resize, no preemption.
    # (Before: y took the GPU at 55 and ran 55-105; x was re-granted 1 slice at 60 with 70 s of work,
    # had 25 left at 105, was resized again (checkpoint 105-115, 45 s at 1.6) and ended at 143.125
    # after 2 resizes.)
    rows = (
        "r,t,0,,,50,1,1.0,,,gpu_mem_gib=4;min_gpu=1;max_gpu=1\n"
        "x,t,0,,,100,1,1.0,,,gpu_mem_gib=4\n"
        "y,t,55,,,50,1,1.0,,,gpu_mem_gib=4;min_gpu=1;max_gpu=1\n"
    )
    times, result = _run(tmp_path, rows, _pool(PoolMapping(elastic=(0.5, 2.0))))
    assert times == {"r": (0.0, 50.0), "x": (0.0, 103.75), "y": (103.75, 153.75)}
    assert result.resizes == 1 and result.preemptions == 0


def test_elastic_job_grows_past_a_queued_gang_that_cannot_use_the_room(tmp_path: Path) -> None:
    # 3 GPUs. a (rigid, 1 GPU, 40 s), b (rigid, 1 GPU, 100 s), x (1 GPU, 120 s, elastic 1-2) at 0:
    # one GPU each. g (rigid gang of 3, 10 s) arrives at 1 and queues (every GPU is busy; no
    # preemption among equal priorities). t=40: a ends; g cannot be placed on the 1 free GPU, so x
    # (40 s done, 80 left) grows into it: checkpoint 40-50, then 80 + 20 = 100 s of work at 1.6 =
    # 62.5 s: ends at 112.5 (b ends at 100); g runs 112.5-122.5. (Before: the queued g blocked all
    # growth; the freed GPU idled from 40, x ended at 120 on 1 GPU and g ran 120-130.)
    rows = (
        "a,t,0,,,40,1,1.0,,,gpu_mem_gib=4;min_gpu=1;max_gpu=1\n"
        "b,t,0,,,100,1,1.0,,,gpu_mem_gib=4;min_gpu=1;max_gpu=1\n"
        "x,t,0,,,120,1,1.0,,,gpu_mem_gib=4\n"
        "g,t,1,,,10,3,1.0,,,gpu_mem_gib=4;min_gpu=3;max_gpu=3\n"
    )
    times, result = _run(tmp_path, rows, _pool(PoolMapping(elastic=(0.5, 2.0))), cluster="3xV100-32GB")
    assert times == {"a": (0.0, 40.0), "b": (0.0, 100.0), "x": (0.0, 112.5), "g": (112.5, 122.5)}
    assert result.resizes == 1 and result.preemptions == 0


def test_elastic_job_is_shrunk_for_a_higher_priority_job_then_grows_back(tmp_path: Path) -> None:
    # 2 GPUs. e (2 GPUs for 200 s, min 1, priority 0) runs alone on both from 0. p (rigid, 1 GPU,
    # 100 s, priority 5) arrives at 50: instead of preempting e, the scheduler resizes it to 1 for p
    # (it gives up GPU 0 and keeps GPU 1). e checkpoints 50-60 (150 s of work left), acks, and in the
    # same cycle p is granted GPU 0 and e is re-granted GPU 1: 150 + 20 restart = 170 s of work at
    # scale(1, 2) = 0.625. t=160: p ends; e has done 100 x 0.625 = 62.5 (107.5 left) and is resized
    # back to 2: checkpoint 160-170, then 107.5 + 20 = 127.5 s at speed 1: ends at 297.5.
    # 2 resizes, no preemption. (Before, e was preempted whole at 50: released at 60, it waited for
    # the next cycle (110, p's directive deadline) to get 1 GPU and ended at 328.75.)
    rows = (
        "e,t,0,,,200,2,1.0,,,gpu_mem_gib=4;min_gpu=1\n"
        "p,t,50,,,100,1,1.0,5,,gpu_mem_gib=4;min_gpu=1;max_gpu=1\n"
    )
    times, result = _run(tmp_path, rows, _pool())
    assert times == {"e": (0.0, 297.5), "p": (60.0, 160.0)}
    assert result.resizes == 2 and result.preemptions == 0
    e = next(j for j in result.jobs if j.tj.job_id == "e")
    assert (e.resizes, e.preemptions, e.restarts) == (2, 0, 2)


def test_gpu_used_metric_ignores_the_scaling_factor(tmp_path: Path) -> None:
    # The elastic b on one slice keeps its GPU as busy as its profile says (0.5), not 0.5 x 0.625.
    _, result = _run(tmp_path, ELASTIC_B, _pool())
    # GPU-seconds used: a 100 x 0.5; b 100 x 0.5 on one GPU, 157.5 x 2 x 0.5 on two (the checkpoint
    # 100-110 makes no progress and keeps nothing busy).
    assert result.used_gpu_s == pytest.approx(50.0 + 50.0 + 157.5)


class _OneSlicePolicy(FifoPolicy):
    """Grants every pending job exactly one slice on GPU 0 (to exercise the engine's check)."""

    name = "one-slice"

    def schedule(self, sim: Simulator) -> Sequence[Decision]:
        out: list[Decision] = []
        for job in list(sim.pending.values()):
            g = sim.gpus[0]
            s = SliceGrant(node=g.node, gpu_uuid=g.uuid, gpu_index=g.index, memory_bytes=job.demand, compute_share=1.0)
            out.append(Grant(job.name, (s,)))
        return out


def test_engine_rejects_grants_outside_the_bounds(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match=r"Grant for j0 has 1 slices; the job asks 2"):
        _run(tmp_path, "b,t,0,,,200,2,1.0,,,gpu_mem_gib=4\n", _OneSlicePolicy())
    with pytest.raises(SimulationError, match=r"Grant for j0 has 1 slices; the job accepts 2-4 \(elastic\)"):
        _run(tmp_path, "b,t,0,,,200,2,1.0,,,gpu_mem_gib=4;max_gpu=4\n", _OneSlicePolicy())
    # Within the row's bounds the engine takes it: b runs alone on one slice at 0.625 -> 320 s.
    times, result = _run(tmp_path, "b,t,0,,,200,2,1.0,,,gpu_mem_gib=4;min_gpu=1\n", _OneSlicePolicy())
    assert times == {"b": (0.0, 320.0)}
    assert result.jobs[0].state == DONE


def test_elastic_job_larger_than_the_cluster_runs_on_its_minimum(tmp_path: Path) -> None:
    # 4 GPUs wanted, min 2, on a 2-GPU cluster: not rejected; runs on 2 at
    # scale(2, 4) = 1.6 / (4 / 1.75) = 0.7: 70 s of work take 100 s.
    times, _ = _run(tmp_path, "b,t,0,,,70,4,1.0,,,gpu_mem_gib=4;min_gpu=2\n", _pool())
    assert times["b"][0] == 0.0 and times["b"][1] == pytest.approx(100.0, rel=1e-12)
    _, result = _run(tmp_path, "b,t,0,,,70,4,1.0,,,gpu_mem_gib=4\n", _pool())
    assert result.jobs[0].state == REJECTED  # rigid: asks 4 of 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("min_gpu=0", "min_gpu='0' must be a whole number of GPUs >= 1"),
        ("min_gpu=1.5", "min_gpu='1.5' must be a whole number of GPUs >= 1"),
        ("max_gpu=lots", "max_gpu='lots' is not a whole number of GPUs"),
        ("min_gpu=3", "min_gpu=3 exceeds num_gpu=2"),
        ("max_gpu=1", "max_gpu=1 is below num_gpu=2"),
    ],
)
def test_bad_gpu_bounds_name_row_and_column(tmp_path: Path, extra: str, message: str) -> None:
    path = tmp_path / "tiny.csv"
    path.write_text(HEADER + "a,t,0,,,100,1,1.0,,,\nb,t,0,,,200,2,1.0,,," + extra + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert str(exc.value).startswith("trace: tiny.csv row 3, column 'extra': ")
    assert message in str(exc.value)


def test_gpu_bounds_mapping() -> None:
    path_rows = [
        # (num_gpu, row min, row max, elastic) -> bounds
        (3, None, None, (0.5, 2.0), (2, 6)),
        (1, None, None, (0.5, 2.0), (1, 2)),
        (4, None, None, (0.25, 1.5), (1, 6)),
        (3, None, None, (1 / 3, 1.0), (1, 3)),
        (2, 1, None, (0.5, 4.0), (1, 2)),  # the row's own bounds win over --elastic
        (2, None, None, None, (2, 2)),
    ]
    from gpupool_sdk.sim.trace import TraceJob

    for n, lo, hi, elastic, expected in path_rows:
        tj = TraceJob(index=0, job_id="a", source="t", submit_s=0, duration_s=1, num_gpu=n, gpu_fraction=1.0,
                      min_gpu=lo, max_gpu=hi)
        assert PoolMapping(elastic=elastic).gpu_bounds(tj) == expected, (n, lo, hi, elastic)


@pytest.mark.parametrize("text", ["0", "1.5", "0.5,0.5", "a,b", "0.5,2,3", "nan", "0.5,inf", ""])
def test_parse_elastic_rejects_bad_values(text: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_elastic(text)
    assert exc.value.field == "elastic"


def test_parse_elastic_defaults_the_factor() -> None:
    assert parse_elastic("0.5") == (0.5, 1.0)
    assert parse_elastic(" 0.25 , 2 ") == (0.25, 2.0)


def _cli(tmp_path: Path, rows: str, *args: str):  # noqa: ANN202 - click's Result
    path = tmp_path / "rows.csv"
    path.write_text(HEADER + rows)
    return CliRunner().invoke(simulate, ["--trace", str(path), "--cluster", "2xV100-32GB", *args])


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--elastic", "0"], "--elastic"),
        (["--elastic", "0.5,0.9"], "--elastic"),
        (["--elastic", "half"], "--elastic"),
        (["--elastic-sigma", "-0.1"], "--elastic-sigma"),
        (["--elastic-sigma", "2"], "--elastic-sigma"),
    ],
)
def test_bad_elastic_flags_name_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    res = _cli(tmp_path, RIGID_B, "--policy", "gpupool", *args)
    assert res.exit_code != 0
    assert isinstance(res.exception, ConfigError)
    assert res.exception.field == flag


def test_elastic_flag_reaches_gpupool_only(tmp_path: Path) -> None:
    # Default sigma 0.05 and the 10 s + 20 s costs. fifo: a 0-100, b 100-300 (avg 200) with or
    # without --elastic. gpupool with --elastic 0.5,2: a (1-2 GPUs) takes one GPU at 0, b (1-4) the
    # other at scale(1, 2) = 1 / (2 / 1.05) = 0.525; neither can grow. t=100: a ends, b has 147.5 s
    # left, is resized to 2 (nothing free beyond), checkpoints to 110 and runs 167.5 s: ends 277.5.
    plain = _cli(tmp_path, RIGID_B, "--policy", "fifo", "--policy", "gpupool", "-o", "json")
    elastic = _cli(tmp_path, RIGID_B, "--policy", "fifo", "--policy", "gpupool", "--elastic", "0.5,2", "-o", "json")
    assert plain.exit_code == 0 and elastic.exit_code == 0, (plain.output, elastic.output)
    p, e = json.loads(plain.output)["policies"], json.loads(elastic.output)["policies"]
    assert p["fifo"]["avg_jct_s"] == e["fifo"]["avg_jct_s"] == 200.0
    assert e["fifo"]["resizes"] == 0 and p["gpupool"]["resizes"] == 0
    assert p["gpupool"]["avg_jct_s"] == 200.0
    assert e["gpupool"]["resizes"] == 1
    assert e["gpupool"]["avg_jct_s"] == pytest.approx((100.0 + 277.5) / 2)


def test_idle_gap_between_arrivals_does_not_end_the_run(tmp_path: Path) -> None:
    # Elastic jobs finish sooner and leave the cluster idle before the next arrival; the engine used
    # to stop there (every arrived job done, nothing pending) and drop the rest of the trace.
    rows = "a,t,0,,,10,1,1.0,,,gpu_mem_gib=4\nb,t,100,,,10,1,1.0,,,gpu_mem_gib=4\n"
    times, result = _run(tmp_path, rows, FifoPolicy(), cluster="1xV100-32GB")
    assert times == {"a": (0.0, 10.0), "b": (100.0, 110.0)}
    times, _ = _run(tmp_path, rows, _pool(), cluster="1xV100-32GB")
    assert times == {"a": (0.0, 10.0), "b": (100.0, 110.0)}
