"""Scenarios of placement: NVLink topology, anti-affinity and spread, gang (all or nothing)."""

from __future__ import annotations

import time

from gpupool_sdk.resources import GpuInfo, JobState
from scenarios.harness import Pool, wait_for


def _gpus(pool: Pool) -> dict[str, GpuInfo]:
    return {g.uuid: g for g, _ in pool.store.list_records(pool.keys.gpus_prefix(), GpuInfo)}


def test_pack_job_lands_on_one_nvlink_island(pool: Pool) -> None:
    pool.gpus("node-a:8xH100-80GB:nvlink=2x4")
    pool.coordinator("c1", "--no-preemption")
    # One GPU taken first: a first-fit over indices would now straddle the two islands.
    filler = pool.submit("filler", gpus=1, qos="exclusive")
    filler.wait_state(JobState.GRANTED)
    big = pool.submit("big", gpus=4, qos="exclusive", topology="pack")
    big.wait_state(JobState.GRANTED)
    gpus = _gpus(pool)
    islands = {gpus[a.gpu_uuid].nvlink_island for a in big.allocations()}
    assert len(big.allocations()) == 4
    assert len(islands) == 1 and None not in islands, f"pack job spans islands {islands}"
    filler_island = gpus[filler.allocations()[0].gpu_uuid].nvlink_island
    assert islands != {filler_island}
    pool.check()


def test_anti_affinity_group_lands_on_distinct_nodes(pool: Pool) -> None:
    pool.gpus("node-a:4xA100-80GB:pcie,node-b:4xA100-80GB:pcie")
    pool.coordinator("c1", "--no-preemption")
    a = pool.submit("shard-a", gpus=1, memory="10GiB", qos="guaranteed", anti_affinity="ps")
    a.wait_state(JobState.GRANTED)
    b = pool.submit("shard-b", gpus=1, memory="10GiB", qos="guaranteed", anti_affinity="ps")
    b.wait_state(JobState.GRANTED)
    assert a.allocations()[0].node != b.allocations()[0].node
    # A third member has no node left to itself: it waits rather than share one.
    c = pool.submit("shard-c", gpus=1, memory="10GiB", qos="guaranteed", anti_affinity="ps")
    c.wait_state(JobState.PENDING)
    assert not c.allocations()
    spread = pool.submit("spread", gpus=2, memory="10GiB", qos="guaranteed", topology="spread")
    spread.wait_state(JobState.GRANTED)
    assert len({x.node for x in spread.allocations()}) == 2
    pool.check()


def test_gang_gets_all_slices_or_none(pool: Pool) -> None:
    pool.gpus("node-a:2xA100-40GB:pcie,node-b:2xA100-40GB:pcie")
    pool.coordinator("c1", "--no-preemption")
    filler = pool.submit("filler", gpus=1, qos="exclusive")
    filler.wait_state(JobState.GRANTED)
    gang = pool.submit("gang", gpus=4, qos="exclusive", topology="any")
    gang.wait_state(JobState.PENDING)
    # Three GPUs are free but the gang needs four: it must hold nothing, cycle after cycle.
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert not gang.allocations(), "a gang was granted part of its slices"
        pool.check()
        time.sleep(0.1)
    filler.release()
    status = gang.wait_state(JobState.GRANTED)
    assert status.gpus == 4 and len(gang.allocations()) == 4
    wait_for(lambda: len({a.gpu_uuid for a in gang.allocations()}) == 4, what="four distinct GPUs")
    pool.check()
