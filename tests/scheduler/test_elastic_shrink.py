"""Elastic victims are shrunk toward ``min_gpus`` for a pending job instead of preempted whole.

Every pool here is whole H100-80GB GPUs and every job asks 70 GiB per slice, so a GPU takes one
slice at most and each expectation is a count of GPUs. Aging is off unless a case says otherwise
(a case's priorities are then what decides who may be a victim).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, only, run, running, snap

from gpupool_sdk.resources import Ack, Directive, DirectiveKind, JobState
from gpupool_sdk.scheduler import Grant, JobView, Preempt, Queue, Release, Resize, Revoke, SchedulerConfig

POOL = gpus("a:4xH100-80GB:nvlink")
G = list(POOL.values())
MEM = "70GiB"
NO_AGING = SchedulerConfig(aging_s_per_priority=0.0)


def elastic(name: str, gpus: int = 4, lo: int = 2, hi: int = 4, **kw: object) -> JobView:
    return job(name, gpus=gpus, min_gpus=lo, max_gpus=hi, memory=MEM, **kw)


def rigid(name: str, gpus: int = 2, **kw: object) -> JobView:
    return job(name, gpus=gpus, memory=MEM, **kw)


def uuids(*idx: int) -> tuple[str, ...]:
    return tuple(G[i].uuid for i in idx)


# ---------------------------------------------------------------- the shrink decision


def test_elastic_victim_is_shrunk_to_its_minimum_not_preempted() -> None:
    # el (4 GPUs, min 2) holds the whole pool; p (rigid, 2 GPUs, priority 5) arrives. Shrinking el
    # by 2 frees exactly what p needs: el gives up G0 and G1 (the first GPUs of its walk that p's
    # placement uses) and keeps G2 and G3.
    el = running(elastic("el"), G)
    p = rigid("p", priority=5, order=1)
    ds = run(snap(POOL, [el, p], now=100.0), NO_AGING)
    rz = only(ds, "el")
    assert isinstance(rz, Resize)
    assert (rz.gpus, rz.for_job, rz.keep) == (2, "p", uuids(2, 3))
    assert rz.deadline == 160.0  # the preempt grace: a shrink costs a checkpoint like a preemption
    assert only(ds, "p") == Queue("p", "queued: waiting for 1 shrink of el")
    assert not [d for d in ds if isinstance(d, Preempt)]


def test_shrink_elastic_off_preempts_whole() -> None:
    el = running(elastic("el"), G)
    ds = run(snap(POOL, [el, rigid("p", priority=5, order=1)], now=100.0), replace(NO_AGING, shrink_elastic=False))
    assert isinstance(only(ds, "el"), Preempt)


def test_same_priority_with_aging_shrinks_too() -> None:
    # Aging 60 s per point: p waited 120 s (effective 2), el was granted at once (running priority
    # 0): el is a victim one whole level lower and is shrunk.
    el = running(elastic("el"), G)
    p = rigid("p", order=1)
    ds = run(snap(POOL, [el, p], now=120.0), SchedulerConfig(aging_s_per_priority=60.0))
    rz = only(ds, "el")
    assert isinstance(rz, Resize) and (rz.gpus, rz.for_job, rz.keep) == (2, "p", uuids(2, 3))


def test_shrinks_to_its_minimum_at_once() -> None:
    # p asks 1 GPU: el (4, min 2) gives up G0 (where p is placed) and goes to its minimum at once:
    # it keeps the lowest-index GPUs of the others, G1 and G2, and gives up G3 too (freeing one GPU
    # per arrival would restart it at every arrival).
    el = running(elastic("el"), G)
    ds = run(snap(POOL, [el, rigid("p", gpus=1, priority=5)], now=100.0), NO_AGING)
    rz = only(ds, "el")
    assert isinstance(rz, Resize) and (rz.gpus, rz.keep) == (2, uuids(1, 2))


def test_the_kept_gpus_stay_on_the_node_where_it_holds_most() -> None:
    # r (priority 9) holds a0 and a1; el (4 GPUs, min 2) holds a2, a3, b0 and b1 (a2 first). p
    # (1 GPU) is placed on a2 (first in el's walk); of a3, b0 and b1 el keeps the two on node b,
    # where it holds more, and gives up a3 as well.
    pool = gpus("a:4xH100-80GB:nvlink,b:2xH100-80GB:nvlink")
    g = list(pool.values())
    r = running(rigid("r", priority=9), g[:2])
    el = running(elastic("el"), g[2:])
    ds = run(snap(pool, [r, el, rigid("p", gpus=1, priority=5)], now=100.0), NO_AGING)
    rz = only(ds, "el")
    assert isinstance(rz, Resize) and (rz.gpus, rz.keep) == (2, (g[4].uuid, g[5].uuid))


def test_a_shrink_too_small_preempts_whole() -> None:
    # p asks 3 GPUs; el may give up only 2 (min 2): no mixed plans, el is preempted whole.
    el = running(elastic("el"), G)
    ds = run(snap(POOL, [el, rigid("p", gpus=3, priority=5)], now=100.0), NO_AGING)
    assert isinstance(only(ds, "el"), Preempt)


@pytest.mark.parametrize(
    ("r_priority", "expect"),
    [
        # r (rigid, priority 0) sorts before el (priority 1) in victim order: it is preempted whole
        # rather than a more protected job shrunk.
        (0, {"r": Preempt}),
        # Same priority: shrinking el is preferred (el keeps running after its checkpoint).
        (1, {"el": Resize}),
    ],
)
def test_victim_order_before_the_cheaper_shrink(r_priority: int, expect: dict[str, type]) -> None:
    pool = gpus("a:4xH100-80GB:nvlink,b:2xH100-80GB:nvlink")
    g = list(pool.values())
    el = running(elastic("el", priority=1), g[:4])
    r = running(rigid("r", priority=r_priority), g[4:])
    ds = run(snap(pool, [el, r, rigid("p", priority=5, order=2)], now=100.0), NO_AGING)
    got = {d.job: type(d) for d in ds if d.job in ("el", "r")}
    assert got == expect


def test_protected_elastic_job_is_not_shrunk() -> None:
    # Inside its minimum run time el is no victim at all: p queues.
    el = running(elastic("el"), G, granted_at=50.0)
    ds = run(snap(POOL, [el, rigid("p", priority=5)], now=100.0), replace(NO_AGING, min_runtime_s=300.0))
    assert [type(d) for d in ds] == [Queue]


def test_las_shrinks_a_same_level_job_in_a_higher_queue() -> None:
    # LAS (threshold 1,000 GPU-s): el has 4,000 GPU-s (queue 1), p none (queue 0), same priority.
    cfg = replace(NO_AGING, las_threshold_gpu_s=(1000.0,))
    el = running(elastic("el"), G, attained_gpu_s=4000.0)
    ds = run(snap(POOL, [el, rigid("p", order=1)], now=100.0), cfg)
    rz = only(ds, "el")
    assert isinstance(rz, Resize) and (rz.gpus, rz.for_job) == (2, "p")


# ---------------------------------------------------------------- while it checkpoints, and at its ack


def _shrinking(ack: bool, deadline: float = 160.0) -> JobView:
    view = running(elastic("el"), G, state=JobState.PREEMPTING)
    target = {"gpus": 2, "for_job": "p", "keep": list(uuids(2, 3))}
    return replace(
        view,
        directive=Directive(DirectiveKind.RESIZE, seq=4, deadline=deadline, target=target),
        ack=Ack(seq=4, step=9) if ack else None,
    )


def test_while_it_checkpoints_the_pending_job_waits_for_it() -> None:
    # Next cycle, no ack yet: p waits for the shrink (nobody else is preempted for the same room),
    # and q (rigid, 1 GPU, same priority as p, later) may not take the GPUs being freed for p.
    ds = run(snap(POOL, [_shrinking(ack=False), rigid("p", priority=5), rigid("q", gpus=1, priority=5, order=1)],
                  now=110.0), NO_AGING)
    assert only(ds, "p") == Queue("p", "queued: waiting for 1 release of el")
    assert isinstance(only(ds, "q"), Queue)
    assert not [d for d in ds if d.job == "el"]


def test_at_the_ack_the_freed_gpus_go_to_the_pending_job_and_the_kept_ones_back() -> None:
    # el acks: Release to PENDING; p gets the freed G0 and G1, el is re-granted exactly G2 and G3.
    # n (rigid, 1 GPU, order -1: ahead of both in FIFO order) finds no GPU: all four are held.
    n = rigid("n", gpus=1, order=-1)
    ds = run(snap(POOL, [_shrinking(ack=True), rigid("p", priority=5), n], now=110.0), NO_AGING)
    assert isinstance(ds[0], Release) and ds[0].job == "el" and ds[0].state is JobState.PENDING
    grants = {d.job: tuple(s.gpu_uuid for s in d.slices) for d in ds if isinstance(d, Grant)}
    assert grants == {"p": uuids(0, 1), "el": uuids(2, 3)}
    assert isinstance(only(ds, "n"), Queue)


def test_at_the_ack_the_kept_gpus_win_over_a_better_fit_elsewhere() -> None:
    # Node "0" (sorted first) has two idle GPUs. el (placed first: same priority as p, lower name)
    # would be placed there by best fit; it is re-granted the GPUs it kept on node a instead (its
    # workers restart where they were), and p takes node 0. Growth off: el stays at its target.
    pool = gpus("0:2xH100-80GB:nvlink,a:4xH100-80GB:nvlink")
    cfg = replace(NO_AGING, resize_up=False)
    ds = run(snap(pool, [_shrinking(ack=True), rigid("p", order=1)], now=110.0), cfg)
    grants = {d.job: tuple(s.gpu_uuid for s in d.slices) for d in ds if isinstance(d, Grant)}
    assert grants == {"el": uuids(2, 3), "p": ("GPU-sim-0-0", "GPU-sim-0-1")}


def test_past_its_deadline_the_shrink_is_revoked_and_the_room_goes_to_the_pending_job() -> None:
    ds = run(snap(POOL, [_shrinking(ack=False, deadline=100.0), rigid("p", priority=5)], now=110.0), NO_AGING)
    assert isinstance(only(ds, "el"), Revoke)
    assert isinstance(only(ds, "p"), Grant)
