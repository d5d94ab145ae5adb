"""A hand-written allocation for a live job, on a GPU no agent publishes, is garbage, not a grant.

Garbage in etcd (real etcd, the real coordinator loop in-process): a job's spec is live on its
lease with no status yet, and someone wrote ``allocations/{node}/{gpu}/{job}`` by hand on that
same lease, for a GPU that no agent publishes. The leader writes allocations only in the
transaction that makes a job GRANTED, so this one is not a grant: before the fix the job counted
as holding it, was never scheduled (a pending job holding allocations is skipped) and never
preempted (it was not GRANTED), and stayed PENDING for good. Now the key is an orphan: named as
a problem, deleted after the grace, and the job is granted a GPU the agent publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from testkit import loop_in_thread, publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import Allocation, GiB, GpuInfo, JobSpec, JobState, JobStatus, QoS
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


@contextmanager
def _leader(store: EtcdStore, replica: str) -> Iterator[tuple[GpuInfo, list[CycleReport]]]:
    """One published A100 and a coordinator loop (orphan grace 1 s) running in a thread, stopped after:
    yields the GPU and the cycle reports as they come."""
    (gpu,) = parse_cluster_spec("node-a:1xA100-40GB:pcie")
    publish_gpus(store, [gpu])
    reports: list[CycleReport] = []
    coord = Coordinator(store, SchedulerConfig(), TIMING, replica, loop_wait_s=0.2, orphan_grace_s=1.0,
                        on_cycle=reports.append)  # fmt: skip
    with loop_in_thread(coord):
        yield gpu, reports


def test_a_hand_written_allocation_for_a_job_without_a_grant_is_an_orphan(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    lease = store.grant_lease(60)
    ghost = store.keys.allocation("node-z", "GPU-ghost-0", "j")
    store.put(ghost, Allocation("j", "node-z", "GPU-ghost-0", 0, 8 * GiB, 0.5, QoS.GUARANTEED, 1, time.time()),
              lease=lease)  # fmt: skip
    store.create(store.keys.job_spec("j"), JobSpec(name="j", gpus=1, memory="8GiB", owner="alice"), lease=lease)
    with _leader(store, "hand-alloc") as (gpu, _reports):
        def granted() -> JobStatus | None:
            got = store.get_record(store.keys.job_status("j"), JobStatus)
            return got[0] if got is not None and got[0].state is JobState.GRANTED else None

        wait_for(granted, 30, "job j to be granted a published GPU")
        wait_for(lambda: store.get(ghost) is None, 30, "the leader to delete the hand-written allocation")
        kvs, _ = store.get_prefix(store.keys.allocations_prefix())
        held = [decode(kv.key, kv.value, Allocation) for kv in kvs]
        assert [(a.job, a.gpu_uuid) for a in held] == [("j", gpu.uuid)]
        assert any(ghost in r.getMessage() and "holds no grant" in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records
        ]


def test_a_hand_written_allocation_after_the_grant_is_an_orphan_and_the_job_keeps_running(
    store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The same key written by hand on the job's lease *after* its grant, while it is GRANTED: the status
    alone cannot tell it from the grant's own, and it joined the job's slices (a GPU no agent publishes:
    the job was preempted as "agent gone"). Every allocation of a grant carries the grant's
    ``granted_at``, as the status does; this one does not, so it is an orphan: named as a problem,
    counted as used, deleted after the grace, and the job keeps its grant throughout."""
    caplog.set_level(logging.WARNING)
    lease = store.grant_lease(60)
    store.create(store.keys.job_spec("j"), JobSpec(name="j", gpus=1, memory="8GiB", owner="alice"), lease=lease)
    with _leader(store, "hand-alloc-after") as (gpu, reports):
        def status() -> JobStatus | None:
            got = store.get_record(store.keys.job_status("j"), JobStatus)
            return got[0] if got is not None else None

        grant = wait_for(lambda: (s := status()) is not None and s.state is JobState.GRANTED and s, 30,
                         "job j to be granted")  # fmt: skip
        assert isinstance(grant, JobStatus) and grant.granted_at is not None
        ghost = store.keys.allocation("node-z", "GPU-ghost-0", "j")
        store.put(ghost, Allocation("j", "node-z", "GPU-ghost-0", 0, 8 * GiB, 0.5, QoS.GUARANTEED, grant.term,
                                    grant.granted_at + 1.0), lease=lease)  # fmt: skip
        seen = len(reports)
        wait_for(lambda: store.get(ghost) is None, 30, "the leader to delete the hand-written allocation")
        after = reports[seen:]
        # Seen as an orphan (counted as used), never as one of the job's slices.
        assert any(any(o.gpu_uuid == "GPU-ghost-0" for o in r.snapshot.orphans) for r in after if r.snapshot)
        for r in after:
            if r.snapshot is not None and "j" in r.snapshot.jobs:
                assert [a.gpu_uuid for a in r.snapshot.jobs["j"].allocations] == [gpu.uuid], r.snapshot.jobs["j"]
            assert not [d for d in r.decided if d.job == "j"], r.decided  # never preempted, revoked or re-granted
        now = status()
        assert now is not None and now.state is JobState.GRANTED and now.granted_at == grant.granted_at, now
        assert store.get(store.keys.directive("j")) is None
        kvs, _ = store.get_prefix(store.keys.allocations_prefix())
        assert [(a.job, a.gpu_uuid) for a in (decode(kv.key, kv.value, Allocation) for kv in kvs)] == [("j", gpu.uuid)]
        assert any(ghost in r.getMessage() and "not written by its grant" in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records
        ]
