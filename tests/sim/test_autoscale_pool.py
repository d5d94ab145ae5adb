"""The simulated node pool that follows the autoscale signal: hand-computed scale-up, boot, release and cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.autoscale import AutoscaleSettings
from gpupool_sdk.sim.autoscale_pool import AutoscaledPolicy
from gpupool_sdk.sim.baselines import FifoPolicy
from gpupool_sdk.sim.engine import SimConfig, Simulator
from gpupool_sdk.sim.runner import make_policy
from gpupool_sdk.sim.trace import load_trace
from gpupool_sdk.sim.workload import Profile, WorkloadModel

HEADER = "job_id,source,submit_s,start_s,end_s,duration_s,num_gpu,gpu_fraction,priority,status,extra\n"
WORKLOAD = WorkloadModel(profiles=[Profile("p", 0.5, 4096.0, 1)], slowdown=[[0.5] * 3] * 3)
CONFIG = SimConfig(tick_s=0.0)
SETTINGS = AutoscaleSettings(scale_up_after_s=60, scale_down_idle_s=600, min_nodes=1, max_nodes=3)
# a holds the only provisioned node for 1000 s; b arrives at 10 and waits.
ROWS = "a,t,0,,,1000,2,1.0,,,gpu_mem_gib=4\nb,t,10,,,500,2,1.0,,,gpu_mem_gib=4\n"


def _run(tmp_path: Path, policy: AutoscaledPolicy, rows: str = ROWS, cluster: str = "3*2xV100-32GB"):
    path = tmp_path / "t.csv"
    path.write_text(HEADER + rows)
    trace = load_trace(path)
    result = Simulator(trace.jobs, parse_cluster_spec(cluster), policy, WORKLOAD, CONFIG).run()
    return {j.tj.job_id: (j.first_start, j.end) for j in result.jobs}, result, policy.finish(result.makespan_s)


def test_scale_up_after_the_delay_boot_then_release_when_idle(tmp_path: Path) -> None:
    policy = AutoscaledPolicy(FifoPolicy(), SETTINGS, initial_nodes=1, boot_s=300, tick_s=60)
    times, result, usage = _run(tmp_path, policy)
    # b waits from 10; counts as demand at the tick >= 70 (t=70: 10 + 60), a node is asked for
    # then and is in service 300 s later, at 370: b runs 370-870. a ends at 1000.
    assert times["a"] == (0.0, 1000.0)
    assert times["b"] == (370.0, 870.0)
    assert (usage.peak_nodes, usage.scale_ups) == (2, 1)
    # Paid: node 1 for 0-1000 (2 GPUs), node 2 from the request at 70 to the end at 1000 (the
    # 600 s idle release would come at 1470, after the run): (1000 + 930) * 2 GPU-seconds.
    assert usage.gpu_hours == pytest.approx((1000 + 930) * 2 / 3600)
    assert usage.mean_nodes == pytest.approx(1930 / 1000)


def test_idle_nodes_are_released_and_no_longer_paid(tmp_path: Path) -> None:
    # b ends at 870 on node 2; c arrives at 3000 (long after): node 2 idle from 870, released at
    # the first tick past 870 + 600; node 1 idle from 1000 stays (min_nodes 1), c runs there.
    rows = ROWS + "c,t,3000,,,100,2,1.0,,,gpu_mem_gib=4\n"
    policy = AutoscaledPolicy(FifoPolicy(), SETTINGS, initial_nodes=1, boot_s=300, tick_s=60)
    times, _, usage = _run(tmp_path, policy, rows)
    assert times["c"] == (3000.0, 3100.0)
    assert usage.scale_downs == 1 and usage.peak_nodes == 2
    # Node 2 was paid from 70 until its release, well before 3100.
    released = [t for t, n in policy.signals if n == 1 and t > 0][0]
    assert 1470.0 <= released <= 1530.0
    assert usage.gpu_hours == pytest.approx((3100 + released - 70) * 2 / 3600)


def test_works_with_the_pool_scheduler(tmp_path: Path) -> None:
    policy = AutoscaledPolicy(make_policy("gpupool"), SETTINGS, initial_nodes=1, boot_s=0, tick_s=60)
    times, result, usage = _run(tmp_path, policy)
    assert all(end is not None for _, end in times.values())
    assert usage.peak_nodes == 2 and times["b"][0] == pytest.approx(70.0)


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="tick_s"):
        AutoscaledPolicy(FifoPolicy(), tick_s=0)
    with pytest.raises(ConfigError, match="boot_s"):
        AutoscaledPolicy(FifoPolicy(), boot_s=-1)
