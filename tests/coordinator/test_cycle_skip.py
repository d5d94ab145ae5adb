"""The coordinator skips cycles in which nothing but the clock changed, before ``valid_until`` (real etcd)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GpuInfo, JobSpec
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.policy import Scheduler
from gpupool_sdk.scheduler.types import ClusterSnapshot, Grant, Queue, SchedulerConfig, ScheduleResult
from gpupool_sdk.store import EtcdStore, WatchEvent
from gpupool_sdk.store.codec import decode

TIMING = LeaseTiming(ttl_s=5, keepalive_interval_s=0.5, retry_timeout_s=1.0)


class CountingScheduler(Scheduler):
    """The real policy, counting its runs."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.runs = 0

    def run(self, snapshot: ClusterSnapshot) -> ScheduleResult:
        self.runs += 1
        return super().run(snapshot)


def _coordinator(store: EtcdStore, config: SchedulerConfig, skip: bool = True) -> tuple[Coordinator, CountingScheduler]:
    sched = CountingScheduler(replace(config, etcd_max_txn_ops=128))
    coord = Coordinator(store, config, TIMING, "skip-test", loop_wait_s=0.5, scheduler=sched, skip_unchanged=skip,
                        autoscale=None)
    assert coord.election.step(), "the only replica leads"
    return coord, sched


@pytest.fixture
def two_jobs(store: EtcdStore) -> Iterator[int]:
    """One A100-40GB; job a (30 GiB) fits, job b (30 GiB, same priority and LAS queue) waits."""
    publish_gpus(store, parse_cluster_spec("node-a:1xA100-40GB:pcie"))
    lease = store.grant_lease(60)
    store.create(store.keys.job_spec("a"), JobSpec(name="a", gpus=1, memory="30GiB"), lease=lease)
    store.create(store.keys.job_spec("b"), JobSpec(name="b", gpus=1, memory="30GiB"), lease=lease)
    yield lease
    store.revoke_lease(lease)


def _cycle(coord: Coordinator) -> CycleReport:
    report = coord.run_cycle()
    assert report is not None
    return report


def test_unchanged_input_skips_the_scheduler_and_decides_the_same(store: EtcdStore, two_jobs: int) -> None:
    coord, sched = _coordinator(store, DEFAULT_SCHEDULER)
    try:
        first = _cycle(coord)  # grants a, queues b: writes
        assert not first.skipped and first.applied.get("Grant") == 1
        second = _cycle(coord)  # reads its own writes: a new input, scheduled again
        assert not second.skipped
        assert [type(d) for d in second.decided] == [Queue] and second.applied == {}
        runs = sched.runs
        later = [_cycle(coord) for _ in range(3)]
        # Nothing changed but the clock, well before b's reserve_after_s or a's LAS crossing.
        assert all(r.skipped and r.decisions == 0 and not r.applied for r in later)
        assert sched.runs == runs and coord.stats.skipped == 3
        # Exact: a fresh scheduler on the current state decides what the last scheduled cycle did.
        state = coord.read_state(coord.term)
        fresh = Scheduler(replace(DEFAULT_SCHEDULER, etcd_max_txn_ops=128)).run(state.snapshot)
        assert fresh.decisions == second.decided
        assert state.snapshot.now < fresh.valid_until

        # Any write to the scheduler's input (a new job) runs the next cycle.
        store.create(store.keys.job_spec("c"), JobSpec(name="c", gpus=1, memory="4GiB"), lease=two_jobs)
        third = _cycle(coord)
        assert not third.skipped and sched.runs == runs + 1
        assert "c" in {d.job for d in third.decided}
    finally:
        coord.election.resign()


def test_valid_until_passing_runs_the_cycle(store: EtcdStore, two_jobs: int) -> None:
    # b reaches reserve_after_s (1 s) of waiting: its reservation is a new decision.
    coord, sched = _coordinator(store, replace(DEFAULT_SCHEDULER, reserve_after_s=1.0))
    try:
        _cycle(coord)
        second = _cycle(coord)
        assert not second.skipped
        assert "reserved" not in second.decided[0].reason  # type: ignore[attr-defined]
        assert _cycle(coord).skipped
        time.sleep(1.1)
        after = _cycle(coord)
        assert not after.skipped
        assert "reserved for it" in after.decided[0].reason  # type: ignore[attr-defined]
    finally:
        coord.election.resign()


@pytest.mark.parametrize(
    "config, skip",
    [
        (SchedulerConfig(), True),  # aging on (60 s per point): the order moves with time, valid_until = now
        (DEFAULT_SCHEDULER, False),  # skipping off
    ],
    ids=["time-dependent-order", "skip-off"],
)
def test_no_skip_when_time_orders_or_when_off(store: EtcdStore, two_jobs: int, config: SchedulerConfig, skip: bool) -> None:
    coord, sched = _coordinator(store, config, skip=skip)
    try:
        reports = [_cycle(coord) for _ in range(4)]
        assert not any(r.skipped for r in reports)
        assert sched.runs == 4 and coord.stats.skipped == 0
    finally:
        coord.election.resign()


