"""Elastic jobs (``min_gpus <= gpus <= max_gpus``): growth at the grant, growth past queued jobs
that cannot use the free GPUs, and the room a growing resize holds until its ack.

Every pool here is whole H100-80GB GPUs and every job asks 70 GiB per slice, so a GPU takes one
slice at most and each expectation is a count of free GPUs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import apply, gpus, job, only, run, running, snap

from gpupool_sdk.resources import Ack, Directive, DirectiveKind, JobState
from gpupool_sdk.scheduler import Grant, Preempt, Queue, Release, Resize, Revoke, SchedulerConfig

POOL = gpus("a:4xH100-80GB:nvlink")
G = list(POOL.values())
MEM = "70GiB"


def elastic(name: str, gpus: int = 1, lo: int = 1, hi: int = 2, **kw: object) -> object:
    return job(name, gpus=gpus, min_gpus=lo, max_gpus=hi, memory=MEM, **kw)


# ---------------------------------------------------------------- 1. grown at its grant, not resized after


@pytest.mark.parametrize(
    ("name", "others", "config", "expect"),
    [
        # 4 idle GPUs, el asks 2 (1-4), nothing else: granted all 4 at once.
        ("alone on an idle pool", [], SchedulerConfig(), {"el": 4}),
        # r (rigid, 1 GPU, after el in FIFO order) is placed first from what el leaves: el 2, r 1,
        # then el grows into the last free GPU: 3.
        ("a later job placed first", [job("r", memory=MEM, order=1)], SchedulerConfig(), {"el": 3, "r": 1}),
        # r2 (rigid gang of 3, order 1) cannot be placed beside el's 2: it queues, and el takes the
        # 2 GPUs left (r2 could not be placed on them even with both).
        ("past a gang that cannot fit", [job("r2", gpus=3, memory=MEM, order=1)], SchedulerConfig(), {"el": 4}),
        # max_decisions=1: r is not considered this cycle; it might have used the free GPUs, so el
        # stays at the 2 it asked.
        ("not past a job left unconsidered", [job("r", memory=MEM, order=1)], SchedulerConfig(max_decisions=1),
         {"el": 2}),
    ],
)
def test_fresh_grant_grows_in_the_same_cycle(name: str, others: list, config: SchedulerConfig,
                                             expect: dict[str, int]) -> None:
    el = elastic("el", gpus=2, lo=1, hi=4, order=0)
    ds = run(snap(POOL, [el, *others]), config)
    got = {d.job: len(d.slices) for d in ds if isinstance(d, Grant)}
    assert got == expect
    assert not [d for d in ds if isinstance(d, Resize)]
    # Decisions stay in order and on distinct GPUs.
    used = [s.gpu_uuid for d in ds if isinstance(d, Grant) for s in d.slices]
    assert len(used) == len(set(used))


def test_no_resize_at_the_instant_of_the_grant() -> None:
    # el was granted 1 of 2 at t=10 (a blocker held the rest, gone since); another cycle at the same
    # instant (the simulator's follow-up) must not resize it; one at t=11 does.
    el = running(elastic("el"), [G[0]], granted_at=10.0)
    assert run(snap(POOL, [el], now=10.0)) == []
    rz = only(run(snap(POOL, [el], now=11.0)), "el")
    assert isinstance(rz, Resize) and rz.gpus == 2


# ---------------------------------------------------------------- 3. growth while jobs are queued


def test_running_job_grows_past_a_queued_gang_that_cannot_use_the_free_gpu() -> None:
    # el holds G0, b holds G1 and G2, G3 is free; g (rigid gang of 2) cannot be placed on one GPU.
    el = running(elastic("el"), [G[0]])
    b = running(job("b", gpus=2, memory=MEM), [G[1], G[2]])
    g = job("g", gpus=2, memory=MEM, order=5)
    ds = run(snap(POOL, [el, b, g], now=100.0), SchedulerConfig(aging_s_per_priority=0.0))  # g preempts nobody
    assert isinstance(only(ds, "g"), Queue)
    rz = only(ds, "el")
    assert isinstance(rz, Resize) and rz.gpus == 2 and "no queued job can use the free GPUs" in rz.reason


def test_no_growth_into_gpus_held_for_a_preemption() -> None:
    # el (priority 5) holds G0, low (priority 0) G1, b (priority 5) G2; G3 is free. h (priority 3,
    # rigid gang of 2) preempts low and holds G1 and G3 for itself: el may not grow into G3.
    el = running(elastic("el", priority=5), [G[0]])
    low = running(job("low", memory=MEM), [G[1]])
    b = running(job("b", memory=MEM, priority=5), [G[2]])
    h = job("h", gpus=2, memory=MEM, priority=3)
    cfg = SchedulerConfig(aging_s_per_priority=0.0)
    ds = run(snap(POOL, [el, low, b, h], now=100.0), cfg)
    assert isinstance(only(ds, "low"), Preempt) and isinstance(only(ds, "h"), Queue)
    assert not [d for d in ds if d.job == "el"]
    # Next cycle, low still checkpointing: h waits for it and the free GPU stays held for h.
    low2 = replace(low, state=JobState.PREEMPTING,
                   directive=Directive(DirectiveKind.PREEMPT, seq=1, deadline=200.0, target={"for_job": "h"}))
    ds = run(snap(POOL, [el, low2, b, h], now=110.0), cfg)
    assert "waiting for 1 release of low" in only(ds, "h").reason
    assert not [d for d in ds if d.job == "el"]


# ---------------------------------------------------------------- 2. a growing resize holds its room


def _resizing(ack: bool, deadline: float = 200.0) -> object:
    view = running(elastic("el", order=1), [G[0]], state=JobState.PREEMPTING)
    return replace(
        view,
        directive=Directive(DirectiveKind.RESIZE, seq=3, deadline=deadline, target={"gpus": 2}),
        ack=Ack(seq=3, step=7) if ack else None,
    )


def test_resize_in_flight_holds_the_gpu_it_grows_into() -> None:
    # 2-GPU pool: el holds G0 and is resizing to 2; n (rigid, 1 GPU) arrives: G1 is held for el.
    pool = dict(list(POOL.items())[:2])
    ds = run(snap(pool, [_resizing(ack=False), job("n", memory=MEM, order=2)], now=150.0))
    q = only(ds, "n")
    # Not "waiting for 1 release of el": a resize frees nothing for others.
    assert isinstance(q, Queue) and "release" not in q.reason


def test_resize_ack_regrants_the_target_before_an_earlier_job() -> None:
    # At the ack, n (FIFO ahead of el: order 0) would otherwise take one of the 2 GPUs first and el
    # would be re-granted 1 slice: the target is held for el.
    pool = dict(list(POOL.items())[:2])
    n = job("n", memory=MEM, order=0)
    ds = run(snap(pool, [_resizing(ack=True), n], now=150.0))
    assert isinstance(only([d for d in ds if isinstance(d, Release)], "el"), Release)
    grant = only([d for d in ds if isinstance(d, Grant)], "el")
    assert len(grant.slices) == 2
    assert isinstance(only(ds, "n"), Queue)


def test_resize_past_its_deadline_holds_nothing() -> None:
    pool = dict(list(POOL.items())[:2])
    ds = run(snap(pool, [_resizing(ack=False, deadline=100.0), job("n", memory=MEM, order=2)], now=150.0))
    assert isinstance(only(ds, "el"), Revoke)
    # The revoked job's GPU and the free one: n takes one (its grant is not elastic).
    assert isinstance(only(ds, "n"), Grant)


def test_apply_then_next_cycle_grows_nothing_more() -> None:
    # After a grown grant is applied, a cycle at a later instant finds nothing left to grow into.
    el = elastic("el", gpus=2, lo=1, hi=4)
    s = apply(snap(POOL, [el]), run(snap(POOL, [el])))
    assert len(s.jobs["el"].allocations) == 4
    assert run(replace(s, now=50.0)) == []


# ---------------------------------------------------------------- 4. who grows first


@pytest.mark.parametrize(
    ("name", "big_priority", "expect"),
    [
        # big (FIFO first) holds 2 GPUs, small holds 1; one GPU is free: it speeds small up by
        # about 1/1, big by about 1/2, so small grows (FIFO order would have grown big).
        ("fewest slices first", 0, {"small": 2}),
        # Priority still comes first: a higher-priority big grows whatever it holds.
        ("priority before slice count", 1, {"big": 3}),
    ],
)
def test_the_job_holding_fewest_slices_grows_first(name: str, big_priority: int, expect: dict[str, int]) -> None:
    big = running(elastic("big", gpus=2, lo=2, hi=4, order=0, priority=big_priority), [G[0], G[1]])
    small = running(elastic("small", gpus=1, lo=1, hi=2, order=1), [G[2]])
    ds = run(snap(POOL, [big, small], now=100.0))
    got = {d.job: d.gpus for d in ds if isinstance(d, Resize)}
    assert got == expect
