"""etcd's cap on operations per transaction: the count (pinned), the reject stage, the applier's check.

etcd refuses a transaction when ``max(len(compare), len(success), len(failure)) > --max-txn-ops``.
The coordinator's grant or release of a gang is one fenced transaction with an operation per
slice, so the count decides the largest gang; :mod:`gpupool_sdk.scheduler.reject` holds it, and
:class:`~gpupool_sdk.coordinator.apply.Applier` checks every plan with it before sending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.coordinator.apply import Applier, plan
from gpupool_sdk.coordinator.fencing import DeleteOp, Fence, Guard, Op, PutOp, fence_compares
from gpupool_sdk.coordinator.snapshot import PoolState, build_state
from gpupool_sdk.errors import ConfigError, TxnTooLargeError
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
from gpupool_sdk.scheduler.reject import (
    FENCE_COMPARES,
    JOB_GUARDS,
    grant_txn_ops,
    job_txn_ops,
    max_slices_for,
    release_txn_ops,
    txn_limit_reason,
    txn_ops,
)
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode, encode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.types import Compare, KeyValue, Put

KS = Keyspace("/t")
NOW = 1000.0
LEASE = 0xAB
GPUS = parse_cluster_spec("17*8xT4")  # 136 GPUs
DIRECTIVE = Directive(DirectiveKind.PREEMPT, seq=1, deadline=2000.0, reason="for hi", issued_at=900.0, term=4)


def _state(jobs: Sequence[tuple[str, int, int]], directive: bool = False, status: JobState = JobState.PENDING) -> PoolState:
    """A pool of 136 T4s and ``jobs`` as (name, slices asked, slices held); ``directive`` on every job."""
    kvs: list[KeyValue] = []
    rev = [0]

    def put(key: str, value: Any, lease: int = 0) -> None:
        rev[0] += 1
        kvs.append(KeyValue(key, encode(value), rev[0], rev[0], 1, lease))

    for g in GPUS:
        put(KS.gpu(g.node, g.uuid), g, 9)
    for node in sorted({g.node for g in GPUS}):
        put(KS.node(node), NodeInfo(name=node, hostname="test", agent_pid=1, gpu_count=8, backend="simulated",
                                    started_at=0.0), 9)
    start = 0
    for name, gpus, held in jobs:
        put(KS.job_spec(name), JobSpec(name=name, gpus=gpus, memory="1GiB"), LEASE)
        put(KS.job_status(name), JobStatus(status, "", 900.0, 800.0, term=4, gpus=held), LEASE)
        for g in GPUS[start : start + held]:
            put(KS.allocation(g.node, g.uuid, name),
                Allocation(name, g.node, g.uuid, g.index, GiB, 1.0, QoS.GUARANTEED, 4, 900.0), LEASE)
        start += held
        if directive:
            put(KS.directive(name), DIRECTIVE, LEASE)
    return build_state(kvs, KS, NOW, revision=rev[0], term=5)


def _grant(job: str, first: int, n: int) -> st.Grant:
    return st.Grant(job, tuple(st.SliceGrant(g.node, g.uuid, g.index, GiB, 1.0) for g in GPUS[first : first + n]))


# ------------------------------------------------------------------ the count, pinned


def test_fence_adds_the_compares_the_count_assumes() -> None:
    assert len(fence_compares(Fence("/t/leader", 7, b"x", 1))) == FENCE_COMPARES


@pytest.mark.parametrize("n", [1, 124, 130])
def test_each_plan_needs_what_the_formula_says(n: int) -> None:
    cfg = st.SchedulerConfig()
    fresh = plan(_grant("j", 0, n), _state([("j", n, 0)]), KS, cfg)
    # n allocation puts + the status; compares: the fence, the spec and one per GPU (nothing
    # written there since the snapshot), so the compares decide: n + 3.
    assert len(fresh.ops) == n + 1 and len(fresh.gpu_guards) == n
    assert fresh.txn_ops == max(grant_txn_ops(n), FENCE_COMPARES + JOB_GUARDS + n) == n + 3 <= job_txn_ops(n)
    # A re-grant on other GPUs to a job that holds 3 slices and has a directive: each old key deleted too.
    moved = plan(_grant("j", 3, n), _state([("j", n, 3)], directive=True), KS, cfg)
    assert moved.txn_ops == grant_txn_ops(n, dropped=3, directive=True) == n + 5
    held = _state([("j", n, n)], directive=True, status=JobState.PREEMPTING)
    release = plan(st.Release("j", JobState.SUSPENDED, "preempted"), held, KS, cfg)
    assert release.txn_ops == release_txn_ops(n, directive=True) == n + 4 == job_txn_ops(n)
    done = plan(st.Release("j", JobState.DONE, "done"), _state([("j", n, n)], status=JobState.GRANTED), KS, cfg)
    assert done.txn_ops == release_txn_ops(n, directive=False) == n + 3
    revoke = plan(st.Revoke("j", "late"), held, KS, cfg)
    assert revoke.txn_ops == txn_ops(n + 2) and revoke.revoke_lease == LEASE
    # A preempt or resize directive: two writes, so the three compares are what etcd counts.
    granted = _state([("j", n, n)], status=JobState.GRANTED)
    for d in (st.Preempt("j", "for hi", 1060.0, "hi"), st.Resize("j", 1, "shrink", 1060.0)):
        p = plan(d, granted, KS, cfg)
        assert len(p.ops) == 2 and p.txn_ops == txn_ops(2) == 3


def test_the_largest_gang_for_etcds_default() -> None:
    assert job_txn_ops(124) == 128 and job_txn_ops(125) == 129
    assert max_slices_for(128) == 124 and max_slices_for(1024) == 1020


def test_etcd_counts_compares_and_operations_separately(store: EtcdStore, etcd_server: Any) -> None:
    """The count's premise, on the session etcd (its launcher gives it ``--max-txn-ops 1024``)."""
    limit = etcd_server.max_txn_ops
    assert limit == 1024
    compares = [Compare(store.keys.root() + f"/c{i}", "create", "==", 0) for i in range(3)]
    puts = [Put(store.keys.root() + f"/k{i}", b"v") for i in range(limit + 1)]
    assert store.txn(compares, puts[:limit]) is True  # 3 compares + 1024 puts: fits
    with pytest.raises(TxnTooLargeError, match="too many operations in txn request"):
        store.txn(compares, puts)


