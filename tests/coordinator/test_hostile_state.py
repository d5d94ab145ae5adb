"""Issue 12: the scheduler acts only on keys backed by a live lease of the right writer, and counts
every allocation in etcd as used (failures 1-3 of the fault run, each reproduced here).

Pure tests build the snapshot with :func:`build_state` from key/value lists (leases included) and
run the real :class:`Scheduler`; the last tests run the coordinator loop against a real etcd to
show the leader garbage-collects orphans with a fenced delete after the grace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.coordinator.snapshot import MAX_GPU_MEMORY_BYTES, build_state
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Allocation,
    GiB,
    GpuInfo,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    NodeInfo,
    QoS,
)
from gpupool_sdk.scheduler import Scheduler
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import encode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.types import KeyValue

KS = Keyspace("/t")
NOW = 1000.0
AGENT = 0xA6E
UUID = "GPU-sim-node-a-0"


class Items:
    """Keys as one etcd range read would return them (revisions grow, leases as given)."""

    def __init__(self) -> None:
        self.kvs: list[KeyValue] = []
        self.rev = 0

    def put(self, key: str, value: Any, lease: int = 0) -> None:
        self.rev += 1
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        self.kvs.append(KeyValue(key, encode(value), self.rev, self.rev, 1, lease))


def _agent(it: Items, spec: str = "node-a:1xH100-80GB:pcie") -> list[GpuInfo]:
    gpus = parse_cluster_spec(spec)
    for g in gpus:
        it.put(KS.gpu(g.node, g.uuid), g, AGENT)
    for node in {g.node for g in gpus}:
        it.put(KS.node(node), NodeInfo(node, "h", 1, len(gpus), "simulated", 0.0), AGENT)
    return gpus


def _decide(snapshot: st.ClusterSnapshot) -> list[st.Decision]:
    result = Scheduler(st.SchedulerConfig()).schedule(snapshot)
    return list(getattr(result, "decisions", result))


def _grants(it: Items) -> dict[str, st.Grant]:
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    return {d.job: d for d in _decide(state.snapshot) if isinstance(d, st.Grant)}


# ---------------------------------------------------------------- failure 1: a spec without a lease


def test_a_spec_without_a_lease_is_never_granted_and_is_listed_as_a_problem() -> None:
    it = Items()
    _agent(it)
    it.put(KS.job_spec("nolease"), JobSpec(name="nolease", gpus=1, memory="10GiB"))  # lease 0
    it.put(KS.job_spec("ok"), JobSpec(name="ok", gpus=1, memory="10GiB", qos="shared"), 0x10)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    assert "nolease" not in state.snapshot.jobs and "nolease" not in state.jobs
    problems = {p.key: p.message for p in state.problems}
    assert "no lease" in problems[KS.job_spec("nolease")]
    assert set(_grants(it)) == {"ok"}


def test_a_spec_on_an_agents_or_the_leaders_lease_is_not_a_job() -> None:
    it = Items()
    _agent(it)
    it.put(KS.leader(), LeaderRecord("c1", 1, 1.0), 0x1EAD)
    it.put(KS.job_spec("on-agent"), JobSpec(name="on-agent", gpus=1, memory="1GiB"), AGENT)
    it.put(KS.job_spec("on-leader"), JobSpec(name="on-leader", gpus=1, memory="1GiB"), 0x1EAD)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    assert not state.snapshot.jobs
    problems = {p.key: p.message for p in state.problems}
    assert "an agent's" in problems[KS.job_spec("on-agent")]
    assert "the leader's" in problems[KS.job_spec("on-leader")]


def test_the_applier_never_writes_a_job_key_without_a_lease() -> None:
    from gpupool_sdk.coordinator.apply import plan

    it = Items()
    _agent(it)
    it.put(KS.job_spec("j"), JobSpec(name="j", gpus=1, memory="1GiB"), 0x10)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    from dataclasses import replace

    meta = replace(state.jobs["j"], lease=0)
    broken = replace(state, jobs={"j": meta})
    grant = st.Grant("j", (st.SliceGrant("node-a", UUID, 0, GiB, 1.0),))
    assert plan(grant, broken, KS, st.SchedulerConfig()).empty
    assert not plan(grant, state, KS, st.SchedulerConfig()).empty


# ---------------------------------------------------------------- failure 2: orphaned memory counted as free


def _orphan(it: Items, job: str, memory: int, mode: QoS = QoS.GUARANTEED, lease: int = 0) -> None:
    a = Allocation(job, "node-a", UUID, 0, memory, 0.5, mode, 1, 900.0)
    it.put(KS.allocation("node-a", UUID, job), a, lease)
    it.put(KS.job_status(job), JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=1, gpus=1), lease)


@pytest.mark.parametrize(
    ("why", "spec_lease", "alloc_lease"),
    [
        ("no lease, no spec", None, 0),
        ("no lease, spec present", 0x20, 0),
        ("spec gone, lease alive", None, 0x21),
        ("an earlier incarnation's lease", 0x22, 0x23),
    ],
)
def test_orphaned_memory_is_counted_as_used(why: str, spec_lease: int | None, alloc_lease: int) -> None:
    it = Items()
    _agent(it)  # one H100, 80 GiB
    if spec_lease is not None:
        it.put(KS.job_spec("ghost"), JobSpec(name="ghost", gpus=1, memory="41GiB"), spec_lease)
    _orphan(it, "ghost", 41 * GiB, lease=alloc_lease)
    it.put(KS.job_spec("new"), JobSpec(name="new", gpus=1, memory="40GiB", qos="guaranteed", compute_share=0.5), 0x30)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    assert [o.key for o in state.orphans if o.allocation] == [KS.allocation("node-a", UUID, "ghost")], why
    assert len(state.snapshot.orphans) == 1, why
    assert "ghost" not in state.snapshot.jobs or not state.snapshot.jobs["ghost"].allocations, why
    # 41 GiB orphaned + 40 GiB would be 81 GiB on an 80 GiB GPU: not granted.
    assert "new" not in _grants(it), why
    assert any(KS.allocation("node-a", UUID, "ghost") == p.key and "orphan" in p.message for p in state.problems)


def test_an_exclusive_job_never_lands_beside_an_orphan_and_a_small_one_still_fits() -> None:
    it = Items()
    _agent(it)
    _orphan(it, "ghost", 10 * GiB)
    it.put(KS.job_spec("excl"), JobSpec(name="excl", gpus=1, memory="10GiB", qos="exclusive"), 0x31)
    it.put(KS.job_spec("small"), JobSpec(name="small", gpus=1, memory="30GiB", qos="guaranteed", compute_share=0.5), 0x32)
    assert set(_grants(it)) == {"small"}


def test_a_preemption_never_counts_on_an_orphans_memory() -> None:
    """A high-priority job that needs the whole GPU is not placed by preempting the low one: the
    orphan's memory would still be in the way."""
    it = Items()
    _agent(it)
    _orphan(it, "ghost", 30 * GiB)
    it.put(KS.job_spec("low"), JobSpec(name="low", gpus=1, memory="20GiB", qos="guaranteed", compute_share=0.25,
                                       priority=0), 0x40)
    it.put(KS.job_status("low"), JobStatus(JobState.GRANTED, "g", 500.0, 400.0, 500.0, term=1, gpus=1), 0x40)
    it.put(KS.allocation("node-a", UUID, "low"),
           Allocation("low", "node-a", UUID, 0, 20 * GiB, 0.25, QoS.GUARANTEED, 1, 500.0), 0x40)
    it.put(KS.job_spec("high"), JobSpec(name="high", gpus=1, memory="60GiB", qos="guaranteed", compute_share=0.5,
                                        priority=9), 0x41)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    decisions = _decide(state.snapshot)
    assert not any(isinstance(d, (st.Grant, st.Preempt)) and d.job in ("high", "low") for d in decisions), decisions


