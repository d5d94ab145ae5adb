"""The coordinator's resize protocol against a real etcd: the scheduler's decisions applied by the
:class:`Applier` through fenced transactions, the job's acks written by hand.

* An accepted resize is released and re-granted in one transaction: the job's status is written
  once, GRANTED, never PENDING in between; ``resizes`` counts it, ``preemptions`` does not.
* A refused resize (``ok=False``) keeps the grant as it is, withdraws the directive, says why in
  the status, and backs off (doubling) before the next resize.
* A preemption supersedes a resize in flight: the directive is replaced, and an ack of either
  seq releases the job to SUSPENDED as a preemption.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from testkit import publish_gpus

from coordinator.drivenpool import DrivenCycles
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.apply import Applier, plan
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import FencedWriter
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Ack,
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
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.records import ResumeRecord

NOW = 1000.0
CFG = st.SchedulerConfig(aging_s_per_priority=0.0, resize_retry_s=300.0)


@dataclass
class Pool(DrivenCycles):
    lease: int


    def hold(self, job: str, gpus: list[GpuInfo]) -> None:
        ks = self.store.keys
        self.store.put(ks.job_status(job), JobStatus(JobState.GRANTED, "granted", 900.0, 800.0, 900.0,
                                                     term=self.election.term, gpus=len(gpus)), lease=self.lease)
        for g in gpus:
            self.store.put(ks.allocation(g.node, g.uuid, job),
                           Allocation(job, g.node, g.uuid, g.index, 70 * GiB, 1.0, QoS.GUARANTEED, self.election.term,
                                      900.0), lease=self.lease)

    def status(self, job: str) -> tuple[JobStatus, Any]:
        kv = self.store.get(self.store.keys.job_status(job))
        assert kv is not None
        return decode("s", kv.value, JobStatus), kv

    def directive(self, job: str) -> Directive | None:
        kv = self.store.get(self.store.keys.directive(job))
        return decode("d", kv.value, Directive) if kv is not None else None

    def allocations(self, job: str) -> list[Any]:
        kvs, _ = self.store.get_prefix(self.store.keys.allocations_prefix())
        return [kv for kv in kvs if kv.key.endswith(f"/{job}")]

    def ack(self, job: str, **fields: Any) -> None:
        self.store.put(self.store.keys.ack(job), Ack(**fields), lease=self.lease)


@pytest.fixture
def pool(store: EtcdStore) -> Iterator[Pool]:
    election = Election(store, "c", ElectionTiming(LeaseTiming(3, 0.5, 1.0), 0.5))
    try:
        assert election.step()
        writer = FencedWriter(store, election.fence, election.demote)
        lease = store.grant_lease(60)
        gpus = parse_cluster_spec("node-a:4xH100-80GB:nvlink")
        publish_gpus(store, gpus)
        yield Pool(store, election, Applier(writer, store.keys, CFG, store.revoke_lease), Scheduler(CFG), gpus, lease)
    finally:
        election.resign()


def elastic(pool: Pool, name: str, lo: int, hi: int, held: int) -> None:
    pool.store.put(pool.store.keys.job_spec(name), JobSpec(name=name, gpus=hi, min_gpus=lo, max_gpus=hi, memory="70GiB"),
                   lease=pool.lease)
    pool.hold(name, pool.gpus[:held])


def test_an_accepted_grow_is_released_and_re_granted_in_one_transaction(pool: Pool) -> None:
    elastic(pool, "el", 1, 2, held=1)
    pool.store.put(pool.store.keys.job_spec("rigid"), JobSpec(name="rigid", gpus=2, memory="70GiB"), lease=pool.lease)
    pool.hold("rigid", pool.gpus[2:])
    first, _ = pool.cycle(NOW)
    assert [(type(d), d.job, getattr(d, "gpus", None)) for d in first] == [(st.Resize, "el", 2)]
    d = pool.directive("el")
    assert d is not None and d.kind is DirectiveKind.RESIZE
    _, before = pool.status("el")

    pool.ack("el", seq=d.seq, step=11, checkpoint="/ckpt/11", at=NOW + 5)
    decisions, report = pool.cycle(NOW + 10)
    assert [type(x) for x in decisions] == [st.Release, st.Grant]  # the scheduler's decisions are unchanged
    assert report.applied == {"Regrant": 1} and report.granted_jobs == []  # one transaction; not a new grant

    status, kv = pool.status("el")
    assert kv.version == before.version + 1, "the status was written more than once: a PENDING in between"
    assert status.state is JobState.GRANTED and status.gpus == 2 and status.granted_at == NOW + 10
    assert status.resizes == 1 and status.preemptions == 0
    assert status.last_checkpoint is not None and status.last_checkpoint.path == "/ckpt/11"
    assert "resize to 2 GPU(s) acknowledged at step 11" in status.reason and "re-granted 2 slice(s)" in status.reason
    allocs = pool.allocations("el")
    assert len(allocs) == 2 and {a.mod_revision for a in allocs} == {kv.mod_revision}
    assert pool.directive("el") is None
    ck = pool.store.get(pool.store.keys.checkpoint("el"))
    assert ck is not None
    resume = decode("c", ck.value, ResumeRecord)
    assert ck.mod_revision == kv.mod_revision and resume.resizes == 1 and resume.preemptions == 0
    assert resume.last_checkpoint is not None and resume.last_checkpoint.path == "/ckpt/11"
    usage = pool.store.get(pool.store.keys.usage("el"))
    assert usage is not None and usage.mod_revision == kv.mod_revision  # the old grant's service, up to now


def test_a_shrink_for_a_pending_job_frees_before_the_pending_job_is_granted(pool: Pool) -> None:
    elastic(pool, "el", 2, 4, held=4)
    pool.store.put(pool.store.keys.job_spec("p"), JobSpec(name="p", gpus=2, memory="70GiB", priority=5), lease=pool.lease)
    pool.cycle(NOW)
    d = pool.directive("el")
    assert d is not None and d.kind is DirectiveKind.RESIZE and d.target["for_job"] == "p"
    _, before = pool.status("el")
    pool.ack("el", seq=d.seq, step=7, checkpoint="/ckpt/7", at=NOW + 5)
    decisions, report = pool.cycle(NOW + 10)
    assert [type(x).__name__ for x in decisions] == ["Release", "Grant", "Grant"]
    assert report.applied == {"Regrant": 1, "Grant": 1}
    status, kv = pool.status("el")
    assert kv.version == before.version + 1 and status.state is JobState.GRANTED and status.gpus == 2
    assert status.resizes == 1 and status.preemptions == 0
    # The regrant (which deletes el's two freed allocations) came before p's grant on those GPUs:
    # etcd never held both jobs on one GPU.
    p_allocs = pool.allocations("p")
    assert len(p_allocs) == 2 and all(a.mod_revision > kv.mod_revision for a in p_allocs)
    assert {a.key.split("/")[-2] for a in pool.allocations("el")} == {g.uuid for g in pool.gpus[2:]}


def test_a_refused_resize_keeps_the_grant_and_backs_off(pool: Pool) -> None:
    elastic(pool, "el", 1, 2, held=1)
    pool.cycle(NOW)
    d = pool.directive("el")
    assert d is not None and d.kind is DirectiveKind.RESIZE
    (held_before,) = pool.allocations("el")

    pool.ack("el", seq=d.seq, step=12, ok=False, message="cannot reshard the data loader")
    decisions, report = pool.cycle(NOW + 10)
    assert [type(x) for x in decisions] == [st.Withdraw] and report.applied == {"Withdraw": 1}
    status, _ = pool.status("el")
    assert status.state is JobState.GRANTED and status.gpus == 1 and status.granted_at == 900.0
    assert "resize to 2 GPU(s) refused at step 12: cannot reshard the data loader" in status.reason
    assert status.resize_refusals == 1 and status.resize_retry_at == NOW + 10 + 300
    assert status.resizes == 0 and status.preemptions == 0
    assert pool.directive("el") is None
    (held_after,) = pool.allocations("el")
    assert held_after.mod_revision == held_before.mod_revision  # the grant was not touched

    # No retry storm: nothing is proposed during the backoff ...
    decisions, report = pool.cycle(NOW + 20)
    assert decisions == [] and pool.directive("el") is None
    # ... then the resize comes again, and a second refusal doubles the wait.
    decisions, _ = pool.cycle(NOW + 311)
    assert [(type(x), x.job) for x in decisions] == [(st.Resize, "el")]
    d2 = pool.directive("el")
    assert d2 is not None and d2.seq > d.seq
    pool.ack("el", seq=d2.seq, step=30, ok=False, message="still no")
    pool.cycle(NOW + 320)
    status, _ = pool.status("el")
    assert status.resize_refusals == 2 and status.resize_retry_at == NOW + 320 + 600

    # An accepted resize later clears the backoff.
    pool.cycle(NOW + 921)
    d3 = pool.directive("el")
    assert d3 is not None and d3.kind is DirectiveKind.RESIZE
    pool.ack("el", seq=d3.seq, step=50, checkpoint="/ckpt/50", at=NOW + 925)
    pool.cycle(NOW + 930)
    status, _ = pool.status("el")
    assert status.gpus == 2 and status.resizes == 1 and status.resize_refusals == 0 and status.resize_retry_at is None


@pytest.mark.parametrize("which", ["resize", "preempt"])
def test_a_preemption_supersedes_a_resize_in_flight(pool: Pool, which: str) -> None:
    elastic(pool, "el", 1, 2, held=1)
    pool.cycle(NOW)
    resize = pool.directive("el")
    assert resize is not None and resize.kind is DirectiveKind.RESIZE

    state = pool.state(NOW + 5)
    # A resize never replaces a preemption, nor a resize another; a preemption replaces a resize.
    assert plan(st.Resize("el", 2, "again", NOW + 60), state, pool.store.keys, CFG).empty
    report = pool.applier.apply([st.Preempt("el", "node draining; checkpoint and move", NOW + 65)], state)
    assert report.applied == {"Preempt": 1}
    pre = pool.directive("el")
    assert pre is not None and pre.kind is DirectiveKind.PREEMPT and pre.seq == resize.seq + 1
    assert pre.target["supersedes"] == resize.seq and pre.deadline == NOW + 65
    status, _ = pool.status("el")
    assert status.state is JobState.PREEMPTING and status.reason == "node draining; checkpoint and move"
    assert plan(st.Preempt("el", "again", NOW + 70), pool.state(NOW + 6), pool.store.keys, CFG).empty

    # The job acks the preempt, or the resize it was already checkpointing for: a preemption either way.
    seq = resize.seq if which == "resize" else pre.seq
    pool.ack("el", seq=seq, step=20, checkpoint="/ckpt/20", at=NOW + 8)
    decisions, _ = pool.cycle(NOW + 10)
    assert [(x.job, x.state) for x in decisions if isinstance(x, st.Release)] == [("el", JobState.SUSPENDED)]
    status, _ = pool.status("el")
    assert status.state is JobState.SUSPENDED and status.preemptions == 1 and status.resizes == 0
    assert pool.allocations("el") == [] and pool.directive("el") is None


def test_a_preempt_after_the_resize_was_acked_writes_nothing(pool: Pool) -> None:
    elastic(pool, "el", 1, 2, held=1)
    pool.cycle(NOW)
    resize = pool.directive("el")
    assert resize is not None
    pool.ack("el", seq=resize.seq, step=3, checkpoint="/ckpt/3")
    assert plan(st.Preempt("el", "late", NOW + 70), pool.state(NOW + 5), pool.store.keys, CFG).empty


def test_a_resize_release_without_its_re_grant_counts_a_resize_not_a_preemption(pool: Pool) -> None:
    elastic(pool, "el", 1, 2, held=1)
    pool.cycle(NOW)
    resize = pool.directive("el")
    assert resize is not None
    pool.ack("el", seq=resize.seq, step=3, checkpoint="/ckpt/3")
    # Not re-granted in this batch (say max_decisions cut it): the release is written alone.
    report = pool.applier.apply([st.Release("el", JobState.PENDING, "resize to 2 GPU(s) acknowledged; re-placing")],
                                pool.state(NOW + 5))
    assert report.applied == {"Release": 1}
    status, _ = pool.status("el")
    assert status.state is JobState.PENDING and status.resizes == 1 and status.preemptions == 0
