"""plan(): what each decision writes (pure, table-driven), and the applier against a real etcd."""

from __future__ import annotations

from typing import Any

import pytest
from testkit import publish_gpus

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.apply import Applier, housekeeping, plan
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import DeleteOp, FencedWriter, PutOp, SameIncarnation
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    DirectiveKind,
    GiB,
    JobSpec,
    JobState,
    JobStatus,
    NodeInfo,
    QoS,
)
from gpupool_sdk.scheduler import Scheduler
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode, encode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.records import ResumeRecord
from gpupool_sdk.store.types import KeyValue

KS = Keyspace("/t")
NOW = 1000.0
CFG = st.SchedulerConfig(balloon_grace_s=30)
UUID0, UUID1 = "GPU-sim-node-a-0", "GPU-sim-node-a-1"
LEASE = 0xAB


def _state(status: JobStatus | None = None, held: int = 0, directive: Directive | None = None,
           ack: Ack | None = None) -> PoolState:
    kvs = _kvs(status, held, directive, ack)
    return build_state(kvs, KS, NOW, revision=len(kvs), term=5)


def _kvs(status: JobStatus | None = None, held: int = 0, directive: Directive | None = None,
         ack: Ack | None = None, memory: int = 10 * GiB) -> list[KeyValue]:
    kvs: list[KeyValue] = []
    rev = [0]

    def put(key: str, value: Any, lease: int = 0) -> None:
        rev[0] += 1
        kvs.append(KeyValue(key, encode(value), rev[0], rev[0], 1, lease))

    for g in parse_cluster_spec("node-a:2xH100-80GB:nvlink"):
        put(KS.gpu(g.node, g.uuid), g, 9)
    put(KS.node("node-a"), NodeInfo(name="node-a", hostname="test", agent_pid=1, gpu_count=2, backend="simulated", started_at=0.0), 9)
    put(KS.job_spec("j"), JobSpec(name="j", gpus=2, memory="10GiB", qos="guaranteed"), LEASE)
    if status is not None:
        put(KS.job_status("j"), status, LEASE)
    for i, uuid in enumerate((UUID0, UUID1)[:held]):
        put(KS.allocation("node-a", uuid, "j"), Allocation("j", "node-a", uuid, i, memory, 1.0, QoS.GUARANTEED, 1, 900.0), LEASE)
    if directive is not None:
        put(KS.directive("j"), directive, LEASE)
    if ack is not None:
        put(KS.ack("j"), ack, LEASE)
    return kvs


def _written(kvs: list[KeyValue], p: Any) -> PoolState:
    """The pool read back after ``p``'s writes (what the next cycle's snapshot sees)."""
    by_key = {kv.key: kv for kv in kvs}
    rev = max(kv.mod_revision for kv in kvs) + 1
    for o in p.ops:
        if isinstance(o, DeleteOp):
            by_key.pop(o.key, None)
        else:
            old = by_key.get(o.key)
            by_key[o.key] = KeyValue(o.key, o.value, old.create_revision if old else rev, rev, 1, o.lease or 0)
    return build_state(list(by_key.values()), KS, NOW + 1, revision=rev, term=5)


BALLOON = Directive(DirectiveKind.BALLOON, 3, 2000.0, {"memory_bytes": 4 * GiB})
BOTH = (st.SliceGrant("node-a", UUID0, 0, 10 * GiB, 1.0), st.SliceGrant("node-a", UUID1, 1, 10 * GiB, 1.0))


@pytest.mark.parametrize(
    ("case", "kvs", "decision", "held"),
    [
        ("grant", _kvs(JobStatus(JobState.PENDING, "queued: full", 800.0, 800.0, term=4)), st.Grant("j", BOTH), 2),
        ("re-grant (migration)", _kvs(JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=4, gpus=1), held=1),
         st.Grant("j", (st.SliceGrant("node-a", UUID1, 1, 10 * GiB, 1.0),)), 1),
        ("deflate", _kvs(JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=4, gpus=2), held=2,
                         memory=4 * GiB), st.Deflate("j", "pressure over"), 2),
        ("shrink", _kvs(JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=4, gpus=2), held=2,
                        directive=BALLOON, ack=Ack(seq=3)), st.Shrink("j", 4 * GiB, "balloon acked"), 2),
    ],
)
def test_the_leaders_allocation_writes_read_back_as_the_jobs_own(case: str, kvs: list[KeyValue], decision: Any,
                                                                  held: int) -> None:
    """Every allocation the leader writes carries its grant's ``granted_at`` (the status's): read back,
    none is an orphan and every one is the job's (a hand-written one beside them is told apart by it)."""
    before = build_state(kvs, KS, NOW, revision=len(kvs), term=5)
    after = _written(kvs, plan(decision, before, KS, CFG))
    assert after.orphans == (), after.orphans
    assert len(after.snapshot.jobs["j"].allocations) == held, case


