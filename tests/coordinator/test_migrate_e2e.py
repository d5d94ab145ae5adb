"""Migration for fragmentation against a real etcd: the scheduler's decisions applied by the
:class:`Applier` through fenced transactions; each job's client (ack, release, queue again) is
played by hand, as ``gpupool run`` does it.

Two 16 GiB GPUs: GPU 0 holds two 4 GiB shared jobs, GPU 1 one 8 GiB job; a 12 GiB shared job of
the same priority waits (8 GiB free on each GPU). One 4 GiB job is moved: it gets a preempt
directive with the ``migrate:`` reason naming the pending job, acks, is released; the pending job
is granted GPU 0's merged room in that cycle; the mover queues again (a new lease, as after any
preemption) and is granted GPU 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner
from testkit import publish_gpus

from coordinator.drivenpool import DrivenCycles
from gpupool_sdk.cli.job_cmd import describe
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.apply import Applier
from gpupool_sdk.coordinator.election import Election, ElectionTiming
from gpupool_sdk.coordinator.fencing import FencedWriter
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    DirectiveKind,
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
from gpupool_sdk.telemetry.coordinator_metrics import reason_code

NOW = 10_000.0
CFG = st.SchedulerConfig(aging_s_per_priority=0.0, migrate_for_fragmentation=True, migrate_min_run_s=600.0)


@dataclass
class Pool(DrivenCycles):
    leases: dict[str, int]


    def submit(self, name: str, memory: str) -> None:
        self.leases[name] = self.store.grant_lease(60)
        spec = JobSpec(name=name, memory=memory, qos="shared", compute_share=0.25)
        self.store.put(self.store.keys.job_spec(name), spec, lease=self.leases[name])

    def hold(self, name: str, memory: str, gpu: GpuInfo) -> None:
        """A job running on ``gpu`` since long before NOW (past ``migrate_min_run_s``)."""
        self.submit(name, memory)
        ks, lease = self.store.keys, self.leases[name]
        spec = JobSpec(name=name, memory=memory)
        self.store.put(ks.job_status(name), JobStatus(JobState.GRANTED, "granted", 100.0, 100.0, 100.0,
                                                      term=self.election.term, gpus=1), lease=lease)
        self.store.put(ks.allocation(gpu.node, gpu.uuid, name),
                       Allocation(name, gpu.node, gpu.uuid, gpu.index, spec.memory_bytes, 0.25, QoS.SHARED,
                                  self.election.term, 100.0), lease=lease)

    def status(self, name: str) -> JobStatus:
        kv = self.store.get(self.store.keys.job_status(name))
        assert kv is not None
        return decode("s", kv.value, JobStatus)

    def directive(self, name: str) -> Directive | None:
        kv = self.store.get(self.store.keys.directive(name))
        return decode("d", kv.value, Directive) if kv is not None else None

    def gpus_of(self, name: str) -> set[str]:
        kvs, _ = self.store.get_prefix(self.store.keys.allocations_prefix())
        return {kv.key.split("/")[-2] for kv in kvs if kv.key.endswith(f"/{name}")}

    def ack(self, name: str, **fields: Any) -> None:
        self.store.put(self.store.keys.ack(name), Ack(**fields), lease=self.leases[name])


@pytest.fixture
def pool(store: EtcdStore) -> Iterator[Pool]:
    election = Election(store, "c", ElectionTiming(LeaseTiming(3, 0.5, 1.0), 0.5))
    try:
        assert election.step()
        writer = FencedWriter(store, election.fence, election.demote)
        gpus = parse_cluster_spec("node-a:2xT4:pcie")
        publish_gpus(store, gpus)
        yield Pool(store, election, Applier(writer, store.keys, CFG, store.revoke_lease), Scheduler(CFG), gpus, {})
    finally:
        election.resign()


def _fragment_and_move(pool: Pool) -> st.Preempt:
    """GPU 0 holds two 4 GiB shared jobs, GPU 1 one of 8 GiB, and a 12 GiB job waits: the first
    cycle moves one of GPU 0's jobs (its only Preempt is returned)."""
    g0, g1 = pool.gpus
    pool.hold("s0", "4GiB", g0)
    pool.hold("s1", "4GiB", g0)
    pool.hold("s2", "8GiB", g1)
    pool.submit("big", "12GiB")
    first, _ = pool.cycle(NOW)
    (p,) = [d for d in first if isinstance(d, st.Preempt)]
    return p


