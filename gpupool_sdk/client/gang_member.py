"""The I/O helper's side of multi-node gangs (runs in the helper process, next to :mod:`.helper`).

A gang member is one node's part of a multi-node job: ``jobs/{job}/members/{node}`` written on
the member process's own etcd lease (create-if-absent: one member per node).

* Node rank 0 writes its member key here (request ``member``, not following) and submits the
  spec through the ordinary acquire path: status, allocations and directives reach it there, and
  its spec's lease carries every allocation of the gang.
* Every other node (request ``member`` with ``follow``) writes its member key and follows the
  job read-only: status, the gang's allocations (those on the spec's lease) and directives are
  forwarded to its training process exactly as for an acquired job; the request is answered
  once the gang is granted.

A follower's lease is lost (the training process is told, and its member key revoked) when its
own member lease goes, when node rank 0's spec vanishes after it was seen (rank 0 left), or when
the gang is released back to PENDING after a grant (another member left: no half-gang trains).

The request ``nodes`` lists ``nodes/{node}`` with the agents that publish them (for
:func:`~gpupool_sdk.client.node.resolve_node`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gpupool_sdk.client.node import PublishedNode
from gpupool_sdk.client.protocol import JobAlreadyRunningError, pack_error
from gpupool_sdk.errors import (
    AcquireTimeoutError,
    GpupoolError,
    JobRejectedError,
    LeaseLostError,
    SchemaError,
)
from gpupool_sdk.resources import Allocation, Directive, GangMember, JobSpec, JobState, JobStatus, NodeInfo
from gpupool_sdk.resources.grant import of_grant
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.lease import LeaseKeeper
from gpupool_sdk.store.types import KeyValue, WatchEvent
from gpupool_sdk.store.watch import Watcher

if TYPE_CHECKING:
    from gpupool_sdk.client.helper import Helper

log = logging.getLogger(__name__)


def list_nodes(helper: Helper) -> list[PublishedNode]:
    """Every ``nodes/{node}`` record with the host and pid of its agent (malformed ones skipped)."""
    out = []
    kvs, _ = helper.store.get_prefix(helper.keys.nodes_prefix())
    for kv in kvs:
        try:
            info = decode(kv.key, kv.value, NodeInfo)
        except SchemaError:
            continue
        out.append(PublishedNode(info.name, info.hostname, info.agent_pid))
    return out


@dataclass
class MemberSession:
    """One node's membership of a gang (and, for a follower, its view of the job)."""

    helper: Helper
    spec: JobSpec
    member: GangMember
    follow: bool
    keeper: LeaseKeeper | None = None
    lease_id: int = 0
    pending_id: int | None = None
    status: JobStatus | None = None
    spec_lease: int = 0
    seen_spec: bool = False
    own_key_seen: bool = False
    allocations: dict[str, tuple[Allocation, int]] = field(default_factory=dict)
    last_seq: int = -1
    ever_granted: bool = False
    lease_gone: bool = False
    ended: bool = False
    watchers: list[Watcher] = field(default_factory=list)
    timer: threading.Timer | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def job(self) -> str:
        return self.spec.name

    # ------------------------------------------------------------------ start

    def start(self, req_id: int, timeout: float | None) -> None:
        h = self.helper
        keys = h.keys
        self.keeper = LeaseKeeper(h.store, h.timing, on_lost=lambda exc: self.lose(exc))
        self.lease_id = self.keeper.start()
        key = keys.job_member(self.job, self.member.node)
        try:
            if not h.store.create(key, self.member, lease=self.lease_id):
                kv = h.store.get(key)
                holder = f"etcd lease {kv.lease:x}" if kv is not None and kv.lease else "a key without a lease"
                raise JobAlreadyRunningError(
                    f"node {self.member.node} already joined job {self.job!r}: {key} is held by {holder}; "
                    f"one process per node joins a gang (the launcher's local rank 0); stop the other one"
                )
            if not self.follow:
                h.reply(req_id, {"lease_id": self.lease_id})
                return
            self.pending_id = req_id
            if timeout is not None:
                self.timer = threading.Timer(timeout, self._timed_out)
                self.timer.daemon = True
                self.timer.start()
            self._watch()
        except BaseException:
            self.end()
            raise

    def _watch(self) -> None:
        h = self.helper
        keys = h.keys
        job = self.job
        jobs_prefix = keys.job_status(job).rsplit("/", 1)[0] + "/"
        alloc_prefix = keys.allocations_prefix()
        directive_key = keys.directive(job)

        def list_jobs() -> int:
            kvs, rev = h.store.get_prefix(jobs_prefix)
            with self.lock:
                self.status = None
                had_spec = self.seen_spec
                spec_now = False
                for kv in kvs:
                    self._job_key(kv, deleted=False)
                    spec_now |= kv.key == keys.job_spec(job)
                if had_spec and not spec_now:
                    self.spec_lease = 0
            self.evaluate(spec_vanished=had_spec and not spec_now)
            return rev

        def on_jobs(events: list[WatchEvent]) -> None:
            vanished = False
            with self.lock:
                for ev in events:
                    vanished |= self._job_key(ev.kv, deleted=ev.type == "delete")
            self.evaluate(spec_vanished=vanished)

        def list_allocs() -> int:
            kvs, rev = h.store.get_prefix(alloc_prefix)
            with self.lock:
                self.allocations.clear()
                for kv in kvs:
                    self._alloc(kv, deleted=False)
            self.evaluate()
            return rev

        def on_allocs(events: list[WatchEvent]) -> None:
            with self.lock:
                for ev in events:
                    self._alloc(ev.kv, deleted=ev.type == "delete")
            self.evaluate()

        def list_directive() -> int:
            kvs, rev = h.store.get_prefix(directive_key)
            for kv in kvs:
                if kv.key == directive_key:
                    self._directive(kv)
            return rev

        def on_directive(events: list[WatchEvent]) -> None:
            for ev in events:
                if ev.kv.key == directive_key and ev.type == "put":
                    self._directive(ev.kv)

        for lister, handler, prefix in (
            (list_jobs, on_jobs, jobs_prefix),
            (list_allocs, on_allocs, alloc_prefix),
            (list_directive, on_directive, directive_key),
        ):
            rev = lister()
            self.watchers.append(h.store.watch_prefix(prefix, handler, start_revision=rev + 1, on_resync=lister))

    # ------------------------------------------------------------------ events (under self.lock)

    def _job_key(self, kv: KeyValue, deleted: bool) -> bool:
        """Apply one key under ``jobs/{job}/``; True when the spec vanished after it was seen."""
        keys = self.helper.keys
        if kv.key == keys.job_spec(self.job):
            if deleted:
                return self.seen_spec
            if self.seen_spec and self.spec_lease and kv.lease != self.spec_lease:
                return True  # a new incarnation under the same name: this membership was for the old one
            self.seen_spec = True
            self.spec_lease = kv.lease
        elif kv.key == keys.job_status(self.job):
            if deleted:
                self.status = None
                return False
            try:
                self.status = decode(kv.key, kv.value, JobStatus)
            except SchemaError as exc:
                log.warning("ignoring malformed status: %s", exc)
        elif kv.key == keys.job_member(self.job, self.member.node):
            if deleted and not self.ended:
                self.lease_gone = True
            elif not deleted:
                self.own_key_seen = True
        return False

    def _alloc(self, kv: KeyValue, deleted: bool) -> None:
        parsed = self.helper.keys.parse(kv.key)
        if parsed is None or parsed.kind != "allocations" or parsed.parts[2] != self.job:
            return
        if deleted:
            self.allocations.pop(kv.key, None)
            return
        try:
            self.allocations[kv.key] = (decode(kv.key, kv.value, Allocation), kv.lease)
        except SchemaError as exc:
            log.warning("ignoring malformed allocation: %s", exc)

    def _directive(self, kv: KeyValue) -> None:
        try:
            d = decode(kv.key, kv.value, Directive)
        except SchemaError as exc:
            log.warning("ignoring malformed directive: %s", exc)
            return
        with self.lock:
            if d.seq <= self.last_seq or self.ended:
                return
            self.last_seq = d.seq
        self.helper.send({"op": "directive", "job": self.job, "directive": d})

    # ------------------------------------------------------------------ decisions

    def _gang_allocations(self) -> tuple[Allocation, ...]:
        if not self.spec_lease:
            return ()
        return of_grant(self.status, (a for a, lease in self.allocations.values() if lease == self.spec_lease))

    def evaluate(self, spec_vanished: bool = False) -> None:
        """Forward the job's state; answer the join once granted; lose the lease when the gang broke."""
        h = self.helper
        lost: GpupoolError | None = None
        reply: tuple[int, Any, GpupoolError | None] | None = None
        with self.lock:
            if self.ended:
                return
            allocs = self._gang_allocations()
            st = self.status
            h.send({"op": "state", "job": self.job, "lease_id": self.lease_id, "status": st, "allocations": allocs})
            if self.lease_gone:
                lost = LeaseLostError(f"the member lease {self.lease_id:x} of node {self.member.node} in job {self.job!r} is gone")
            elif spec_vanished:
                lost = LeaseLostError(
                    f"node rank 0 of gang {self.job!r} left (its spec vanished): every node stops; the launcher restarts the gang"
                )
            elif self.ever_granted and st is not None and st.state is JobState.PENDING:
                lost = LeaseLostError(f"gang {self.job!r} was released on every node: {st.reason}")
            elif st is not None and st.state is JobState.REJECTED and self.pending_id is not None:
                reply = (self.pending_id, None, JobRejectedError(f"job {self.job!r} rejected by the pool: {st.reason}"))
                self.pending_id = None
            elif st is not None and st.state is JobState.GRANTED:
                need = max(st.gpus, 1)
                if sum(1 for a in allocs if a.term == st.term) >= need:
                    self.ever_granted = True
                    if self.pending_id is not None:
                        reply = (self.pending_id, {"lease_id": self.lease_id, "status": st, "allocations": allocs}, None)
                        self.pending_id = None
        if reply is not None:
            h.reply(reply[0], reply[1], reply[2])
            if reply[2] is not None:
                self.end()
        if lost is not None:
            self.lose(lost)

    def ack(self, ack: Any) -> int:
        """Acknowledge a directive for this node: ``acked_seq`` in its member key (its own lease)."""
        with self.lock:
            if self.ended:
                raise LeaseLostError(f"node {self.member.node} is no longer a member of gang {self.job!r}")
            self.member = replace(self.member, acked_seq=max(self.member.acked_seq, int(ack.seq)))
            member = self.member
        return self.helper.store.put(self.helper.keys.job_member(self.job, member.node), member, lease=self.lease_id)

    def _timed_out(self) -> None:
        with self.lock:
            if self.ended or self.pending_id is None:
                return
            req_id, self.pending_id = self.pending_id, None
            st = self.status
        where = f"{st.state.value}: {st.reason}" if st is not None else "no status yet (has node rank 0 joined?)"
        self.end()
        self.helper.reply(
            req_id, error=AcquireTimeoutError(f"gang {self.job!r} was not granted in time; last status {where}; left the gang")
        )

    def lose(self, exc: GpupoolError) -> None:
        with self.lock:
            if self.ended:
                return
            pending, self.pending_id = self.pending_id, None
        self.helper.send({"op": "lost", "job": self.job, "error": pack_error(exc)})
        if pending is not None:
            self.helper.reply(pending, error=exc)
        self.end()

    def end(self) -> None:
        """Leave the gang: stop following and revoke the member lease (the member key vanishes)."""
        with self.lock:
            self.ended = True
        if self.timer is not None:
            self.timer.cancel()
        for w in self.watchers:
            w.cancel()
        if self.keeper is not None:
            self.keeper.stop(revoke=True)


