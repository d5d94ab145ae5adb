"""A job granted and gone before the coordinator's next snapshot is still charged.

The leader charges what its snapshots show a job holding; a grant is written after the cycle's
snapshot, so a job whose lease ends (it finished, crashed, was cancelled) before the next read
never appears holding anything there. Before the fix such a job got no ``usage/{job}`` at all:
its GPU time was free. Real etcd, the real coordinator loop in-process; the test revokes the
job's lease inside the grant's write, right after it commits, so no snapshot can see the slice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.telemetry.usage import UsageRecord

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


def test_a_job_that_ends_right_after_its_grant_is_charged(store: EtcdStore) -> None:
    publish_gpus(store, parse_cluster_spec("node-a:2xA100-40GB:pcie"))
    reports: list[CycleReport] = []
    coord = Coordinator(store, SchedulerConfig(), TIMING, "usage-short", loop_wait_s=0.2, usage_flush_s=0.2,
                        on_cycle=reports.append)  # fmt: skip
    lease = store.grant_lease(30)
    ended = threading.Event()
    real: Callable[..., Any] = coord.writer.commit

    def end_the_job_after_its_grant(ops: Sequence[Any], guards: Sequence[Any] = ()) -> int | None:
        revision = real(ops, guards)
        grants = [op for op in ops if "/allocations/" in getattr(op, "key", "") and op.key.endswith("/brief")]
        if revision is not None and grants and not ended.is_set():
            store.revoke_lease(lease)  # the job ends before the leader reads the pool again
            ended.set()
        return revision

    coord.writer.commit = end_the_job_after_its_grant  # type: ignore[method-assign]
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: coord.is_leader, 30, "leadership")
        store.create(store.keys.job_spec("brief"), JobSpec(name="brief", gpus=2, memory="8GiB", owner="alice"),
                     lease=lease)  # fmt: skip
        wait_for(ended.is_set, 30, "the grant to be written and the job to end")
        n = len(reports)
        wait_for(lambda: len(reports) >= n + 3, 30, "a few cycles after the job ended")
        seen = [r for r in reports if r.snapshot is not None and (v := r.snapshot.jobs.get("brief")) and v.allocations]
        assert not seen, "a snapshot saw the slices: this test no longer covers the gap"

        def charged() -> UsageRecord | None:
            got = store.get_record(store.keys.usage("brief"), UsageRecord)
            return got[0] if got is not None and got[0].gpu_seconds > 0 else None

        rec = wait_for(charged, 30, "usage/brief with the GPU time between the grant and the job's end")
        assert rec.owner == "alice"
        assert rec.qos == "guaranteed" and rec.gpu_seconds_by_model.keys() == {"A100-40GB"}
    finally:
        coord.stop()
        t.join(20)
        assert not t.is_alive()