# ------------------------------------------------------------------ the reject stage


def test_config_validates_the_limit() -> None:
    assert st.SchedulerConfig().etcd_max_txn_ops == 0  # no etcd in the simulator: no limit
    with pytest.raises(ConfigError, match="etcd_max_txn_ops"):
        st.SchedulerConfig(etcd_max_txn_ops=8)


def test_coordinator_assumes_etcds_default_when_unset(store: EtcdStore) -> None:
    coord = Coordinator(store, st.SchedulerConfig(), LeaseTiming(3, 0.5, 1.0), "c", loop_wait_s=0.5)
    assert coord.config.etcd_max_txn_ops == 128 and coord.applier.max_txn_ops == 128
    assert coord.scheduler.config.etcd_max_txn_ops == 128


@pytest.mark.parametrize(
    ("spec", "limit", "ops"),
    [
        (JobSpec(name="a", gpus=124, memory="1GiB"), 128, None),
        (JobSpec(name="a", gpus=125, memory="1GiB"), 128, 129),
        (JobSpec(name="a", gpus=200, memory="1GiB"), 128, 204),
        (JobSpec(name="a", gpus=200, memory="1GiB"), 1024, None),
        (JobSpec(name="a", gpus=200, memory="1GiB"), 0, None),
        # Elastic: judged on min_gpus; a job that may grow past the cap is capped, not rejected.
        (JobSpec(name="a", gpus=100, max_gpus=130, memory="1GiB"), 128, None),
        (JobSpec(name="a", gpus=130, min_gpus=64, memory="1GiB"), 128, None),
        (JobSpec(name="a", gpus=200, min_gpus=130, memory="1GiB"), 128, 134),
    ],
)
def test_txn_limit_reason(spec: JobSpec, limit: int, ops: int | None) -> None:
    why = txn_limit_reason(spec, limit)
    if ops is None:
        assert why is None
    else:
        assert why is not None
        if spec.min_gpus != spec.gpus:
            assert why.startswith(f"an elastic job needing at least min_gpus {spec.min_gpus}")
        assert f"needs {ops} operations" in why
        assert f"--etcd-max-txn-ops {limit}" in why and f"--max-txn-ops >= {ops}" in why