def test_a_mover_is_preempted_acks_is_regranted_elsewhere_and_the_pending_job_gets_the_merged_room(
    pool: Pool, etcd_endpoint: str
) -> None:
    g0, g1 = pool.gpus
    p = _fragment_and_move(pool)
    mover = p.job
    assert mover in ("s0", "s1") and p.for_job == "big"
    assert reason_code(p.reason, p.for_job) == "migrate"
    d = pool.directive(mover)
    assert d is not None and d.kind is DirectiveKind.PREEMPT and d.target.get("for_job") == "big"
    assert d.reason.startswith(f"migrate: defragmenting {g0.uuid} for big")
    status = pool.status(mover)
    assert status.state is JobState.PREEMPTING and status.reason.startswith("migrate:")  # what `gpupool status` shows
    assert pool.status("big").state is JobState.PENDING and "migration" in pool.status("big").reason
    shown = CliRunner().invoke(describe, [mover, "--endpoints", etcd_endpoint, "--prefix", pool.store.keys.prefix])
    assert shown.exit_code == 0, shown.output
    assert f"Directive:    preempt seq {d.seq}: migrate: defragmenting {g0.uuid} for big" in shown.output

    # The mover checkpoints and acks; the leader releases it and grants the pending job GPU 0 at once.
    pool.ack(mover, seq=d.seq, step=7, checkpoint="/ckpt/7", at=NOW + 5)
    second, _ = pool.cycle(NOW + 10)
    assert any(isinstance(x, st.Release) and x.job == mover for x in second)
    assert pool.status(mover).state is JobState.SUSPENDED
    assert pool.status("big").state is JobState.GRANTED and pool.gpus_of("big") == {g0.uuid}

    # Its client releases its lease and queues again (gpupool run); it lands on the other GPU.
    pool.store.revoke_lease(pool.leases[mover])
    pool.submit(mover, "4GiB")
    third, _ = pool.cycle(NOW + 15)
    assert [type(x) for x in third if x.job == mover] == [st.Grant]
    assert pool.status(mover).state is JobState.GRANTED and pool.gpus_of(mover) == {g1.uuid}
    assert pool.gpus_of("big") == {g0.uuid}


def test_the_movers_landing_room_is_held_while_it_queues_again(pool: Pool) -> None:
    # As above, but a cycle runs while the mover is released (SUSPENDED) and another while its
    # client re-submits it (its spec gone with its lease), and an 8 GiB job arrives meanwhile:
    # GPU 1's free 8 GiB would take it, but 4 GiB of it is the mover's landing room, held for it.
    g0, g1 = pool.gpus
    p = _fragment_and_move(pool)
    mover = p.job
    assert g1.uuid in p.reason
    d = pool.directive(mover)
    assert d is not None
    pool.ack(mover, seq=d.seq, step=7, checkpoint="/ckpt/7", at=NOW + 5)
    pool.cycle(NOW + 10)
    assert pool.status(mover).state is JobState.SUSPENDED and pool.gpus_of("big") == {g0.uuid}

    pool.submit("other", "8GiB")
    suspended, _ = pool.cycle(NOW + 11)
    assert [type(x) for x in suspended if x.job == "other"] == [st.Queue]
    pool.store.revoke_lease(pool.leases[mover])
    gap, _ = pool.cycle(NOW + 12)
    assert [type(x) for x in gap if x.job == "other"] == [st.Queue]
    assert pool.gpus_of("other") == set()

    pool.submit(mover, "4GiB")
    back, _ = pool.cycle(NOW + 15)
    assert [type(x) for x in back if x.job == mover] == [st.Grant]
    assert pool.gpus_of(mover) == {g1.uuid} and pool.gpus_of("other") == set()
