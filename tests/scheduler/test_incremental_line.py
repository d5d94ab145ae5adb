"""Property: the pending line a scheduler keeps from cycle to cycle decides like a fresh one.

``Scheduler._line_up`` keeps the pending jobs sorted between cycles and looks again only at jobs
whose view is a new object (new, changed, requeued after a resize, gone); ``_queue_all`` reuses
last cycle's Queue decisions when the same jobs are queued for the same reason. Here one scheduler
runs many cycles of a changing pool (grants applied, jobs finishing, arrivals, pending views
replaced by changed ones: attained and remaining service that move the sort key, memory peaks
that change the request, specs replaced, equal views as new objects, resized jobs re-placed) and
every cycle is compared with a fresh scheduler on the same snapshot: the same decisions, in the
same order, the same ``considered`` and ``valid_until``. ``keep_reservations`` is off (it makes a
decision depend on the last cycle by design, ``docs/architecture.md``).

The second test breaks the line on purpose (a changed view is taken for the one in line) and
checks that the comparison notices: the first test could not pass with a stale line.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from sched_helpers import gpus

from gpupool_sdk.resources import Ack, Allocation, Directive, DirectiveKind, GiB, JobSpec, JobState
from gpupool_sdk.scheduler import ClusterSnapshot, Grant, JobView, Preempt, Scheduler, SchedulerConfig
from gpupool_sdk.scheduler.policy import Scheduler as _Sched

POOLS = [
    "a:4xH100-80GB:nvlink,b:4xH100-80GB:nvlink",
    "a:8xV100-32GB:nvlink,b:8xV100-32GB:nvlink",
    "a:4xA100-40GB:nvlink=2x2,b:4xA100-40GB:pcie,c:2xH100-80GB:nvlink",
]
SEEDS = 60
CYCLES = 8


def _spec(rng: random.Random, name: str, order: int) -> JobSpec:
    qos = rng.choice(["shared", "shared", "guaranteed", "guaranteed", "exclusive"])
    count = rng.choice([1, 1, 1, 2, 2, 4])
    elastic = count > 1 and rng.random() < 0.3
    return JobSpec(
        name=name,
        gpus=count,
        memory=0 if qos == "exclusive" else rng.randint(2, 30) * GiB,
        compute_share=1.0 if qos == "exclusive" else rng.choice([0.25, 0.5, 1.0]),
        qos=qos,
        priority=rng.choice([0, 0, 0, 1, 2]),
        min_gpus=1 if elastic else None,
        max_gpus=count + 2 if elastic else None,
    )


def _pending(rng: random.Random, name: str, order: int, now: float) -> JobView:
    spec = _spec(rng, name, order)
    return JobView(
        spec=spec,
        queued_at=now - rng.uniform(0, 4000),
        order=order,
        memory_peak_bytes=None if spec.qos == "exclusive" or rng.random() < 0.4 else int(spec.memory_bytes * 0.6),
        attained_gpu_s=rng.choice([0.0, 0.0, 300.0, 5000.0]),
        remaining_s=rng.choice([None, None, 60.0, 900.0, 20000.0]),
    )


def _config(rng: random.Random) -> SchedulerConfig:
    # Aging or a starvation bypass makes the order move with time: the line is then rebuilt every
    # cycle (``_line_up_plain``); one run in five.
    timed = rng.choice([None, None, None, None, "aging", "max_wait"])
    return SchedulerConfig(
        overcommit_ratio=rng.choice([1.0, 1.5]),
        aging_s_per_priority=600.0 if timed == "aging" else 0.0,
        max_wait_s=3600.0 if timed == "max_wait" else 0.0,
        las_threshold_gpu_s=rng.choice([(), (1800.0, 18000.0), (1800.0, 18000.0, 180000.0)]),
        las_preempt=rng.random() < 0.7,
        use_remaining=rng.random() < 0.7,
        reserve_after_s=rng.choice([0.0, 600.0]),
        max_considered=rng.choice([0, 2, 4, 8]),
        max_decisions=rng.choice([256, 256, 256, 7]),
        keep_reservations=False,
    )


def _granted(view: JobView, d: Grant, now: float) -> JobView:
    allocs = tuple(
        Allocation(d.job, s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, s.compute_share, view.spec.qos_class)
        for s in d.slices
    )
    return replace(view, state=JobState.GRANTED, allocations=allocs, granted_at=now, directive=None, ack=None)


def _advance(snap: ClusterSnapshot, decisions: Any, rng: random.Random, cycle: int, order: list[int]) -> ClusterSnapshot:
    """The pool after ``decisions`` were applied, 60 s later, with churn in the queue."""
    now = snap.now + 60.0
    jobs = dict(snap.jobs)
    for d in decisions:
        v = jobs.get(d.job)
        if v is None:
            continue
        if isinstance(d, Grant):
            jobs[d.job] = _granted(v, d, snap.now)
        elif isinstance(d, Preempt):
            jobs[d.job] = replace(v, state=JobState.PENDING, allocations=(), granted_at=None, directive=None)
    running = sorted(n for n, v in jobs.items() if v.allocations)
    pending = sorted(n for n, v in jobs.items() if v.state is JobState.PENDING and not v.allocations)
    for name in rng.sample(running, k=min(2, len(running))):  # finished
        del jobs[name]
    for name in running:
        v = jobs.get(name)
        # An elastic job resized down, acknowledged: re-placed at its target next cycle (requeued).
        if v is not None and v.directive is None and v.spec.is_elastic and len(v.allocations) > 1 and rng.random() < 0.1:
            jobs[name] = replace(
                v,
                state=JobState.PREEMPTING,
                directive=Directive(DirectiveKind.RESIZE, 1, now + 50, {"gpus": len(v.allocations) - 1}),
                ack=Ack(seq=1),
            )
    for name in pending:
        v = jobs[name]
        r = rng.random()
        if r < 0.08:
            del jobs[name]  # withdrawn
        elif r < 0.16:  # ran a little elsewhere: its sort key moves
            jobs[name] = replace(v, attained_gpu_s=v.attained_gpu_s + rng.choice([100.0, 4000.0]))
        elif r < 0.24:
            jobs[name] = replace(v, remaining_s=rng.choice([None, 30.0, 3000.0, 90000.0]))
        elif r < 0.30 and v.spec.qos != "exclusive":  # a new telemetry peak: its request changes
            jobs[name] = replace(v, memory_peak_bytes=int(v.spec.memory_bytes * rng.uniform(0.2, 1.0)))
        elif r < 0.35:  # the same values, a new object
            jobs[name] = replace(v)
        elif r < 0.38:  # a new spec object (re-submitted with another priority)
            jobs[name] = replace(v, spec=replace(v.spec, priority=rng.choice([0, 1, 3])))
    for k in range(rng.randint(0, 5)):
        order[0] += 1
        name = f"n{cycle}-{k}"
        jobs[name] = _pending(rng, name, order[0], now)
    return replace(snap, now=now, jobs=jobs)


def _start(seed: int) -> tuple[ClusterSnapshot, SchedulerConfig, random.Random, list[int]]:
    rng = random.Random(seed)
    pool = gpus(rng.choice(POOLS))
    cfg = _config(rng)
    now = 50_000.0
    jobs: dict[str, JobView] = {}
    for i in range(rng.randint(25, 60)):
        jobs[f"j{i}"] = _pending(rng, f"j{i}", i, now)
    return ClusterSnapshot(now=now, gpus=pool, jobs=jobs), cfg, rng, [len(jobs)]


def _compare(seeds: range) -> dict[str, int]:
    """Run one scheduler over each seed's cycles against a fresh scheduler per cycle; returns counters."""
    seen = {"cycles": 0, "kept": 0, "behind": 0, "requeued": 0, "rekeyed": 0, "grants": 0, "mismatch": 0}
    for seed in seeds:
        snap, cfg, rng, order = _start(seed)
        kept = Scheduler(cfg)
        for cycle in range(CYCLES):
            before = dict(kept._line)
            got = kept.run(snap)
            want = Scheduler(cfg).run(snap)
            same = (
                got.decisions == want.decisions
                and got.considered == want.considered
                and got.valid_until == want.valid_until
            )
            if not same:
                seen["mismatch"] += 1
                continue
            seen["cycles"] += 1
            seen["kept"] += sum(1 for n, e in kept._line.items() if n in before and before[n] is e)
            seen["rekeyed"] += sum(1 for n, e in kept._line.items() if n in before and before[n][3] != e[3])
            seen["behind"] += sum(1 for d in got.decisions if "max_considered" in getattr(d, "reason", ""))
            seen["grants"] += sum(1 for d in got.decisions if isinstance(d, Grant))
            seen["requeued"] += sum(1 for v in snap.jobs.values() if v.ack is not None and v.directive is not None)
            snap = _advance(snap, got.decisions, rng, cycle, order)
    return seen


def test_the_kept_line_decides_like_a_fresh_scheduler() -> None:
    seen = _compare(range(SEEDS))
    assert seen["mismatch"] == 0, seen
    # The runs must exercise what the line keeps, or this test proves nothing.
    assert seen["kept"] > 2000 and seen["rekeyed"] > 50, seen
    assert seen["behind"] > 200 and seen["grants"] > 200 and seen["requeued"] > 10, seen


def test_a_stale_line_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line that took a changed view for the one it holds (the bug the identity check prevents)
    decides differently from a fresh scheduler somewhere in these runs."""
    real = _Sched._line_up

    def stale(self: _Sched, cyc: Any, own: list[tuple[str, JobView]], counts: dict[str, int], now: float) -> Any:
        own = [(n, self._line[n][0] if n in self._line else v) for n, v in own]
        return real(self, cyc, own, counts, now)

    monkeypatch.setattr(_Sched, "_line_up", stale)
    seen = _compare(range(SEEDS))
    assert seen["mismatch"] > 0, seen