def _puts(p: Any) -> dict[str, PutOp]:
    return {o.key: o for o in p.ops if isinstance(o, PutOp)}


def _deletes(p: Any) -> set[str]:
    return {o.key for o in p.ops if isinstance(o, DeleteOp)}


GRANTED = JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=4, gpus=2)
PENDING = JobStatus(JobState.PENDING, "queued: full", 800.0, 800.0, term=4)


def test_grant_writes_every_slice_and_the_status_on_the_jobs_lease_guarded_on_the_spec() -> None:
    state = _state(PENDING)
    grant = st.Grant("j", (st.SliceGrant("node-a", UUID0, 0, 10 * GiB, 1.0), st.SliceGrant("node-a", UUID1, 1, 10 * GiB, 1.0)))
    p = plan(grant, state, KS, CFG)
    puts = _puts(p)
    assert set(puts) == {KS.allocation("node-a", UUID0, "j"), KS.allocation("node-a", UUID1, "j"), KS.job_status("j")}
    assert all(o.lease == LEASE for o in puts.values())
    status = decode("s", puts[KS.job_status("j")].value, JobStatus)
    assert status.state is JobState.GRANTED and status.gpus == 2 and status.term == 5
    assert status.granted_at == NOW and status.queued_at == 800.0 and status.reason
    alloc = decode("a", puts[KS.allocation("node-a", UUID0, "j")].value, Allocation)
    assert alloc.term == 5 and alloc.mode is QoS.GUARANTEED
    assert p.guards == (SameIncarnation(KS.job_spec("j"), state.jobs["j"].spec_create_revision),)


@pytest.mark.parametrize(
    ("status", "decision", "writes"),
    [
        (None, st.Queue("j", "queued: full"), True),  # first sight: status PENDING
        (PENDING, st.Queue("j", "queued: full"), False),  # same reason: no write storm
        (PENDING, st.Queue("j", "queued: waiting for 1 preemption"), True),
        (None, st.Reject("j", "needs 90GiB; the largest GPU has 80GiB"), True),
        (JobStatus(JobState.REJECTED, "needs 90GiB; the largest GPU has 80GiB"), st.Reject("j", "needs 90GiB; the largest GPU has 80GiB"), False),
    ],
)
def test_queue_and_reject_write_only_on_change(status: JobStatus | None, decision: Any, writes: bool) -> None:
    p = plan(decision, _state(status), KS, CFG)
    assert bool(p.ops) is writes
    if writes:
        s = decode("s", _puts(p)[KS.job_status("j")].value, JobStatus)
        assert s.reason == decision.reason and s.updated_at == NOW
        assert s.state is (JobState.REJECTED if isinstance(decision, st.Reject) else JobState.PENDING)


@pytest.mark.parametrize(
    ("decision", "kind", "state", "target"),
    [
        (st.Preempt("j", "for hi", 1060.0, "hi"), DirectiveKind.PREEMPT, JobState.PREEMPTING, {"for_job": "hi"}),
        (st.Preempt("j", "gpu unhealthy", 1060.0), DirectiveKind.PREEMPT, JobState.PREEMPTING, {}),
        (st.Resize("j", 1, "shrink", 1060.0), DirectiveKind.RESIZE, JobState.PREEMPTING, {"gpus": 1}),
        (
            st.Resize("j", 1, "shrink for hi", 1060.0, for_job="hi", keep=(UUID1,)),
            DirectiveKind.RESIZE,
            JobState.PREEMPTING,
            {"gpus": 1, "for_job": "hi", "keep": [UUID1]},
        ),
        (st.Balloon("j", 4 * GiB, "pressure", 1030.0), DirectiveKind.BALLOON, None, {"memory_bytes": 4 * GiB}),
        (
            st.Balloon("j", 4 * GiB, "pressure", 1030.0, for_job="hi"),
            DirectiveKind.BALLOON,
            None,
            {"memory_bytes": 4 * GiB, "for_job": "hi"},
        ),
    ],
)
def test_directives_take_the_next_seq(decision: Any, kind: DirectiveKind, state: JobState | None, target: dict[str, int]) -> None:
    p = plan(decision, _state(GRANTED, held=2, ack=Ack(seq=6)), KS, CFG)
    puts = _puts(p)
    d = decode("d", puts[KS.directive("j")].value, Directive)
    assert d.kind is kind and d.seq == 7 and dict(d.target) == target and d.term == 5
    assert puts[KS.directive("j")].lease == LEASE
    if state is None:
        assert KS.job_status("j") not in puts
    else:
        assert decode("s", puts[KS.job_status("j")].value, JobStatus).state is state


