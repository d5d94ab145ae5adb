"""A write that adds to a GPU is refused when that GPU's allocations changed after the snapshot (real etcd).

Only the leader writes allocations, but the pool must keep its capacity invariant against garbage
in etcd: an allocation written by hand between the leader's snapshot and its grant on the same
GPU. The hand-written key is injected at that seam by the test itself (after the scheduler
decided, before the applier writes), never by timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from testkit import publish_gpus

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.coordinator.apply import Applier, plan
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import FencedWriter, UnchangedSince
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Allocation,
    Directive,
    DirectiveKind,
    GiB,
    GpuInfo,
    JobSpec,
    JobState,
    JobStatus,
    QoS,
)
from gpupool_sdk.scheduler import Scheduler
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.scheduler.types import ClusterSnapshot, SchedulerConfig, ScheduleResult
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode
from gpupool_sdk.telemetry.coordinator_metrics import CoordinatorMetrics

# A long TTL: these tests drive cycles by hand, and leadership must not lapse between two calls
# on a loaded machine (a lapse would be a NotLeaderError, not what is tested).
TIMING = LeaseTiming(ttl_s=60, keepalive_interval_s=0.5, retry_timeout_s=1.0)
CFG = SchedulerConfig(etcd_max_txn_ops=128)
GHOST_BYTES = 41 * GiB  # what the fault harness's ghost holds: with a 50 GiB job, over 80 GiB


@dataclass
class Pool:
    store: EtcdStore
    election: Election
    applier: Applier
    gpu: GpuInfo
    lease: int

    def read(self) -> PoolState:
        kvs, rev = self.store.get_prefix(self.store.keys.root())
        return build_state(kvs, self.store.keys, time.time(), rev, self.election.term)

    def allocations(self) -> list[tuple[Allocation, int]]:
        kvs, _ = self.store.get_prefix(self.store.keys.allocations_prefix())
        return [(decode(kv.key, kv.value, Allocation), kv.lease) for kv in kvs]

    def used_bytes(self) -> int:
        return sum(a.memory_bytes for a, _ in self.allocations() if a.gpu_uuid == self.gpu.uuid)

    def status(self, job: str) -> JobStatus | None:
        got = self.store.get_record(self.store.keys.job_status(job), JobStatus)
        return got[0] if got else None


def _ghost(store: EtcdStore, gpu: GpuInfo, name: str = "ghost-1") -> str:
    """A lease-less allocation written by hand, as the fault harness's garbage writer does."""
    key = store.keys.allocation(gpu.node, gpu.uuid, name)
    store.put(key, Allocation(name, gpu.node, gpu.uuid, gpu.index, GHOST_BYTES, 0.5, QoS.GUARANTEED, 1, time.time()))
    return key


@pytest.fixture
def pool(store: EtcdStore) -> Iterator[Pool]:
    (gpu,) = parse_cluster_spec("node-a:1xH100-80GB:pcie")
    publish_gpus(store, [gpu])
    election = Election(store, "c", ElectionTiming(TIMING, 0.5))
    assert election.step()
    writer = FencedWriter(store, election.fence, election.demote)
    lease = store.grant_lease(60)
    try:
        yield Pool(store, election, Applier(writer, store.keys, CFG, store.revoke_lease), gpu, lease)
    finally:
        election.resign()
        store.revoke_lease(lease)


