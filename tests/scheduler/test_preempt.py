"""Preempt stage: victim choice, minimal sets, balloons before preemption, capacity already being freed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, only, run, running, snap

from gpupool_sdk.resources import Directive, DirectiveKind, GiB, JobState, QoS
from gpupool_sdk.scheduler import (
    Balloon,
    Grant,
    Holding,
    Preempt,
    Queue,
    SchedulerConfig,
    SliceRequest,
    build_ledger,
)
from gpupool_sdk.scheduler.preempt import (
    eligible_victims,
    is_protected,
    plan_balloon,
    plan_from_freeing,
    plan_preemption,
    victim_key,
    work_lost_s,
)

POOL = gpus("a:4xH100-80GB:nvlink")
G = list(POOL.values())
NOW = 1000.0


def r(name: str, gpu_idx: list[int], *, granted_at: float = 0.0, ckpt: float | None = None, **spec: object):
    spec.setdefault("memory", "70GiB")
    return replace(running(job(name, **spec), [G[i] for i in gpu_idx], granted_at=granted_at), last_checkpoint_at=ckpt)


@pytest.mark.parametrize(
    ("granted_at", "ckpt", "slices", "expected"),
    [(900.0, None, 1, 100.0), (900.0, 990.0, 1, 10.0), (900.0, 990.0, 3, 30.0), (None, None, 1, 0.0)],
)
def test_work_lost(granted_at: float | None, ckpt: float | None, slices: int, expected: float) -> None:
    view = replace(running(job("v", memory="1GiB"), G[:slices]), granted_at=granted_at, last_checkpoint_at=ckpt)
    assert work_lost_s(view, NOW) == expected


@pytest.mark.parametrize(
    ("spec_min", "cfg_min", "granted_at", "expected"),
    [(0.0, 0.0, 999.0, False), (600.0, 0.0, 500.0, True), (0.0, 600.0, 500.0, True), (100.0, 50.0, 850.0, False),
     (600.0, 0.0, 400.0, False)],
)
def test_min_guarantee(spec_min: float, cfg_min: float, granted_at: float, expected: bool) -> None:
    view = r("v", [0], granted_at=granted_at, min_runtime_s=spec_min)
    assert is_protected(view, NOW, SchedulerConfig(min_runtime_s=cfg_min)) is expected


def test_victim_order_shared_first_then_priority_then_work_lost() -> None:
    views = [
        r("g-p0-old", [0], granted_at=0.0, priority=0, compute_share=0.5),
        r("g-p0-new", [0], granted_at=990.0, priority=0, compute_share=0.5),
        r("s-p3", [1], priority=3, qos="shared"),
        r("x-p0", [2], priority=0, qos="exclusive"),
        r("g-p1", [3], priority=1),
        r("s-p1", [1], priority=1, qos="shared"),
    ]
    order = [v.name for v in sorted(views, key=lambda v: victim_key(v, NOW))]
    assert order == ["s-p1", "s-p3", "g-p0-new", "g-p0-old", "x-p0", "g-p1"]


def test_eligible_victims_filters() -> None:
    cfg = SchedulerConfig(min_runtime_s=0.0)
    views = [
        r("low", [0], priority=0),
        r("same", [1], priority=5),
        r("young", [2], priority=0, granted_at=990.0, min_runtime_s=60.0),
        replace(r("busy", [3], priority=0), directive=Directive(DirectiveKind.PREEMPT, 1, 2000.0)),
        replace(job("pending", memory="1GiB")),
    ]
    assert [v.name for v in eligible_victims(views, 5.0, NOW, cfg)] == ["low"]
    assert [v.name for v in eligible_victims(views, 5.9, NOW, cfg)] == ["low"]  # a whole level is needed
    assert [v.name for v in eligible_victims(views, 6.0, NOW, cfg)] == ["low", "same"]
    assert eligible_victims(views, 6.0, NOW, cfg, busy={"low", "same"}) == []
    assert [v.name for v in eligible_victims(views, 0.99, NOW, cfg)] == []


def whole(count: int = 1) -> SliceRequest:
    return SliceRequest(job="p", qos=QoS.GUARANTEED, memory=70 * GiB, compute=1.0, peak=70 * GiB, count=count, min_count=count)


def test_plan_preemption_minimal_and_ledger_untouched() -> None:
    views = [r(f"v{i}", [i], priority=0) for i in range(4)]
    s = snap(POOL, views, now=NOW)
    ledger = build_ledger(s, SchedulerConfig())
    before = [gl.copy() for gl in ledger.loads]
    plan = plan_preemption(ledger, whole(2), [f"v{i}" for i in (3, 1, 0, 2)])
    assert plan is not None and plan.jobs == ("v3", "v1") and sorted(plan.gpus) == [1, 3]
    assert ledger.loads == before and ledger.frees == 0
    assert plan_preemption(ledger, whole(4), ["v0", "v1"]) is None
    assert ledger.loads == before


def test_plan_preemption_takes_only_what_is_needed_on_shared_gpu() -> None:
    # GPU 0 holds a shared job and a guaranteed one; freeing the guaranteed half suffices for 40GiB.
    views = [
        r("s", [0], memory="20GiB", qos="shared"),
        r("g", [0], memory="40GiB", compute_share=0.5),
        r("x1", [1], qos="exclusive"), r("x2", [2], qos="exclusive"), r("x3", [3], qos="exclusive"),
    ]
    ledger = build_ledger(snap(POOL, views, now=NOW), SchedulerConfig())
    need = SliceRequest(job="p", qos=QoS.GUARANTEED, memory=50 * GiB, compute=0.5, peak=50 * GiB)
    plan = plan_preemption(ledger, need, ["s", "g", "x1"])
    assert plan is not None and plan.jobs == ("g",)


def test_plan_balloon_only_needed_jobs() -> None:
    views = [
        r("s0", [0], memory="60GiB", qos="shared"), r("s1", [1], memory="60GiB", qos="shared"),
        r("x2", [2], qos="exclusive"), r("x3", [3], qos="exclusive"),
    ]
    ledger = build_ledger(snap(POOL, views, now=NOW), SchedulerConfig())
    need = SliceRequest(job="p", qos=QoS.GUARANTEED, memory=50 * GiB, compute=0.5, peak=50 * GiB)
    before = [gl.copy() for gl in ledger.loads]
    plan = plan_balloon(ledger, need, {"s0": 25 * GiB, "s1": 25 * GiB})
    assert plan is not None and plan.jobs == ("s0",) and plan.targets == (25 * GiB,)
    assert ledger.loads == before
    assert plan_balloon(ledger, need, {"s0": 40 * GiB}) is None


def test_plan_from_freeing() -> None:
    views = [r(f"v{i}", [i]) for i in range(4)]
    ledger = build_ledger(snap(POOL, views, now=NOW), SchedulerConfig())
    assert plan_from_freeing(ledger, whole(2), ["v0"], {}) is None
    plan = plan_from_freeing(ledger, whole(1), ["v2", "v3"], {})
    assert plan is not None and plan.jobs == ("v2",)


# ---------------------------------------------------------------- through schedule()


def test_preempts_lower_priority_and_waits() -> None:
    views = [r("low", [0, 1, 2, 3], priority=0, granted_at=0.0, preempt_grace_s=45.0, gpus=4)]
    ds = run(snap(POOL, [*views, job("high", memory="70GiB", priority=5, queued_at=NOW)], now=NOW))
    p = only(ds, "low")
    assert isinstance(p, Preempt) and p.for_job == "high" and p.deadline == NOW + 45.0 and "high" in p.reason
    q = only(ds, "high")
    assert isinstance(q, Queue) and "waiting for 1 preemption of low" in q.reason


def test_no_preemption_of_equal_or_protected_or_when_disabled() -> None:
    high = job("high", memory="70GiB", priority=5, queued_at=NOW)
    for views, cfg in [
        ([r("eq", [0, 1, 2, 3], gpus=4, priority=5)], SchedulerConfig(aging_s_per_priority=0)),
        ([r("young", [0, 1, 2, 3], gpus=4, granted_at=NOW - 10, min_runtime_s=60.0)], SchedulerConfig()),
        ([r("low", [0, 1, 2, 3], gpus=4)], SchedulerConfig(allow_preemption=False)),
    ]:
        ds = run(snap(POOL, [*views, high], now=NOW), cfg)
        assert [type(d).__name__ for d in ds] == ["Queue"], ds


def test_does_not_preempt_again_while_freeing() -> None:
    victim = replace(
        r("low", [0, 1, 2, 3], gpus=4),
        state=JobState.PREEMPTING,
        directive=Directive(DirectiveKind.PREEMPT, 1, NOW + 30, target={"for_job": "high"}),
    )
    ds = run(snap(POOL, [victim, job("high", memory="70GiB", priority=5, queued_at=NOW - 5)], now=NOW))
    assert [type(d).__name__ for d in ds] == ["Queue"]
    assert "waiting for 1 release of low" in ds[0].reason


def test_balloon_before_preempt_for_guaranteed_job() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = pool.values()
    # The floor below the peak (a quarter of 40GiB): the balloon goes to the measured peak.
    cfg = SchedulerConfig(overcommit_ratio=1.5, peak_margin=0.0, balloon_floor_fraction=0.25)
    shared = [
        replace(running(job(f"s{i}", memory="40GiB", qos="shared", peak=15 * GiB), [gpu]), granted_at=0.0)
        for i in range(2)
    ]
    ds = run(snap(pool, [*shared, job("g", memory="40GiB", compute_share=0.5, priority=1)], now=NOW), cfg)
    balloons = [d for d in ds if isinstance(d, Balloon)]
    assert balloons and all(b.target_bytes == 15 * GiB and b.for_job == "g" for b in balloons)
    assert not any(isinstance(d, Preempt) for d in ds)
    assert isinstance(only(ds, "g"), Queue) and "balloon" in only(ds, "g").reason


def test_preempt_shared_when_balloon_not_enough() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = pool.values()
    shared = running(job("s", memory="70GiB", qos="shared", peak=65 * GiB), [gpu])
    ds = run(snap(pool, [shared, job("g", memory="40GiB", priority=1)], now=NOW), SchedulerConfig(peak_margin=0.0))
    assert isinstance(only(ds, "s"), Preempt)


def test_grant_after_victim_released_next_cycle() -> None:
    views = [r("low", [0, 1, 2, 3], gpus=4)]
    s = snap(POOL, [*views, job("high", memory="70GiB", gpus=4, priority=5)], now=NOW)
    ds = run(s)
    assert isinstance(only(ds, "low"), Preempt)
    # The victim acked and is gone in the next snapshot: the high job gets all four GPUs.
    ds2 = run(snap(POOL, [job("high", memory="70GiB", gpus=4, priority=5)], now=NOW + 5))
    g = only(ds2, "high")
    assert isinstance(g, Grant) and len(g.slices) == 4


def test_victim_index_cached_search_rechecks_the_ledger() -> None:
    from gpupool_sdk.scheduler.preempt import VictimIndex, preempt_bound

    views = [r(f"v{i}", [i], priority=i % 2) for i in range(4)]  # v0, v2 priority 0; v1, v3 priority 1
    ledger = build_ledger(snap(POOL, views, now=NOW), SchedulerConfig())
    index = VictimIndex(ledger, [("v0", 0), ("v2", 0), ("v1", 1), ("v3", 1)])
    assert preempt_bound(1.0) == 0 and preempt_bound(1.5) == 0.5 and preempt_bound(2.0) == 1
    assert list(index.groups(whole(), preempt_bound(1.0), set())) == [["v0"], ["v2"]]
    assert list(index.groups(whole(), preempt_bound(2.0), {"v0"})) == [["v2"], ["v1"], ["v3"]]
    ledger.block([2], "someone-else")
    assert list(index.groups(whole(), preempt_bound(1.0), set())) == [["v0"]]
    # A grant that lands on GPU 0 after the cache was built makes its prefix insufficient: skipped.
    ledger.reserve("late", [Holding(0, QoS.GUARANTEED, 20 * GiB, 0.1, 20 * GiB)])
    assert list(index.groups(whole(), preempt_bound(1.0), set())) == []
    plan = plan_preemption(ledger, whole(), [], groups=index.groups(whole(), preempt_bound(2.0), set()))
    assert plan is not None and plan.jobs == ("v1",)