def handle_request(helper: Helper, op: str, req_id: int, msg: dict[str, Any]) -> None:
    """Serve the helper requests of this module: ``member`` (join a gang) and ``nodes``."""
    if op == "nodes":
        helper.reply(req_id, list_nodes(helper))
        return
    spec: JobSpec = msg["spec"]
    member = GangMember(
        job=spec.name,
        node=msg["node"],
        node_rank=int(msg["node_rank"]),
        nnodes=int(msg["nnodes"]),
        hostname=socket.gethostname(),
        pid=int(msg.get("pid") or os.getpid()),
        joined_at=time.time(),
    )
    members = helper.gang_members
    old = members.pop(spec.name, None)
    if old is not None:
        # The client checks that it holds no live lease of this job: an earlier membership left
        # behind (its job's lease was lost and never released) is over; leave it first.
        old.end()
    session = MemberSession(helper, spec, member, follow=bool(msg.get("follow")))
    members[spec.name] = session
    try:
        session.start(req_id, msg.get("timeout"))
    except BaseException:
        members.pop(spec.name, None)
        raise


def end_member(helper: Helper, job: str) -> None:
    """Leave gang ``job`` if this helper joined it (called on release)."""
    session = helper.gang_members.pop(job, None)
    if session is not None:
        session.end()


def end_all(helper: Helper) -> None:
    """Leave every gang (helper shutdown)."""
    for job in list(helper.gang_members):
        end_member(helper, job)