def test_a_second_preempt_while_one_is_outstanding_writes_nothing() -> None:
    d = Directive(DirectiveKind.PREEMPT, 3, 1050.0)
    p = plan(st.Preempt("j", "again", 1070.0), _state(GRANTED, held=2, directive=d), KS, CFG)
    assert p.empty


def test_release_frees_slices_and_keeps_the_checkpoint_for_resume() -> None:
    d = Directive(DirectiveKind.PREEMPT, 3, 1050.0)
    state = _state(JobStatus(JobState.PREEMPTING, "for hi", 950.0, 800.0, 900.0, term=4, gpus=2), held=2, directive=d,
                   ack=Ack(seq=3, step=42, checkpoint="/ckpt/42", at=990.0))
    p = plan(st.Release("j", JobState.SUSPENDED, "acked"), state, KS, CFG)
    assert _deletes(p) == {KS.allocation("node-a", UUID0, "j"), KS.allocation("node-a", UUID1, "j"), KS.directive("j")}
    puts = _puts(p)
    status = decode("s", puts[KS.job_status("j")].value, JobStatus)
    assert status.state is JobState.SUSPENDED and status.gpus == 0 and status.preemptions == 1
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 42
    resume = decode("r", puts[KS.checkpoint("j")].value, ResumeRecord)
    assert puts[KS.checkpoint("j")].lease == 0  # outlives the job
    assert resume.preemptions == 1 and resume.last_checkpoint is not None and resume.last_checkpoint.path == "/ckpt/42"
    assert resume.attained_gpu_s == pytest.approx(2 * (NOW - 900.0))
    # Aging credit: the 100 s it waited (queued 800, granted 900), not the 100 s it ran.
    assert resume.first_queued_at == NOW - 100.0
    assert KS.usage("j") in puts and puts[KS.usage("j")].lease == 0


def test_revoke_keeps_resume_data_then_revokes_the_jobs_lease() -> None:
    d = Directive(DirectiveKind.PREEMPT, 3, 990.0)
    p = plan(st.Revoke("j", "missed its deadline"), _state(GRANTED, held=2, directive=d), KS, CFG)
    assert p.revoke_lease == LEASE
    assert KS.checkpoint("j") in _puts(p)


def test_shrink_rewrites_allocation_sizes() -> None:
    d = Directive(DirectiveKind.BALLOON, 3, 1020.0, {"memory_bytes": 4 * GiB})
    p = plan(st.Shrink("j", 4 * GiB, "balloon acked"), _state(GRANTED, held=2, directive=d), KS, CFG)
    puts = _puts(p)
    sizes = {decode("a", o.value, Allocation).memory_bytes for k, o in puts.items() if "/allocations/" in k}
    assert sizes == {4 * GiB}
    assert _deletes(p) == {KS.directive("j")}


def test_decisions_about_vanished_jobs_write_nothing() -> None:
    p = plan(st.Queue("ghost", "x"), _state(), KS, CFG)
    assert p.empty


def test_grant_is_not_applied_once_the_job_restarted(store: EtcdStore) -> None:
    """Against etcd: the spec guard makes a grant for an old incarnation a no-op (and not a demotion)."""
    ks = store.keys
    timing = ElectionTiming(LeaseTiming(3, 0.5, 1.0), 0.5)
    election = Election(store, "c", timing)
    try:
        assert election.step()
        writer = FencedWriter(store, election.fence, election.demote)
        applier = Applier(writer, ks, CFG, store.revoke_lease)
        lease = store.grant_lease(10)
        publish_gpus(store, parse_cluster_spec("node-a:1xH100-80GB:pcie"))
        store.put(ks.job_spec("j"), JobSpec(name="j", gpus=1, memory="10GiB"), lease=lease)
        kvs, rev = store.get_prefix(ks.root())
        state = build_state(kvs, ks, NOW, rev, election.term)
        store.delete(ks.job_spec("j"))
        store.put(ks.job_spec("j"), JobSpec(name="j", gpus=1, memory="10GiB"), lease=lease)  # restarted
        report = applier.apply([st.Grant("j", (st.SliceGrant("node-a", UUID0, 0, GiB, 1.0),))], state)
        assert report.lost == 1 and not report.applied
        assert election.is_leader()
        assert store.get(ks.job_status("j")) is None
        assert not store.get_prefix(ks.allocations_prefix())[0]
    finally:
        election.resign()


