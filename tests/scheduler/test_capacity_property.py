"""Property: whatever the snapshot, applying the scheduler's decisions never breaks the capacity invariant.

Per GPU, after every cycle's grants (victims still holding their slices):

* guaranteed + exclusive reservations plus shared predicted peaks <= physical memory;
* all quotas together <= overcommit_ratio x physical (1.0 when there is no shared slice);
* guaranteed + exclusive compute shares <= 1.0;
* an exclusive slice is alone on its GPU; a job never holds two slices of one GPU.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import gpus

from gpupool_sdk.resources import Ack, Allocation, Directive, DirectiveKind, GiB, JobSpec, JobState, QoS
from gpupool_sdk.scheduler import (
    Balloon,
    ClusterSnapshot,
    Deflate,
    Grant,
    JobView,
    Preempt,
    Reject,
    Release,
    Resize,
    Revoke,
    Scheduler,
    SchedulerConfig,
    Shrink,
    predicted_peak,
)

POOLS = [
    "a:2xH100-80GB:nvlink",
    "a:4xH100-80GB:nvlink=2x2,b:2xA100-40GB:pcie",
    "a:2xA100-40GB:pcie,b:2xA100-40GB:pcie,c:1xH100-80GB:nvlink",
]

spec_st = st.fixed_dictionaries(
    {
        "qos": st.sampled_from(["shared", "shared", "guaranteed", "exclusive"]),
        "gpus": st.integers(1, 3),
        "memory_gib": st.sampled_from([4, 10, 20, 30, 45, 70]),
        "compute": st.sampled_from([0.1, 0.25, 0.5, 1.0]),
        "priority": st.integers(0, 3),
        "topology": st.sampled_from(["pack", "spread", "any"]),
        "elastic": st.booleans(),
        "peak_frac": st.one_of(st.none(), st.floats(0.1, 0.6), st.floats(0.1, 1.0)),
        "group": st.sampled_from([None, None, "g"]),
    }
)


def make_view(i: int, d: dict, now: float) -> JobView:
    qos = d["qos"]
    spec = JobSpec(
        name=f"j{i}",
        gpus=d["gpus"],
        memory=0 if qos == "exclusive" else d["memory_gib"] * GiB,
        compute_share=1.0 if qos == "exclusive" else d["compute"],
        qos=qos,
        priority=d["priority"],
        topology=d["topology"],
        anti_affinity=d["group"],
        min_gpus=1 if d["elastic"] else None,
    )
    peak = None if d["peak_frac"] is None or qos == "exclusive" else int(spec.memory_bytes * d["peak_frac"])
    return JobView(spec=spec, queued_at=now, order=i, memory_peak_bytes=peak)


def check_invariant(snap: ClusterSnapshot, cfg: SchedulerConfig) -> None:
    per_gpu: dict[str, list[tuple[JobView, Allocation]]] = {}
    for v in snap.jobs.values():
        seen = set()
        for a in v.allocations:
            assert a.gpu_uuid not in seen, f"{v.name} holds two slices of {a.gpu_uuid}"
            seen.add(a.gpu_uuid)
            per_gpu.setdefault(a.gpu_uuid, []).append((v, a))
    for uuid, items in per_gpu.items():
        phys = snap.gpus[uuid].memory_bytes
        reserved = sum(phys if a.mode is QoS.EXCLUSIVE else a.memory_bytes for _, a in items if a.mode is not QoS.SHARED)
        quota = sum(a.memory_bytes for _, a in items if a.mode is QoS.SHARED)
        peaks = sum(predicted_peak(v, a.memory_bytes, cfg) for v, a in items if a.mode is QoS.SHARED)
        compute = sum(a.compute_share for _, a in items if a.mode is not QoS.SHARED)
        assert reserved + peaks <= phys, (uuid, reserved, peaks, phys)
        ratio = cfg.overcommit_ratio if quota else 1.0
        assert reserved + quota <= ratio * phys + 1, (uuid, reserved, quota, phys)
        assert compute <= 1.0 + 1e-9
        if any(a.mode is QoS.EXCLUSIVE for _, a in items):
            assert len(items) == 1, f"exclusive GPU {uuid} shared by {[v.name for v, _ in items]}"


def step(snap: ClusterSnapshot, decisions: list, cfg: SchedulerConfig, ack: bool = True) -> ClusterSnapshot:
    """Apply the decisions in order like the coordinator does, check the invariant, then let every
    directive written this cycle be acknowledged (the next cycle sees the acks)."""
    jobs = dict(snap.jobs)
    for d in decisions:
        v = jobs.get(d.job)
        if v is None:
            continue
        if isinstance(d, Grant):
            assert not v.allocations, f"{d.job} granted while still holding slices"
            allocs = tuple(
                Allocation(d.job, s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, s.compute_share, v.spec.qos_class)
                for s in d.slices
            )
            assert v.spec.min_gpus is not None and v.spec.min_gpus <= len(allocs) <= (v.spec.max_gpus or v.spec.gpus)
            jobs[d.job] = replace(v, state=JobState.GRANTED, allocations=allocs, granted_at=snap.now)
        elif isinstance(d, (Preempt, Resize)):
            kind = DirectiveKind.PREEMPT if isinstance(d, Preempt) else DirectiveKind.RESIZE
            target = {"for_job": d.for_job} if isinstance(d, Preempt) and d.for_job else {}
            if isinstance(d, Resize):
                target = {"gpus": d.gpus}
            seq = (v.directive.seq + 1) if v.directive else 1
            jobs[d.job] = replace(v, state=JobState.PREEMPTING, directive=Directive(kind, seq, d.deadline, target), ack=None)
        elif isinstance(d, Balloon):
            seq = (v.directive.seq + 1) if v.directive else 1
            target = {"memory_bytes": d.target_bytes, "for_job": d.for_job}
            jobs[d.job] = replace(v, directive=Directive(DirectiveKind.BALLOON, seq, d.deadline, target), ack=None)
        elif isinstance(d, Shrink):
            allocs = tuple(replace(a, memory_bytes=d.memory_bytes) for a in v.allocations)
            jobs[d.job] = replace(v, allocations=allocs, directive=None, ack=None)
        elif isinstance(d, Deflate):
            allocs = tuple(replace(a, memory_bytes=v.spec.memory_bytes) for a in v.allocations)
            jobs[d.job] = replace(v, allocations=allocs)
        elif isinstance(d, Release):
            jobs[d.job] = replace(v, state=JobState.PENDING, allocations=(), granted_at=None, directive=None, ack=None)
        elif isinstance(d, (Reject, Revoke)):
            del jobs[d.job]
    out = replace(snap, jobs=jobs)
    check_invariant(out, cfg)
    if not ack:  # jobs that never answer: their deadlines pass, leases are revoked
        return out
    for name, v in jobs.items():
        if v.directive is not None and v.ack is None:
            reached = v.directive.target.get("memory_bytes")
            jobs[name] = replace(v, ack=Ack(seq=v.directive.seq, step=1, reached_bytes=reached))
    return replace(out, jobs=jobs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pool=st.sampled_from(POOLS),
    waves=st.lists(st.lists(spec_st, min_size=0, max_size=6), min_size=1, max_size=6),
    ratio=st.sampled_from([1.0, 1.5, 2.0]),
    preempt=st.booleans(),
    cordon_first=st.booleans(),
    acks=st.booleans(),
    migrate=st.booleans(),
)
def test_capacity_invariant_over_cycles(
    pool: str, waves: list[list[dict]], ratio: float, preempt: bool, cordon_first: bool, acks: bool, migrate: bool
) -> None:
    cfg = SchedulerConfig(overcommit_ratio=ratio, allow_preemption=preempt, peak_margin=0.1, min_runtime_s=0.0,
                          migrate_for_fragmentation=migrate, migrate_min_run_s=0.0)
    g = gpus(pool)
    cordoned = frozenset([next(iter(g))]) if cordon_first else frozenset()
    sched = Scheduler(cfg)
    snap = ClusterSnapshot(now=0.0, gpus=g, jobs={}, cordoned=cordoned)
    n = 0
    for k, wave in enumerate([*waves, [], [], []]):  # then quiet cycles: acks land, deadlines pass
        jobs = dict(snap.jobs)
        for d in wave:
            v = make_view(n, d, snap.now)
            jobs[v.name] = v
            n += 1
        snap = replace(snap, jobs=jobs, now=k * 30.0)
        decisions = sched.schedule(snap)
        assert decisions == sched.schedule(snap)  # deterministic
        pending = {v.name for v in snap.jobs.values() if v.state is JobState.PENDING}
        answered = {d.job for d in decisions if isinstance(d, (Grant, Reject)) or type(d).__name__ == "Queue"}
        assert pending <= answered
        for d in decisions:
            if isinstance(d, Grant):
                assert not {s.gpu_uuid for s in d.slices} & cordoned
        snap = step(snap, decisions, cfg, ack=acks)
