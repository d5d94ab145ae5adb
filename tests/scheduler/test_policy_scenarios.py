"""Scenario tests of one or several whole ``schedule()`` cycles over small snapshots."""

from __future__ import annotations

import pytest
from sched_helpers import by_job, gpus, job, only, run, running, snap

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB
from gpupool_sdk.scheduler import Grant, Queue, Reject


def test_grant_single_fractional_job() -> None:
    g = gpus("node-a:2xH100-80GB:nvlink")
    d = only(run(snap(g, [job("a", memory="20GiB")])), "a")
    assert isinstance(d, Grant)
    assert len(d.slices) == 1 and d.slices[0].memory_bytes == 20 * GiB


def test_queue_when_full_and_reject_impossible() -> None:
    g = gpus("node-a:1xH100-80GB:nvlink")
    big = running(job("big", memory="70GiB"), [next(iter(g.values()))])
    ds = run(snap(g, [big, job("b", memory="20GiB"), job("c", memory="200GiB")]))
    assert isinstance(only(ds, "b"), Queue)
    rej = only(ds, "c")
    assert isinstance(rej, Reject) and "largest matching GPU has 80.0GiB" in rej.reason


def test_empty_pool_queues() -> None:
    d = only(run(snap({}, [job("a", memory="1GiB")])), "a")
    assert isinstance(d, Queue) and "no GPUs published" in d.reason


def test_best_fit_prefers_partly_used_gpu() -> None:
    # spread_idle_above=1.0: always pack.
    g = gpus("node-a:2xH100-80GB:nvlink")
    first = list(g.values())[1]
    held = running(job("x", memory="40GiB", compute_share=0.5), [first])
    d = only(run(snap(g, [held, job("a", memory="20GiB", compute_share=0.5)]), SchedulerConfig(spread_idle_above=1.0)), "a")
    assert isinstance(d, Grant) and d.slices[0].gpu_uuid == first.uuid


def test_idle_gpu_first_while_many_are_idle_then_best_fit() -> None:
    # Default spread_idle_above=0.25. 4 GPUs, x holds half of GPU 3: 3 of 4 idle (75 % > 25 %), so the
    # new half-GPU slice goes to an idle GPU (the first idle one in best-fit order), not next to x.
    g = gpus("node-a:4xH100-80GB:nvlink")
    gl = list(g.values())
    x = running(job("x", memory="40GiB", compute_share=0.5), [gl[3]])
    d = only(run(snap(g, [x, job("a", memory="20GiB", compute_share=0.5)])), "a")
    assert isinstance(d, Grant) and d.slices[0].gpu_uuid == gl[0].uuid
    # Three GPUs partly used, one idle: 1 of 4 idle is not above 25 %, so the slice packs next to the
    # fullest job it fits with (x2 holds 60 GiB of 80: least leftover), keeping GPU 0 whole.
    x1 = running(job("x1", memory="40GiB", compute_share=0.5), [gl[1]])
    x2 = running(job("x2", memory="60GiB", compute_share=0.5), [gl[2]])
    d = only(run(snap(g, [x, x1, x2, job("a", memory="20GiB", compute_share=0.5)])), "a")
    assert isinstance(d, Grant) and d.slices[0].gpu_uuid == gl[2].uuid
    # spread_idle_above=0: any idle GPU goes first.
    d = only(run(snap(g, [x, x1, x2, job("a", memory="20GiB", compute_share=0.5)]), SchedulerConfig(spread_idle_above=0.0)), "a")
    assert isinstance(d, Grant) and d.slices[0].gpu_uuid == gl[0].uuid


def test_spread_idle_above_must_be_a_fraction() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="spread_idle_above: must be a fraction in"):
            SchedulerConfig(spread_idle_above=bad)


def test_each_pending_job_gets_one_decision() -> None:
    g = gpus("node-a:4xH100-80GB:nvlink")
    jobs = [job(f"j{i}", memory="30GiB", qos="shared", order=i) for i in range(12)]
    ds = run(snap(g, jobs))
    assert sorted(by_job(ds)) == sorted(j.name for j in jobs)
    assert all(len(v) == 1 for v in by_job(ds).values())
    assert sum(isinstance(d, Grant) for d in ds) == 8


# ---------------------------------------------------------------- multi-cycle scenarios

from dataclasses import replace  # noqa: E402

