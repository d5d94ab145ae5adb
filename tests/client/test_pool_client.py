"""PoolClient and Lease against a real etcd, with the leader played by LeaderStub."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from gpupool_sdk.client import JobAlreadyRunningError, Lease, PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import (
    AcquireTimeoutError,
    ConfigError,
    GpupoolError,
    JobRejectedError,
    LeaseLostError,
)
from gpupool_sdk.resources import (
    Allocation,
    Checkpoint,
    Directive,
    DirectiveKind,
    JobSpec,
    JobState,
    JobStatus,
    QoS,
)
from gpupool_sdk.store import EtcdStore, ResumeRecord, TelemetryRecord

from .leader_stub import LeaderStub

TIMING = LeaseTiming(ttl_s=5, keepalive_interval_s=1.0, retry_timeout_s=1.5)


def wait_for(cond: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.02)


def spec(name: str = "job-a", gpus: int = 1) -> JobSpec:
    return JobSpec(name=name, gpus=gpus, memory="1GiB")


def acquire_in_thread(pool: PoolClient, s: JobSpec, **kw: object) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["lease"] = pool.acquire(s, **kw)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_acquire_waits_for_grant_and_sees_allocations(pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    statuses: list[JobStatus] = []
    t, out = acquire_in_thread(pool, spec(gpus=2), timeout=60, on_status=statuses.append)
    leader.pending("job-a", "queued: waiting for 2 GPUs")
    wait_for(lambda: statuses)
    assert t.is_alive()  # pending is not granted
    assert leader.grant("job-a", [("node-a", "GPU-0", 0), ("node-b", "GPU-9", 3)])
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease), out
    assert lease.status is not None and lease.status.state is JobState.GRANTED and lease.term == 1
    assert sorted(a.gpu_uuid for a in lease.allocations) == ["GPU-0", "GPU-9"]
    assert lease.visible_devices == "0"  # only node-a's slice is on this node
    assert [s.state for s in statuses][:1] == [JobState.PENDING]
    info = store.lease_info(lease.etcd_lease_id)
    assert info is not None and store.keys.job_spec("job-a") in info.keys
    assert store.keys.allocation("node-b", "GPU-9", "job-a") in info.keys
    lease.release()
    assert lease.allocations == () and store.lease_info(lease.etcd_lease_id) is None
    assert store.get(store.keys.job_spec("job-a")) is None


def test_an_allocation_written_beside_the_grant_is_not_a_device_of_the_job(
    pool: PoolClient, leader: LeaderStub, store: EtcdStore
) -> None:
    # Someone with write access puts an allocation for GPU-7 on the granted job's own lease
    # (its grant holds GPU-0). The leader treats it as an orphan (granted_at differs from the
    # status's); the job must not train on it either: not in allocations, not in its devices.
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    assert leader.grant("job-a", [("node-a", "GPU-0", 0)])
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease), out
    status = lease.status
    assert status is not None and status.granted_at is not None
    forged = Allocation(job="job-a", node="node-a", gpu_uuid="GPU-7", gpu_index=7, memory_bytes=1 << 30,
                        compute_share=1.0, mode=QoS.GUARANTEED, term=status.term, granted_at=status.granted_at + 1)
    store.put(store.keys.allocation("node-a", "GPU-7", "job-a"), forged, lease=lease.etcd_lease_id)
    # Then the grant's own allocation changes (as a balloon rewrites it): an event of the same watch,
    # so once the job sees it, it has seen the forged one too.
    (own,) = lease.allocations
    ballooned = replace(own, memory_bytes=1 << 29)
    store.put(store.keys.allocation("node-a", "GPU-0", "job-a"), ballooned, lease=lease.etcd_lease_id)
    wait_for(lambda: [a.memory_bytes for a in lease.allocations if a.gpu_uuid == "GPU-0"] == [1 << 29])
    assert [a.gpu_uuid for a in lease.allocations] == ["GPU-0"]
    assert lease.visible_devices == "0"
    lease.release()


def test_acquire_timeout_revokes_the_lease(pool: PoolClient, store: EtcdStore) -> None:
    with pytest.raises(AcquireTimeoutError, match="no status yet"):
        pool.acquire(spec(), timeout=0.5)
    kvs, _ = store.get_prefix(store.keys.root())
    assert [kv.key for kv in kvs] == []  # spec gone with the lease


def test_rejected_job_raises_with_reason(pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    leader.reject("job-a", "needs 1TiB per slice; the largest GPU has 80GiB")
    t.join(30)
    err = out.get("error")
    assert isinstance(err, JobRejectedError) and "80GiB" in str(err)
    wait_for(lambda: store.get(store.keys.job_spec("job-a")) is None)


def test_same_name_while_live_is_an_error_naming_the_lease(etcd_endpoint: str, pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    leader.grant("job-a")
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease)
    other = PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=TIMING, in_process=True, node="node-a")
    with other, pytest.raises(JobAlreadyRunningError, match=f"etcdctl lease timetolive {lease.etcd_lease_hex} --keys"):
        other.acquire(spec(), timeout=5)
    with pytest.raises(JobAlreadyRunningError):
        pool.acquire(spec(), timeout=5)  # same client
    lease.release()


def test_directive_stream_and_ack_lands_in_etcd(pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    leader.grant("job-a")
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease)
    assert lease.poll_directive() is None
    sent = leader.directive("job-a", DirectiveKind.BALLOON, target={"memory_bytes": 512})
    got = next(lease.directives(timeout=30))
    assert got.seq == sent.seq and got.kind is DirectiveKind.BALLOON and got.target == {"memory_bytes": 512}
    lease.ack(got, step=7, reached_bytes=500)
    ack = leader.read_ack("job-a")
    assert ack is not None and ack.seq == sent.seq and ack.step == 7 and ack.reached_bytes == 500
    # Preempt: ack with a checkpoint, the leader frees the slices, the job sees them go.
    pre = leader.directive("job-a", DirectiveKind.PREEMPT)
    wait_for(lambda: lease.status is not None and lease.status.state is JobState.PREEMPTING)
    d = None
    while d is None:
        d = lease.poll_directive()
        time.sleep(0.01)
    assert d.seq == pre.seq
    lease.ack(d, step=9, checkpoint="/ckpt/9.ckpt")
    assert not lease.wait_released(timeout=0.05)
    assert leader.release_allocations("job-a")
    assert lease.wait_released(timeout=30)
    assert lease.allocations == () and not lease.lost
    lease.release()
    with pytest.raises(LeaseLostError):
        lease.ack(d)


def test_external_revoke_fires_lost_callback_and_fences(pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    leader.grant("job-a")
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease) and lease.allocations
    fired = threading.Event()
    reasons: list[GpupoolError] = []
    lease.add_lost_callback(lambda r: (reasons.append(r), fired.set()))
    assert store.revoke_lease(lease.etcd_lease_id)  # what a forced preemption does
    assert fired.wait(30)
    assert lease.lost and isinstance(lease.lost_reason, LeaseLostError)
    assert lease.allocations == () and lease.visible_devices == ""
    assert list(lease.directives(timeout=5)) == []  # the stream ends
    late: list[GpupoolError] = []
    lease.add_lost_callback(late.append)  # registered after the fact: called at once
    assert late and len(reasons) == 1
    with pytest.raises(LeaseLostError):
        lease.ack(Directive(kind=DirectiveKind.PREEMPT, seq=1, deadline=0.0))


def test_telemetry_is_coalesced_and_written(pool: PoolClient, leader: LeaderStub, store: EtcdStore) -> None:
    t, out = acquire_in_thread(pool, spec(), timeout=60)
    leader.grant("job-a")
    t.join(30)
    lease = out["lease"]
    assert isinstance(lease, Lease)
    for i in range(50):
        lease.publish_telemetry({"step": i, "peak_bytes": 100 + i})

    def latest() -> TelemetryRecord | None:
        got = store.get_record(store.keys.telemetry("job-a"), TelemetryRecord)
        return got[0] if got else None

    wait_for(lambda: (r := latest()) is not None and r.summary["step"] == 49)
    kv = store.get(store.keys.telemetry("job-a"))
    assert kv is not None and kv.lease == lease.etcd_lease_id and kv.version < 50
    lease.release()


def test_resume_info(pool: PoolClient, store: EtcdStore) -> None:
    assert pool.resume_info("job-a") is None
    ck = Checkpoint(path="/ckpt/100.ckpt", step=100, at=1.0)
    store.put(store.keys.checkpoint("job-a"), ResumeRecord(job="job-a", last_checkpoint=ck, preemptions=2))
    assert pool.resume_info("job-a") == ck


def test_bad_arguments_name_the_field(etcd_endpoint: str) -> None:
    with pytest.raises(ConfigError, match="endpoints"):
        PoolClient(endpoints="nohost")
    with pytest.raises(ConfigError, match="timing"):
        PoolClient(endpoints=etcd_endpoint, timing={"ttl_s": 1})  # type: ignore[arg-type]
    with PoolClient(endpoints=etcd_endpoint) as c, pytest.raises(ConfigError, match="spec"):
        c.acquire({"name": "x"})  # type: ignore[arg-type]


def test_in_process_mode_runs_the_same_protocol(etcd_endpoint: str, leader: LeaderStub, store: EtcdStore) -> None:
    with PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=TIMING, in_process=True, node="node-a") as pool:
        t, out = acquire_in_thread(pool, spec(), timeout=60)
        leader.grant("job-a", [("node-a", "GPU-1", 1)])
        t.join(30)
        lease = out["lease"]
        assert isinstance(lease, Lease) and lease.visible_devices == "1"
        sent = leader.directive("job-a", DirectiveKind.PREEMPT)
        got = next(lease.directives(timeout=30))
        lease.ack(got, step=3, checkpoint="/c")
        ack = leader.read_ack("job-a")
        assert ack is not None and ack.seq == sent.seq and ack.checkpoint == "/c"
        lease_id = lease.etcd_lease_id
    # close() released the lease.
    assert store.lease_info(lease_id) is None