# ---------------------------------------------------------------- failure 3: a GPU key nobody publishes


def _rogue(it: Items, lease: int, node: str = "rogue", memory: int = 1 << 60, model: str = "H999-1EB") -> str:
    g = GpuInfo(uuid="GPU-rogue", node=node, index=0, model=model, memory_bytes=memory)
    it.put(KS.gpu(node, g.uuid), g, lease)
    return KS.gpu(node, g.uuid)


@pytest.mark.parametrize(
    ("case", "lease", "node", "memory", "words"),
    [
        ("no lease, no node key, unknown model, 2^60 bytes", 0, "rogue", 1 << 60, "no lease"),
        ("on a lease but no node key", 0x50, "rogue", 1 << 60, "no live node key"),
        ("on another lease than its node's agent", 0x51, "node-a", 80 * GiB, "not the lease"),
        ("the agent's lease but an implausible size", AGENT, "node-a", MAX_GPU_MEMORY_BYTES + 1, "implausible"),
    ],
)
def test_a_gpu_key_not_published_by_its_agent_is_never_granted(case: str, lease: int, node: str, memory: int,
                                                               words: str) -> None:
    it = Items()
    it.put(KS.node("node-a"), NodeInfo("node-a", "h", 1, 0, "simulated", 0.0), AGENT)  # an agent with no GPUs
    key = _rogue(it, lease, node, memory)
    for i in range(4):
        it.put(KS.job_spec(f"j{i}"), JobSpec(name=f"j{i}", gpus=1, memory="1GiB", qos="shared"), 0x60 + i)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    assert not state.snapshot.gpus, case
    assert words in {p.key: p.message for p in state.problems}[key], case
    assert _grants(it) == {}, case


