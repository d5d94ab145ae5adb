"""Build a frozen :class:`~gpupool_sdk.scheduler.types.ClusterSnapshot` from etcd.

One ``get_prefix`` of the whole pool prefix is read at one etcd revision and parsed into a
:class:`PoolState`: the scheduler's snapshot plus what the coordinator needs to apply decisions
(each job's etcd lease, its spec's create revision, its current status) and what ``gpupool status``
shows (leader, nodes, usage, the agents' per-GPU usage readings when the read included them: the
coordinator's does not). A value that does not parse is reported as a :class:`Problem`
naming the key and skipped: one hand-edited key never stops the pool.

**Only keys backed by a live lease of the right writer are acted on** (issue 12): a key with a
lease exists only while that lease lives (etcd deletes it with the lease), so the checks are on
the lease ids of one consistent read:

* ``nodes/{node}`` must be on a lease (its agent's);
* ``gpus/{node}/{uuid}`` must be on the same lease as ``nodes/{node}``, which must be present;
  memory above :data:`MAX_GPU_MEMORY_BYTES` is refused as implausible;
* ``jobs/{job}/spec`` must be on a lease that is not an agent's or the leader's;
* ``jobs/{job}/members/{node}`` (a gang member) likewise; a member of a job with no live spec
  is simply waiting for the spec (node rank 0 writes it) and is not a problem. A member key
  created after the gang's grant (a node's process restarted before the leader saw it go) is
  left out of ``JobView.members``, so the gang is released and granted again with it.

Anything else is a :class:`Problem` (logged once per key and revision), never granted and never
counted as capacity. Allocations are a different matter: *every* allocation in etcd takes
physical memory, whoever wrote it. One that belongs to no live job (no lease, no valid spec, or
a lease other than its spec's), to a job whose status is not a holding one (the leader writes
allocations only together with GRANTED), or whose ``granted_at`` is not its job's grant's
(``JobStatus.granted_at``: every allocation of a grant carries it, so one written by hand on the
job's lease while it is GRANTED is told apart), is an :class:`Orphan`: listed as a problem, counted
as used by the scheduler (``ClusterSnapshot.orphans``), deleted by the job's next grant and
garbage-collected by the leader after a grace.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import SchemaError
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Directive,
    GangMember,
    GpuInfo,
    GpuReadings,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    NodeInfo,
)
from gpupool_sdk.scheduler.types import ClusterSnapshot, JobView
from gpupool_sdk.store.codec import decode, decode_dict
from gpupool_sdk.store.keyspace import Keyspace, ParsedKey
from gpupool_sdk.store.records import JobResult, ResumeRecord
from gpupool_sdk.store.types import KeyValue

log = logging.getLogger(__name__)

# States in which a job holds (or is about to give back) slices.
HOLDING_STATES = frozenset({JobState.GRANTED, JobState.PREEMPTING})

#: A GPU key claiming more memory than this (16 TiB) is refused as implausible: a value this
#: large is a hand edit or corruption, and granting on it would overcommit the real device.
MAX_GPU_MEMORY_BYTES = 16 * 2**40


@dataclass(frozen=True)
class Problem:
    """A value under the prefix that could not be used (reported, then skipped)."""

    key: str
    message: str


@dataclass(frozen=True)
class Orphan:
    """A leader-owned job key that belongs to no live job (garbage-collected after a grace).

    Attributes:
        key: the etcd key.
        mod_revision: its mod revision at the read (the fenced delete compares it).
        lease: the lease it is attached to (0: none, so it would never expire on its own).
        reason: why it is an orphan.
        allocation: the allocation it holds, for allocation keys (counted as used until deleted).
    """

    key: str
    mod_revision: int
    lease: int
    reason: str
    allocation: Allocation | None = None


@dataclass(frozen=True)
class JobMeta:
    """What the coordinator needs besides the scheduler's view to write a job's keys.

    Attributes:
        name: the job.
        lease: the etcd lease of its spec key; status, allocations and directives go on it.
        spec_create_revision: create revision of ``jobs/{job}/spec`` (identifies this incarnation).
        status: the status as last written, if any.
        status_mod_revision: mod revision of the status key (0 when absent).
        resume: the job's ``checkpoints/{job}`` record from earlier incarnations, if any.
        telemetry: the raw telemetry body the client reported, if any.
    """

    name: str
    lease: int
    spec_create_revision: int
    status: JobStatus | None = None
    status_mod_revision: int = 0
    resume: ResumeRecord | None = None
    telemetry: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PoolState:
    """Everything under the pool prefix at one etcd revision.

    Attributes:
        snapshot: the scheduler's input.
        revision: the etcd revision the state was read at (0 when unknown).
        leader: the current leader record, if any.
        leader_create_revision: create revision of the leader key (0 when none).
        nodes: node records by name.
        jobs: coordinator-side details of every job with a valid spec.
        allocations: every valid allocation, including orphans whose job has no spec.
        orphans: allocations (and statuses, directives) that belong to no live job.
        resumes: every ``checkpoints/{job}`` record.
        usage: raw ``usage/{job}`` bodies.
        usage_revisions: the mod revision of each ``usage/{job}`` key read (the coordinator's
            usage writes compare it: a record deleted by ``gpupool job forget`` is not re-created).
        cordons: operator intent bodies by GPU UUID (reason, by, at), ``{}`` when unreadable.
        drains: operator intent bodies by node.
        problems: keys that could not be used, with the reason.
        timeslice_members: per GPU UUID, the jobs that run a time-slicing gate on it
            (``timeslice/{node}/{gpu}/members/{job}``; shown by ``gpupool status``, not scheduled on).
        results: ``results/{job}``: how jobs that left ended (FAILED under ``gpupool run``), by job.
        readings: the agents' usage readings (``readings/{node}/{gpu}``) by GPU UUID, for
            ``gpupool status``; empty in the coordinator's state, whose read leaves them out.
    """

    snapshot: ClusterSnapshot
    revision: int = 0
    leader: LeaderRecord | None = None
    leader_create_revision: int = 0
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    jobs: Mapping[str, JobMeta] = field(default_factory=dict)
    allocations: tuple[Allocation, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    resumes: Mapping[str, ResumeRecord] = field(default_factory=dict)
    usage: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    usage_revisions: Mapping[str, int] = field(default_factory=dict)
    cordons: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    drains: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    timeslice_members: Mapping[str, frozenset[str]] = field(default_factory=dict)
    problems: tuple[Problem, ...] = ()
    results: Mapping[str, JobResult] = field(default_factory=dict)
    readings: Mapping[str, GpuReadings] = field(default_factory=dict)


def _peak_from_telemetry(body: Mapping[str, Any] | None) -> int | None:
    # The telemetry record is the client's (a TelemetrySummary, possibly wrapped in a
    # TelemetryRecord's "summary"); only its memory peak matters here, read leniently.
    if not body:
        return None
    for holder in (body, body.get("summary")):
        if isinstance(holder, Mapping):
            v = holder.get("memory_peak_bytes")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf:
                return int(v)
    return None


def _peak_history_from_telemetry(body: Mapping[str, Any] | None) -> tuple[int, ...]:
    # ``memory_peak_history`` of the job's TelemetrySummary (its recent window peaks, oldest first);
    # absent or malformed reads as none (the scheduler then uses the latest peak alone).
    if not body:
        return ()
    for holder in (body, body.get("summary")):
        if isinstance(holder, Mapping):
            v = holder.get("memory_peak_history")
            if isinstance(v, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in v
            ):
                return tuple(int(x) for x in v[-32:])
    return ()


def _remaining_from_telemetry(body: Mapping[str, Any] | None) -> float | None:
    # ``remaining_s`` of the job's TelemetrySummary (seconds of training left, published by a job
    # that knows its length); absent, null or malformed reads as unknown (LAS ranks the job).
    if not body:
        return None
    for holder in (body, body.get("summary")):
        if isinstance(holder, Mapping):
            v = holder.get("remaining_s")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf:
                return float(v)
    return None


def _util_from_telemetry(body: Mapping[str, Any] | None) -> float | None:
    # ``gpu_util`` of the job's TelemetrySummary (mean SM utilisation 0-1, null without NVML);
    # absent, null or outside [0, 1] reads as unknown (colocation-aware placement skips it).
    if not body:
        return None
    for holder in (body, body.get("summary")):
        if isinstance(holder, Mapping):
            v = holder.get("gpu_util")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1:
                return float(v)
    return None


class DecodeCache:
    """Parsed values by key, reused while the key's mod revision is unchanged.

    Records are frozen, so a value parsed in one cycle is safe to hand to the next; only keys
    written since are decoded again. Keys that vanished are dropped on each :meth:`prune`.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, Any]] = {}
        self.reported: dict[str, str] = {}  # key -> problem already logged (log once, not every cycle)
        self.shapes: dict[str, ParsedKey | None] = {}  # key -> its parsed shape (keys never change shape)
        self.hits = 0
        self.misses = 0

    def get(self, kv: KeyValue, parse: Callable[[], Any]) -> Any:
        """The parsed value of ``kv`` (``parse()`` on a miss); a :class:`SchemaError` is cached and re-raised."""
        hit = self._entries.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision and kv.mod_revision:
            self.hits += 1
            value = hit[1]
        else:
            self.misses += 1
            try:
                value = parse()
            except SchemaError as exc:
                value = exc
            self._entries[kv.key] = (kv.mod_revision, value)
        if isinstance(value, SchemaError):
            raise value
        return value

    def prune(self, live: set[str]) -> None:
        for k in [k for k in self._entries if k not in live]:
            del self._entries[k]
        for k in [k for k in self.reported if k not in live]:
            del self.reported[k]
        for k in [k for k in self.shapes if k not in live]:
            del self.shapes[k]


