"""Turn the scheduler's decisions into fenced etcd writes, per the lease protocol.

:func:`plan` is pure: a decision and the :class:`~gpupool_sdk.coordinator.snapshot.PoolState`
it was made on in, a :class:`Plan` (guarded writes, then an optional lease revocation) out.
:class:`Applier` runs plans through a :class:`~gpupool_sdk.coordinator.fencing.FencedWriter`.

What each decision writes (see ``docs/architecture.md``, "The lease protocol"):

* ``Grant``: every ``allocations/{node}/{gpu}/{job}`` and status GRANTED (term, gpus), all on the
  job's lease, in one transaction that also checks the spec key is the same incarnation.
* ``Queue`` / ``Reject``: status PENDING / REJECTED with the reason, only when state or reason
  changed (no write storms on every cycle).
* ``Preempt`` / ``Resize``: ``directives/{job}`` with the next seq, and status PREEMPTING; the
  target names ``for_job`` (and, for a shrink, ``keep``: the GPUs the job keeps) when the decision does.
  One preemption or resize at a time, except that **a preemption supersedes a resize in flight**
  (not acked yet): the preempt directive replaces it, with ``target["supersedes"]`` naming the
  resize's seq, and the job acks the preempt (an ack of that resize counts too: the job was already
  checkpointing for it; :mod:`gpupool_sdk.scheduler.protocol`). A resize never replaces a preemption.
* ``Withdraw`` (the job refused its resize): delete ``directives/{job}``; status GRANTED again with
  the refusal as the reason, its grant untouched, ``resize_refusals`` + 1 and ``resize_retry_at``.
* ``Balloon``: ``directives/{job}`` with the per-slice memory target (the allocations shrink
  when the job acks: ``Shrink``).
* ``Deflate``: the allocations back to full size and ``directives/{job}`` telling the job, in one
  transaction; :func:`housekeeping` retires the directive once acked.
* ``Release``: delete allocations and directive, status SUSPENDED (or the decision's state),
  ``checkpoints/{job}`` with the acknowledged checkpoint, ``usage/{job}``. A preempt's release
  counts one more ``preemptions``, a resize's one more ``resizes`` (never a preemption).
* **A resize's re-placement** (a ``Release`` to PENDING of a job whose resize was acked, and its
  ``Grant`` later in the same batch) is one transaction (:func:`plan_batch`): the old allocations
  go, the new ones come, status GRANTED with ``resizes`` + 1, ``checkpoints/{job}`` and
  ``usage/{job}``, so neither operators nor the launcher ever see the resized job PENDING. It is
  applied where the first grant of the batch stands (after every release of the batch, before
  any other grant). When it would exceed etcd's ``--max-txn-ops``, or the job is not re-granted
  in this cycle, the two are written apart as before (the status then says PENDING with the
  resize as the reason: it holds nothing meanwhile).
* ``Revoke``: ``checkpoints/{job}`` and ``usage/{job}``, then revoke the job's etcd lease.
* ``Shrink`` (when the scheduler emits it): rewrite the job's allocations with a new memory size.

**Every write that adds to a GPU is guarded on that GPU** (``Plan.gpu_guards``): a grant (and a
re-grant) on each GPU it places a slice on, a deflate on each GPU whose allocation grows. The
transaction also compares that no key under ``allocations/{node}/{gpu}/`` was created or rewritten
after the revision of the state the decision was made on (:class:`UnchangedSince`, an etcd range
compare). Only the leader writes allocations, so what breaks it is garbage: an allocation written
by hand between the snapshot and the grant, which the scheduler did not count. The
:class:`Applier` raises the revision to its own last write on that GPU in the same batch, so the
leader's several grants to one GPU in one cycle all commit. A write refused this way is not a
leadership loss: it is skipped, logged once with the GPU and the key that changed, counted
(``ApplyReport.gpu_changed``, ``gpupool_scheduler_gpu_changed_total``), and the next cycle
decides again from a fresh snapshot, which counts the key (an orphan is counted as used).

**etcd's cap on a transaction's size.** etcd refuses a transaction of more than ``--max-txn-ops``
operations (128 by default). The scheduler rejects jobs that could outgrow it
(:func:`~gpupool_sdk.scheduler.reject.txn_limit_reason`); the :class:`Applier` counts every plan
with the same functions before sending it (``SchedulerConfig.etcd_max_txn_ops``). A grant over the
limit is never split (a grant is all or nothing): it is not sent, and the job is written REJECTED
with a reason naming both flags. So is a grant etcd itself refuses as too large (etcd runs with a
lower ``--max-txn-ops`` than the coordinator was told). Any other plan over the limit is logged and
skipped, and the cycle goes on with the other decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpupool_sdk.coordinator.fencing import (
    DeleteOp,
    FencedWriter,
    Guard,
    Op,
    PutOp,
    SameIncarnation,
    UnchangedSince,
)
from gpupool_sdk.coordinator.snapshot import JobMeta, PoolState
from gpupool_sdk.errors import LeaseLostError, StoreError, TxnTooLargeError
from gpupool_sdk.resources import Allocation, Checkpoint, Directive, DirectiveKind, JobState, JobStatus
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.scheduler.reject import FENCE_COMPARES, job_txn_ops, txn_limit_message, txn_ops
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store.codec import encode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.records import ResumeRecord

log = logging.getLogger(__name__)

UsageWriter = Callable[[str, PoolState, float], "Mapping[str, Any] | None"]


@dataclass(frozen=True)
class Plan:
    """The writes one decision needs.

    Attributes:
        job: the job the decision is about.
        kind: the decision's class name (for logs and metrics).
        ops: writes applied atomically (empty = nothing to do).
        guards: extra compares beyond the fence.
        revoke_lease: an etcd lease to revoke after the writes succeeded (forced preemption).
        gpu_guards: one per GPU the plan adds to: nothing was written there since the state the
            plan was made on (the :class:`Applier` raises each revision to its own later writes).
        allocations: a grant's slices as written (the leader charges them from the grant on).
    """

    job: str
    kind: str
    ops: tuple[Op, ...] = ()
    guards: tuple[Guard, ...] = ()
    revoke_lease: int = 0
    gpu_guards: tuple[UnchangedSince, ...] = ()
    allocations: tuple[Allocation, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.ops and not self.revoke_lease

    @property
    def txn_ops(self) -> int:
        """Operations etcd counts against ``--max-txn-ops`` for this plan's fenced transaction."""
        return txn_ops(len(self.ops), FENCE_COMPARES + len(self.guards) + len(self.gpu_guards))


