"""Scenarios of one job's life: grant, queue, cooperative and forced preemption, bad input."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import Ack, DirectiveKind, GiB, JobSpec, JobState
from gpupool_sdk.store.records import TelemetryRecord
from gpupool_sdk.telemetry.usage import UsageRecord
from scenarios.harness import Pool, wait_for


def test_grant_puts_allocations_on_the_jobs_lease(pool: Pool) -> None:
    pool.gpus("node-a:2xH100-80GB:nvlink")
    pool.coordinator("c1")
    leader = pool.wait_leader()
    job = pool.submit("bert", gpus=2, memory="30GiB", qos="guaranteed", priority=10)
    status = job.wait_state(JobState.GRANTED)
    assert status.gpus == 2 and status.term >= leader.term  # (a busy machine may have re-elected)
    allocs = job.allocations()
    assert len(allocs) == 2 and {a.memory_bytes for a in allocs} == {30 * GiB}
    assert all(a.term == status.term for a in allocs)
    info = pool.store.lease_info(job.lease)
    assert info is not None
    assert {pool.keys.allocation(a.node, a.gpu_uuid, "bert") for a in allocs} <= set(info.keys)
    assert pool.keys.job_status("bert") in info.keys
    pool.check()
    # The job dies: its lease goes and so do its grants, with no coordinator action needed.
    job.release()
    wait_for(lambda: not pool.allocations(), what="the grants to vanish with the lease")
    pool.check()


def test_queueing_when_full_then_grant_when_freed(pool: Pool) -> None:
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.coordinator("c1", "--no-preemption")
    first = pool.submit("first", gpus=1, qos="exclusive")
    first.wait_state(JobState.GRANTED)
    second = pool.submit("second", gpus=1, qos="exclusive", priority=5)
    queued = second.wait_state(JobState.PENDING)
    assert queued.reason, "a queued job says what it waits for"
    pool.check()
    first.release()
    second.wait_state(JobState.GRANTED)
    pool.check()


def test_preemption_with_ack_then_high_priority_grant(pool: Pool) -> None:
    pool.gpus("node-a:1xH100-80GB:pcie")
    pool.coordinator("c1")
    low = pool.submit("low", gpus=1, qos="exclusive", priority=1, preempt_grace_s=60)
    low.wait_state(JobState.GRANTED)
    high = pool.submit("high", gpus=1, qos="exclusive", priority=10)
    d = low.wait_directive()
    assert d.kind is DirectiveKind.PREEMPT and d.seq >= 1
    assert low.wait_state(JobState.PREEMPTING).reason
    assert high.state() is not JobState.GRANTED  # nobody is granted a slice still held
    pool.check()
    low.ack(d, step=1234, checkpoint="/ckpt/low/step1234.ckpt")
    suspended = low.wait_state(JobState.SUSPENDED)
    assert suspended.last_checkpoint is not None and suspended.last_checkpoint.step == 1234
    high.wait_state(JobState.GRANTED)
    resume = wait_for(lambda: pool.resume("low"), what="checkpoints/low")
    assert resume.last_checkpoint is not None and resume.last_checkpoint.path == "/ckpt/low/step1234.ckpt"
    assert resume.preemptions == 1
    assert not low.allocations() and low.directive() is None
    usage = pool.store.get_record(pool.keys.usage("low"), UsageRecord)
    assert usage is not None and usage[0].gpu_seconds > 0 and usage[1].lease == 0  # outlives the job
    pool.check()


def test_forced_revoke_after_a_missed_deadline(pool: Pool) -> None:
    pool.gpus("node-a:1xH100-80GB:pcie")
    pool.coordinator("c1")
    stubborn = pool.submit("stubborn", gpus=1, qos="exclusive", priority=1, preempt_grace_s=1.0)
    stubborn.wait_state(JobState.GRANTED)
    urgent = pool.submit("urgent", gpus=1, qos="exclusive", priority=10)
    d = stubborn.wait_directive()
    assert d.kind is DirectiveKind.PREEMPT
    # No ack: after the deadline the coordinator revokes the job's etcd lease.
    wait_for(lambda: not stubborn.alive(), what="the stubborn job's lease to be revoked")
    assert stubborn.state() is None  # every key of the job vanished with its lease
    urgent.wait_state(JobState.GRANTED)
    resume = wait_for(lambda: pool.resume("stubborn"), what="checkpoints/stubborn")
    assert resume.preemptions == 1
    pool.check()


def test_invalid_spec_is_rejected_before_anything_is_written(pool: Pool) -> None:
    with pytest.raises(SpecError, match="memory"):
        JobSpec(name="bad", gpus=1, memory="lots", qos="guaranteed")
    with pytest.raises(SpecError, match="gpus"):
        JobSpec(name="bad", gpus=0, memory="1GiB")
    with pytest.raises(SpecError, match="name"):
        JobSpec(name="Bad Name!", gpus=1, memory="1GiB")
    kvs, _ = pool.store.get_prefix(pool.keys.root())
    assert kvs == []


def test_impossible_specs_are_rejected_with_the_reason(pool: Pool) -> None:
    pool.gpus("node-a:2xA100-40GB:pcie")
    pool.coordinator("c1")
    too_big = pool.submit("too-big", gpus=1, memory="60GiB", qos="guaranteed")
    no_feature = pool.submit("no-fp8", gpus=1, memory="10GiB", qos="guaranteed", features=("fp8",))
    too_many = pool.submit("too-many", gpus=4, memory="10GiB", qos="guaranteed")
    ok = pool.submit("fits", gpus=1, memory="10GiB", qos="guaranteed")
    assert "memory" in too_big.wait_state(JobState.REJECTED).reason.lower() or "GiB" in too_big.status().reason  # type: ignore[union-attr]
    assert "fp8" in no_feature.wait_state(JobState.REJECTED).reason
    assert too_many.wait_state(JobState.REJECTED).reason
    ok.wait_state(JobState.GRANTED)
    pool.check()


def test_real_client_processes_preempt_ack_and_grant(pool: Pool) -> None:
    pool.gpus("node-a:1xH100-80GB:pcie")
    pool.coordinator("c1")
    low = pool.client(JobSpec(name="low", gpus=1, qos="exclusive", priority=1))
    pool.wait_output(low, "GRANTED")
    high = pool.client(JobSpec(name="high", gpus=1, qos="exclusive", priority=10))
    assert low.wait(60) == 75, "a preempted job exits with EX_TEMPFAIL after its checkpoint and ack"
    assert "DIRECTIVE preempt" in pool.output(low)
    pool.wait_output(high, "GRANTED")
    resume = wait_for(lambda: pool.resume("low"), what="checkpoints/low")
    assert resume.last_checkpoint is not None and resume.last_checkpoint.path.startswith("/ckpt/low/")
    pool.check()
    # A client killed outright loses its grants when its lease expires, with no one's help.
    high.kill()
    high.wait(10)
    wait_for(lambda: not pool.allocations(), what="the killed job's grants to expire with its lease")
    pool.check()


def test_hand_edited_garbage_is_skipped_and_the_pool_keeps_working(pool: Pool, etcdctl: Any) -> None:
    uuids = pool.gpus("node-a:2xA100-40GB:pcie")
    pool.coordinator("c1")
    pool.wait_leader()
    etcdctl("put", pool.keys.job_spec("garbage"), "{not json")
    etcdctl("put", pool.keys.allocation("node-a", uuids[0], "ghost"), '{"schema": 1, "kind": "Allocation"}')
    etcdctl("put", pool.keys.directive("nobody"), "[]")
    job = pool.submit("fine", gpus=1, memory="10GiB", qos="guaranteed")
    job.wait_state(JobState.GRANTED)
    assert "garbage" in pool.log("coordinator-c1")  # reported with its key
    assert pool.procs[-1].poll() is None
    pool.check()


def test_balloon_shrinks_a_shared_job_to_make_room(pool: Pool) -> None:
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.coordinator("c1")
    shared = pool.submit("shared", gpus=1, memory="30GiB", qos="shared", priority=0)
    shared.wait_state(JobState.GRANTED)
    # It reports that it really peaks at 8 GiB: the pool may shrink it rather than preempt it.
    pool.store.put(pool.keys.telemetry("shared"),
                   TelemetryRecord(job="shared", at=time.time(), summary={"memory_peak_bytes": 8 * GiB}),
                   lease=shared.lease)
    urgent = pool.submit("urgent", gpus=1, memory="20GiB", qos="guaranteed", priority=5)
    d = shared.wait_directive()
    assert d.kind is DirectiveKind.BALLOON
    target = int(d.target["memory_bytes"])
    assert 8 * GiB <= target <= 20 * GiB
    assert urgent.state() is not JobState.GRANTED  # not before the memory is actually given back
    pool.check()
    ack = Ack(seq=d.seq, step=50, reached_bytes=target, at=time.time())
    pool.store.put(pool.keys.ack("shared"), ack, lease=shared.lease)
    urgent.wait_state(JobState.GRANTED)
    wait_for(lambda: [a.memory_bytes for a in shared.allocations()] == [target], what="the shrunk allocation")
    assert shared.state() is JobState.GRANTED  # it kept running, on less memory
    pool.check()
    # The pressure ends: the quota comes back (allocation first, then the job is told).
    urgent.release()
    d2 = wait_for(lambda: (x if (x := shared.directive()) is not None and x.kind is DirectiveKind.DEFLATE else None),
                  what="a deflate directive")
    assert d2.seq > d.seq and d2.target["memory_bytes"] == 30 * GiB
    assert [a.memory_bytes for a in shared.allocations()] == [30 * GiB]
    pool.check()
    pool.store.put(pool.keys.ack("shared"), Ack(seq=d2.seq, step=60, reached_bytes=30 * GiB, at=time.time()),
                   lease=shared.lease)
    wait_for(lambda: shared.directive() is None, what="the acked deflate directive to be retired")


def test_elastic_job_grows_through_a_resize(pool: Pool) -> None:
    pool.gpus("node-a:2xA100-40GB:pcie")
    pool.coordinator("c1")
    blocker = pool.submit("blocker", gpus=1, qos="exclusive", priority=5)
    blocker.wait_state(JobState.GRANTED)
    elastic = pool.submit("elastic", gpus=1, min_gpus=1, max_gpus=2, qos="exclusive", priority=0)
    elastic.wait_state(JobState.GRANTED)
    assert len(elastic.allocations()) == 1
    blocker.release()  # a GPU frees up and nothing else waits: the elastic job may grow
    d = elastic.wait_directive()
    assert d.kind is DirectiveKind.RESIZE and d.target["gpus"] == 2
    elastic.ack(d, step=10)
    status = wait_for(lambda: (s if (s := elastic.status()) is not None and s.state is JobState.GRANTED and s.gpus == 2 else None),
                      what="the re-grant with two GPUs")
    assert len(elastic.allocations()) == 2 and elastic.directive() is None
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 10
    pool.check()


def test_real_client_that_ignores_its_preemption_is_revoked_and_knows_it(pool: Pool) -> None:
    pool.gpus("node-a:1xH100-80GB:pcie")
    pool.coordinator("c1")
    deaf = pool.client(JobSpec(name="deaf", gpus=1, qos="exclusive", priority=1, preempt_grace_s=1.0), "--ignore-directives")
    pool.wait_output(deaf, "GRANTED")
    urgent = pool.client(JobSpec(name="urgent", gpus=1, qos="exclusive", priority=10))
    assert deaf.wait(60) == 4, pool.output(deaf)
    assert "DIRECTIVE preempt" in pool.output(deaf) and "LOST" in pool.output(deaf)
    pool.wait_output(urgent, "GRANTED")
    pool.check()
