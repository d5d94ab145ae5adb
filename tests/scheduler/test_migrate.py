"""Migration for fragmentation (``SchedulerConfig.migrate_for_fragmentation``): a pending job that
fits on no GPU, when moving a few running shared jobs off one GPU (each fits right now on another)
would open enough room there, gets that room: the movers are preempted with a ``migrate:`` reason
naming it, and the room is held for it as for a preemption."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import gpus, job, only, run, running, snap, unhealthy
from test_capacity_property import step

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Ack, Directive, DirectiveKind, GiB, JobSpec, JobState
from gpupool_sdk.scheduler import ClusterSnapshot, Grant, Preempt, Queue, Release, Scheduler, SchedulerConfig
from gpupool_sdk.scheduler.types import JobView

NOW = 100_000.0
POOL = "a:4xT4:pcie"
ON = SchedulerConfig(migrate_for_fragmentation=True)


def _fragmented(qos: str = "shared", granted_at: float = 0.0, **spec: object) -> list[JobView]:
    """Four 16 GiB GPUs, each holding two 4 GiB jobs: 8 GiB free on every GPU, 32 GiB in all."""
    out = []
    for i, g in enumerate(gpus(POOL).values()):
        for k in range(2):
            name = f"s{i}{k}"
            view = job(name, memory="4GiB", qos=qos, compute_share=0.25, order=10 * i + k, **spec)  # type: ignore[arg-type]
            out.append(running(view, [g], granted_at=granted_at))
    return out


def _big(name: str = "big", memory: str = "12GiB", order: int = 100) -> JobView:
    return job(name, memory=memory, qos="shared", order=order, queued_at=NOW)  # no aging credit: it may preempt nobody


def _preempts(ds: list) -> list[Preempt]:  # type: ignore[type-arg]
    return [d for d in ds if isinstance(d, Preempt)]


def test_a_mover_is_preempted_with_the_migrate_reason_and_the_room_is_held() -> None:
    ds = run(snap(gpus(POOL), [*_fragmented(), _big()], now=NOW), ON)
    (p,) = _preempts(ds)
    assert p.for_job == "big"
    assert p.reason.startswith("migrate: defragmenting GPU-sim-a-")
    assert "for big" in p.reason
    (q,) = [d for d in ds if d.job == "big"]
    assert isinstance(q, Queue) and "migration" in q.reason and p.job in q.reason
    assert not [d for d in ds if isinstance(d, Grant)]


def test_off_no_migration() -> None:
    ds = run(snap(gpus(POOL), [*_fragmented(), _big()], now=NOW), SchedulerConfig())
    assert _preempts(ds) == []
    assert isinstance([d for d in ds if d.job == "big"][0], Queue)


def test_not_when_the_job_fits_without_it() -> None:
    jobs = [*_fragmented(), _big(memory="8GiB")]
    ds = run(snap(gpus(POOL), jobs, now=NOW), ON)
    assert _preempts(ds) == []
    assert isinstance([d for d in ds if d.job == "big"][0], Grant)


def test_not_when_no_mover_fits_elsewhere() -> None:
    # Each GPU: a 7 GiB and a 4 GiB job (5 GiB free). 12 GiB needs 7 GiB more on one GPU: the 7 GiB
    # job fits on no other GPU, and the 4 GiB job alone frees too little.
    out = []
    for i, g in enumerate(gpus(POOL).values()):
        out.append(running(job(f"l{i}", memory="7GiB", qos="shared", order=i), [g]))
        out.append(running(job(f"m{i}", memory="4GiB", qos="shared", order=10 + i), [g]))
    ds = run(snap(gpus(POOL), [*out, _big()], now=NOW), ON)
    assert _preempts(ds) == []


@pytest.mark.parametrize("qos", ["guaranteed"])
def test_guaranteed_jobs_are_never_movers(qos: str) -> None:
    ds = run(snap(gpus(POOL), [*_fragmented(qos), _big()], now=NOW), ON)
    assert _preempts(ds) == []


def test_exclusive_jobs_are_never_movers() -> None:
    # One GPU held exclusively, the others full of 4 GiB shared jobs but for 8 GiB each: the
    # exclusive job is the only one whose move would open 16 GiB; it is not moved.
    pool = gpus("a:2xT4:pcie")
    g0, g1 = pool.values()
    ex = running(job("ex", qos="exclusive", memory="8GiB"), [g0])
    s = running(job("s", memory="8GiB", qos="shared"), [g1])
    ds = run(snap(pool, [ex, s, _big(memory="12GiB")], now=NOW), ON)
    assert _preempts(ds) == []


def test_protected_jobs_are_never_movers() -> None:
    ds = run(snap(gpus(POOL), [*_fragmented(min_runtime_s=10 * NOW), _big()], now=NOW), ON)
    assert _preempts(ds) == []


def test_jobs_under_a_directive_are_never_movers() -> None:
    views = _fragmented()
    d = Directive(seq=1, kind=DirectiveKind.BALLOON, reason="x", deadline=NOW + 30, target={"memory_bytes": 4 * GiB})
    views = [replace(v, directive=d) for v in views]
    ds = run(snap(gpus(POOL), [*views, _big()], now=NOW), ON)
    assert _preempts(ds) == []


def test_a_job_is_moved_at_most_once_per_migrate_min_run_s() -> None:
    # Granted (or re-granted after a move) less than migrate_min_run_s ago: not moved again.
    recent = _fragmented(granted_at=NOW - ON.migrate_min_run_s + 1)
    assert _preempts(run(snap(gpus(POOL), [*recent, _big()], now=NOW), ON)) == []
    old = _fragmented(granted_at=NOW - ON.migrate_min_run_s)
    assert len(_preempts(run(snap(gpus(POOL), [*old, _big()], now=NOW), ON))) == 1


def test_moves_per_cycle_are_bounded() -> None:
    jobs = [*_fragmented(), _big("b1", order=100), _big("b2", order=101)]
    many = run(snap(gpus(POOL), jobs, now=NOW), ON)
    assert sorted({p.for_job for p in _preempts(many)}) == ["b1", "b2"]
    one = run(snap(gpus(POOL), jobs, now=NOW), replace(ON, migrate_max_per_cycle=1))
    assert [p.for_job for p in _preempts(one)] == ["b1"]


def test_each_mover_lands_on_another_gpu_and_movers_share_no_destination_room() -> None:
    # Two GPUs with 8 GiB free each, one with 4 GiB free: b1 moves a 4 GiB job from GPU 0 to GPU 1;
    # b2 would need the same destination room, which is taken: only one migration.
    pool = gpus("a:3xT4:pcie")
    g0, g1, g2 = pool.values()
    views = [
        running(job("x0", memory="4GiB", qos="shared", order=1), [g0]),
        running(job("y0", memory="4GiB", qos="shared", order=2), [g0]),
        running(job("x1", memory="8GiB", qos="shared", order=3), [g1]),
        running(job("x2", memory="12GiB", qos="shared", order=4), [g2]),
    ]
    ds = run(snap(pool, [*views, _big("b1", order=100), _big("b2", order=101)], now=NOW), ON)
    ps = _preempts(ds)
    assert [p.for_job for p in ps] == ["b1"]
    assert ps[0].job in ("x0", "y0") and "GPU-sim-a-0" in ps[0].reason


def test_decisions_are_deterministic() -> None:
    jobs = [*_fragmented(), _big("b1", order=100), _big("b2", order=101)]
    first = run(snap(gpus(POOL), jobs, now=NOW), ON)
    for seed in range(5):
        shuffled = list(jobs)
        random.Random(seed).shuffle(shuffled)
        assert run(snap(gpus(POOL), shuffled, now=NOW), ON) == first


def test_at_the_ack_the_room_goes_to_the_pending_job() -> None:
    views = _fragmented()
    ds = run(snap(gpus(POOL), [*views, _big()], now=NOW), ON)
    (p,) = _preempts(ds)
    d = Directive(seq=1, kind=DirectiveKind.PREEMPT, reason=p.reason, deadline=p.deadline, target={"for_job": "big"})
    later = NOW + 10
    acked = [
        replace(v, state=JobState.PREEMPTING, directive=d, ack=Ack(seq=1, step=5, checkpoint="c", at=later))
        if v.name == p.job else v
        for v in views
    ]
    ds2 = run(snap(gpus(POOL), [*acked, _big()], now=later), ON)
    assert any(isinstance(x, Release) and x.job == p.job for x in ds2)
    (g,) = [x for x in ds2 if isinstance(x, Grant) and x.job == "big"]
    assert g.slices[0].gpu_uuid in p.reason


@pytest.mark.parametrize(
    ("field", "value"),
    [("migrate_min_run_s", -1.0), ("migrate_min_run_s", float("nan")), ("migrate_max_per_cycle", -1),
     ("migrate_max_per_cycle", 1.5), ("migrate_max_per_cycle", True), ("migrate_hold_s", -1.0),
     ("migrate_hold_s", float("inf"))],
)
def test_settings_are_validated(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]


def test_valid_until_ends_when_a_job_becomes_movable() -> None:
    # A cycle skipped until valid_until must not skip the instant a mover becomes movable.
    granted = NOW - ON.migrate_min_run_s + 100
    snapshot = snap(gpus(POOL), [*_fragmented(granted_at=granted), _big()], now=NOW)
    cfg = replace(ON, aging_s_per_priority=0.0, max_wait_s=0.0)
    assert Scheduler(cfg).run(snapshot).valid_until == granted + ON.migrate_min_run_s
    off = replace(cfg, migrate_for_fragmentation=False)
    assert Scheduler(off).run(snapshot).valid_until > granted + ON.migrate_min_run_s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=st.lists(st.lists(st.sampled_from([2, 3, 4, 6, 8, 10, 12]), min_size=0, max_size=8), min_size=1, max_size=6),
    peaks=st.booleans(),
    ratio=st.sampled_from([1.0, 1.5]),
    hold=st.sampled_from([0.0, 600.0]),
)
def test_moves_keep_the_capacity_invariant_and_land_elsewhere(
    waves: list[list[int]], peaks: bool, ratio: float, hold: float
) -> None:
    """Waves of one-slice shared jobs of one priority on four 16 GiB GPUs, cycles with acks (a
    released job queues again): the capacity invariant holds after every cycle, every move's
    reason names another GPU than the one it empties, and the same cycle twice decides the same
    (a fresh scheduler too when no landing room is held from cycle to cycle)."""
    cfg = SchedulerConfig(overcommit_ratio=ratio, migrate_for_fragmentation=True, migrate_min_run_s=0.0,
                          aging_s_per_priority=0.0, max_wait_s=0.0, migrate_hold_s=hold)
    sched = Scheduler(cfg)
    snapshot = ClusterSnapshot(now=0.0, gpus=gpus(POOL), jobs={})
    n = 0
    for k, wave in enumerate([*waves, [], [], []]):
        jobs = dict(snapshot.jobs)
        for gib in wave:
            spec = JobSpec(name=f"j{n}", memory=gib * GiB, qos="shared", compute_share=0.25)
            jobs[spec.name] = JobView(spec=spec, queued_at=snapshot.now, order=n,
                                      memory_peak_bytes=gib * GiB // 2 if peaks else None)
            n += 1
        snapshot = replace(snapshot, jobs=jobs, now=k * 30.0)
        twin = copy.deepcopy(sched)
        decisions = sched.schedule(snapshot)
        assert decisions == twin.schedule(snapshot)
        if not hold:
            assert decisions == Scheduler(cfg).schedule(snapshot)
        for p in _preempts(decisions):
            if p.reason.startswith("migrate:"):
                emptied = p.reason.split()[2]
                landing = p.reason.split(" fits now on ")[1].split()[0]
                assert emptied != landing
        snapshot = step(snapshot, decisions, cfg)  # checks the invariant


# ------------------------------------------------------------------ the landing room held until the mover runs

HELD = replace(ON, aging_s_per_priority=0.0, max_wait_s=0.0)


class _Moved:
    """Three 16 GiB GPUs: GPU 0 holds two 4 GiB jobs (8 GiB free), GPU 1 a 13 GiB job (3 GiB free),
    GPU 2 a 12 GiB job (4 GiB free). ``big`` (12 GiB) fits nowhere: one 4 GiB job moves from
    GPU 0 to GPU 2, the only room for it. Cycle 1 moves it, cycle 2 acks it (its slice goes to
    ``big``); then it is pending again at its old place in line."""

    def __init__(self, config: SchedulerConfig = HELD) -> None:
        self.pool = gpus("a:3xT4:pcie")
        g0, g1, g2 = self.pool.values()
        self.views = [
            running(job("x0", memory="4GiB", qos="shared", order=1), [g0]),
            running(job("y0", memory="4GiB", qos="shared", order=2), [g0]),
            running(job("x1", memory="13GiB", qos="shared", order=3), [g1]),
            running(job("x2", memory="12GiB", qos="shared", order=4), [g2]),
        ]
        self.sched = Scheduler(config)
        ds = self.sched.schedule(snap(self.pool, [*self.views, _big()], now=NOW))
        (p,) = _preempts(ds)
        self.mover, self.dest = p.job, p.reason.split(" fits now on ")[1].split()[0]
        assert self.dest == g2.uuid
        d = Directive(seq=1, kind=DirectiveKind.PREEMPT, reason=p.reason, deadline=p.deadline, target={"for_job": "big"})
        acked = [
            replace(v, state=JobState.PREEMPTING, directive=d, ack=Ack(seq=1, step=5, checkpoint="c", at=NOW + 10))
            if v.name == self.mover else v
            for v in self.views
        ]
        self.ack = self.sched.run(snap(self.pool, [*acked, _big()], now=NOW + 10))
        (g,) = [x for x in self.ack.decisions if isinstance(x, Grant) and x.job == "big"]
        self.big = running(_big(), [self.pool[g.slices[0].gpu_uuid]], granted_at=NOW + 10)
        old = next(v for v in self.views if v.name == self.mover)
        self.pending = job(self.mover, memory="4GiB", qos="shared", order=old.order, queued_at=NOW + 20)

    def after(self, now: float, extra: list[JobView], pool: dict | None = None) -> list:  # type: ignore[type-arg]
        """A cycle at ``now`` with the mover pending again, ``big`` running and ``extra`` jobs."""
        rest = [v for v in self.views if v.name != self.mover]
        return self.sched.schedule(snap(pool or self.pool, [*rest, self.big, self.pending, *extra], now=now))


def _ahead() -> JobView:
    """A 4 GiB job ahead of every mover in line (order 0), arriving after the move."""
    return job("ahead", memory="4GiB", qos="shared", order=0, queued_at=NOW + 20)


def test_a_movers_landing_room_is_not_taken_by_a_job_ahead_of_it_while_it_requeues() -> None:
    moved = _Moved()
    ds = moved.after(NOW + 30, [_ahead()])
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == moved.mover and g.slices[0].gpu_uuid == moved.dest
    assert isinstance(only(ds, "ahead"), Queue)


def test_without_a_hold_the_job_ahead_takes_the_room() -> None:
    moved = _Moved(replace(HELD, migrate_hold_s=0.0))
    ds = moved.after(NOW + 30, [_ahead()])
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == "ahead" and g.slices[0].gpu_uuid == moved.dest
    assert isinstance(only(ds, moved.mover), Queue)


def test_a_hold_lapses_after_migrate_hold_s_and_valid_until_says_when() -> None:
    moved = _Moved()
    assert moved.ack.valid_until <= NOW + HELD.migrate_hold_s
    ds = moved.after(NOW + HELD.migrate_hold_s, [_ahead()])
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == "ahead" and g.slices[0].gpu_uuid == moved.dest


@pytest.mark.parametrize("gone", ["vanished", "unhealthy"])
def test_a_hold_on_a_gpu_gone_or_unhealthy_is_dropped(gone: str) -> None:
    moved = _Moved()
    pool = dict(moved.pool)
    if gone == "vanished":
        del pool[moved.dest]
    else:
        pool[moved.dest] = unhealthy(pool[moved.dest])
    moved.after(NOW + 30, [_ahead()], pool)
    # The GPU is back: the hold is gone, the job ahead takes the room first.
    ds = moved.after(NOW + 40, [_ahead()])
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == "ahead" and g.slices[0].gpu_uuid == moved.dest


def test_a_hold_is_dropped_when_the_room_no_longer_fits() -> None:
    # A job granted on the destination meanwhile (the room is taken legitimately): the hold does
    # not count it twice, and the mover is placed like any job.
    moved = _Moved()
    g2 = moved.pool[moved.dest]
    other = running(job("other", memory="4GiB", qos="shared", order=0), [g2], granted_at=NOW + 25)
    ds = moved.after(NOW + 30, [other])
    assert isinstance(only(ds, moved.mover), Queue)
    assert moved.sched._holds == {}


def test_a_hold_ends_when_the_mover_runs_again() -> None:
    moved = _Moved()
    ds = moved.after(NOW + 30, [])
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == moved.mover and g.slices[0].gpu_uuid == moved.dest
    assert moved.sched._holds == {}



def test_a_hold_is_dropped_when_its_job_is_gone() -> None:
    # Its spec gone while it was not released (cancelled, or its client gave up): the room is free again.
    moved = _Moved()
    rest = [v for v in moved.views if v.name != moved.mover]
    moved.sched.schedule(snap(moved.pool, [*rest, moved.big], now=NOW + 20))
    ds = moved.sched.schedule(snap(moved.pool, [*rest, moved.big, _ahead()], now=NOW + 30))
    (g,) = [d for d in ds if isinstance(d, Grant)]
    assert g.job == "ahead" and g.slices[0].gpu_uuid == moved.dest