@dataclass
class ApplyReport:
    """What one cycle's application did (``too_large``: plans over etcd's transaction limit)."""

    applied: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    lost: int = 0
    revoked: int = 0
    granted_jobs: list[str] = field(default_factory=list)
    #: the slices each written grant put, by job (what the job holds from this cycle on).
    granted: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)
    too_large: int = 0
    #: plans refused because a GPU they add to changed since the snapshot, by plan kind.
    gpu_changed: dict[str, int] = field(default_factory=dict)


def _status(
    state: PoolState,
    job: str,
    new_state: JobState,
    reason: str,
    now: float,
    **changes: Any,
) -> JobStatus:
    meta = state.jobs[job]
    view = state.snapshot.jobs[job]
    old = meta.status
    resume = meta.resume
    base = JobStatus(
        state=new_state,
        reason=reason,
        updated_at=now,
        queued_at=view.queued_at,
        granted_at=old.granted_at if old is not None else None,
        preemptions=old.preemptions if old is not None else (resume.preemptions if resume is not None else 0),
        resizes=old.resizes if old is not None else (resume.resizes if resume is not None else 0),
        resize_refusals=old.resize_refusals if old is not None else 0,
        resize_retry_at=old.resize_retry_at if old is not None else None,
        # The newest acknowledged checkpoint: this incarnation's ack, else the status, else resume data.
        last_checkpoint=_checkpoint_from_ack(state, job),
        term=state.snapshot.term,
        gpus=len(view.allocations),
        attained_gpu_s=view.attained_gpu_s,
    )
    return replace(base, **changes)


def _put_status(ks: Keyspace, meta: JobMeta, status: JobStatus) -> PutOp:
    return PutOp(ks.job_status(meta.name), encode(status), meta.lease)


def _guard(ks: Keyspace, meta: JobMeta) -> tuple[Guard, ...]:
    return (SameIncarnation(ks.job_spec(meta.name), meta.spec_create_revision),)


def _gpu_guards(ks: Keyspace, state: PoolState, gpus: Sequence[tuple[str, str]]) -> tuple[UnchangedSince, ...]:
    """Guards that no allocation on any of ``gpus`` ((node, uuid)) was written after the state's revision.

    A state without a revision (0) guards that the GPU holds no allocation at all: refusing is
    the safe side.
    """
    return tuple(UnchangedSince(ks.allocations_prefix(node, uuid), state.revision) for node, uuid in sorted(set(gpus)))


def _next_seq(state: PoolState, job: str) -> int:
    view = state.snapshot.jobs[job]
    seqs = [0]
    if view.directive is not None:
        seqs.append(view.directive.seq)
    if view.ack is not None:
        seqs.append(view.ack.seq)
    return max(seqs) + 1


def _checkpoint_from_ack(state: PoolState, job: str) -> Checkpoint | None:
    view = state.snapshot.jobs[job]
    meta = state.jobs[job]
    ack = view.ack
    if ack is not None and ack.checkpoint:
        return Checkpoint(path=ack.checkpoint, step=ack.step, at=ack.at or state.snapshot.now)
    if meta.status is not None and meta.status.last_checkpoint is not None:
        return meta.status.last_checkpoint
    return meta.resume.last_checkpoint if meta.resume is not None else None


