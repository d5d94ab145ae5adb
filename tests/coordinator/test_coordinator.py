"""The coordinator loop in-process against a real etcd: cycles, usage accounting, resignation."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from testkit import loop_in_thread, publish_gpus

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec, JobState, JobStatus
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.telemetry.usage import UsageRecord

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


def _wait(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def running(store: EtcdStore) -> Iterator[tuple[Coordinator, list[CycleReport]]]:
    publish_gpus(store, parse_cluster_spec("node-a:2xA100-40GB:pcie"))
    reports: list[CycleReport] = []
    coord = Coordinator(store, SchedulerConfig(), TIMING, "inproc", loop_wait_s=0.5, usage_flush_s=0.3,
                        on_cycle=reports.append)
    with loop_in_thread(coord):
        yield coord, reports


def _status(store: EtcdStore, job: str) -> JobStatus | None:
    got = store.get_record(store.keys.job_status(job), JobStatus)
    return got[0] if got else None


def test_loop_grants_charges_usage_and_resigns_on_stop(store: EtcdStore, running: tuple[Coordinator, list[CycleReport]]) -> None:
    coord, reports = running
    _wait(lambda: coord.is_leader, "leadership")
    job_lease = store.grant_lease(10)
    store.create(store.keys.job_spec("a"), JobSpec(name="a", gpus=1, memory="8GiB"), lease=job_lease)
    _wait(lambda: (s := _status(store, "a")) is not None and s.state is JobState.GRANTED, "the grant")
    # The cycle reports after it applied: the status may be read before its report is appended.
    _wait(lambda: any(r.applied.get("Grant") for r in reports), "the grant's cycle report")
    assert all(r.term >= 1 for r in reports)
    time.sleep(1.2)  # hold the slice a little, so there is something to charge
    store.revoke_lease(job_lease)  # the job finishes
    # Held for at least the 1.2 s slept (grant seen to revoke), charged from its grant to its end.
    # (Records of a running job are flushed too: wait for the final one.)
    def charged() -> bool:
        rec = store.get_record(store.keys.usage("a"), UsageRecord)
        return rec is not None and rec[0].gpu_seconds >= 1.1

    _wait(charged, "usage/a to charge the whole run")
    got = store.get_record(store.keys.usage("a"), UsageRecord)
    assert got is not None and got[1].lease == 0  # outlives the job
    first = got[0].gpu_seconds
    # The same job name runs again: its account continues from usage/a, it does not restart.
    time.sleep(0.5)  # several flushes: the ledger forgets the finished job and reloads it from etcd
    again = store.grant_lease(10)
    store.create(store.keys.job_spec("a"), JobSpec(name="a", gpus=1, memory="8GiB"), lease=again)
    _wait(lambda: (s := _status(store, "a")) is not None and s.state is JobState.GRANTED, "the second grant")
    time.sleep(0.5)
    store.revoke_lease(again)

    def grew() -> bool:
        rec = store.get_record(store.keys.usage("a"), UsageRecord)
        return rec is not None and rec[0].gpu_seconds >= first + 0.4

    _wait(grew, "usage/a to add the second run")
    coord.stop()
    _wait(lambda: store.get(store.keys.leader()) is None, "the leader key to go at stop")


def test_loop_wait_must_fit_the_ttl(store: EtcdStore) -> None:
    with pytest.raises(ConfigError, match="loop_wait_s"):
        Coordinator(store, SchedulerConfig(), TIMING, "x", loop_wait_s=2.5)