from sched_helpers import apply, unhealthy  # noqa: E402

from gpupool_sdk.resources import Ack, Directive, DirectiveKind, JobState  # noqa: E402
from gpupool_sdk.scheduler import (  # noqa: E402
    ClusterSnapshot,
    Deflate,
    Preempt,
    Release,
    Resize,
    Scheduler,
    SchedulerConfig,
)


def simulate(
    pool: dict,
    arrivals: dict[float, list],
    run_s: dict[str, float],
    cfg: SchedulerConfig,
    cycles: int,
    step: float = 10.0,
) -> dict[str, float]:
    """A tiny coordinator: jobs arrive, are granted, finish after ``run_s`` of running; a preempted
    job gets a directive (with ``for_job``), acks it one cycle later, and once released goes back
    to the queue keeping its first queue time. Returns each job's first grant time."""
    sched = Scheduler(cfg)
    jobs: dict = {}
    granted_at: dict[str, float] = {}
    ran: dict[str, float] = {}
    order = 0
    for c in range(cycles):
        now = c * step
        for v in arrivals.get(now, []):
            jobs[v.name] = replace(v, queued_at=now, order=order)
            order += 1
        for name, v in list(jobs.items()):
            if v.state is JobState.GRANTED and v.granted_at is not None:
                if ran.get(name, 0.0) + now - v.granted_at >= run_s.get(name, 1e9):
                    del jobs[name]
            elif v.directive is not None and v.ack is None:
                jobs[name] = replace(v, ack=Ack(seq=v.directive.seq, step=1, at=now))
        s = ClusterSnapshot(now=now, gpus=pool, jobs=dict(jobs))
        ds = sched.schedule(s)
        s = apply(s, ds)
        jobs = dict(s.jobs)
        for d in ds:
            if isinstance(d, Grant):
                granted_at.setdefault(d.job, now)
            elif isinstance(d, Preempt):
                directive = Directive(DirectiveKind.PREEMPT, 1, d.deadline, target={"for_job": d.for_job})
                jobs[d.job] = replace(jobs[d.job], state=JobState.PREEMPTING, directive=directive)
            elif isinstance(d, Release):
                v = jobs[d.job]
                ran[d.job] = ran.get(d.job, 0.0) + now - (v.granted_at or now)
                jobs[d.job] = replace(v, state=JobState.PENDING, allocations=(), granted_at=None, directive=None, ack=None)
    return granted_at


def test_anti_starvation_under_stream_of_higher_priority_arrivals() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    arrivals = {0.0: [job("low", memory="70GiB", priority=0)]}
    run_s = {"low": 25.0}
    for k in range(60):
        t = k * 10.0
        arrivals.setdefault(t, []).append(job(f"hi{k}", memory="70GiB", priority=3))
        run_s[f"hi{k}"] = 15.0
    no_aging = SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=0.0, allow_preemption=False)
    assert "low" not in simulate(pool, arrivals, run_s, no_aging, cycles=60)  # starves without aging
    aging = SchedulerConfig(aging_s_per_priority=60.0, allow_preemption=False)
    got = simulate(pool, arrivals, run_s, aging, cycles=60)
    # Bounded: it passes every high job queued more than 3 priority points (180 s) after it.
    assert "low" in got and got["low"] <= 400.0
    only_max_wait = SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=200.0, allow_preemption=False)
    got = simulate(pool, arrivals, run_s, only_max_wait, cycles=60)
    assert "low" in got and got["low"] <= 260.0
    # With preemption on it still runs, and equal-priority jobs do not preempt each other back and forth.
    preempting = SchedulerConfig(aging_s_per_priority=60.0, min_runtime_s=5.0)
    got = simulate(pool, arrivals, run_s, preempting, cycles=60)
    assert "low" in got and got["low"] <= 400.0