def resume_record(state: PoolState, job: str, preempted: bool, resized: bool = False) -> ResumeRecord:
    """The ``checkpoints/{job}`` record to keep when the job gives its slices back.

    ``preempted`` counts one more preemption, ``resized`` one more resize (an elastic job's
    resize writes the record too: its launcher restarts the script from the checkpoint named there).

    **Decision (aging credit):** ``first_queued_at`` is written as ``now - time waited``, where
    the time waited is what the job spent queued before its grants (its own earlier credit
    included), not the time it ran. A job restarted under the same name is queued as of that
    instant, so it keeps the credit it earned by waiting (plus the time it was out of the pool)
    but gets none for its own run time: with credit for run time, a preempted job would come
    back with a huge effective priority and preempt straight back.

    **Decision (remaining-time estimate):** a preempted job's last ``remaining_s`` is kept too.
    Its telemetry key goes with its lease and a queued job publishes nothing, so without it the
    job would be ranked by attained service while it waits and by remaining service once it runs:
    two such jobs preempt each other back and forth (measured by ``benchmarks/live_miniature.py``,
    ``docs/simulation.md`` section 8). The simulator keeps a waiting job's last estimate the same way.
    Its place in submission order (``JobView.order``) is kept likewise, so that among jobs of equal
    rank it is not queued behind jobs that arrived after it (Tiresias and the simulator order a
    queue by first arrival).
    """
    view = state.snapshot.jobs[job]
    meta = state.jobs[job]
    now = state.snapshot.now
    old_pre = meta.status.preemptions if meta.status is not None else 0
    old_res = meta.status.resizes if meta.status is not None else 0
    if meta.resume is not None:
        old_pre = max(old_pre, meta.resume.preemptions)
        old_res = max(old_res, meta.resume.resizes)
    end = view.granted_at if view.granted_at is not None else now
    waited = max(0.0, end - view.queued_at)
    first_queued = now - waited
    return ResumeRecord(
        job=job,
        last_checkpoint=_checkpoint_from_ack(state, job),
        preemptions=old_pre + (1 if preempted else 0),
        resizes=old_res + (1 if resized else 0),
        first_queued_at=first_queued,
        attained_gpu_s=view.attained_gpu_s,
        # A preempted job comes back: it is ranked by its last estimate while it waits (the
        # snapshot falls back to it until the job publishes again). A job that ended has none.
        remaining_s=view.remaining_s if preempted else None,
        # ... and keeps its place in submission order among equals (FIFO by first submission).
        order=view.order if preempted else 0,
    )


def simple_usage(job: str, state: PoolState, now: float) -> Mapping[str, Any]:
    """A minimal ``usage/{job}`` body: GPU-seconds by QoS class, accumulated over incarnations."""
    view = state.snapshot.jobs[job]
    prev = state.usage.get(job, {})
    gpu_s = 0.0
    if view.granted_at is not None and view.allocations:
        gpu_s = len(view.allocations) * max(0.0, now - view.granted_at)
    qos = view.spec.qos_class.value
    by_qos = dict(prev.get("gpu_seconds_by_qos", {})) if isinstance(prev.get("gpu_seconds_by_qos"), dict) else {}
    by_qos[qos] = float(by_qos.get(qos, 0.0)) + gpu_s
    mem_s = sum(a.memory_bytes for a in view.allocations) * (
        max(0.0, now - view.granted_at) if view.granted_at is not None else 0.0
    )
    prev_mem = prev.get("memory_byte_seconds", 0.0)
    return {
        "job": job,
        "owner": view.spec.owner,
        "gpu_seconds": sum(float(v) for v in by_qos.values()),
        "gpu_seconds_by_qos": by_qos,
        "memory_byte_seconds": (float(prev_mem) if isinstance(prev_mem, (int, float)) else 0.0) + mem_s,
        "models": sorted({state.snapshot.gpus[a.gpu_uuid].model for a in view.allocations if a.gpu_uuid in state.snapshot.gpus}),
        "updated_at": now,
    }


def _release_ops(
    ks: Keyspace, state: PoolState, job: str, now: float, preempted: bool, usage: UsageWriter | None,
    resized: bool = False,
) -> list[Op]:
    view = state.snapshot.jobs[job]
    ops: list[Op] = [DeleteOp(ks.allocation(a.node, a.gpu_uuid, job)) for a in view.allocations]
    ops.append(PutOp(ks.checkpoint(job), encode(resume_record(state, job, preempted, resized))))
    body = (usage or simple_usage)(job, state, now)
    if body is not None:
        ops.append(PutOp(ks.usage(job), encode(dict(body), kind="UsageRecord")))
    return ops