def test_a_node_key_without_a_lease_publishes_nothing() -> None:
    it = Items()
    it.put(KS.node("rogue"), NodeInfo("rogue", "h", 1, 1, "simulated", 0.0))  # lease 0
    _rogue(it, 0, "rogue", 80 * GiB, "H100-80GB")
    it.put(KS.job_spec("j"), JobSpec(name="j", gpus=1, memory="1GiB"), 0x70)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=1)
    assert not state.snapshot.gpus and "rogue" not in state.nodes
    assert _grants(it) == {}


def test_problems_are_logged_once_per_key_and_revision(caplog: pytest.LogCaptureFixture) -> None:
    from gpupool_sdk.coordinator.snapshot import DecodeCache

    it = Items()
    _agent(it)
    it.put(KS.job_spec("nolease"), JobSpec(name="nolease", gpus=1, memory="1GiB"))
    cache = DecodeCache()
    for _ in range(3):
        build_state(it.kvs, KS, NOW, cache=cache)
    assert caplog.text.count("skipping /t/jobs/nolease/spec") == 1
    it.put(KS.job_spec("nolease"), JobSpec(name="nolease", gpus=1, memory="2GiB"))  # a new revision
    build_state(it.kvs, KS, NOW, cache=cache)
    assert caplog.text.count("skipping /t/jobs/nolease/spec") == 2


# ---------------------------------------------------------------- the leader collects orphans (real etcd)

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


@pytest.fixture
def leader(store: EtcdStore) -> Iterator[Coordinator]:
    publish_gpus(store, parse_cluster_spec("node-a:1xH100-80GB:pcie"))
    coord = Coordinator(store, st.SchedulerConfig(), TIMING, "gc", loop_wait_s=0.5, orphan_grace_s=1.0)
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: coord.is_leader, what="leadership")
        yield coord
    finally:
        coord.stop()
        t.join(20)


def test_the_leader_deletes_orphans_after_the_grace_and_grants_the_room(store: EtcdStore, leader: Coordinator) -> None:
    ks = store.keys
    a = Allocation("ghost", "node-a", UUID, 0, 41 * GiB, 0.5, QoS.GUARANTEED, 1, time.time())
    store.put(ks.allocation("node-a", UUID, "ghost"), a)  # no lease, no spec: would never expire
    store.put(ks.job_status("ghost"), JobStatus(JobState.GRANTED, "by hand", term=1, gpus=1))
    lease = store.grant_lease(30)
    store.create(ks.job_spec("new"), JobSpec(name="new", gpus=1, memory="40GiB", compute_share=0.5), lease=lease)

    def status() -> JobStatus | None:
        got = store.get_record(ks.job_status("new"), JobStatus)
        return got[0] if got else None

    # Queued while the orphan holds 41 GiB, then granted once the leader deleted it.
    wait_for(lambda: (s := status()) is not None and s.state is JobState.PENDING, what="new to be queued")
    wait_for(lambda: (s := status()) is not None and s.state is JobState.GRANTED, what="new to be granted after the GC")
    assert store.get(ks.allocation("node-a", UUID, "ghost")) is None
    assert store.get(ks.job_status("ghost")) is None
    assert leader.stats.orphans_deleted >= 2
    store.revoke_lease(lease)


def test_orphan_grace_is_validated(store: EtcdStore) -> None:
    with pytest.raises(ConfigError, match="orphan_grace_s"):
        Coordinator(store, st.SchedulerConfig(), TIMING, "x", orphan_grace_s=-1)
