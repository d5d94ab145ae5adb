"""A tiny stand-in for the coordinator's leader, writing etcd as the lease protocol says.

It plays the leader's side of ``docs/architecture.md`` with direct EtcdStore writes, so that the
client can be tested while the real coordinator is written in parallel. Replace it with the
real coordinator in scenario tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    DirectiveKind,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
)
from gpupool_sdk.store import Compare, Delete, EtcdStore, KeyValue, Put, WatchEvent
from gpupool_sdk.store.codec import decode


class LeaderStub:
    """Writes status, allocations and directives for jobs, fenced on a leader key it holds."""

    def __init__(self, store: EtcdStore, leader_id: str = "stub", term: int = 1) -> None:
        self.store = store
        self.keys = store.keys
        self.term = term
        self.leader_id = leader_id
        self._seq: dict[str, int] = {}
        self._auto: object | None = None
        store.put(self.keys.leader(), LeaderRecord(id=leader_id, term=term, since=time.time()))
        kv = store.get(self.keys.leader())
        assert kv is not None
        self._leader_kv = kv

    def _fence(self) -> list[Compare]:
        return [
            Compare(self.keys.leader(), "create", "==", self._leader_kv.create_revision),
            Compare(self.keys.leader(), "value", "==", self._leader_kv.value),
        ]

    def wait_spec(self, job: str, timeout: float = 30.0) -> tuple[JobSpec, KeyValue]:
        """Wait (polling is fine in a test stub) until the job's spec exists; return it and its key."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.store.get_record(self.keys.job_spec(job), JobSpec)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"spec of {job} never appeared")
            time.sleep(0.02)

    def _status(self, state: JobState, reason: str = "", gpus: int = 0, granted_at: float | None = None) -> JobStatus:
        now = time.time()
        if state is JobState.GRANTED and granted_at is None:
            granted_at = now
        return JobStatus(state=state, reason=reason, updated_at=now, queued_at=now, term=self.term, gpus=gpus,
                         granted_at=granted_at)

    def pending(self, job: str, reason: str = "queued: no free GPU") -> bool:
        spec, kv = self.wait_spec(job)
        return self.store.txn(
            [*self._fence(), Compare(kv.key, "create", "==", kv.create_revision)],
            [Put(self.keys.job_status(job), self._status(JobState.PENDING, reason), lease=kv.lease)],
        )

    def grant(self, job: str, gpus: Sequence[tuple[str, str, int]] = (("node-a", "GPU-0", 0),)) -> bool:
        """Grant ``gpus`` as (node, gpu uuid, index) in one fenced transaction, on the job's lease."""
        spec, kv = self.wait_spec(job)
        at = time.time()  # the grant's time, on its status and on each of its allocations (as the leader writes them)
        ops: list[Put | Delete] = [
            Put(
                self.keys.allocation(node, uuid, job),
                Allocation(job=job, node=node, gpu_uuid=uuid, gpu_index=idx, memory_bytes=spec.memory_bytes,
                           compute_share=spec.compute_share, mode=spec.qos_class, term=self.term, granted_at=at),
                lease=kv.lease,
            )
            for node, uuid, idx in gpus
        ]
        ops.append(Put(self.keys.job_status(job), self._status(JobState.GRANTED, "granted", gpus=len(gpus), granted_at=at),
                       lease=kv.lease))
        return self.store.txn([*self._fence(), Compare(kv.key, "create", "==", kv.create_revision)], ops)

    def reject(self, job: str, reason: str) -> bool:
        spec, kv = self.wait_spec(job)
        return self.store.txn(
            [*self._fence(), Compare(kv.key, "create", "==", kv.create_revision)],
            [Put(self.keys.job_status(job), self._status(JobState.REJECTED, reason), lease=kv.lease)],
        )

    def directive(self, job: str, kind: DirectiveKind = DirectiveKind.PREEMPT, target: dict | None = None,  # type: ignore[type-arg]
                  grace_s: float = 60.0) -> Directive:
        spec, kv = self.wait_spec(job)
        seq = self._seq.get(job, 0) + 1
        self._seq[job] = seq
        d = Directive(kind=kind, seq=seq, deadline=time.time() + grace_s, target=target or {}, reason="test", issued_at=time.time(), term=self.term)
        ops: list[Put | Delete] = [Put(self.keys.directive(job), d, lease=kv.lease)]
        if kind is DirectiveKind.PREEMPT:
            ops.append(Put(self.keys.job_status(job), self._status(JobState.PREEMPTING, "preempted by test"), lease=kv.lease))
        assert self.store.txn([*self._fence(), Compare(kv.key, "create", "==", kv.create_revision)], ops)
        return d

    def read_ack(self, job: str) -> Ack | None:
        got = self.store.get_record(self.keys.ack(job), Ack)
        return got[0] if got else None

    def release_allocations(self, job: str) -> bool:
        """What the leader does on a preempt ack: delete allocations and directive, status SUSPENDED."""
        spec, kv = self.wait_spec(job)
        allocs, _ = self.store.get_prefix(self.keys.allocations_prefix())
        ops: list[Put | Delete] = [Delete(a.key) for a in allocs if a.key.endswith("/" + job)]
        ops += [Delete(self.keys.directive(job)),
                Put(self.keys.job_status(job), self._status(JobState.SUSPENDED, "preempted"), lease=kv.lease)]
        return self.store.txn([*self._fence(), Compare(kv.key, "create", "==", kv.create_revision)], ops)

    def auto_grant(self) -> AutoGrant:
        """Grant every job whose spec appears, on one simulated GPU, until stopped."""
        return AutoGrant(self)


class AutoGrant:
    """Watches specs and grants each new one (for tests whose client runs in another process)."""

    def __init__(self, leader: LeaderStub) -> None:
        self.leader = leader
        self.granted: list[str] = []
        self._lock = threading.Lock()
        _, rev = leader.store.get_prefix(leader.keys.jobs_prefix())
        self._watch = leader.store.watch_prefix(leader.keys.jobs_prefix(), self._on_events, start_revision=rev + 1)

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            parsed = self.leader.keys.parse(ev.kv.key)
            if ev.type == "put" and parsed is not None and parsed.kind == "jobs.spec" and ev.kv.version == 1:
                job = decode(ev.kv.key, ev.kv.value, JobSpec).name
                if self.leader.grant(job):
                    with self._lock:
                        self.granted.append(job)

    def stop(self) -> None:
        self._watch.cancel()