def plan(
    decision: st.Decision,
    state: PoolState,
    keyspace: Keyspace,
    config: SchedulerConfig,
    usage: UsageWriter | None = None,
) -> Plan:
    """Plan the writes of one decision (pure: no I/O, no clock; ``now`` is the snapshot's).

    Args:
        decision: what the scheduler decided.
        state: the state it decided on.
        keyspace: the pool's keyspace.
        config: scheduler settings (grace periods for directives without a deadline).
        usage: builds the ``usage/{job}`` body when a job gives its slices back (default
            :func:`simple_usage`); returning None writes nothing.

    Returns:
        The plan; an empty plan when nothing needs writing (the job vanished, or the status
        already says the same thing).
    """
    ks = keyspace
    job = decision.job
    kind = type(decision).__name__
    meta = state.jobs.get(job)
    view = state.snapshot.jobs.get(job)
    now = state.snapshot.now
    term = state.snapshot.term
    if meta is None or view is None:
        return Plan(job, kind)  # the spec vanished since the snapshot: nothing to write for it
    if not meta.lease:
        # Never reached through build_state (a spec without a lease is ignored there); a key the
        # leader wrote without a lease would outlive the job forever, so refuse it here as well.
        log.error("%s for %s not planned: its spec has no etcd lease", kind, job)
        return Plan(job, kind)
    guards = _guard(ks, meta)
    old = meta.status

    if isinstance(decision, st.Grant):
        ops: list[Op] = []
        new_keys = set()
        allocs: list[Allocation] = []
        for s in decision.slices:
            alloc = Allocation(
                job=job,
                node=s.node,
                gpu_uuid=s.gpu_uuid,
                gpu_index=s.gpu_index,
                memory_bytes=s.memory_bytes,
                compute_share=s.compute_share,
                mode=view.spec.qos_class,
                term=term,
                granted_at=now,
            )
            key = ks.allocation(s.node, s.gpu_uuid, job)
            new_keys.add(key)
            allocs.append(alloc)
            ops.append(PutOp(key, encode(alloc), meta.lease))
        ops.extend(
            DeleteOp(k)
            for a in view.allocations
            if (k := ks.allocation(a.node, a.gpu_uuid, job)) not in new_keys
        )
        # Allocations of this job on its own lease that no grant wrote (the snapshot lists them as
        # orphans): garbage, deleted with the grant so that they never join the job's slices.
        ops.extend(
            DeleteOp(o.key)
            for o in state.orphans
            if o.allocation is not None and o.allocation.job == job and o.lease == meta.lease and o.key not in new_keys
        )
        if view.directive is not None:
            ops.append(DeleteOp(ks.directive(job)))
        where = ", ".join(sorted({s.node for s in decision.slices}))
        reason = decision.reason or f"granted {len(decision.slices)} slice(s) on {where}"
        status = _status(state, job, JobState.GRANTED, reason, now, granted_at=now, gpus=len(decision.slices))
        ops.append(_put_status(ks, meta, status))
        gpu_guards = _gpu_guards(ks, state, [(s.node, s.gpu_uuid) for s in decision.slices])
        return Plan(job, kind, tuple(ops), guards, gpu_guards=gpu_guards, allocations=tuple(allocs))

    if isinstance(decision, st.Queue):
        if old is not None and old.state is JobState.PENDING and old.reason == decision.reason:
            return Plan(job, kind)
        if view.allocations:
            log.warning("scheduler queued %s which holds %d slice(s); ignoring", job, len(view.allocations))
            return Plan(job, kind)
        status = _status(state, job, JobState.PENDING, decision.reason, now, granted_at=None, gpus=0)
        return Plan(job, kind, (_put_status(ks, meta, status),), guards)

    if isinstance(decision, st.Reject):
        if old is not None and old.state is JobState.REJECTED and old.reason == decision.reason:
            return Plan(job, kind)
        status = _status(state, job, JobState.REJECTED, decision.reason, now, granted_at=None, gpus=0)
        return Plan(job, kind, (_put_status(ks, meta, status),), guards)

    if isinstance(decision, (st.Preempt, st.Resize)):
        dkind = DirectiveKind.PREEMPT if isinstance(decision, st.Preempt) else DirectiveKind.RESIZE
        cur = view.directive
        target: dict[str, Any] = {"gpus": decision.gpus} if isinstance(decision, st.Resize) else {}
        if cur is not None and cur.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
            if not (dkind is DirectiveKind.PREEMPT and _resize_in_flight(view)):
                return Plan(job, kind)  # one preemption at a time; its deadline stands
            # A preemption supersedes a resize the job has not acked: it replaces the directive.
            # An ack of the resize written meanwhile counts as the preempt's (scheduler.protocol).
            target["supersedes"] = cur.seq
        if decision.for_job:
            # The scheduler holds the room being freed for this job until the ack (protocol.freeing_for).
            target["for_job"] = decision.for_job
        if isinstance(decision, st.Resize) and decision.keep:
            # A shrink for for_job: the GPUs the job keeps, held for it and re-granted at the ack.
            target["keep"] = list(decision.keep)
        directive = Directive(
            kind=dkind,
            seq=_next_seq(state, job),
            deadline=decision.deadline,
            target=target,
            reason=decision.reason,
            issued_at=now,
            term=term,
        )
        status = _status(state, job, JobState.PREEMPTING, decision.reason, now)
        return Plan(
            job, kind, (PutOp(ks.directive(job), encode(directive), meta.lease), _put_status(ks, meta, status)), guards
        )

    if isinstance(decision, (st.Balloon, st.Deflate)):
        if isinstance(decision, st.Balloon):
            dkind, target_bytes, deadline = DirectiveKind.BALLOON, decision.target_bytes, decision.deadline
        else:
            granted = max((a.memory_bytes for a in view.allocations), default=view.spec.memory_bytes)
            dkind, target_bytes, deadline = DirectiveKind.DEFLATE, max(granted, view.spec.memory_bytes), now + config.balloon_grace_s
        cur = view.directive
        if cur is not None and cur.kind is dkind and cur.target.get("memory_bytes") == target_bytes:
            return Plan(job, kind)
        if cur is not None and cur.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
            return Plan(job, kind)  # a preemption outranks a memory change
        directive = Directive(
            kind=dkind,
            seq=_next_seq(state, job),
            deadline=deadline,
            target={"memory_bytes": target_bytes}
            | ({"for_job": decision.for_job} if isinstance(decision, st.Balloon) and decision.for_job else {}),
            reason=decision.reason,
            issued_at=now,
            term=term,
        )
        ops = [PutOp(ks.directive(job), encode(directive), meta.lease)]
        if dkind is DirectiveKind.DEFLATE:
            # The quota comes back at once, in the same transaction: the allocations are what
            # every later cycle counts, so they must say the full size before the job grows into it.
            grown = [a for a in view.allocations if a.memory_bytes != target_bytes]
            ops.extend(
                PutOp(ks.allocation(a.node, a.gpu_uuid, job), encode(replace(a, memory_bytes=target_bytes, term=term)), meta.lease)
                for a in grown
            )
            # Growing on a GPU: guarded like a grant (nothing added there since the snapshot).
            return Plan(job, kind, tuple(ops), guards, gpu_guards=_gpu_guards(ks, state, [(a.node, a.gpu_uuid) for a in grown]))
        return Plan(job, kind, tuple(ops), guards)

    if isinstance(decision, st.Withdraw):
        if view.directive is None or view.directive.kind is not DirectiveKind.RESIZE:
            return Plan(job, kind)  # nothing to withdraw (already gone)
        status = _status(
            state,
            job,
            JobState.GRANTED,
            decision.reason,
            now,
            resize_refusals=(old.resize_refusals if old is not None else 0) + 1,
            resize_retry_at=decision.retry_at,
        )
        return Plan(job, kind, (DeleteOp(ks.directive(job)), _put_status(ks, meta, status)), guards)

    if isinstance(decision, st.Release):
        dk = view.directive.kind if view.directive is not None else None
        preempted, resized = dk is DirectiveKind.PREEMPT, dk is DirectiveKind.RESIZE
        ops = _release_ops(ks, state, job, now, preempted, usage, resized)
        if view.directive is not None:
            ops.append(DeleteOp(ks.directive(job)))
        status = _status(
            state,
            job,
            decision.state,
            decision.reason,
            now,
            granted_at=None,
            gpus=0,
            preemptions=(old.preemptions if old is not None else 0) + (1 if preempted else 0),
            resizes=(old.resizes if old is not None else 0) + (1 if resized else 0),
            resize_refusals=0 if resized else (old.resize_refusals if old is not None else 0),
            resize_retry_at=None,
            last_checkpoint=_checkpoint_from_ack(state, job),
        )
        ops.append(_put_status(ks, meta, status))
        return Plan(job, kind, tuple(ops), guards)

    if isinstance(decision, st.Revoke):
        ops = _release_ops(ks, state, job, now, True, usage)
        # The allocations vanish with the lease; deleting them here as well frees them even if
        # the revoke below fails.
        return Plan(job, kind, tuple(ops), guards, revoke_lease=meta.lease)

    if isinstance(decision, st.Shrink):
        mem = int(decision.memory_bytes)
        ops = []
        for a in view.allocations:
            if a.memory_bytes != mem:
                new = replace(a, memory_bytes=mem, term=term)
                ops.append(PutOp(ks.allocation(a.node, a.gpu_uuid, job), encode(new), meta.lease))
        if view.directive is not None and view.directive.kind is DirectiveKind.BALLOON:
            ops.append(DeleteOp(ks.directive(job)))
        return Plan(job, kind, tuple(ops), guards)

    log.warning("unknown decision %r ignored", decision)
    return Plan(job, kind)