def build_state(
    items: Iterable[KeyValue],
    keyspace: Keyspace,
    now: float,
    revision: int = 0,
    term: int = 0,
    cache: DecodeCache | None = None,
) -> PoolState:
    """Parse every key of the pool into a :class:`PoolState` (pure: no I/O, no clock).

    Args:
        items: every key under ``keyspace.root()``, read at one revision.
        keyspace: the pool's keyspace.
        now: wall-clock time of the snapshot (seconds since the epoch).
        revision: the etcd revision of the read.
        term: the leader term decisions will be written under.
        cache: reuse values parsed in earlier calls while their mod revision is unchanged.

    Returns:
        The parsed state; malformed values are in ``problems`` (also logged with the key) and skipped.
    """
    problems: list[Problem] = []

    def bad(key: str, message: str, revision: int = 0) -> None:
        # One warning per key, revision and reason: a key that stays bad is not logged every cycle.
        mark = f"{revision}:{message}"
        if cache is None or cache.reported.get(key) != mark:
            log.warning("skipping %s: %s", key, message)
            if cache is not None:
                cache.reported[key] = mark
        problems.append(Problem(key, message))

    gpu_kvs: list[tuple[GpuInfo, KeyValue]] = []
    node_kvs: dict[str, tuple[NodeInfo, KeyValue]] = {}
    cordoned: set[str] = set()
    draining: set[str] = set()
    spec_kvs: list[tuple[JobSpec, KeyValue]] = []
    status_kvs: dict[str, tuple[JobStatus, KeyValue]] = {}
    member_kvs: list[tuple[GangMember, KeyValue]] = []
    alloc_kvs: list[tuple[Allocation, KeyValue]] = []
    directive_kvs: dict[str, tuple[Directive, KeyValue]] = {}
    acks: dict[str, Ack] = {}
    telemetry: dict[str, Mapping[str, Any]] = {}
    resumes: dict[str, ResumeRecord] = {}
    usage: dict[str, Mapping[str, Any]] = {}
    usage_revisions: dict[str, int] = {}
    results: dict[str, JobResult] = {}
    readings: dict[str, GpuReadings] = {}
    timeslice: dict[str, set[str]] = {}
    cordons: dict[str, Mapping[str, Any]] = {}
    drains: dict[str, Mapping[str, Any]] = {}
    leader: LeaderRecord | None = None
    leader_rev = 0
    leader_lease = 0

    seen: set[str] = set()

    def parse(kv: KeyValue, cls: type[Any]) -> Any:
        if cache is None:
            return decode(kv.key, kv.value, cls)
        return cache.get(kv, lambda: decode(kv.key, kv.value, cls))

    def parse_dict(kv: KeyValue) -> dict[str, Any]:
        if cache is None:
            return decode_dict(kv.key, kv.value)
        return cache.get(kv, lambda: decode_dict(kv.key, kv.value))  # type: ignore[no-any-return]

    for kv in items:
        seen.add(kv.key)
        if cache is None:
            parsed = keyspace.parse(kv.key)
        elif kv.key in cache.shapes:
            parsed = cache.shapes[kv.key]
        else:
            parsed = cache.shapes[kv.key] = keyspace.parse(kv.key)
        if parsed is None:
            continue  # keys of other shapes (future kinds, the term counter) are not ours to judge
        kind, parts = parsed.kind, parsed.parts
        try:
            if kind == "gpus":
                g = parse(kv, GpuInfo)
                if g.uuid != parts[1] or g.node != parts[0]:
                    raise SchemaError(kv.key, f"names GPU {g.node}/{g.uuid}, not the one in its key")
                gpu_kvs.append((g, kv))
            elif kind == "nodes":
                info = parse(kv, NodeInfo)
                if info.name != parts[0]:
                    raise SchemaError(kv.key, f"names node {info.name!r}, not {parts[0]!r}")
                node_kvs[parts[0]] = (info, kv)
            elif kind in ("cordons", "drains"):
                # The key's presence is the intent; its value (reason, who, when) is informative only.
                (cordoned if kind == "cordons" else draining).add(parts[0])
                try:
                    (cordons if kind == "cordons" else drains)[parts[0]] = parse_dict(kv)
                except SchemaError:
                    (cordons if kind == "cordons" else drains)[parts[0]] = {}
            elif kind == "jobs.spec":
                spec = parse(kv, JobSpec)
                if spec.name != parts[0]:
                    raise SchemaError(kv.key, f"spec names job {spec.name!r}, not {parts[0]!r}")
                spec_kvs.append((spec, kv))
            elif kind == "jobs.member":
                m = parse(kv, GangMember)
                if (m.job, m.node) != parts:
                    raise SchemaError(kv.key, f"names member {m.job}/{m.node}, not the one in its key")
                member_kvs.append((m, kv))
            elif kind == "jobs.status":
                status_kvs[parts[0]] = (parse(kv, JobStatus), kv)
            elif kind == "allocations":
                a = parse(kv, Allocation)
                if (a.node, a.gpu_uuid, a.job) != parts:
                    raise SchemaError(kv.key, "allocation fields do not match its key")
                alloc_kvs.append((a, kv))
            elif kind == "directives":
                directive_kvs[parts[0]] = (parse(kv, Directive), kv)
            elif kind == "acks":
                acks[parts[0]] = parse(kv, Ack)
            elif kind == "telemetry":
                telemetry[parts[0]] = parse_dict(kv)
            elif kind == "checkpoints":
                resumes[parts[0]] = parse(kv, ResumeRecord)
            elif kind == "usage":
                usage[parts[0]] = parse_dict(kv)
                usage_revisions[parts[0]] = kv.mod_revision
            elif kind == "results":
                results[parts[0]] = parse(kv, JobResult)
            elif kind == "readings":
                readings[parts[1]] = parse(kv, GpuReadings)
            elif kind == "timeslice.member":
                timeslice.setdefault(parts[1], set()).add(parts[2])
            elif kind == "leader":
                leader = parse(kv, LeaderRecord)
                leader_rev = kv.create_revision
                leader_lease = kv.lease
        except SchemaError as exc:
            bad(kv.key, str(exc).removeprefix(kv.key + ": "), kv.mod_revision)
    if cache is not None:
        cache.prune(seen)

    # Agents: a node key on a lease (its agent's); GPUs on that same lease, with the node key present.
    nodes: dict[str, NodeInfo] = {}
    node_lease: dict[str, int] = {}
    for name, (info, kv) in sorted(node_kvs.items()):
        if not kv.lease:
            bad(kv.key, "no lease: an agent publishes its node on its own etcd lease; ignored "
                f"(delete it with `etcdctl del {kv.key}`)", kv.mod_revision)
            continue
        nodes[name] = info
        node_lease[name] = kv.lease
    agent_leases = set(node_lease.values())
    gpus: dict[str, GpuInfo] = {}
    for g, kv in gpu_kvs:
        owner = node_lease.get(g.node)
        if not kv.lease:
            bad(kv.key, "no lease: a GPU is published by its agent on the agent's etcd lease; ignored, never granted",
                kv.mod_revision)
        elif owner is None:
            bad(kv.key, f"no live node key {keyspace.node(g.node)}: no agent publishes node {g.node!r}; "
                "ignored, never granted", kv.mod_revision)
        elif kv.lease != owner:
            bad(kv.key, f"on etcd lease {kv.lease:x}, not the lease {owner:x} of its agent "
                f"({keyspace.node(g.node)}); ignored, never granted", kv.mod_revision)
        elif g.memory_bytes > MAX_GPU_MEMORY_BYTES:
            bad(kv.key, f"memory_bytes {g.memory_bytes} is implausible (above {MAX_GPU_MEMORY_BYTES}); "
                "ignored, never granted", kv.mod_revision)
        else:
            gpus[g.uuid] = g

    # Jobs: a spec on a lease of its own (not an agent's, not the leader's).
    specs: dict[str, tuple[JobSpec, KeyValue]] = {}
    for spec, kv in spec_kvs:
        if not kv.lease:
            bad(kv.key, "no lease: a job's spec must be created on the job's own etcd lease (PoolClient does this); "
                f"ignored, never granted (delete it with `etcdctl del {kv.key}`)", kv.mod_revision)
        elif kv.lease in agent_leases or (leader_lease and kv.lease == leader_lease):
            writer = "an agent's" if kv.lease in agent_leases else "the leader's"
            bad(kv.key, f"on etcd lease {kv.lease:x}, which is {writer}, not a job's; ignored, never granted",
                kv.mod_revision)
        else:
            specs[spec.name] = (spec, kv)

    # Gang members: each on a lease of its own (the member process's), never an agent's or the leader's.
    members_by_job: dict[str, list[tuple[GangMember, int]]] = {}
    for m, kv in member_kvs:
        if not kv.lease or kv.lease in agent_leases or (leader_lease and kv.lease == leader_lease):
            bad(kv.key, "a gang member must be written on its own process's etcd lease (PoolClient.join does this); "
                "ignored", kv.mod_revision)
        else:
            members_by_job.setdefault(m.job, []).append((m, kv.create_revision))

    # Leader-owned job keys belong to the live spec of their job, on its lease; the rest are orphans.
    orphans: list[Orphan] = []

    def owner_problem(job: str, kv: KeyValue) -> str | None:
        own = specs.get(job)
        if not kv.lease:
            return "no lease: it would never expire"
        if own is None:
            return f"job {job!r} has no live spec"
        if own[1].lease != kv.lease:
            return f"on etcd lease {kv.lease:x}, not its job's lease {own[1].lease:x} (an earlier incarnation)"
        return None

    def orphan(kv: KeyValue, reason: str, allocation: Allocation | None = None) -> None:
        orphans.append(Orphan(kv.key, kv.mod_revision, kv.lease, reason, allocation))
        bad(kv.key, f"orphan: {reason}" + ("; counted as used until the leader deletes it" if allocation else ""),
            kv.mod_revision)

    statuses: dict[str, tuple[JobStatus, int]] = {}
    for job, (st_, kv) in status_kvs.items():
        why = owner_problem(job, kv)
        if why is None:
            statuses[job] = (st_, kv.mod_revision)
        else:
            orphan(kv, why)
    allocations: list[Allocation] = []
    allocs_by_job: dict[str, list[Allocation]] = {}
    granted_rev: dict[str, int] = {}  # revision of each job's grant (its allocations' earliest creation)
    for a, kv in alloc_kvs:
        allocations.append(a)
        why = owner_problem(a.job, kv)
        if why is None:
            # The leader writes a job's allocations in the same transaction as a holding status
            # (GRANTED), and deletes them in the one that ends it: one beside no such status was
            # written by someone else, and the job does not hold it (it stays schedulable).
            held_by = statuses.get(a.job)
            if held_by is None or held_by[0].state not in HOLDING_STATES:
                state = "no status" if held_by is None else f"status {held_by[0].state.value}"
                why = f"job {a.job!r} holds no grant ({state}): not written by the leader"
            elif not held_by[0].wrote(a.granted_at):
                why = (f"granted_at {a.granted_at!r} is not that of job {a.job!r}'s grant "
                       f"({held_by[0].granted_at!r}): not written by its grant")
        if why is None:
            allocs_by_job.setdefault(a.job, []).append(a)
            granted_rev[a.job] = min(granted_rev.get(a.job, kv.create_revision), kv.create_revision)
        else:
            orphan(kv, why, a)
    directives: dict[str, Directive] = {}
    for job, (d, kv) in directive_kvs.items():
        why = owner_problem(job, kv)
        if why is None:
            directives[job] = d
        else:
            orphan(kv, why)

    views: dict[str, JobView] = {}
    metas: dict[str, JobMeta] = {}
    for name, (spec, kv) in specs.items():
        status, status_rev = statuses.get(name, (None, 0))
        resume = resumes.get(name)
        ack = acks.get(name)
        held = tuple(sorted(allocs_by_job.get(name, ()), key=lambda a: (a.node, a.gpu_index, a.gpu_uuid)))
        state = status.state if status is not None else JobState.PENDING
        if status is not None and status.queued_at:
            queued_at = status.queued_at
        elif resume is not None and resume.first_queued_at:
            queued_at = resume.first_queued_at
        else:
            queued_at = now
        granted_at = status.granted_at if status is not None and state in HOLDING_STATES else None
        ckpt_times = [status.last_checkpoint.at] if status is not None and status.last_checkpoint else []
        if ack is not None and ack.checkpoint and ack.at:
            ckpt_times.append(ack.at)
        last_ckpt = max(ckpt_times) if ckpt_times else None
        if last_ckpt is not None and granted_at is not None and last_ckpt < granted_at:
            last_ckpt = None  # a checkpoint from an earlier grant does not reduce the work this grant would lose
        attained = resume.attained_gpu_s if resume is not None else 0.0
        if granted_at is not None and held:
            attained += len(held) * max(0.0, now - granted_at)
        views[name] = JobView(
            spec=spec,
            state=state,
            allocations=held,
            queued_at=queued_at,
            granted_at=granted_at,
            last_checkpoint_at=last_ckpt,
            attained_gpu_s=attained,
            directive=directives.get(name),
            ack=ack,
            memory_peak_bytes=_peak_from_telemetry(telemetry.get(name)),
            memory_peak_history=_peak_history_from_telemetry(telemetry.get(name)),
            # A job queued again after a preemption keeps its place in submission order.
            order=resume.order if resume is not None and resume.order > 0 else kv.create_revision,
            # A job queued again after a preemption has no telemetry until it runs: its last
            # estimate, kept in checkpoints/{job}, ranks it meanwhile (apply.resume_record).
            remaining_s=_remaining_from_telemetry(telemetry.get(name))
            if name in telemetry or resume is None else resume.remaining_s,
            gpu_util=_util_from_telemetry(telemetry.get(name)),
            # A member that joined after the grant is a restarted process, not the one the gang was
            # granted with: it does not count until the gang was released and granted again.
            members=tuple(sorted(
                (m for m, rev in members_by_job.get(name, ()) if rev <= granted_rev.get(name, rev)),
                key=lambda m: (m.node_rank, m.node),
            )),
            # A refused resize holds the job back from another one until its retry time.
            resize_refusals=status.resize_refusals if status is not None else 0,
            resize_retry_at=status.resize_retry_at if status is not None and state in HOLDING_STATES else None,
        )
        metas[name] = JobMeta(
            name=name,
            lease=kv.lease,
            spec_create_revision=kv.create_revision,
            status=status,
            status_mod_revision=status_rev,
            resume=resume,
            telemetry=telemetry.get(name),
        )

    snap = ClusterSnapshot(
        now=now,
        gpus=gpus,
        jobs=views,
        cordoned=frozenset(cordoned),
        draining=frozenset(draining),
        term=term,
        orphans=tuple(o.allocation for o in orphans if o.allocation is not None),
    )
    return PoolState(
        snapshot=snap,
        revision=revision,
        leader=leader,
        leader_create_revision=leader_rev,
        nodes=nodes,
        jobs=metas,
        allocations=tuple(allocations),
        orphans=tuple(orphans),
        resumes=resumes,
        usage=usage,
        usage_revisions=usage_revisions,
        cordons=cordons,
        drains=drains,
        problems=tuple(problems),
        timeslice_members={g: frozenset(js) for g, js in timeslice.items()},
        results=results,
        readings=readings,
    )