def test_a_gpu_rewritten_for_its_usage_readings_alone_does_not_wake_the_coordinator(store: EtcdStore) -> None:
    """The agent republishes utilisation and PCIe/NVLink rates about once a minute per node; that is no news."""
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    publish_gpus(store, [gpu])
    coord, _ = _coordinator(store, DEFAULT_SCHEDULER)
    key = store.keys.gpu(gpu.node, gpu.uuid)
    seen: list[WatchEvent] = []
    kv = store.get(key)
    watch = store.watch_prefix(key, seen.extend, start_revision=kv.mod_revision + 1)
    try:
        busy = replace(gpu, health=replace(gpu.health, utilization=0.9, pcie_tx_bytes_per_s=1e9))
        hot = replace(busy, health=replace(busy.health, temperature_c=95.0, healthy=False, reasons=("hot",)))
        for record in (busy, replace(busy, health=replace(busy.health, utilization=0.1)), hot):
            store.put(key, record, lease=kv.lease)  # as the agent does, on its own lease
        wait_for(lambda: len(seen) == 3, what="three watch events")
        woke = []
        for e in seen:
            coord._wake.clear()
            coord._on_events([e])
            woke.append(coord._wake.is_set())
        assert woke == [False, False, True]  # usage readings alone: quiet; a health change: a cycle
    finally:
        watch.cancel()


def test_usage_readings_alone_do_not_defeat_the_skip(store: EtcdStore, two_jobs: int) -> None:
    """A GPU rewritten for its usage readings alone is the same scheduler input; a health change is not."""
    coord, sched = _coordinator(store, DEFAULT_SCHEDULER)
    try:
        _cycle(coord)
        _cycle(coord)
        assert _cycle(coord).skipped
        key = next(kv.key for kv in store.get_prefix(store.keys.gpus_prefix("node-a"))[0])
        kv = store.get(key)
        gpu = decode(key, kv.value, GpuInfo)
        for util in (0.5, 0.9):
            store.put(key, replace(gpu, health=replace(gpu.health, utilization=util, pcie_rx_bytes_per_s=1e9)), lease=kv.lease)
            assert _cycle(coord).skipped
        runs = sched.runs
        store.put(key, replace(gpu, health=replace(gpu.health, temperature_c=55.0)), lease=kv.lease)
        assert not _cycle(coord).skipped and sched.runs == runs + 1
        assert _cycle(coord).skipped
        store.put(key, replace(gpu, health=replace(gpu.health, temperature_c=55.0)), lease=store.grant_lease(60))
        assert not _cycle(coord).skipped  # a new lease on the same record is news
    finally:
        coord.election.resign()


def test_the_policy_does_not_read_the_usage_readings(store: EtcdStore, two_jobs: int) -> None:
    """What lets the skip above ignore them: the same snapshot with busy or idle readings decides the same.
    A policy that starts reading them must make Coordinator._read count them again."""
    coord, _ = _coordinator(store, DEFAULT_SCHEDULER)
    try:
        snap = coord.read_state(coord.term).snapshot  # a and b pending: a placement to decide
        busy = {u: replace(g, health=replace(g.health, utilization=1.0, memory_bandwidth_utilization=1.0,
                                             memory_used_bytes=g.memory_bytes, pcie_rx_bytes_per_s=25e9))
                for u, g in snap.gpus.items()}
        policy = Scheduler(replace(DEFAULT_SCHEDULER, etcd_max_txn_ops=128))
        decided = policy.run(snap)
        assert any(isinstance(d, Grant) for d in decided.decisions)
        assert policy.run(replace(snap, gpus=busy)) == decided
    finally:
        coord.election.resign()


@pytest.mark.parametrize("garbage", [b"{oops", b"[1, 2]", b'{"schema": 1, "v": ' + b"[" * 3000 + b"]" * 3000 + b"}"])
def test_garbage_under_a_gpu_key_neither_crashes_the_read_nor_hides_a_change(store: EtcdStore, garbage: bytes) -> None:
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    publish_gpus(store, [gpu])
    coord, _ = _coordinator(store, DEFAULT_SCHEDULER)
    try:
        key = store.keys.gpu(gpu.node, gpu.uuid)
        _cycle(coord)
        _cycle(coord)
        store.put(key, garbage)
        assert not _cycle(coord).skipped
        prev = store.get(key)
        store.put(key, garbage + b" ")
        assert not _cycle(coord).skipped
        coord._wake.clear()
        coord._on_events([WatchEvent("put", store.get(key), prev)])  # no exception in the watch thread
        assert coord._wake.is_set()
    finally:
        coord.election.resign()