def test_shrink_for_a_pending_job_end_to_end(store: EtcdStore) -> None:
    """Against etcd: an elastic job on 4 GPUs (min 2) is shrunk for a pending 2-GPU job of higher
    priority; at its ack the freed GPUs are granted to the pending job and the kept ones back to it."""
    ks = store.keys
    timing = ElectionTiming(LeaseTiming(3, 0.5, 1.0), 0.5)
    election = Election(store, "c", timing)
    cfg = st.SchedulerConfig(aging_s_per_priority=0.0)
    scheduler = Scheduler(cfg)
    try:
        assert election.step()
        writer = FencedWriter(store, election.fence, election.demote)
        applier = Applier(writer, ks, cfg, store.revoke_lease)
        lease = store.grant_lease(30)
        pool = parse_cluster_spec("node-a:4xH100-80GB:nvlink")
        publish_gpus(store, pool)
        store.put(ks.job_spec("el"), JobSpec(name="el", gpus=4, min_gpus=2, max_gpus=4, memory="70GiB"), lease=lease)
        store.put(ks.job_status("el"), JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0, term=election.term,
                                                 gpus=4), lease=lease)
        for g in pool:
            store.put(ks.allocation(g.node, g.uuid, "el"),
                      Allocation("el", g.node, g.uuid, g.index, 70 * GiB, 1.0, QoS.GUARANTEED, election.term, 900.0),
                      lease=lease)
        store.put(ks.job_spec("p"), JobSpec(name="p", gpus=2, memory="70GiB", priority=5), lease=lease)

        def cycle(now: float) -> list[st.Decision]:
            kvs, rev = store.get_prefix(ks.root())
            state = build_state(kvs, ks, now, rev, election.term)
            decisions = scheduler.schedule(state.snapshot)
            report = applier.apply(decisions, state)
            assert report.lost == 0
            return decisions

        first = cycle(NOW)
        resize = next(d for d in first if d.job == "el")
        kept = (pool[2].uuid, pool[3].uuid)
        assert resize == st.Resize("el", 2, resize.reason, NOW + 60.0, for_job="p", keep=kept)
        kv = store.get(ks.directive("el"))
        assert kv is not None
        d = decode("d", kv.value, Directive)
        assert d.kind is DirectiveKind.RESIZE
        assert dict(d.target) == {"gpus": 2, "for_job": "p", "keep": list(kept)}

        store.put(ks.ack("el"), Ack(seq=d.seq, step=11, checkpoint="/ckpt/11", at=NOW + 5), lease=lease)
        second = cycle(NOW + 10)
        assert [type(x).__name__ for x in second] == ["Release", "Grant", "Grant"]
        allocs, _ = store.get_prefix(ks.allocations_prefix())
        held = {(a.job, a.gpu_uuid) for a in (decode("a", kv.value, Allocation) for kv in allocs)}
        assert held == {("p", pool[0].uuid), ("p", pool[1].uuid), ("el", pool[2].uuid), ("el", pool[3].uuid)}
        assert store.get(ks.directive("el")) is None
        kv = store.get(ks.job_status("el"))
        assert kv is not None
        el_status = decode("s", kv.value, JobStatus)
        assert el_status.state is JobState.GRANTED and el_status.gpus == 2
    finally:
        election.resign()


def test_deflate_restores_the_allocations_with_the_directive() -> None:
    state = _state(GRANTED, held=2)
    shrunk = replace_allocs(state, 4 * GiB)
    p = plan(st.Deflate("j", "pressure over"), shrunk, KS, CFG)
    puts = _puts(p)
    d = decode("d", puts[KS.directive("j")].value, Directive)
    assert d.kind is DirectiveKind.DEFLATE and d.target["memory_bytes"] == 10 * GiB
    sizes = {decode("a", o.value, Allocation).memory_bytes for k, o in puts.items() if "/allocations/" in k}
    assert sizes == {10 * GiB}


@pytest.mark.parametrize(("ack_seq", "deadline", "retired"), [(None, 2000.0, False), (3, 2000.0, True), (None, 999.0, False)])
def test_deflate_directives_retire_once_acked(ack_seq: int | None, deadline: float, retired: bool) -> None:
    d = Directive(DirectiveKind.DEFLATE, 3, deadline, {"memory_bytes": 10 * GiB})
    state = _state(GRANTED, held=2, directive=d, ack=Ack(seq=ack_seq) if ack_seq else None)
    plans = housekeeping(state, KS)
    assert bool(plans) is retired
    if retired:
        assert _deletes(plans[0]) == {KS.directive("j")}


def replace_allocs(state: PoolState, memory: int) -> PoolState:
    from dataclasses import replace as dc_replace

    view = state.snapshot.jobs["j"]
    view = dc_replace(view, allocations=tuple(dc_replace(a, memory_bytes=memory) for a in view.allocations))
    snap = dc_replace(state.snapshot, jobs={**state.snapshot.jobs, "j": view})
    return dc_replace(state, snapshot=snap)