def test_aged_job_preempts_a_whole_level_lower_and_is_not_swapped_back() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    cfg = SchedulerConfig(aging_s_per_priority=60.0, min_runtime_s=0.0)
    (gpu,) = pool.values()
    # Running since t=0 without having waited: running priority 0.
    runner = running(job("runner", memory="70GiB", order=0), [gpu], granted_at=0.0)
    young = job("young", memory="70GiB", queued_at=100.0, order=1)
    assert [type(d) for d in run(snap(pool, [runner, young], now=130.0), cfg)] == [Queue]  # half a level: no
    ds = run(snap(pool, [runner, young], now=161.0), cfg)  # waited > 60 s: a whole level above
    assert isinstance(only(ds, "runner"), Preempt)
    # Young runs with the credit it had when granted (61 s = 1.02 levels). The runner comes back
    # with its first queue time (t=0) and the 161 GPU-seconds it ran: time run is no credit, so it
    # has waited 9 s and does not preempt young back.
    young_running = running(young, [gpu], granted_at=161.0)
    runner_back = replace(job("runner", memory="70GiB", order=0), queued_at=0.0, attained_gpu_s=161.0)
    assert [type(d) for d in run(snap(pool, [young_running, runner_back], now=170.0), cfg)] == [Queue]
    assert [type(d) for d in run(snap(pool, [young_running, runner_back], now=200.0), cfg)] == [Queue]
    # Without the attained service the snapshot says it waited 200 s: it would swap right back,
    # which the minimum run time bounds.
    no_history = replace(runner_back, attained_gpu_s=0.0)
    assert isinstance(only(run(snap(pool, [young_running, no_history], now=200.0), cfg), "young"), Preempt)
    guarded = SchedulerConfig(aging_s_per_priority=60.0, min_runtime_s=120.0)
    assert [type(d) for d in run(snap(pool, [young_running, no_history], now=200.0), guarded)] == [Queue]


def test_reservation_stops_small_jobs_leapfrogging_a_large_one() -> None:
    pool = gpus("a:2xH100-80GB:nvlink")
    arrivals: dict[float, list] = {0.0: [job("s-a", memory="70GiB"), job("big", memory="70GiB", gpus=2)]}
    run_s = {"big": 20.0, "s-a": 25.0}
    for k in range(1, 40):
        arrivals.setdefault(k * 10.0, []).append(job(f"s{k}", memory="70GiB"))
        run_s[f"s{k}"] = 25.0
    base = dict(aging_s_per_priority=0.0, max_wait_s=0.0, allow_preemption=False)
    never = simulate(pool, arrivals, run_s, SchedulerConfig(**base, max_reservations=0), cycles=40)
    assert "big" not in never  # smalls keep backfilling whichever GPU frees
    got = simulate(pool, arrivals, run_s, SchedulerConfig(**base, reserve_after_s=30.0), cycles=40)
    assert "big" in got and got["big"] <= 80.0


def test_four_gpu_pack_lands_on_one_island_of_two() -> None:
    pool = gpus("a:8xH100-80GB:nvlink=2x4")
    ds = run(snap(pool, [job("p", gpus=4, memory="70GiB", topology="pack")]))
    g = only(ds, "p")
    assert isinstance(g, Grant)
    assert len({pool[s.gpu_uuid].nvlink_island for s in g.slices}) == 1


def test_spread_and_anti_affinity_on_distinct_nodes() -> None:
    pool = gpus("a:4xH100-80GB:nvlink,b:4xH100-80GB:nvlink,c:4xH100-80GB:nvlink")
    ds = run(snap(pool, [job("sp", gpus=3, memory="10GiB", compute_share=0.2, topology="spread")]))
    assert len({s.node for s in only(ds, "sp").slices}) == 3
    members = [job(f"m{i}", memory="10GiB", compute_share=0.2, anti_affinity="ps", order=i) for i in range(4)]
    ds = run(snap(pool, members))
    granted = [d for d in ds if isinstance(d, Grant)]
    assert len(granted) == 3 and len({d.slices[0].node for d in granted}) == 3
    assert "away from group ps" not in only(ds, "m3").reason or isinstance(only(ds, "m3"), Queue)


def test_gang_all_or_none() -> None:
    pool = gpus("a:4xH100-80GB:nvlink")
    held = running(job("x", qos="exclusive"), [list(pool.values())[0]])
    ds = run(snap(pool, [held, job("gang", gpus=4, memory="10GiB", compute_share=0.5)]))
    d = only(ds, "gang")
    assert isinstance(d, Queue) and "needs 4 x" in d.reason