def _resize_in_flight(view: Any) -> bool:
    """True when ``view``'s directive is a resize the job has not acked (yet)."""
    d = view.directive
    return d is not None and d.kind is DirectiveKind.RESIZE and (view.ack is None or view.ack.seq < d.seq)


def _is_resize_release(decision: st.Decision, state: PoolState) -> bool:
    """A Release to PENDING of a job whose resize directive was acked: its re-placement follows."""
    if not isinstance(decision, st.Release) or decision.state is not JobState.PENDING:
        return False
    view = state.snapshot.jobs.get(decision.job)
    d = view.directive if view is not None else None
    return d is not None and d.kind is DirectiveKind.RESIZE and view is not None and view.ack is not None \
        and view.ack.seq == d.seq


def plan_regrant(
    release: st.Release,
    grant: st.Grant,
    state: PoolState,
    keyspace: Keyspace,
    config: SchedulerConfig,
    usage: UsageWriter | None = None,
) -> Plan:
    """One transaction for a resize's re-placement: ``release`` (its old slices, the resize's
    checkpoint and usage) and ``grant`` (its new slices) together, status GRANTED throughout.

    The grant's plan already deletes the allocations it does not keep and the directive; the
    release adds ``checkpoints/{job}`` (the checkpoint the relaunched script resumes from, with
    ``resizes`` + 1) and ``usage/{job}`` (the service of the old grant up to now: the new grant
    counts from now). Pure, like :func:`plan`.

    Returns:
        The plan, or an empty one when the re-grant writes nothing or the merged transaction
        would exceed ``config.etcd_max_txn_ops`` (then both are planned apart).
    """
    job = grant.job
    granted = plan(grant, state, keyspace, config, usage)
    if granted.empty:
        return Plan(job, "Regrant")
    view = state.snapshot.jobs[job]
    meta = state.jobs[job]
    now = state.snapshot.now
    ks = keyspace
    ops = [o for o in granted.ops if not (isinstance(o, PutOp) and o.key == ks.job_status(job))]
    ops.append(PutOp(ks.checkpoint(job), encode(resume_record(state, job, preempted=False, resized=True))))
    limit = config.etcd_max_txn_ops
    if limit and txn_ops(len(ops) + 2, FENCE_COMPARES + len(granted.guards) + len(granted.gpu_guards)) > limit:
        # Over etcd's limit with the usage and status puts: written apart (before the usage
        # writer is asked, which charges the job up to now).
        return Plan(job, "Regrant")
    body = (usage or simple_usage)(job, state, now)
    if body is not None:
        ops.append(PutOp(ks.usage(job), encode(dict(body), kind="UsageRecord")))
    old = meta.status
    nodes = ", ".join(sorted({s.node for s in grant.slices}))
    what = release.reason.split(";")[0] if release.reason else f"resize to {len(grant.slices)} GPU(s) acknowledged"
    status = _status(
        state,
        job,
        JobState.GRANTED,
        f"{what}; re-granted {len(grant.slices)} slice(s) on {nodes} (was {len(view.allocations)})",
        now,
        granted_at=now,
        gpus=len(grant.slices),
        resizes=(old.resizes if old is not None else 0) + 1,
        resize_refusals=0,
        resize_retry_at=None,
        last_checkpoint=_checkpoint_from_ack(state, job),
    )
    ops.append(_put_status(ks, meta, status))
    return Plan(job, "Regrant", tuple(ops), granted.guards, gpu_guards=granted.gpu_guards)