def test_a_ghost_written_between_snapshot_and_grant_is_not_overcommitted(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """The grant's transaction compares the GPU's allocation range: it loses, the GPU stays within capacity,
    the replica still leads, and the refusal is logged with the GPU and the key. (The code before
    this change committed the grant: 91 GiB on the 80 GiB GPU.)"""
    store, ks = pool.store, pool.store.keys
    store.create(ks.job_spec("j"), JobSpec(name="j", gpus=1, memory="50GiB", compute_share=0.5), lease=pool.lease)
    state = pool.read()
    decisions = Scheduler(CFG).schedule(state.snapshot)
    assert [type(d) for d in decisions] == [st.Grant]
    ghost = _ghost(store, pool.gpu)  # the seam: after the snapshot, before the grant
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.coordinator.apply"):
        report = pool.applier.apply(decisions, state)
    assert pool.used_bytes() == GHOST_BYTES <= pool.gpu.memory_bytes
    assert report.gpu_changed == {"Grant": 1} and report.lost == 1 and not report.applied
    assert pool.election.is_leader()  # a changed GPU is not a lost fence
    assert store.get(ks.job_status("j")) is None
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert pool.gpu.uuid in line and ghost in line and "Grant for j" in line

    # The next cycle decides from a state that has the ghost in it (an orphan counts as used): j waits.
    again = pool.read()
    assert [o.key for o in again.orphans] == [ghost]
    decisions = Scheduler(CFG).schedule(again.snapshot)
    assert not any(isinstance(d, st.Grant) for d in decisions)
    assert pool.applier.apply(decisions, again).lost == 0
    # Once the ghost is gone, j is granted.
    store.delete(ghost)
    last = pool.read()
    report = pool.applier.apply(Scheduler(CFG).schedule(last.snapshot), last)
    assert report.granted_jobs == ["j"] and not report.gpu_changed
    assert pool.used_bytes() == 50 * GiB


def test_the_leaders_own_writes_to_one_gpu_in_one_cycle_all_commit(pool: Pool) -> None:
    """A shrink and three grants on one GPU in one batch: each guard starts after the batch's own
    last write there, so none refuses the next. (A guard on the snapshot's revision alone refuses
    every write after the first: checked by disabling ``apply._after_own_writes``.)"""
    store, ks, g = pool.store, pool.store.keys, pool.gpu
    store.create(ks.job_spec("x"), JobSpec(name="x", gpus=1, memory="30GiB", compute_share=0.1), lease=pool.lease)
    store.put(ks.job_status("x"), JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=pool.election.term,
                                            gpus=1), lease=pool.lease)
    store.put(ks.allocation(g.node, g.uuid, "x"),
              Allocation("x", g.node, g.uuid, g.index, 30 * GiB, 0.1, QoS.GUARANTEED, pool.election.term, 900.0),
              lease=pool.lease)
    store.put(ks.directive("x"), Directive(DirectiveKind.BALLOON, 1, time.time() + 60, {"memory_bytes": 10 * GiB}),
              lease=pool.lease)
    for job in ("a", "b", "c"):
        store.create(ks.job_spec(job), JobSpec(name=job, gpus=1, memory="20GiB", compute_share=0.3), lease=pool.lease)
    state = pool.read()
    decisions: list[st.Decision] = [st.Shrink("x", 10 * GiB, "balloon acked")]
    decisions += [st.Grant(job, (st.SliceGrant(g.node, g.uuid, g.index, 20 * GiB, 0.3),)) for job in ("a", "b", "c")]
    report = pool.applier.apply(decisions, state)
    assert report.applied == {"Shrink": 1, "Grant": 3} and report.lost == 0 and not report.gpu_changed
    assert sorted(a.job for a, _ in pool.allocations()) == ["a", "b", "c", "x"]
    assert pool.used_bytes() == 70 * GiB


def test_only_writes_that_add_to_a_gpu_are_guarded_on_it(pool: Pool) -> None:
    """Pure planning: grants guard every GPU they place on, a deflate the GPUs it grows on, at the
    snapshot's revision; writes that only free room (shrink, release, directives) guard no GPU."""
    store, ks = pool.store, pool.store.keys
    gpus = parse_cluster_spec("node-b:2xH100-80GB:nvlink")
    publish_gpus(store, gpus)
    store.create(ks.job_spec("h"), JobSpec(name="h", gpus=2, memory="40GiB"), lease=pool.lease)
    for gi in gpus:
        store.put(ks.allocation(gi.node, gi.uuid, "h"),
                  Allocation("h", gi.node, gi.uuid, gi.index, 10 * GiB, 1.0, QoS.GUARANTEED, 1, 900.0), lease=pool.lease)
    store.put(ks.job_status("h"), JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=1, gpus=2),
              lease=pool.lease)
    state = pool.read()
    per_gpu = tuple(UnchangedSince(ks.allocations_prefix(gi.node, gi.uuid), state.revision) for gi in gpus)
    grant = st.Grant("h", tuple(st.SliceGrant(gi.node, gi.uuid, gi.index, 40 * GiB, 1.0) for gi in gpus))
    assert plan(grant, state, ks, CFG).gpu_guards == per_gpu
    assert plan(st.Deflate("h", "pressure over"), state, ks, CFG).gpu_guards == per_gpu  # 10 -> 40 GiB each
    for d in (st.Shrink("h", 5 * GiB, "acked"), st.Release("h", JobState.DONE, "done"), st.Preempt("h", "x", 2000.0)):
        p = plan(d, state, ks, CFG)
        assert p.ops and p.gpu_guards == (), d


