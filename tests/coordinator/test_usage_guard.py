"""Usage records against an operator's ``gpupool job forget`` and a lost answer from etcd.

A usage write whose answer is lost (the transaction landed, the client saw an error) used to stay
pending and be written again at the next flush: after ``job forget`` had deleted the record of the
finished job, the coordinator re-created it (seen under load in the operator CLI test). Real etcd,
the real coordinator loop in-process; the fault wraps the real writer: it commits, then raises
(for ``late``: after deleting the key, as a `job forget` landing before the answer would).
The ``late`` step fails on the code before the guard (the record came back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.errors import StoreUnavailableError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec, JobState, JobStatus
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.telemetry.usage import UsageRecord

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


@pytest.fixture
def pool(store: EtcdStore) -> Iterator[tuple[Coordinator, list[CycleReport], list[str]]]:
    publish_gpus(store, parse_cluster_spec("node-a:2xA100-40GB:pcie"))
    reports: list[CycleReport] = []
    coord = Coordinator(store, SchedulerConfig(), TIMING, "usage-guard", loop_wait_s=0.2, usage_flush_s=0.2,
                        on_cycle=reports.append)
    lost: list[str] = []  # usage keys whose answer the fault has dropped
    real: Callable[..., Any] = coord.writer.commit
    forget_late = threading.Event()  # set: usage/late's next write is forgotten before its answer comes

    def lose_the_first_answer(ops: Sequence[Any], guards: Sequence[Any] = ()) -> int | None:
        revision = real(ops, guards)
        for op in ops:
            key = getattr(op, "key", "")
            if key == store.keys.usage("late") and forget_late.is_set() and key not in lost:
                lost.append(key)
                store.delete(key)  # `gpupool job forget late` lands between the write and its answer
                raise StoreUnavailableError(f"deadline exceeded (the fault: {key} was written, then forgotten)")
            if "/usage/" in key and key not in lost and not key.endswith("/late"):
                lost.append(key)
                raise StoreUnavailableError(f"deadline exceeded (the fault: {key} was written)")
        return revision

    coord.forget_late = forget_late  # type: ignore[attr-defined]  # for the test

    coord.writer.commit = lose_the_first_answer  # type: ignore[method-assign]
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    try:
        yield coord, reports, lost
    finally:
        coord.stop()
        t.join(20)
        assert not t.is_alive()


def _granted(store: EtcdStore, job: str) -> bool:
    got = store.get_record(store.keys.job_status(job), JobStatus)
    return got is not None and got[0].state is JobState.GRANTED


def _usage(store: EtcdStore, job: str) -> UsageRecord | None:
    got = store.get_record(store.keys.usage(job), UsageRecord)
    return got[0] if got else None


def test_a_forgotten_record_whose_write_answer_was_lost_is_not_recreated(
    store: EtcdStore, pool: tuple[Coordinator, list[CycleReport], list[str]]
) -> None:
    coord, reports, lost = pool
    wait_for(lambda: coord.is_leader, 30, "leadership")
    leases = {}
    for job in ("gone", "live"):
        leases[job] = store.grant_lease(10)
        store.create(store.keys.job_spec(job), JobSpec(name=job, gpus=1, memory="8GiB"), lease=leases[job])
    wait_for(lambda: _granted(store, "gone") and _granted(store, "live"), 30, "both grants")
    # Both running jobs' first usage writes land and their answers are lost.
    wait_for(lambda: {store.keys.usage("gone"), store.keys.usage("live")} <= set(lost), 30, "both lost answers")
    store.revoke_lease(leases["gone"])  # the job ends
    def slices_gone() -> bool:
        state = coord.last_state
        return state is not None and not [a for a in state.allocations if a.job == "gone"]

    wait_for(slices_gone, 30, "the coordinator to see gone's slices go")
    n = len(reports)
    wait_for(lambda: len(reports) >= n + 3, 30, "a few flushes after the job ended")
    assert _usage(store, "gone") is not None  # its final record
    assert store.delete(store.keys.usage("gone"))  # `gpupool job forget gone`
    n = len(reports)
    wait_for(lambda: len(reports) >= n + 10, 60, "ten cycles (flushes every 0.2 s) after the forget")
    assert _usage(store, "gone") is None, "the coordinator re-created a forgotten usage record"
    # A job that ends while its usage write's answer is lost, forgotten in between: the coordinator
    # must not write the record again (before the guard it did: the write stayed pending).
    late_lease = store.grant_lease(10)
    store.create(store.keys.job_spec("late"), JobSpec(name="late", gpus=1, memory="8GiB"), lease=late_lease)
    wait_for(lambda: _granted(store, "late"), 30, "late's grant")

    def late_held() -> bool:  # the leader tracks (charges) what a snapshot showed it holding
        state = coord.last_state
        return state is not None and any(a.job == "late" for a in state.allocations)

    wait_for(late_held, 30, "the coordinator to see late's slice")
    coord.forget_late.set()  # type: ignore[attr-defined]
    store.revoke_lease(late_lease)  # the job ends
    wait_for(lambda: store.keys.usage("late") in lost, 30, "late's write to land and be forgotten")
    n = len(reports)
    wait_for(lambda: len(reports) >= n + 10, 60, "ten cycles after the forget")
    assert _usage(store, "late") is None, "the coordinator re-created a record forgotten while its answer was lost"
    # The live job's account goes on after its lost answer: charged, not dropped.
    first = _usage(store, "live")
    assert first is not None
    wait_for(lambda: (u := _usage(store, "live")) is not None and u.gpu_seconds > first.gpu_seconds + 0.5, 30,
             "usage/live to keep growing")  # fmt: skip
