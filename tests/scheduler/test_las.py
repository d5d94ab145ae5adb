"""Least-attained-service mode: LAS queues that preempt within a priority level (Tiresias-like)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sched_helpers import apply, gpus, job, only, run, running, snap

from gpupool_sdk.resources import Directive, DirectiveKind, JobState
from gpupool_sdk.scheduler import Grant, JobView, Preempt, Queue, SchedulerConfig
from gpupool_sdk.scheduler.ordering import las_rank, order_pending
from gpupool_sdk.scheduler.preempt import eligible_victims, las_bound, victim_key

NOW = 10_000.0
ONE = gpus("a:1xH100-80GB:nvlink")
TWO = gpus("a:2xH100-80GB:nvlink")
LAS = SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=0.0, las_threshold_gpu_s=(3600.0,))
LAS3 = replace(LAS, las_threshold_gpu_s=(3600.0, 36000.0))


def ran(name: str, attained: float, gpu_idx: int = 0, pool: dict[str, Any] = ONE, *, granted_at: float = 0.0,
        **spec: Any) -> JobView:
    """A job running on one whole GPU of ``pool`` with ``attained`` GPU-seconds of service."""
    spec.setdefault("memory", "70GiB")
    view = running(job(name, **spec), [list(pool.values())[gpu_idx]], granted_at=granted_at)
    return replace(view, attained_gpu_s=attained)


def waiting(name: str, attained: float = 0.0, *, queued_at: float = NOW - 100.0, order: int = 9, **spec: Any) -> JobView:
    spec.setdefault("memory", "70GiB")
    return replace(job(name, order=order, queued_at=queued_at, **spec), attained_gpu_s=attained)


# (case, config, running jobs, pending job, expected victims)
CASES: list[tuple[str, SchedulerConfig, list[JobView], JobView, list[str]]] = [
    ("lower queue preempts a higher queue of the same level", LAS, [ran("heavy", 5000.0)], waiting("fresh"), ["heavy"]),
    ("same queue: no preemption", LAS, [ran("light", 3000.0)], waiting("fresh"), []),
    ("pending in the higher queue never preempts", LAS, [ran("light", 100.0)], waiting("heavy", 5000.0), []),
    ("inside min_runtime_s: protected", replace(LAS, min_runtime_s=600.0),
     [ran("heavy", 5000.0, granted_at=NOW - 300.0)], waiting("fresh"), []),
    ("the spec's own min_runtime_s protects too", LAS,
     [ran("heavy", 5000.0, granted_at=NOW - 300.0, min_runtime_s=600.0)], waiting("fresh"), []),
    ("past min_runtime_s: preempted", replace(LAS, min_runtime_s=600.0),
     [ran("heavy", 5000.0, granted_at=NOW - 700.0)], waiting("fresh"), ["heavy"]),
    ("a higher priority level wins over queue rank", LAS, [ran("heavy", 5000.0, priority=1)],
     waiting("fresh", priority=0), []),
    ("a lower level in a higher queue is a victim", LAS, [ran("heavy", 5000.0, priority=0)],
     waiting("fresh", priority=3), ["heavy"]),
    ("priority still preempts against queue rank", LAS, [ran("light", 10.0, priority=0)],
     waiting("heavy", 5000.0, priority=1), ["light"]),
    ("exclusive is never a LAS victim", LAS, [ran("heavy", 5000.0, qos="exclusive", memory=0)],
     waiting("fresh"), []),
    ("shared is a LAS victim", LAS, [ran("heavy", 5000.0, qos="shared")], waiting("fresh", qos="shared"), ["heavy"]),
    ("las_preempt=False: ordering only", replace(LAS, las_preempt=False), [ran("heavy", 5000.0)], waiting("fresh"), []),
    ("LAS off (the default): no preemption", replace(LAS, las_threshold_gpu_s=()), [ran("heavy", 5000.0)],
     waiting("fresh"), []),
    ("three queues: queue 1 preempts queue 2", LAS3, [ran("heavy", 40_000.0)], waiting("mid", 5000.0), ["heavy"]),
    ("three queues: queue 1 does not preempt queue 1", LAS3, [ran("heavy", 30_000.0)], waiting("mid", 5000.0), []),
    ("shared before guaranteed", LAS, [ran("g", 5000.0, 0, TWO), ran("s", 5000.0, 1, TWO, qos="shared")],
     waiting("fresh"), ["s"]),
    ("most attained queue first", LAS3, [ran("q1", 5000.0, 0, TWO), ran("q2", 40_000.0, 1, TWO)],
     waiting("fresh"), ["q2"]),
    ("promoted after waiting 8x its run", replace(LAS, las_promote_after_factor=8.0), [ran("other", 5000.0)],
     waiting("starved", 4000.0, queued_at=NOW - 40_000.0), ["other"]),
    ("not promoted before 8x its run", replace(LAS, las_promote_after_factor=8.0), [ran("other", 5000.0)],
     waiting("starved", 4000.0, queued_at=NOW - 30_000.0), []),
]


@pytest.mark.parametrize(("case", "config", "jobs", "pending", "victims"), CASES, ids=[c[0] for c in CASES])
def test_las_preemption(case: str, config: SchedulerConfig, jobs: list[JobView], pending: JobView,
                        victims: list[str]) -> None:
    pool = TWO if len(jobs) > 1 else ONE
    ds = run(snap(pool, [*jobs, pending], now=NOW), config)
    assert [d.job for d in ds if isinstance(d, Preempt)] == victims, case
    decision = only(ds, pending.name)
    assert isinstance(decision, Queue)
    if victims:
        assert decision.reason.startswith("queued: waiting for") and all(v in decision.reason for v in victims)
        preempt = next(d for d in ds if isinstance(d, Preempt))
        assert preempt.for_job == pending.name
        if config.las_threshold_gpu_s:
            assert "LAS queue" in preempt.reason


def test_preemption_in_flight_is_not_repeated() -> None:
    directive = Directive(DirectiveKind.PREEMPT, 1, NOW + 60.0, target={"for_job": "fresh"})
    going = replace(ran("heavy", 5000.0, 0, TWO), state=JobState.PREEMPTING, directive=directive)
    other = ran("other", 5000.0, 1, TWO)
    ds = run(snap(TWO, [going, other, waiting("fresh")], now=NOW), LAS)
    assert not [d for d in ds if isinstance(d, Preempt)]
    decision = only(ds, "fresh")
    assert isinstance(decision, Queue) and "heavy" in decision.reason


def test_room_held_for_one_job_is_not_taken_by_the_next() -> None:
    # Two fresh jobs, one GPU with a heavy job: one preemption, for the first in FIFO order only.
    ds = run(snap(ONE, [ran("heavy", 5000.0), waiting("f1", order=1), waiting("f2", order=2)], now=NOW), LAS)
    assert [(d.job, d.for_job) for d in ds if isinstance(d, Preempt)] == [("heavy", "f1")]
    assert isinstance(only(ds, "f2"), Queue)


def _play(config: SchedulerConfig, work: dict[str, float], step: float = 60.0, cycles: int = 2000) -> tuple[int, float]:
    """Jobs needing ``work`` GPU-seconds each on one GPU; preemptions are acked at once. Returns
    (preemptions, time when all finished)."""
    views = {n: waiting(n, order=i, queued_at=0.0) for i, n in enumerate(work)}
    s = snap(ONE, views.values(), now=0.0)
    preemptions = 0
    for _ in range(cycles):
        if not s.jobs:
            return preemptions, s.now
        ds = run(s, config)
        s = apply(s, ds)
        jobs = dict(s.jobs)
        for d in ds:
            if isinstance(d, Preempt):
                preemptions += 1
                v = jobs[d.job]
                jobs[d.job] = replace(v, state=JobState.PENDING, allocations=(), granted_at=None)
        now = s.now + step
        for n, v in list(jobs.items()):
            if v.state is JobState.GRANTED:
                v = replace(v, attained_gpu_s=v.attained_gpu_s + step)
                jobs[n] = v
                if v.attained_gpu_s >= work[n]:
                    del jobs[n]
        s = replace(s, now=now, jobs=jobs)
    raise AssertionError(f"not finished after {cycles} cycles ({preemptions} preemptions)")


@pytest.mark.parametrize(
    ("config", "most"),
    [(LAS, 1), (LAS3, 2), (replace(LAS3, las_promote_after_factor=8.0), 3), (replace(LAS, min_runtime_s=600.0), 1)],
    ids=["two queues", "three queues", "three queues + promotion", "min_runtime"],
)
def test_two_equal_jobs_do_not_thrash(config: SchedulerConfig, most: int) -> None:
    preemptions, _ = _play(config, {"a": 50_000.0, "b": 50_000.0})
    assert 1 <= preemptions <= most


def test_short_job_overtakes_long_one() -> None:
    # The long job started first; the short one arrives behind it and preempts it once it crosses.
    fifo_pre, _ = _play(SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=0.0), {"long": 20_000.0, "short": 600.0})
    las_pre, _ = _play(LAS, {"long": 20_000.0, "short": 600.0})
    assert fifo_pre == 0 and las_pre == 1


def test_las_rank_and_bound() -> None:
    cfg = replace(LAS3, las_promote_after_factor=8.0)
    assert las_rank(waiting("x", 0.0), NOW, cfg) == 0
    assert las_rank(waiting("x", 5000.0), NOW, cfg) == 1
    assert las_rank(waiting("x", 5000.0, queued_at=0.0), NOW, cfg) == 1  # waited 5,000 s < 8 x 5,000 s
    assert las_rank(waiting("x", 1000.0 + 3600.0, queued_at=-50_000.0), NOW, cfg) == 0  # promoted
    # A granted job's wait is frozen at its grant: promoted while its run is short, not after.
    granted = replace(ran("y", 4000.0, granted_at=NOW - 100.0), queued_at=NOW - 50_000.0)
    assert las_rank(granted, NOW, cfg) == 0  # waited 46,000 s >= 8 x 4,000 s
    assert las_rank(replace(granted, attained_gpu_s=6000.0), NOW, cfg) == 1  # 46,000 s < 8 x 6,000 s
    assert las_bound(waiting("x"), 0.0, NOW, cfg) == (0, 1)
    assert las_bound(waiting("x", 40_000.0), 2.5, NOW, cfg) is None  # nothing above the last queue
    assert las_bound(waiting("x"), 0.0, NOW, replace(cfg, las_preempt=False)) is None
    assert las_bound(waiting("x"), 0.0, NOW, SchedulerConfig()) is None


def test_eligible_victims_with_las_bound() -> None:
    views = [ran("q0", 100.0, 0, TWO), ran("q1", 5000.0, 1, TWO), ran("q1-p1", 5000.0, 1, TWO, priority=1)]
    assert [v.name for v in eligible_victims(views, 0.0, NOW, LAS, las=(0, 1))] == ["q1"]
    assert [v.name for v in eligible_victims(views, 0.0, NOW, LAS)] == []
    assert [v.name for v in eligible_victims(views, 1.0, NOW, LAS, las=(1, 1))] == ["q1", "q0", "q1-p1"]


def test_victim_order_puts_the_most_attained_first() -> None:
    views = [ran("q0", 10.0), ran("q2", 40_000.0), ran("q1", 5000.0), ran("p1-q2", 40_000.0, priority=1)]
    assert [v.name for v in sorted(views, key=lambda v: victim_key(v, NOW, LAS3))] == ["q2", "q1", "q0", "p1-q2"]


def test_pending_order_within_level_uses_promoted_rank() -> None:
    cfg = replace(LAS, las_promote_after_factor=8.0)
    views = [waiting("fresh", 0.0, order=2), waiting("heavy", 5000.0, order=1),
             waiting("starved", 5000.0, order=3, queued_at=-100_000.0), waiting("vip", 9000.0, order=4, priority=1)]
    assert [v.name for v in order_pending(views, NOW, cfg)] == ["vip", "fresh", "starved", "heavy"]


def test_grant_goes_to_preemptor_after_the_ack() -> None:
    ds = run(snap(ONE, [ran("heavy", 5000.0), waiting("fresh")], now=NOW), LAS)
    assert isinstance(only(ds, "heavy"), Preempt)
    # heavy acked and released: fresh is granted, heavy (queue 1) waits and does not preempt back.
    after = snap(ONE, [waiting("heavy", 5000.0, order=0), ran("fresh", 0.0, granted_at=NOW + 30.0)], now=NOW + 60.0)
    ds = run(after, LAS)
    assert not [d for d in ds if isinstance(d, Preempt)] and not [d for d in ds if isinstance(d, Grant)]