def test_scheduler_rejects_the_oversized_gang_and_grants_the_rest() -> None:
    state = _state([("big", 130, 0), ("fits", 124, 0), ("small", 1, 0)])
    decisions = Scheduler(st.SchedulerConfig(etcd_max_txn_ops=128)).schedule(state.snapshot)
    by_job = {d.job: d for d in decisions}
    big = by_job["big"]
    assert isinstance(big, st.Reject)
    assert big.reason == (
        "impossible: a gang of 130 slices needs 134 operations in one etcd transaction, above the coordinator's "
        "--etcd-max-txn-ops 128: start etcd with --max-txn-ops >= 134 and pass the same value to the "
        "coordinator's --etcd-max-txn-ops (or ask for at most 124 slices)"
    )
    assert isinstance(by_job["fits"], st.Grant) and len(by_job["fits"].slices) == 124
    assert isinstance(by_job["small"], st.Grant)
    # No limit (the simulator): the gang is placed.
    unlimited = Scheduler(st.SchedulerConfig()).schedule(_state([("big", 130, 0)]).snapshot)
    assert [type(d).__name__ for d in unlimited] == ["Grant"]


def test_elastic_job_above_the_cap_is_granted_and_grown_up_to_it() -> None:
    # 136 GPUs, etcd cap 128 ops -> at most 124 slices. An elastic job asking 130 (min 64, max 200)
    # is granted 124 slices, never more, and is not grown past the cap on the next cycle.
    state = _state([("el", 130, 0)])
    spec = JobSpec(name="el", gpus=130, min_gpus=64, max_gpus=200, memory="1GiB")
    jobs = {**state.snapshot.jobs, "el": replace(state.snapshot.jobs["el"], spec=spec)}
    snap = replace(state.snapshot, jobs=jobs)
    sched = Scheduler(st.SchedulerConfig(etcd_max_txn_ops=128))
    (grant,) = sched.schedule(snap)
    assert isinstance(grant, st.Grant) and len(grant.slices) == 124
    assert job_txn_ops(len(grant.slices)) <= 128
    held = replace(
        jobs["el"],
        state=JobState.GRANTED,
        granted_at=NOW - 600.0,
        allocations=tuple(
            Allocation("el", s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, 1.0, QoS.GUARANTEED, 4, NOW - 600.0)
            for s in grant.slices
        ),
    )
    later = replace(snap, now=NOW + 60.0, jobs={"el": held})
    assert [d for d in sched.schedule(later) if isinstance(d, st.Resize)] == []
    # Without a cap it takes all 136 GPUs (its 130 at once, grown toward 200 in the same cycle).
    (free,) = Scheduler(st.SchedulerConfig()).schedule(snap)
    assert isinstance(free, st.Grant) and len(free.slices) == 136


# ------------------------------------------------------------------ the applier's check


class RecordingWriter:
    """A FencedWriter stand-in: records transactions; ``refuse_over`` plays an etcd with that limit."""

    def __init__(self, refuse_over: int = 0) -> None:
        self.refuse_over = refuse_over
        self.txns: list[tuple[Op, ...]] = []

    def write(self, ops: Sequence[Op], guards: Sequence[Guard] = ()) -> bool:
        return self.commit(ops, guards) is not None

    def commit(self, ops: Sequence[Op], guards: Sequence[Guard] = ()) -> int | None:
        if self.refuse_over and txn_ops(len(ops), FENCE_COMPARES + len(guards)) > self.refuse_over:
            raise TxnTooLargeError("etcd at 127.0.0.1:2379 refused txn: too many operations in one transaction")
        self.txns.append(tuple(ops))
        return 1000 + len(self.txns)  # the revision of the write

    def check(self) -> bool:
        return True

    def status(self, job: str) -> JobStatus | None:
        found = [o for t in self.txns for o in t if isinstance(o, PutOp) and o.key == KS.job_status(job)]
        return decode("s", found[-1].value, JobStatus) if found else None

    def allocation_puts(self, job: str) -> int:
        return sum(1 for t in self.txns for o in t if isinstance(o, PutOp) and o.key.startswith(KS.allocations_prefix()) and o.key.endswith("/" + job))


def _applier(writer: RecordingWriter, limit: int, revoked: list[int] | None = None) -> Applier:
    sink = revoked if revoked is not None else []
    return Applier(writer, KS, st.SchedulerConfig(etcd_max_txn_ops=limit), sink.append)  # type: ignore[arg-type]