def plan_batch(
    decisions: Sequence[st.Decision],
    state: PoolState,
    keyspace: Keyspace,
    config: SchedulerConfig,
    usage: UsageWriter | None = None,
) -> list[tuple[st.Decision | None, Plan]]:
    """The plans of one cycle's decisions, in order, with each resize's release and re-grant
    merged into one :func:`plan_regrant` placed where the batch's first grant stands (every
    release of the batch is applied before it, no other grant is). A merge over
    ``config.etcd_max_txn_ops`` is left as two plans. Pure."""
    releases = {d.job: i for i, d in enumerate(decisions) if _is_resize_release(d, state)}
    first_grant = next((i for i, d in enumerate(decisions) if isinstance(d, st.Grant)), None)
    merged: dict[int, Plan] = {}  # index of the release -> the merged plan
    skip: set[int] = set()
    for i, d in enumerate(decisions):
        if isinstance(d, st.Grant) and d.job in releases and releases[d.job] < i:
            r = releases[d.job]
            release = decisions[r]
            assert isinstance(release, st.Release)
            p = plan_regrant(release, d, state, keyspace, config, usage)
            if p.empty:
                continue  # over etcd's transaction limit: the release and the grant are written apart
            merged[r] = p
            skip.add(i)
    out: list[tuple[st.Decision | None, Plan]] = []
    front: list[tuple[st.Decision | None, Plan]] = []
    for r, p in merged.items():
        front.append((decisions[r], p))
    for i, d in enumerate(decisions):
        if i == first_grant:
            out.extend(front)
            front = []
        if i in skip or i in merged:
            continue
        out.append((d, plan(d, state, keyspace, config, usage)))
    out.extend(front)
    return out


