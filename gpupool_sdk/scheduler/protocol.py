"""Protocol stage: act on acks and missed deadlines before anything is placed.

For each job with an outstanding directive:

* ``preempt`` acked (``ack.seq == directive.seq``) -> :class:`Release` to SUSPENDED; its slices
  are free for this cycle, held for the job named in ``directive.target["for_job"]`` if any.
* ``resize`` acked -> :class:`Release` to PENDING; its slices are free and the job is placed
  again in this same cycle with the target slice count (it restarts from its checkpoint). A
  shrink for a pending job (``target["for_job"]`` and ``target["keep"]``, the UUIDs of the GPUs
  it keeps) holds the kept GPUs for the job, which is re-granted exactly those, and the others
  for ``for_job``. The coordinator writes the release and the re-grant in one transaction
  (:mod:`gpupool_sdk.coordinator.apply`), so the job is never seen PENDING in between.
* ``resize`` refused (acked with ``ok=False``) -> :class:`Withdraw`: the directive goes, the grant
  stays as it is, and no resize is proposed to the job before ``retry_at``
  (:func:`resize_retry_at`: ``resize_retry_s``, doubled for each refusal in a row, up to 16x).
  A pending job that needed the room may still preempt it whole meanwhile.
* ``preempt`` that superseded a resize in flight (``target["supersedes"]``: the resize's seq,
  written when a preemption replaced it) -> an ack of that resize (the job was already
  checkpointing for it) counts as the preempt's ack: the job stopped at its checkpoint.
* ``balloon`` acked -> :class:`Shrink` to the larger of the target and the bytes reached (never above the current quota);
  an ack that says it could not comply (``ok=False``) -> :class:`Preempt`.
* ``preempt`` / ``resize`` past the deadline without the ack -> :class:`Revoke` (forced: the
  lease goes, with every key of the job, so its slices are free for this cycle).
* ``balloon`` past the deadline without the ack -> :class:`Preempt` (it could not shrink).
* ``deflate`` needs nothing from the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpupool_sdk.resources import Directive, DirectiveKind, JobState, QoS
from gpupool_sdk.resources.units import format_size
from gpupool_sdk.scheduler.filter import predicted_peak
from gpupool_sdk.scheduler.ledger import Ledger
from gpupool_sdk.scheduler.locality import members_acked
from gpupool_sdk.scheduler.types import (
    ClusterSnapshot,
    Decision,
    JobView,
    Preempt,
    Release,
    Revoke,
    SchedulerConfig,
    Shrink,
    Withdraw,
)


@dataclass
class ProtocolOutcome:
    """What the protocol stage decided.

    Attributes:
        decisions: Release / Revoke / Shrink / Preempt decisions, in job-name order.
        freed: jobs whose slices were freed in the ledger (released or revoked).
        requeued: resized jobs to place again this cycle, with their target slice count.
        busy: jobs that still have a directive in flight (no new directive this cycle).
        pinned: requeued jobs that shrank for another job, with the ledger indices of the GPUs
            they keep (held for them this cycle; they are re-granted exactly those).
    """

    decisions: list[Decision] = field(default_factory=list)
    freed: set[str] = field(default_factory=set)
    requeued: dict[str, int] = field(default_factory=dict)
    busy: set[str] = field(default_factory=set)
    pinned: dict[str, list[int]] = field(default_factory=dict)


def preempt_deadline(view: JobView, now: float, config: SchedulerConfig) -> float:
    """Deadline for a preempt directive to ``view``: its spec's grace, else the config default."""
    grace = view.spec.preempt_grace_s if view.spec.preempt_grace_s > 0 else config.preempt_grace_s
    return now + grace