def test_cordon_and_drain_block_new_grants() -> None:
    pool = gpus("a:2xH100-80GB:nvlink,b:2xH100-80GB:nvlink")
    a0, a1, b0, b1 = pool.values()
    ds = run(snap(pool, [job("j", memory="10GiB")], cordoned=frozenset({a0.uuid, a1.uuid}), draining=frozenset({"b"})))
    assert isinstance(only(ds, "j"), Queue)
    ds = run(snap({**pool, a0.uuid: unhealthy(a0)}, [job("j", memory="10GiB")], draining=frozenset({"b"})))
    assert only(ds, "j").slices[0].gpu_uuid == a1.uuid


def test_exclusive_keeps_others_out() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = pool.values()
    held = running(job("x", qos="exclusive"), [gpu])
    ds = run(snap(pool, [held, job("s", memory="1GiB", qos="shared"), job("g", memory="1GiB", compute_share=0.01)]),
             SchedulerConfig(overcommit_ratio=4.0, allow_preemption=False))
    assert all(isinstance(d, Queue) for d in ds)
    # and an exclusive job never joins a GPU with anything on it
    held = running(job("s", memory="1GiB", qos="shared"), [gpu])
    ds = run(snap(pool, [held, job("x", qos="exclusive")]), SchedulerConfig(allow_preemption=False))
    assert isinstance(only(ds, "x"), Queue)


def test_max_decisions_caps_work() -> None:
    pool = gpus("a:8xH100-80GB:nvlink")
    jobs = [job(f"j{i}", memory="1GiB", compute_share=0.1, order=i) for i in range(20)]
    ds = run(snap(pool, jobs), SchedulerConfig(max_decisions=5))
    assert sum(isinstance(d, Grant) for d in ds) == 5
    assert sum("max_decisions" in getattr(d, "reason", "") for d in ds) == 15


def test_deterministic_for_a_snapshot() -> None:
    pool = gpus("a:8xH100-80GB:nvlink=2x4,b:8xH100-80GB:nvlink=2x4")
    jobs = [job(f"j{i}", gpus=1 + i % 3, memory=f"{10 + 7 * (i % 5)}GiB", compute_share=0.25, order=i % 4,
                priority=i % 2) for i in range(30)]
    s = snap(pool, jobs, now=100.0)
    first = run(s)
    assert run(s) == first
    assert run(snap(pool, list(reversed(jobs)), now=100.0)) == first


def test_elastic_granted_fewer_then_resized_up_when_nothing_pending() -> None:
    pool = gpus("a:4xH100-80GB:nvlink")
    blockers = [running(job(f"b{i}", memory="70GiB"), [list(pool.values())[i]]) for i in range(2)]
    el = job("el", gpus=4, min_gpus=1, max_gpus=4, memory="70GiB")
    ds = run(snap(pool, [*blockers, el]), SchedulerConfig(allow_preemption=False))
    g = only(ds, "el")
    assert isinstance(g, Grant) and len(g.slices) == 2 and "elastic" in g.reason
    s = apply(snap(pool, [*blockers, el]), ds)
    # The blockers finish: nothing pending, so the elastic job is asked to grow.
    s2 = replace(s, jobs={"el": s.jobs["el"]}, now=100.0)
    ds2 = run(s2)
    rz = only(ds2, "el")
    assert isinstance(rz, Resize) and rz.gpus == 4


def test_deflate_when_pressure_is_over() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = pool.values()
    shrunk = running(job("s", memory="40GiB", qos="shared", peak=10 * GiB), [gpu], memory=12 * 2**30)
    ds = run(snap(pool, [shrunk]))
    assert isinstance(only(ds, "s"), Deflate)
    other = running(job("g", memory="50GiB", compute_share=0.5), [gpu])
    assert run(snap(pool, [shrunk, other])) == []


def test_least_attained_service_goes_first_within_a_level() -> None:
    pool = gpus("a:1xH100-80GB:nvlink")
    heavy = replace(job("heavy", memory="70GiB", order=0), attained_gpu_s=50_000.0)
    fresh = replace(job("fresh", memory="70GiB", order=1), attained_gpu_s=10.0)
    fifo = run(snap(pool, [heavy, fresh]), SchedulerConfig(aging_s_per_priority=0.0))
    assert isinstance(only(fifo, "heavy"), Grant)
    las = run(snap(pool, [heavy, fresh]), SchedulerConfig(aging_s_per_priority=0.0, las_threshold_gpu_s=(3600.0,)))
    assert isinstance(only(las, "fresh"), Grant) and isinstance(only(las, "heavy"), Queue)