def test_a_grant_over_the_limit_is_not_sent_the_job_is_rejected_and_the_cycle_goes_on() -> None:
    writer = RecordingWriter()
    state = _state([("big", 130, 0), ("small", 1, 0)])
    report = _applier(writer, 128).apply([_grant("big", 0, 130), _grant("small", 130, 1)], state)
    assert writer.allocation_puts("big") == 0
    big = writer.status("big")
    assert big is not None and big.state is JobState.REJECTED
    assert "a grant of 130 slices needs 133 operations" in big.reason and "--max-txn-ops >= 134" in big.reason
    small = writer.status("small")
    assert small is not None and small.state is JobState.GRANTED
    assert report.applied == {"Reject": 1, "Grant": 1} and report.granted_jobs == ["small"] and report.too_large == 1
    # Once REJECTED, the job is no candidate any more: no grant is tried again next cycle.
    after = _state([("big", 130, 0)], status=JobState.REJECTED)
    assert Scheduler(st.SchedulerConfig()).schedule(after.snapshot) == []


def test_a_grant_etcd_refuses_as_too_large_rejects_the_job_naming_both_flags() -> None:
    writer = RecordingWriter(refuse_over=128)  # the coordinator was told 1024, etcd runs with 128
    state = _state([("big", 130, 0), ("small", 1, 0)])
    report = _applier(writer, 1024).apply([_grant("big", 0, 130), _grant("small", 130, 1)], state)
    big = writer.status("big")
    assert big is not None and big.state is JobState.REJECTED
    assert "etcd refused a transaction of 133 operations" in big.reason
    assert "--etcd-max-txn-ops 1024" in big.reason and "--max-txn-ops >= 134" in big.reason
    assert writer.allocation_puts("big") == 0
    assert (s := writer.status("small")) is not None and s.state is JobState.GRANTED
    assert report.too_large == 1


def test_an_oversized_revoke_drops_the_deletes_the_lease_takes_anyway() -> None:
    writer = RecordingWriter()
    revoked: list[int] = []
    state = _state([("j", 127, 127)], directive=True, status=JobState.PREEMPTING)  # granted under a higher limit
    _applier(writer, 128, revoked).apply([st.Revoke("j", "late")], state)
    assert revoked == [LEASE]
    (txn,) = writer.txns
    assert not any(isinstance(o, DeleteOp) for o in txn)
    assert {o.key for o in txn} == {KS.checkpoint("j"), KS.usage("j")}


def test_a_regrant_after_this_batchs_release_drops_the_redundant_deletes() -> None:
    writer = RecordingWriter()
    # A resized job: holds 30 slices, acked; released and re-placed on 100 other GPUs in one batch.
    state = _state([("j", 100, 30)], directive=True, status=JobState.PREEMPTING)
    report = _applier(writer, 128).apply([st.Release("j", JobState.PENDING, "resize"), _grant("j", 30, 100)], state)
    assert report.applied == {"Release": 1, "Grant": 1}
    release, grant = writer.txns
    assert sum(isinstance(o, DeleteOp) for o in release) == 31  # 30 allocations + the directive
    assert len(grant) == 101 and not any(isinstance(o, DeleteOp) for o in grant)


def _acked_resize(state: PoolState, job: str) -> PoolState:
    """``state`` with ``job``'s directive an acknowledged resize (what the protocol releases to PENDING)."""
    view = state.snapshot.jobs[job]
    d = Directive(DirectiveKind.RESIZE, seq=1, deadline=2000.0, target={"gpus": 100}, issued_at=900.0, term=4)
    view = replace(view, directive=d, ack=Ack(seq=1, step=5, checkpoint="/ckpt/5"))
    return replace(state, snapshot=replace(state.snapshot, jobs={**state.snapshot.jobs, job: view}))


@pytest.mark.parametrize(("held", "new", "limit", "merged"), [(3, 4, 128, True), (30, 100, 128, False), (30, 100, 1024, True)])
def test_a_resize_regrant_is_one_transaction_unless_that_exceeds_the_limit(held: int, new: int, limit: int,
                                                                          merged: bool) -> None:
    writer = RecordingWriter()
    state = _acked_resize(_state([("j", new, held)], directive=True, status=JobState.PREEMPTING), "j")
    report = _applier(writer, limit).apply([st.Release("j", JobState.PENDING, "resize"), _grant("j", held, new)], state)
    if merged:
        assert report.applied == {"Regrant": 1}
        (txn,) = writer.txns
        assert sum(isinstance(o, DeleteOp) for o in txn) == held + 1  # the old allocations + the directive
        status = writer.status("j")
        assert status is not None and status.state is JobState.GRANTED and status.gpus == new and status.resizes == 1
    else:  # 100 puts + 31 deletes + status, checkpoint, usage: over 128, written apart as before
        assert report.applied == {"Release": 1, "Grant": 1} and len(writer.txns) == 2