def test_a_lost_fence_with_a_changed_gpu_is_a_leadership_loss(pool: Pool) -> None:
    """The leader key changes at the same seam as the ghost: the applier stops at the first refusal
    and the replica steps down; nothing is counted as a changed GPU, no later write is tried."""
    store, ks = pool.store, pool.store.keys
    (other,) = parse_cluster_spec("node-c:1xH100-80GB:pcie")
    publish_gpus(store, [other])
    store.create(ks.job_spec("j"), JobSpec(name="j", gpus=1, memory="50GiB", compute_share=0.5), lease=pool.lease)
    store.create(ks.job_spec("k"), JobSpec(name="k", gpus=1, memory="10GiB", compute_share=0.5), lease=pool.lease)
    state = pool.read()
    g = pool.gpu
    decisions = [st.Grant("j", (st.SliceGrant(g.node, g.uuid, g.index, 50 * GiB, 0.5),)),
                 st.Grant("k", (st.SliceGrant(other.node, other.uuid, other.index, 10 * GiB, 0.5),))]
    _ghost(store, g)
    store.put(ks.leader(), b'{"schema": 1, "kind": "LeaderRecord", "id": "usurper", "term": 99}')
    report = pool.applier.apply(decisions, state)
    assert report.lost == 1 and not report.applied and not report.gpu_changed
    assert not pool.election.is_leader()
    assert [a.job for a, _ in pool.allocations()] == ["ghost-1"]


class GhostOnce(Scheduler):
    """The real policy; the first time it grants ``job``, a ghost lands on that GPU before the apply."""

    def __init__(self, config: SchedulerConfig, store: EtcdStore, job: str) -> None:
        super().__init__(config)
        self.store, self.job, self.ghosts = store, job, 0

    def run(self, snapshot: ClusterSnapshot) -> ScheduleResult:
        result = super().run(snapshot)
        for d in result.decisions:
            if isinstance(d, st.Grant) and d.job == self.job and not self.ghosts:
                s = d.slices[0]
                _ghost(self.store, snapshot.gpus[s.gpu_uuid])
                self.ghosts += 1
        return result


def test_the_coordinator_counts_a_refused_grant_and_grants_again_once_the_ghost_is_collected(store: EtcdStore) -> None:
    """The whole loop: cycle 1 is refused (counted in the stats and in
    ``gpupool_scheduler_gpu_changed_total``, and the next cycle is due at once); cycle 2 sees the
    ghost, keeps the job waiting and deletes the orphan (grace 0); cycle 3 grants."""
    (gpu,) = parse_cluster_spec("node-a:1xH100-80GB:pcie")
    publish_gpus(store, [gpu])
    metrics = CoordinatorMetrics()
    registry = CollectorRegistry()
    registry.register(metrics)
    sched = GhostOnce(CFG, store, "j")
    coord = Coordinator(store, CFG, TIMING, "guard-test", loop_wait_s=0.5, scheduler=sched, autoscale=None,
                        orphan_grace_s=0.0, on_cycle=metrics.observe_cycle)
    metrics.watch(coord)
    lease = store.grant_lease(60)
    try:
        assert coord.election.step()
        store.create(store.keys.job_spec("j"), JobSpec(name="j", gpus=1, memory="50GiB", compute_share=0.5), lease=lease)

        first = coord.run_cycle()
        assert first is not None and sched.ghosts == 1
        assert not store.get(store.keys.allocation(gpu.node, gpu.uuid, "j"))  # not over capacity
        assert first.gpu_changed == {"Grant": 1} and "Grant" not in first.applied and first.granted_jobs == ()
        assert coord.stats.gpu_changed == 1 and coord.is_leader
        assert coord._wake.is_set()  # the loop runs the next cycle without waiting loop_wait_s
        assert b'gpupool_scheduler_gpu_changed_total{kind="Grant"} 1.0' in generate_latest(registry)

        second = coord.run_cycle()
        assert second is not None and not second.gpu_changed and second.granted_jobs == ()
        assert [type(d) for d in second.decided] == [st.Queue]
        assert coord.stats.orphans_deleted == 1
        assert not store.get_prefix(store.keys.allocations_prefix())[0]

        third = coord.run_cycle()
        assert third is not None and third.granted_jobs == ("j",)
        got = store.get_record(store.keys.job_status("j"), JobStatus)
        assert got is not None and got[0].state is JobState.GRANTED
        assert coord.stats.gpu_changed == 1 and sched.ghosts == 1
    finally:
        coord.election.resign()
        store.revoke_lease(lease)


def test_a_state_without_a_revision_guards_that_the_gpu_is_empty(pool: Pool) -> None:
    """Refusing is the safe side: with revision 0 a grant lands only on a GPU holding no allocation."""
    store, ks, g = pool.store, pool.store.keys, pool.gpu
    store.create(ks.job_spec("j"), JobSpec(name="j", gpus=1, memory="10GiB", compute_share=0.5), lease=pool.lease)
    state = replace(pool.read(), revision=0)
    grant = st.Grant("j", (st.SliceGrant(g.node, g.uuid, g.index, 10 * GiB, 0.5),))
    _ghost(store, g)
    assert pool.applier.apply([grant], state).gpu_changed == {"Grant": 1}
