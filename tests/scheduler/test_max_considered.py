"""Bounds on a cycle's work (issue 14): ``max_considered`` and ``keep_reservations``.

``SchedulerConfig.max_considered`` bounds the pending jobs a cycle considers in full.

The first ``max_considered`` pending jobs in queue order are considered as without the bound
(placed, or a wait, balloon, shrink, preemption or reservation planned for them); the jobs
behind them are only placed where they fit now (backfill) or queued with one reason, and
nothing grows elastically in that cycle. Checked here: the backfill, that nothing is planned for
a job behind the bound, the validation, and on randomized congested snapshots (those of
``test_cycle_caches``) that the jobs within the bound are decided exactly as without it and a
bound at least as long as the queue changes nothing.

``keep_reservations``: a blocked job keeps last cycle's reserved GPUs while they carry the same
load (no new search); checked: reuse, a new search once a GPU changed, and the same decisions as
new searches when nothing changed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, only, running, snap
from test_cycle_caches import SEEDS, congested

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB
from gpupool_sdk.scheduler import (
    Balloon,
    Grant,
    Preempt,
    Queue,
    Resize,
    Scheduler,
    SchedulerConfig,
)

POOL = gpus("node-a:2xA100-40GB:pcie")
G0, G1 = POOL.values()


def test_a_job_behind_the_bound_still_takes_a_free_gpu() -> None:
    # The head of the queue (a 4-GPU job) can never fit two GPUs right now; the small job behind
    # it is placed on a free GPU although only the first job is considered in full.
    big = job("big", order=0, gpus=2, memory=30 * GiB, qos="guaranteed", priority=5)
    low = running(job("low", order=9, memory=30 * GiB, qos="guaranteed"), [G0])
    small = job("small", order=1, memory=10 * GiB, qos="guaranteed")
    third = job("third", order=2, memory=30 * GiB, qos="guaranteed")
    cfg = SchedulerConfig(max_considered=1, allow_preemption=False)
    out = Scheduler(cfg).schedule(snap(POOL, [big, low, small, third]))
    assert isinstance(only(out, "small"), Grant)
    q = only(out, "third")
    assert isinstance(q, Queue)
    assert "behind the first 1 in order (max_considered)" in q.reason


def test_nothing_is_planned_for_a_job_behind_the_bound() -> None:
    # "urgent" could preempt "low"; without the bound it does, behind it it only queues. "head"
    # (first in order) can neither be placed nor preempt: it must be away from low's group.
    low = running(job("low", order=0, gpus=2, memory=30 * GiB, qos="guaranteed", anti_affinity="g"), [G0, G1])
    head = job("head", order=1, memory=10 * GiB, qos="guaranteed", priority=9, anti_affinity="g")
    urgent = job("urgent", order=2, memory=30 * GiB, qos="guaranteed", priority=5)
    s = snap(POOL, [low, head, urgent], now=10_000.0)
    unbounded = Scheduler(SchedulerConfig()).schedule(s)
    assert any(isinstance(d, Preempt) and d.for_job == "urgent" for d in unbounded)
    bounded = Scheduler(SchedulerConfig(max_considered=1)).schedule(s)
    assert not any(isinstance(d, (Preempt, Balloon, Resize)) for d in bounded), bounded
    assert isinstance(only(bounded, "urgent"), Queue)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_max_considered_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_considered"):
        SchedulerConfig(max_considered=bad)  # type: ignore[arg-type]


def test_within_the_bound_the_same_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mechanism on/off on the congested snapshots: a bound as long as the queue decides exactly
    what no bound decides; a shorter one decides the jobs within it exactly as no bound does (the
    cycle is the same up to the first decision about a job behind it; elastic growth off, which
    the bound holds back), and behind it there are only grants and queue decisions."""
    seen: list[str] = []
    real = Scheduler._consider

    def consider(self: Scheduler, cyc: object, view: object, req: object) -> None:
        seen.append(view.name)  # type: ignore[attr-defined]
        real(self, cyc, view, req)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "_consider", consider)
    cut_somewhere = 0
    for seed in range(SEEDS // 3):
        s, cfg = congested(seed)
        free = Scheduler(cfg).run(s)
        same = Scheduler(replace(cfg, max_considered=len(s.jobs))).run(s)
        assert same.decisions == free.decisions, seed
        assert same.considered == free.considered
        cfg = replace(cfg, resize_up=False)
        free = Scheduler(cfg).run(s)
        seen.clear()
        bounded = Scheduler(replace(cfg, max_considered=3)).run(s)
        head = set(seen)
        assert len(head) == bounded.considered <= 3
        # Every pending job gets one Grant, Queue or Reject (rejects are decided before the order).
        tail = {d.job for d in bounded.decisions if isinstance(d, (Grant, Queue))} - head
        first = next(
            (i for i, d in enumerate(bounded.decisions) if d.job in tail and isinstance(d, (Grant, Queue))),
            len(bounded.decisions),
        )
        assert bounded.decisions[:first] == free.decisions[:first], seed
        for d in bounded.decisions[first:]:
            if d.job in tail:
                assert isinstance(d, (Grant, Queue)), (seed, d)
            assert getattr(d, "for_job", None) not in tail, (seed, d)
        if any(isinstance(d, Queue) and "max_considered" in d.reason for d in bounded.decisions):
            cut_somewhere += 1
    assert cut_somewhere > 10  # the bound did cut on many of the snapshots


# ---------------------------------------------------------------- keep_reservations

FOUR = gpus("node-a:2xA100-40GB:pcie,node-b:2xA100-40GB:pcie")


def _blocked_pool(now: float) -> list:  # type: ignore[type-arg]
    # Four GPUs busy with higher-priority jobs (never preempted by "wide"), "wide" waiting long.
    runners = [
        running(job(f"r{i}", order=i, memory=30 * GiB, qos="guaranteed", priority=5), [g], granted_at=100.0 * i)
        for i, g in enumerate(FOUR.values())
    ]
    wide = job("wide", order=9, gpus=2, memory=30 * GiB, qos="guaranteed", topology="pack", queued_at=0.0)
    return [*runners, wide]


def test_a_kept_reservation_is_reused_while_its_gpus_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = Scheduler._reservation

    def counting(self: Scheduler, *a: object) -> object:
        calls["n"] += 1
        return real(self, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "_reservation", counting)
    sched = Scheduler(SchedulerConfig(keep_reservations=True, aging_s_per_priority=0.0, max_wait_s=0.0))
    jobs = _blocked_pool(0.0)
    first = only(sched.schedule(snap(FOUR, jobs, now=10_000.0)), "wide")
    assert calls["n"] == 1 and "reserved for it" in first.reason
    again = only(sched.schedule(snap(FOUR, jobs, now=10_010.0)), "wide")
    assert calls["n"] == 1  # kept: no new search
    assert again == first
    # A holder of one of its GPUs leaves: that GPU's load changed, so it searches again.
    held = sched._kept_now["wide"][1]
    gone = next(j for j in jobs if j.allocations and FOUR[j.allocations[0].gpu_uuid] is sched._memo.layout.gpus[held[0]])
    rest = [j for j in jobs if j is not gone]
    sched.schedule(snap(FOUR, rest, now=10_020.0))
    assert calls["n"] == 2


def test_kept_reservations_decide_like_new_searches_when_nothing_changed() -> None:
    """Mechanism on/off: the same snapshot scheduled twice gives the same decisions with and
    without ``keep_reservations`` (each kept reservation is the one a new search finds)."""
    kept = 0
    for seed in range(SEEDS // 6):
        s, cfg = congested(seed)
        on, off = Scheduler(replace(cfg, keep_reservations=True)), Scheduler(cfg)
        assert on.run(s).decisions == off.run(s).decisions, seed
        assert on.run(s).decisions == off.run(s).decisions, seed
        kept += len(on._kept_last) > 0
    assert kept > 3  # reservations were made and kept on many snapshots