def housekeeping(state: PoolState, keyspace: Keyspace) -> list[Plan]:
    """Writes no scheduler decision asks for: retire deflate directives once acked.

    A deflate directive only informs the job that its quota is back (the allocations were already
    rewritten); left in place it would keep the job from ever being ballooned again. One not acked
    stays (a preemption may still replace it): the ack's seq is what keeps directive seqs from
    ever being reused once the directive key is gone.
    """
    plans: list[Plan] = []
    for job, view in sorted(state.snapshot.jobs.items()):
        d = view.directive
        if d is None or d.kind is not DirectiveKind.DEFLATE:
            continue
        if view.ack is not None and view.ack.seq >= d.seq:
            meta = state.jobs[job]
            plans.append(Plan(job, "Retire", (DeleteOp(keyspace.directive(job)),), _guard(keyspace, meta)))
    return plans


def _after_own_writes(p: Plan, own: Mapping[str, int]) -> Plan:
    """``p`` with each GPU guard's revision raised to the batch's own last write on that GPU."""
    if not p.gpu_guards or not own:
        return p
    raised = tuple(replace(g, revision=max(g.revision, own.get(g.prefix, 0))) for g in p.gpu_guards)
    return replace(p, gpu_guards=raised)


class Applier:
    """Applies decisions through a :class:`FencedWriter`, one transaction per decision.

    Args:
        writer: the fenced writer (it demotes the coordinator on a lost fence).
        keyspace: the pool's keyspace.
        config: scheduler settings.
        revoke: revokes an etcd lease (the store's ``revoke_lease``).
        usage: builds ``usage/{job}`` bodies (default :func:`simple_usage`).
    """

    def __init__(
        self,
        writer: FencedWriter,
        keyspace: Keyspace,
        config: SchedulerConfig,
        revoke: Callable[[int], Any],
        usage: UsageWriter | None = None,
    ) -> None:
        self._writer = writer
        self._ks = keyspace
        self._config = config
        self._revoke = revoke
        self._usage = usage

    def apply(self, decisions: Sequence[st.Decision], state: PoolState) -> ApplyReport:
        """Apply ``decisions`` in order, then :func:`housekeeping`; stop at the first lost fence."""
        report = ApplyReport()
        busy = {d.job for d in decisions}
        plans = plan_batch(decisions, state, self._ks, self._config, self._usage)
        plans += [(None, p) for p in housekeeping(state, self._ks) if p.job not in busy]
        released: set[str] = set()  # jobs whose Release this batch committed
        # GPU allocation prefix -> revision of this batch's last write of an allocation there.
        own: dict[str, int] = {}
        for d, p in plans:
            if p.empty:
                report.skipped += 1
                continue
            fitted = self._fit(p, d, state, released, report)
            if fitted is None:
                continue
            p = _after_own_writes(fitted, own)
            try:
                revision = self._writer.commit(p.ops, p.guards + p.gpu_guards) if p.ops else 0
            except TxnTooLargeError:
                fitted = self._refused(p, d, state, report)
                if fitted is None:
                    continue
                p = _after_own_writes(fitted, own)
                revision = self._writer.commit(p.ops, p.guards + p.gpu_guards)
            if revision is None:
                report.lost += 1
                if not self._writer.check():
                    break  # the leader key is not ours any more: stop (the writer demoted us)
                self._skipped(p, report)
                continue
            self._note_own_writes(p, revision, own)
            report.applied[p.kind] = report.applied.get(p.kind, 0) + 1
            if p.kind == "Grant":
                report.granted_jobs.append(p.job)
                report.granted[p.job] = p.allocations
            elif p.kind in ("Release", "Regrant"):
                released.add(p.job)
            if p.revoke_lease:
                try:
                    self._revoke(p.revoke_lease)
                    report.revoked += 1
                except LeaseLostError:
                    pass  # already gone: the job died or released on its own
                except StoreError as exc:
                    log.warning("could not revoke lease %x of %s: %s (retried next cycle)", p.revoke_lease, p.job, exc)
            log.info("%s %s: %s", p.kind.lower(), p.job, getattr(d, "reason", "") if d is not None else "deflate done")
        return report

    def _note_own_writes(self, p: Plan, revision: int, own: dict[str, int]) -> None:
        """Remember the revision of ``p``'s allocation puts per GPU: later guards there start after it."""
        for o in p.ops:
            if isinstance(o, PutOp):
                parsed = self._ks.parse(o.key)
                if parsed is not None and parsed.kind == "allocations":
                    prefix = self._ks.allocations_prefix(parsed.parts[0], parsed.parts[1])
                    own[prefix] = max(own.get(prefix, 0), revision)

    def _skipped(self, p: Plan, report: ApplyReport) -> None:
        """Log a plan refused by a guard while the fence held: a GPU changed, or else the job did."""
        try:
            changed = [(g, kvs) for g in p.gpu_guards if (kvs := self._writer.changed_since(g))]
        except StoreError as exc:  # only the log line needs the read: never fail the batch for it
            log.warning("%s for %s refused by a guard (the job or one of its GPUs %s changed since the snapshot; "
                        "could not read which: %s); the next cycle decides again", p.kind, p.job,
                        ", ".join(g.prefix for g in p.gpu_guards) or "-", exc)
            return
        if not changed:
            # (Or a key written on one of its GPUs meanwhile is already gone again: rare, and harmless.)
            log.info("%s for %s skipped: the job changed since the snapshot", p.kind, p.job)
            return
        report.gpu_changed[p.kind] = report.gpu_changed.get(p.kind, 0) + 1
        for g, kvs in changed:
            gpu = g.prefix.rstrip("/").rsplit("/", 1)[-1]
            keys = ", ".join(f"{kv.key} (rev {kv.mod_revision}, lease {kv.lease:x})" for kv in kvs)
            log.warning(
                "%s for %s refused: GPU %s changed after the state it was decided on (rev %d): %s was "
                "written meanwhile, not by this leader (garbage in etcd?); the next cycle decides again, "
                "counting it", p.kind, p.job, gpu, g.revision, keys,
            )

    @property
    def max_txn_ops(self) -> int:
        """The coordinator's ``--etcd-max-txn-ops`` (0 = no check before sending)."""
        return self._config.etcd_max_txn_ops

    def _fit(
        self, p: Plan, d: st.Decision | None, state: PoolState, released: set[str], report: ApplyReport
    ) -> Plan | None:
        """``p`` if it fits etcd's limit; else a slimmer plan, the job's rejection, or None (skip)."""
        limit = self.max_txn_ops
        if not limit or p.txn_ops <= limit:
            return p
        if p.kind == "Revoke" or (p.kind == "Grant" and p.job in released):
            # The deletes are redundant here: a revoked lease takes its keys with it, and a
            # Release this batch committed already deleted the allocations and the directive.
            slim = replace(p, ops=tuple(o for o in p.ops if not isinstance(o, DeleteOp)))
            if slim.txn_ops <= limit:
                return slim
            p = slim
        if isinstance(d, st.Grant):
            n = len(d.slices)
            reason = txn_limit_message(f"a grant of {n} slices", p.txn_ops, limit, need=max(p.txn_ops, job_txn_ops(n)))
            return self._reject(p, f"impossible: {reason}", state, report)
        report.too_large += 1
        log.error(
            "%s for %s not sent: it needs %d operations in one etcd transaction, above the coordinator's "
            "--etcd-max-txn-ops %d; start etcd with --max-txn-ops >= %d and pass the same value to the coordinator",
            p.kind, p.job, p.txn_ops, limit, p.txn_ops,
        )
        return None

    def _refused(self, p: Plan, d: st.Decision | None, state: PoolState, report: ApplyReport) -> Plan | None:
        """etcd refused ``p`` as too large: its ``--max-txn-ops`` is below the coordinator's setting."""
        need = max(p.txn_ops, job_txn_ops(len(d.slices))) if isinstance(d, st.Grant) else p.txn_ops
        reason = (
            f"etcd refused a transaction of {p.txn_ops} operations (too many operations in txn request): its "
            f"--max-txn-ops is lower than the coordinator's --etcd-max-txn-ops {self.max_txn_ops}; "
            f"start etcd with --max-txn-ops >= {need} and pass the same value to the coordinator"
        )
        if isinstance(d, st.Grant):
            return self._reject(p, f"impossible: {reason}", state, report)
        report.too_large += 1
        log.error("%s for %s not applied: %s", p.kind, p.job, reason)
        return None

    def _reject(self, p: Plan, reason: str, state: PoolState, report: ApplyReport) -> Plan | None:
        """The plan that writes ``p.job`` REJECTED with ``reason`` instead of a grant never sent."""
        report.too_large += 1
        log.error("grant to %s not sent, job rejected: %s", p.job, reason)
        rejection = plan(st.Reject(p.job, reason), state, self._ks, self._config, self._usage)
        return None if rejection.empty else rejection