def handle_protocol(snapshot: ClusterSnapshot, ledger: Ledger, config: SchedulerConfig) -> ProtocolOutcome:
    """Run the protocol stage over every job with a directive; mutates ``ledger`` for freed slices."""
    out = ProtocolOutcome()
    now = snapshot.now
    for name in sorted(snapshot.jobs):
        view = snapshot.jobs[name]
        d = view.directive
        if d is None:
            continue
        # A gang's directive is acked when node rank 0 wrote the ack and every other node did in its member key.
        acked = view.ack is not None and view.ack.seq == d.seq and members_acked(view, d.seq)
        if not acked and d.kind is DirectiveKind.PREEMPT:
            acked = _superseded_resize_acked(view, d)
        if d.kind is DirectiveKind.RESIZE and acked and view.ack is not None and not view.ack.ok:
            retry = resize_retry_at(view, now, config)
            why = view.ack.message or "no reason given"
            target = target_int(d, "gpus", len(view.allocations))
            out.decisions.append(
                Withdraw(
                    name,
                    f"resize to {target} GPU(s) refused at step {view.ack.step}: {why}; grant of "
                    f"{len(view.allocations)} kept, no resize proposed for {retry - now:.0f}s",
                    retry_at=retry,
                )
            )
            # No other directive this cycle: the withdrawal's write must land first.
            out.busy.add(name)
            continue
        if d.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
            if acked:
                assert view.ack is not None
                where = f" at step {view.ack.step}" + (f", checkpoint {view.ack.checkpoint}" if view.ack.checkpoint else "")
                _free_for(snapshot, ledger, view, out, acked=True)
                if d.kind is DirectiveKind.RESIZE:
                    target = target_int(d, "gpus", view.spec.gpus)
                    out.requeued[name] = target
                    out.decisions.append(
                        Release(name, JobState.PENDING, f"resize to {target} GPU(s) acknowledged{where}; re-placing")
                    )
                else:
                    out.decisions.append(Release(name, JobState.SUSPENDED, f"preempted{where}: {d.reason}".rstrip(": ")))
            elif now > d.deadline:
                _free_for(snapshot, ledger, view, out, acked=False)
                out.decisions.append(
                    Revoke(name, f"no ack to {getattr(d.kind, 'value', d.kind)} directive seq {d.seq} by its deadline; lease revoked")
                )
            else:
                out.busy.add(name)
        elif d.kind is DirectiveKind.BALLOON:
            if acked:
                assert view.ack is not None
                if not view.ack.ok:
                    out.decisions.append(
                        Preempt(
                            name,
                            f"could not honour balloon seq {d.seq}: {view.ack.message or 'no reason given'}",
                            deadline=preempt_deadline(view, now, config),
                            for_job=_for_job(view),
                        )
                    )
                    out.busy.add(name)
                    continue
                current = max((a.memory_bytes for a in view.allocations), default=view.spec.memory_bytes)
                target = target_int(d, "memory_bytes", current)
                reached = view.ack.reached_bytes
                if reached is None:
                    reached = target
                # Keep the target even when the job got below it: an offloaded optimizer state is
                # brought back for each optimizer step, so the job still needs that room at its peak.
                # Never grow past the current quota.
                reached = min(max(reached, target), current)
                peak = predicted_peak(view, reached, config)
                ledger.set_quota(name, reached, peak)
                if reached < current:
                    out.freed.add(name)
                    ledger.frees += 1
                out.decisions.append(
                    Shrink(name, reached, f"balloon seq {d.seq} reached {format_size(reached)} per slice")
                )
            elif now > d.deadline:
                out.decisions.append(
                    Preempt(
                        name,
                        f"did not honour balloon seq {d.seq} to "
                        f"{format_size(target_int(d, 'memory_bytes', 0))} by its deadline",
                        deadline=preempt_deadline(view, now, config),
                        for_job=_for_job(view),
                    )
                )
                out.busy.add(name)
            else:
                out.busy.add(name)
        # DEFLATE: the coordinator restores the quota itself; nothing to decide.
    return out


def resize_retry_at(view: JobView, now: float, config: SchedulerConfig) -> float:
    """When a job that refuses a resize now may be proposed one again: ``resize_retry_s`` after
    ``now``, doubled for each refusal in a row before this one (``view.resize_refusals``), up to 16x."""
    return now + config.resize_retry_s * (2 ** min(max(view.resize_refusals, 0), 4))


def resize_held_off(view: JobView, now: float) -> bool:
    """True while a refused resize holds ``view`` back from another one (``view.resize_retry_at``)."""
    return view.resize_retry_at is not None and now < view.resize_retry_at


def _superseded_resize_acked(view: JobView, d: Directive) -> bool:
    """A preempt directive that replaced a resize in flight (``target["supersedes"]``) is acked by
    an accepting ack of that resize too: the job was checkpointing for the resize when the preempt
    came, and stopped there."""
    seq = d.target.get("supersedes")
    ack = view.ack
    if isinstance(seq, bool) or not isinstance(seq, int) or ack is None:
        return False
    return ack.seq == seq and ack.ok and members_acked(view, seq)


def target_int(directive: Directive, key: str, default: int) -> int:
    """``directive.target[key]`` as an int, or ``default`` when absent or malformed (hand-edited keys)."""
    value = directive.target.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return int(value)


def _free_for(snapshot: ClusterSnapshot, ledger: Ledger, view: JobView, out: ProtocolOutcome, acked: bool) -> None:
    """Free ``view``'s slices; if they were freed for a pending job, hold them for it this cycle
    (otherwise an older job could take them and the preemption would have to start again).

    An acknowledged shrink keeps its kept GPUs: they are held for the shrunk job itself (it is
    re-granted exactly those in this cycle), only the others for the pending job."""
    held = ledger.unreserve(view.name)
    out.freed.add(view.name)
    keep: list[int] = []
    if acked and view.directive is not None and view.directive.kind is DirectiveKind.RESIZE:
        keep = kept_gpus(view.directive, ledger.index_of)
        if keep:
            ledger.block(keep, view.name)
            out.pinned[view.name] = keep
    who = _for_job(view)
    if who is not None and who in snapshot.jobs and snapshot.jobs[who].state is JobState.PENDING:
        ledger.block((h.gpu for h in held if h.gpu not in keep), who)


def kept_gpus(directive: Directive, index_of: Mapping[str, int]) -> list[int]:
    """Ledger indices of the GPUs a shrinking resize keeps (``target["keep"]``: GPU UUIDs);
    UUIDs no longer published and malformed entries (hand-edited keys) are left out."""
    raw = directive.target.get("keep")
    if not isinstance(raw, (list, tuple)):
        return []
    out = []
    for uuid in raw:
        i = index_of.get(uuid) if isinstance(uuid, str) else None
        if i is not None and i not in out:
            out.append(i)
    return out


def _for_job(view: JobView) -> str | None:
    d = view.directive
    if d is None:
        return None
    who = d.target.get("for_job")
    return str(who) if who else None


def freeing_for(view: JobView) -> str | None:
    """The pending job a PREEMPTING, shrinking or ballooning ``view`` is making room for, if its directive says."""
    return _for_job(view)


def is_shared(view: JobView) -> bool:
    """True for shared-class jobs (the only ones ever ballooned)."""
    return view.spec.qos_class is QoS.SHARED
