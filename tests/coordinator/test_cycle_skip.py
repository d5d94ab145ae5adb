"""The coordinator skips cycles in which nothing but the clock changed, before ``valid_until`` (real etcd)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from testkit import loop_in_thread, publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GpuInfo, GpuReadings, JobSpec
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.policy import Scheduler
from gpupool_sdk.scheduler.types import ClusterSnapshot, Queue, SchedulerConfig, ScheduleResult
from gpupool_sdk.store import EtcdStore, WatchEvent
from gpupool_sdk.store.codec import encode

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


def _readings_key(store: EtcdStore, gpu: GpuInfo) -> str:
    return store.keys.readings(gpu.node, gpu.uuid)


def test_readings_churn_runs_no_scheduler_and_a_health_change_does(store: EtcdStore, two_jobs: int) -> None:
    """A running leader: the agents rewrite readings/{node}/{gpu} every few seconds; that is no news."""
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    gpu_kv = store.get(store.keys.gpu(gpu.node, gpu.uuid))
    reports: list[CycleReport] = []
    sched = CountingScheduler(replace(DEFAULT_SCHEDULER, etcd_max_txn_ops=128))
    coord = Coordinator(store, DEFAULT_SCHEDULER, TIMING, "skip-test", loop_wait_s=0.5, scheduler=sched,
                        autoscale=None, on_cycle=reports.append)
    with loop_in_thread(coord):
        # Grant a, queue b, then a cycle that reads its own writes and is skipped from then on.
        wait_for(lambda: any(r.skipped for r in reports), what="a skipped cycle")
        runs, cycles = sched.runs, coord.stats.cycles
        churn = 0
        for util in (0.1, 0.5, 0.9, 0.3, 0.7):
            churn = store.put(_readings_key(store, gpu), GpuReadings(utilization=util, pcie_rx_bytes_per_s=1e9),
                              lease=gpu_kv.lease)
        store.put(store.keys.readings(gpu.node, "GPU-other"), b"{garbage", lease=gpu_kv.lease)
        churn = store.put(store.keys.readings(gpu.node, "GPU-other"), b"[1, 2]", lease=gpu_kv.lease)
        # The next cycle (the loop's own, every loop_wait) reads past the churn: still nothing to schedule.
        after = wait_for(lambda: [r for r in reports if r.revision >= churn], what="a cycle after the churn")
        assert after[0].skipped and sched.runs == runs
        assert all(r.skipped for r in reports[cycles:]) and sched.runs == runs
        state = coord.last_state
        assert state is not None and state.readings == {} and not state.problems  # never read, garbage or not
        # A health change of the GPU record is scheduler input: it wakes the loop and runs the scheduler.
        hot = store.put(store.keys.gpu(gpu.node, gpu.uuid),
                        replace(gpu, health=replace(gpu.health, temperature_c=95.0, healthy=False, reasons=("hot",))),
                        lease=gpu_kv.lease)
        woke = wait_for(lambda: [r for r in reports if r.revision >= hot], what="a cycle after the health change")
        assert not woke[0].skipped and sched.runs == runs + 1


def test_a_readings_write_never_wakes_the_loop(store: EtcdStore) -> None:
    """The watch drops readings before the coordinator sees them (a GPU write still wakes it)."""
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    lease = publish_gpus(store, [gpu])
    seen: list[WatchEvent] = []
    coord = Coordinator(store, DEFAULT_SCHEDULER, TIMING, "watch-test", loop_wait_s=0.5, autoscale=None)
    on_events = coord._on_events

    def spy(events: list[WatchEvent]) -> None:
        seen.extend(events)
        on_events(events)

    coord._on_events = spy  # type: ignore[method-assign]
    with loop_in_thread(coord):
        wait_for(lambda: coord._watcher is not None and coord._watcher.wait_ready(0.1), what="the watch")
        for util in (0.2, 0.4):
            last = store.put(_readings_key(store, gpu), GpuReadings(utilization=util), lease=lease)
        store.delete(_readings_key(store, gpu))
        wait_for(lambda: coord._watcher.next_revision > last + 1, what="the readings events to pass")
        assert not [e for e in seen if "/readings/" in e.kv.key]
        rev = store.put(store.keys.gpu(gpu.node, gpu.uuid), replace(gpu, health=replace(gpu.health, power_w=99.0)),
                        lease=lease)
        wait_for(lambda: any(e.kv.mod_revision == rev for e in seen), what="the GPU event")


def test_a_gpu_record_of_an_older_agent_with_usage_readings_is_accepted(store: EtcdStore) -> None:
    """Rolling upgrade: agents of the previous release still write the readings inside the GPU record."""
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    lease = publish_gpus(store, [gpu])
    old = gpu.to_dict()
    old["health"].update({"utilization": 0.9, "memory_bandwidth_utilization": 0.4, "memory_used_bytes": 1 << 30,
                          "pcie_tx_bytes_per_s": 1e9, "pcie_rx_bytes_per_s": 2e9})
    store.put(store.keys.gpu(gpu.node, gpu.uuid), encode(old, kind="GpuInfo"), lease=lease)
    job_lease = store.grant_lease(60)
    store.create(store.keys.job_spec("a"), JobSpec(name="a", gpus=1, memory="4GiB"), lease=job_lease)
    coord, _ = _coordinator(store, DEFAULT_SCHEDULER)
    try:
        state = coord.read_state(coord.term)
        assert not state.problems and state.snapshot.gpus[gpu.uuid] == gpu  # the readings are ignored
        assert _cycle(coord).applied.get("Grant") == 1
    finally:
        coord.election.resign()
        store.revoke_lease(job_lease)


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
