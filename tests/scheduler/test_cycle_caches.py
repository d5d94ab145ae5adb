"""Property: the cycle's speed-ups decide exactly what the plain searches decide.

Three of them are exact by design and checked here on several hundred randomized congested
snapshots (fixed seeds):

* :class:`~gpupool_sdk.scheduler.preempt.VictimIndex` computes the per-GPU victim / balloon
  prefixes from a per-GPU walk instead of :func:`~gpupool_sdk.scheduler.preempt._completion_groups`;
* :meth:`~gpupool_sdk.scheduler.preempt.VictimIndex.hopeless` skips searches that cannot succeed,
  remembering failed requests for larger ones later in the cycle;
* a :class:`~gpupool_sdk.scheduler.Scheduler` reuses the GPU layout, unchanged jobs' holdings,
  each unchanged pending job's request, reject check, sort key and queue reason, and each
  unchanged running job's timed rules for ``valid_until`` from its previous cycle (the horizon
  is compared too);
* a placement that failed answers any later request of the cycle with the same constraints
  asking at least as much (``policy._no_place_key``), until capacity is freed;
* a one-slice request that was not placed tells ``hopeless`` that no GPU takes a slice of it
  (``none_fit``: the scan for one is skipped); checked here against the ledger at each call.

The reference runs a fresh scheduler per snapshot with the first two and the last replaced by
the plain searches.
Elastic victims are shrunk (a ``Resize`` for the pending job) rather than preempted when that
alone makes room: the shrink search (:func:`~gpupool_sdk.scheduler.preempt.plan_shrink`) is a
plain walk in both paths, but ``hopeless`` answers it too (a shrink frees less than preempting the
same victims whole), so the snapshots carry elastic jobs above their minimum, shrinks in flight
and acknowledged shrinks, and the test checks that shrinks were decided.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from sched_helpers import gpus

from gpupool_sdk.resources import Ack, Allocation, Directive, DirectiveKind, GiB, GpuHealth, JobSpec, JobState
from gpupool_sdk.scheduler import (
    Balloon,
    ClusterSnapshot,
    Decision,
    Grant,
    JobView,
    Preempt,
    Resize,
    Scheduler,
    SchedulerConfig,
    ScheduleResult,
)
from gpupool_sdk.scheduler import policy as policy_mod
from gpupool_sdk.scheduler import preempt as preempt_mod
from gpupool_sdk.scheduler.preempt import VictimIndex, _completion_groups

POOLS = [
    "a:4xH100-80GB:nvlink,b:4xH100-80GB:nvlink",
    "a:4xA100-40GB:nvlink=2x2,b:4xA100-40GB:pcie,c:2xH100-80GB:nvlink",
    "a:8xV100-32GB:nvlink,b:8xV100-32GB:nvlink,c:8xV100-32GB:nvlink",
]
SEEDS = 300
NOW = 100_000.0


def _spec(rng: random.Random, i: int, prio: int) -> JobSpec:
    qos = rng.choice(["shared", "shared", "shared", "guaranteed", "guaranteed", "exclusive"])
    count = rng.choice([1, 1, 1, 1, 2, 3])
    return JobSpec(
        name=f"j{i}",
        gpus=count,
        memory=0 if qos == "exclusive" else rng.randint(2, 40) * GiB,
        compute_share=1.0 if qos == "exclusive" else rng.choice([0.1, 0.25, 0.5, 1.0]),
        qos=qos,
        priority=prio,
        topology=rng.choice(["pack", "pack", "spread", "any"]),
        anti_affinity=rng.choice([None, None, None, None, "g"]),
        gpu_model=rng.choice([None, None, None, "H100-80GB"]),
        min_gpus=1 if count > 1 and rng.random() < 0.3 else None,
        max_gpus=count + 1 if rng.random() < 0.2 else None,
        min_runtime_s=rng.choice([0.0, 0.0, 600.0]),
    )


def _view(rng: random.Random, i: int, prio: int) -> JobView:
    spec = _spec(rng, i, prio)
    peak = None
    if spec.qos != "exclusive" and rng.random() < 0.7:
        peak = int(spec.memory_bytes * rng.uniform(0.2, 1.0))
    return JobView(
        spec=spec,
        queued_at=NOW - rng.uniform(0, 5000),
        order=i,
        memory_peak_bytes=peak,
        attained_gpu_s=rng.choice([0.0, 50.0, 500.0, 5000.0]),
        remaining_s=rng.choice([None, None, 30.0, 300.0, 3000.0]),  # progress-aware LAS ranks by it
    )


def _config(rng: random.Random) -> SchedulerConfig:
    las = rng.random() < 0.3
    return SchedulerConfig(
        overcommit_ratio=rng.choice([1.0, 1.5, 1.5]),
        aging_s_per_priority=rng.choice([0.0, 0.0, 600.0]),
        max_wait_s=rng.choice([0.0, 3600.0]),
        min_runtime_s=rng.choice([0.0, 300.0]),
        las_threshold_gpu_s=(100.0, 1000.0) if las else (),
        reserve_after_s=rng.choice([0.0, 600.0, 600.0]),
        max_preemption_attempts=rng.choice([32, 32, 3]),
        max_decisions=rng.choice([256, 256, 5]),
    )


def congested(seed: int) -> tuple[ClusterSnapshot, SchedulerConfig]:
    """A busy pool: low-priority jobs granted by the scheduler itself, then a queue of mixed jobs."""
    rng = random.Random(seed)
    pool = gpus(rng.choice(POOLS))
    cfg = _config(rng)
    jobs: dict[str, JobView] = {}
    i = 0
    for _round in range(2):
        for _ in range(rng.randint(8, 20)):
            jobs[f"j{i}"] = _view(rng, i, rng.choice([0, 0, 1, 2]))
            i += 1
        grants = Scheduler(cfg).schedule(ClusterSnapshot(now=NOW - 4000, gpus=pool, jobs=jobs))
        for d in grants:
            if isinstance(d, Grant):
                v = jobs[d.job]
                allocs = tuple(
                    Allocation(d.job, s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, s.compute_share, v.spec.qos_class)
                    for s in d.slices
                )
                jobs[d.job] = replace(
                    v, state=JobState.GRANTED, allocations=allocs, granted_at=NOW - rng.uniform(0, 3000)
                )
        jobs = {n: v for n, v in jobs.items() if v.allocations}
    # A few directives in flight: a preemption for somebody, a balloon under way, a shrink for
    # somebody (still checkpointing, or acknowledged: the job is re-granted the GPUs it keeps).
    for v in list(jobs.values()):
        if v.spec.is_elastic and len(v.allocations) > (v.spec.min_gpus or 1) and rng.random() < 0.3:
            keep = [a.gpu_uuid for a in v.allocations[1:]]
            target = {"gpus": len(keep), "for_job": rng.choice(["", f"j{i + 1}"]), "keep": keep}
            acked = rng.random() < 0.5
            jobs[v.name] = replace(
                v,
                state=JobState.PREEMPTING,
                directive=Directive(DirectiveKind.RESIZE, 1, NOW + 50, target),
                ack=Ack(seq=1) if acked else None,
            )
            continue
        if rng.random() < 0.08:
            kind = rng.choice([DirectiveKind.PREEMPT, DirectiveKind.BALLOON])
            target: dict[str, Any] = {"for_job": rng.choice(["", f"j{i + 1}"])}
            if kind is DirectiveKind.BALLOON:
                target["memory_bytes"] = max(1, v.spec.memory_bytes // 2)
            state = JobState.PREEMPTING if kind is DirectiveKind.PREEMPT else JobState.GRANTED
            jobs[v.name] = replace(v, state=state, directive=Directive(kind, 1, NOW + 50, target))
    for _ in range(rng.randint(10, 40)):
        jobs[f"j{i}"] = _view(rng, i, rng.choice([0, 1, 2, 3, 4, 5]))
        i += 1
    cordoned: frozenset[str] = frozenset()
    if rng.random() < 0.15:
        cordoned = frozenset([rng.choice(sorted(pool))])
    if rng.random() < 0.1:
        bad = rng.choice(sorted(pool))
        pool = {**pool, bad: replace(pool[bad], health=GpuHealth(healthy=False, reasons=("xid 79",)))}
    return ClusterSnapshot(now=NOW, gpus=pool, jobs=jobs, cordoned=cordoned), cfg


def _next(snap: ClusterSnapshot, rng: random.Random) -> ClusterSnapshot:
    """The same pool a little later: most views the same objects, a few granted jobs gone."""
    jobs = dict(snap.jobs)
    for name in rng.sample(sorted(jobs), k=min(3, len(jobs))):
        if jobs[name].allocations:
            del jobs[name]
    return replace(snap, now=snap.now + 30.0, jobs=jobs)


def _plain_options(
    self: VictimIndex, req: Any, top_priority: float, las: tuple[int, int] | None
) -> list[tuple[int, list[str]]]:
    names = self.candidates_under(top_priority, las)
    return list(_completion_groups(self.ledger, req, names, self.targets, respect_blocks=False))


def _reference(snap: ClusterSnapshot, cfg: SchedulerConfig) -> ScheduleResult:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VictimIndex, "hopeless", lambda self, req, top, las=None, none_fit=False: False)
        mp.setattr(VictimIndex, "_options", _plain_options)
        mp.setattr(policy_mod, "_no_place_key", lambda req: None)  # every placement tried
        PLACES["who"] = "reference"
        try:
            return Scheduler(cfg).run(snap)
        finally:
            PLACES["who"] = "other"


#: place() calls of the scheduler under test and of the reference (the dominance check must save some).
PLACES: dict[str, Any] = {"fast": 0, "reference": 0, "other": 0, "who": "other"}


def test_cycle_caches_decide_like_the_plain_searches(monkeypatch: pytest.MonkeyPatch) -> None:
    shortcut = {"calls": 0, "true": 0, "hits": 0, "none_fit": 0}
    real = preempt_mod.VictimIndex.hopeless

    def counting(
        self: VictimIndex, req: Any, top: float, las: tuple[int, int] | None = None, none_fit: bool = False
    ) -> bool:
        if none_fit:  # the scheduler's claim: no GPU takes a slice of the request now
            assert next(iter(self.ledger.candidates(req)), None) is None, req
            shortcut["none_fit"] += 1
        before = self.hopeless_hits
        out = real(self, req, top, las, none_fit)
        shortcut["calls"] += 1
        shortcut["true"] += out
        shortcut["hits"] += self.hopeless_hits - before
        return out

    monkeypatch.setattr(VictimIndex, "hopeless", counting)
    real_place = policy_mod.place

    def counting_place(ledger: Any, req: Any, avoid_nodes: Any = ()) -> Any:
        PLACES[PLACES["who"]] += 1
        return real_place(ledger, req, avoid_nodes)

    monkeypatch.setattr(policy_mod, "place", counting_place)
    kinds: dict[str, int] = {}
    for seed in range(SEEDS):
        first, cfg = congested(seed)
        second = _next(first, random.Random(seed))
        fast = Scheduler(cfg)  # one scheduler for both cycles: its memo carries over
        for snap in (first, second):
            want = _reference(snap, cfg)
            PLACES["who"] = "fast"
            result = fast.run(snap)
            PLACES["who"] = "other"
            got = list(result.decisions)
            assert got == list(want.decisions), f"seed {seed}, now {snap.now}"
            # The horizon (its per-view memo carried over too) is the fresh scheduler's.
            assert result.valid_until == want.valid_until, f"seed {seed}, now {snap.now}"
            for d in got:
                kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
                if isinstance(d, Resize) and d.for_job is not None:
                    kinds["shrink"] = kinds.get("shrink", 0) + 1
    # The snapshots must exercise what the caches speed up, or this test proves nothing.
    assert kinds.get(Preempt.__name__, 0) > 20 and kinds.get(Balloon.__name__, 0) > 5, kinds
    assert kinds.get("shrink", 0) > 20, kinds
    assert shortcut["true"] > 100 and shortcut["hits"] > 20, shortcut
    assert shortcut["true"] < shortcut["calls"], shortcut
    assert shortcut["none_fit"] > 100, shortcut
    assert PLACES["fast"] < PLACES["reference"], PLACES  # 9,856 vs 10,731 when written


def _advance(snap: ClusterSnapshot, decisions: list[Decision], rng: random.Random, i: int) -> ClusterSnapshot:
    """The pool after ``decisions`` were applied (grants hold, preempted and a few running jobs
    leave, a few arrive), 60 s later."""
    jobs = dict(snap.jobs)
    for d in decisions:
        v = jobs.get(d.job)
        if v is None:
            continue
        if isinstance(d, Grant):
            allocs = tuple(
                Allocation(d.job, s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, s.compute_share, v.spec.qos_class)
                for s in d.slices
            )
            jobs[d.job] = replace(v, state=JobState.GRANTED, allocations=allocs, granted_at=snap.now)
        elif isinstance(d, Preempt):
            del jobs[d.job]
    for name in rng.sample(sorted(jobs), k=min(2, len(jobs))):
        del jobs[name]
    for k in range(rng.randint(0, 4)):
        jobs[f"n{i}-{k}"] = replace(_view(rng, 1000 + k, rng.choice([0, 1, 3])), spec=replace(
            _spec(rng, 1000 + k, 1), name=f"n{i}-{k}"))
    return replace(snap, now=snap.now + 60.0, jobs=jobs)


def test_ledger_kept_between_cycles_is_a_fresh_build() -> None:
    """Many cycles of one scheduler (its ledger brought up to date job by job) against a fresh
    ledger and a fresh scheduler on every snapshot: same loads, holdings and decisions."""
    incremental = 0
    for seed in range(60):
        snap, cfg = congested(seed)
        rng = random.Random(seed)
        kept = Scheduler(cfg)
        for i in range(6):
            base_before = kept._memo.base
            got = kept.run(snap)
            if base_before is not None and kept._memo.base is base_before:
                incremental += 1
            fresh_ledger = policy_mod.build_ledger(snap, cfg)
            memo_ledger = kept._memo.base
            assert memo_ledger is not None
            assert [(ld.reserved, ld.shared_quota, ld.shared_peak, ld.exclusive, ld.slices) for ld in memo_ledger.loads] == [
                (ld.reserved, ld.shared_quota, ld.shared_peak, ld.exclusive, ld.slices) for ld in fresh_ledger.loads
            ], f"seed {seed}, cycle {i}"
            assert [ld.compute for ld in memo_ledger.loads] == pytest.approx([ld.compute for ld in fresh_ledger.loads], abs=1e-12)
            assert memo_ledger.holdings == fresh_ledger.holdings
            # (a group whose last member left may stay as an empty counter: the same nodes to avoid)
            assert {g: c for g, c in memo_ledger.groups.items() if c} == fresh_ledger.groups
            want = Scheduler(cfg).run(snap)
            assert got.decisions == want.decisions, f"seed {seed}, cycle {i}"
            assert got.valid_until == want.valid_until, f"seed {seed}, cycle {i}"
            snap = _advance(snap, list(got.decisions), rng, i)
    assert incremental > 100, incremental  # the kept ledger was brought up to date, not rebuilt


def test_candidate_bound_never_undercounts_and_place_decides_the_same() -> None:
    """``Ledger.candidate_bound`` is at least the number of GPUs ``candidates`` yields, so the
    early "fewer than min_count" answer of ``place`` is the one the full search gives."""
    from gpupool_sdk.scheduler.filter import request_for
    from gpupool_sdk.scheduler.placement import place

    cut = 0
    for seed in range(60):
        snap, cfg = congested(seed)
        ledger = policy_mod.build_ledger(snap, cfg)
        rng = random.Random(seed)
        for view in snap.jobs.values():
            count = rng.choice([1, 2, 3, 4, 6, 8, view.spec.gpus])
            req = request_for(view, cfg, count)
            bound = ledger.candidate_bound(req)
            assert bound >= len(list(ledger.candidates(req))), (seed, req)
            fast = place(ledger, req)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(type(ledger), "candidate_bound", lambda self, r: 1 << 30)
                assert place(ledger, req) == fast, (seed, req)
            cut += count > 1 and bound < req.min_count
    assert cut > 50, cut  # the early answer was exercised
