"""Gandiva time-slicing: hand-computed schedules on the real engine, suspend/resume costs, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.sim.baselines import FifoPolicy, GandivaPolicy
from gpupool_sdk.sim.engine import DONE, SimConfig, SimPolicy, SimResult, Simulator
from gpupool_sdk.sim.runner import GandivaSettings, make_policy
from gpupool_sdk.sim.trace import load_trace
from gpupool_sdk.sim.workload import Profile, WorkloadModel

HEADER = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n"
WORKLOAD = WorkloadModel(profiles=[Profile("p", 0.5, 4096.0, 1)], slowdown=[[0.5] * 3] * 3)
# Checkpoint and restart costs differ from the policy's suspend (1 s) and resume (2 s) costs, so a
# schedule computed with the wrong ones cannot match.
CONFIG = SimConfig(checkpoint_s=10.0, restart_s=20.0, tick_s=0.0)


def _run(tmp_path: Path, rows: str, policy: SimPolicy, cluster: str) -> tuple[dict[str, tuple], SimResult]:
    path = tmp_path / "tiny.csv"
    path.write_text(HEADER + rows)
    result = Simulator(load_trace(path).jobs, parse_cluster_spec(cluster), policy, WORKLOAD, CONFIG).run()
    return {j.tj.job_id: (j.first_start, j.end) for j in result.jobs}, result


def _gandiva() -> GandivaPolicy:
    return GandivaPolicy(quantum_s=60.0, suspend_s=1.0, resume_s=2.0)


def test_two_jobs_on_one_gpu_alternate_in_quanta(tmp_path: Path) -> None:
    # 1 GPU, a and b (600 s each) at t=0. A switch = 60 s slice + 1 s suspend; a resumed job
    # first redoes 2 s (resume), so each resumed slice advances it 58 s.
    #   a: 0-60 (540 left), suspended, ack 61; b: 61-121 (540 left), ack 122; a 122-182; ...
    #   a's slices start at 122k, b's at 61 + 122k. Before a's 10th resumed slice (t=1220) it has
    #   540 - 9*58 = 18 s left, +2 resume = 20: a ends at 1240.
    #   b's 9th resumed slice (t=1159) starts with 540 - 8*58 + 2 = 78, runs 60 -> 18 left, is
    #   suspended at 1219 for a; at 1240 b resumes with 18 + 2 = 20: b ends at 1260.
    #   Suspensions: 10 of a, 10 of b. Job a's trace checkpoint/restart costs are not used.
    rows = "a,t,0,,,600,1,1.0,,,checkpoint_s=50;restart_s=70\nb,t,0,,,600,1,1.0,,,\n"
    times, result = _run(tmp_path, rows, _gandiva(), "1xV100-32GB")
    assert times == {"a": (0.0, 1240.0), "b": (61.0, 1260.0)}
    assert result.preemptions == 20
    assert [j.preemptions for j in result.jobs] == [10, 10]


def test_late_arrival_starts_within_one_round(tmp_path: Path) -> None:
    # 2 GPUs, a-d (1 GPU, 1000 s) at t=0, e at t=100. Round-robin queue, slices of 60 s:
    #   0: a, b run; c, d wait.            60: a, b suspended; ack 61: c, d run; queue a, b.
    #   100: e arrives, joins the tail (a, b, e); c and d have not used their quantum.
    #   121: c, d suspended; ack 122: a, b run; queue e, c, d.
    #   182: a, b suspended; ack 183: e and c run.
    # e waited 83 s: less than one round of the 5 jobs on 2 GPUs (3 slices of 60 s + 3 switches).
    rows = "".join(f"{c},t,0,,,1000,1,1.0,,,\n" for c in "abcd") + "e,t,100,,,1000,1,1.0,,,\n"
    times, result = _run(tmp_path, rows, _gandiva(), "2xV100-32GB")
    starts = {name: t[0] for name, t in times.items()}
    assert starts == {"a": 0.0, "b": 0.0, "c": 61.0, "d": 61.0, "e": 183.0}
    assert starts["e"] - 100.0 <= 3 * (60.0 + 1.0 + 2.0)
    assert all(j.state == DONE for j in result.jobs)


def test_gang_waits_for_enough_gpus_and_nobody_overtakes_it(tmp_path: Path) -> None:
    # 2 GPUs, a (2 GPUs, 300 s) at 0, b (1 GPU, 100 s) at 10.
    #   a runs 0-60 (240 left); at 10 b waits (a's slice is not over).
    #   60: a suspended (b needs one GPU); ack 61: b runs 61-121 (40 left); a needs 2, 1 is free.
    #   121: b suspended for a; ack 122: a resumes on its GPUs, 240 + 2 = 242 left, runs to 182.
    #   182: a suspended; ack 183: b resumes, 40 + 2 = 42 -> ends 225; a waits for both GPUs.
    #   225: a resumes, 182 + 2 = 184 -> ends 409.
    rows = "a,t,0,,,300,2,1.0,,,\nb,t,10,,,100,1,1.0,,,\n"
    policy = _gandiva()
    times, result = _run(tmp_path, rows, policy, "2xV100-32GB")
    assert times == {"a": (0.0, 409.0), "b": (61.0, 225.0)}
    assert result.preemptions == 3
    assert policy.resumed_elsewhere == 0


def test_no_time_slicing_when_not_oversubscribed_same_as_fifo(tmp_path: Path) -> None:
    # 4 GPUs, never more than 4 wanted: a 0-100 (2 GPUs), b 10-510, c 50-80, d at 120 -> 120-160.
    # c asks half a GPU and gets a whole one, as under fifo.
    rows = "a,t,0,,,100,2,1.0,,,\nb,t,10,,,500,1,1.0,,,\nc,t,50,,,30,1,0.5,,,\nd,t,120,,,40,2,1.0,,,\n"
    expected = {"a": (0.0, 100.0), "b": (10.0, 510.0), "c": (50.0, 80.0), "d": (120.0, 160.0)}
    g_times, g_result = _run(tmp_path, rows, _gandiva(), "4xV100-32GB")
    f_times, f_result = _run(tmp_path, rows, FifoPolicy(), "4xV100-32GB")
    assert g_times == f_times == expected
    assert g_result.preemptions == 0
    # Whole GPUs for everyone: 2*100 + 500 + 30 + 2*40 GPU-seconds allocated under both.
    assert g_result.alloc_gpu_s == f_result.alloc_gpu_s == 810.0


def test_without_declared_costs_preemption_pays_checkpoint_and_restart(tmp_path: Path) -> None:
    # The engine hook is opt-in: a policy without suspend_s/resume_s pays the config's 10 s + 20 s.
    # Same trace as the two-job test with suspend 10 and resume 20: a 0-60, ack 70; b 70-130, ack
    # 140; a's slices start at 140k, b's at 70 + 140k, each resumed slice advancing 40 s.
    # a: 540 - 13*40 = 20 left before its 14th resumed slice (t=1960), +20 -> ends 2000.
    # b: 13th resumed slice (t=1890) starts with 540 - 12*40 + 20 = 80, 20 left at 1950, ack 1960;
    # resumes at 2000 with 20 + 20 -> ends 2040.
    policy = GandivaPolicy(quantum_s=60.0)
    policy.suspend_s = policy.resume_s = None  # type: ignore[assignment]
    rows = "a,t,0,,,600,1,1.0,,,\nb,t,0,,,600,1,1.0,,,\n"
    times, _ = _run(tmp_path, rows, policy, "1xV100-32GB")
    assert times == {"a": (0.0, 2000.0), "b": (70.0, 2040.0)}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quantum_s": 0.0}, "quantum_s"),
        ({"quantum_s": float("inf")}, "quantum_s"),
        ({"suspend_s": -1.0}, "suspend_s"),
        ({"resume_s": float("nan")}, "resume_s"),
    ],
)
def test_bad_settings_name_the_argument(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GandivaPolicy(**kwargs)
    assert exc.value.field == field
    with pytest.raises(ConfigError) as exc2:
        GandivaSettings(**kwargs)
    assert exc2.value.field == field


def test_make_policy_builds_gandiva_with_its_settings() -> None:
    policy = make_policy("gandiva", gandiva=GandivaSettings(quantum_s=30.0, suspend_s=0.1, resume_s=0.2))
    assert isinstance(policy, GandivaPolicy)
    assert (policy.name, policy.quantum_s, policy.suspend_s, policy.resume_s) == ("gandiva", 30.0, 0.1, 0.2)
    default = make_policy("gandiva")
    assert isinstance(default, GandivaPolicy) and default.quantum_s == 60.0
