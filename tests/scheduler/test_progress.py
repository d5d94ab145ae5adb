"""Progress-aware scheduling: jobs that publish their remaining time (``JobView.remaining_s``) are
ranked shortest-remaining-first with LAS queues; jobs that publish nothing keep LAS. Also the
horizon (``ScheduleResult.valid_until``) and the telemetry field the coordinator reads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sched_helpers import gpus, job, only, run, running, snap

from gpupool_sdk.coordinator.snapshot import _remaining_from_telemetry
from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import Directive, DirectiveKind
from gpupool_sdk.scheduler import Grant, JobView, Preempt, Queue, Scheduler, SchedulerConfig
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.horizon import running_horizon
from gpupool_sdk.scheduler.ordering import las_queue, order_pending, remaining_gpu_s, service_gpu_s
from gpupool_sdk.telemetry.summary import TelemetrySummary

NOW = 50_000.0
ONE = gpus("a:1xH100-80GB:nvlink")
TWO = gpus("a:2xH100-80GB:nvlink")
CFG = replace(DEFAULT_SCHEDULER, las_threshold_gpu_s=(3600.0, 36000.0))
OFF = replace(CFG, use_remaining=False)


def ran(name: str, attained: float, remaining: float | None, gpu_idx: int = 0, pool: dict[str, Any] = ONE,
        **spec: Any) -> JobView:
    spec.setdefault("memory", "70GiB")
    view = running(job(name, **spec), [list(pool.values())[gpu_idx]], granted_at=NOW - 1000.0)
    return replace(view, attained_gpu_s=attained, remaining_s=remaining)


def waiting(name: str, attained: float = 0.0, remaining: float | None = None, order: int = 9, **spec: Any) -> JobView:
    spec.setdefault("memory", "70GiB")
    return replace(job(name, order=order, queued_at=NOW - 100.0, **spec), attained_gpu_s=attained, remaining_s=remaining)


def test_service_is_remaining_when_known() -> None:
    four = waiting("a", attained=100.0, remaining=1000.0, gpus=4, memory="1GiB")
    assert remaining_gpu_s(four) == 4000.0
    assert service_gpu_s(four, CFG) == 4000.0 and las_queue(four, CFG) == 1
    assert service_gpu_s(four, OFF) == 100.0 and las_queue(four, OFF) == 0  # attained only
    blind = waiting("b", attained=100.0)
    assert service_gpu_s(blind, CFG) == 100.0  # declared nothing: least attained service


def test_order_shortest_remaining_first_then_undeclared_fifo() -> None:
    jobs = [
        waiting("undeclared-early", order=1),
        waiting("long", attained=600.0, remaining=3000.0, order=2),  # 3,000 GPU-s left: queue 0
        waiting("short", attained=600.0, remaining=200.0, order=3),
        waiting("undeclared-late", order=4),
        waiting("huge", attained=600.0, remaining=50_000.0, order=0),  # queue 2, whatever its age
    ]
    got = [v.name for v in order_pending(jobs, NOW, CFG)]
    assert got == ["short", "long", "undeclared-early", "undeclared-late", "huge"]
    # Without progress: LAS on attained service, FIFO inside a queue.
    assert [v.name for v in order_pending(jobs, NOW, OFF)] == [
        "huge", "undeclared-early", "long", "short", "undeclared-late"
    ]


# (case, config, running job, pending job, preempted)
CASES: list[tuple[str, SchedulerConfig, JobView, JobView, bool]] = [
    ("a long remaining run is a victim before it attained 1 h", CFG, ran("long", 2000.0, 40_000.0), waiting("new"), True),
    ("the same without progress: LAS protects it", OFF, ran("long", 2000.0, 40_000.0), waiting("new"), False),
    ("nearly done after 10 h: protected", CFG, ran("done-soon", 40_000.0, 600.0), waiting("new"), False),
    ("the same without progress: a LAS victim", OFF, ran("done-soon", 40_000.0, 600.0), waiting("new"), True),
    ("undeclared: LAS as before", CFG, ran("blind", 40_000.0, None), waiting("new"), True),
    ("a preempted job with 2 h left does not preempt one with 30 min left", CFG, ran("short", 9000.0, 1800.0),
     waiting("back", attained=20_000.0, remaining=7200.0), False),
    ("a short job back in the queue preempts a long one", CFG, ran("long", 1000.0, 50_000.0),
     waiting("back", attained=20_000.0, remaining=1000.0), True),
]


@pytest.mark.parametrize(("case", "config", "holder", "pending", "preempted"), CASES, ids=[c[0] for c in CASES])
def test_victims_by_remaining_service(case: str, config: SchedulerConfig, holder: JobView, pending: JobView,
                                      preempted: bool) -> None:
    ds = run(snap(ONE, [holder, pending], now=NOW), config)
    assert [d.job for d in ds if isinstance(d, Preempt)] == ([holder.name] if preempted else []), case
    assert isinstance(only(ds, pending.name), Queue)


def test_the_job_with_most_remaining_is_the_victim() -> None:
    a = ran("a", 50_000.0, 5_000.0, 0, TWO)  # much service, 5,000 GPU-s left: queue 1
    b = ran("b", 1_000.0, 80_000.0, 1, TWO)  # little service, 80,000 GPU-s left: queue 2
    ds = run(snap(TWO, [a, b, waiting("new")], now=NOW), CFG)
    assert [d.job for d in ds if isinstance(d, Preempt)] == ["b"]
    ds_off = run(snap(TWO, [a, b, waiting("new")], now=NOW), OFF)
    assert [d.job for d in ds_off if isinstance(d, Preempt)] == ["a"]  # attained: a is in queue 2, b in 0


def test_horizon_of_queue_crossings_and_min_runtime() -> None:
    # Attained 600 GPU-s on one GPU: crosses 3,600 in 3,000 s.
    a = ran("a", 600.0, None)
    assert running_horizon(snap(ONE, [a], now=NOW), CFG) == NOW + 3000.0
    # Remaining 4,000 s: drops below 3,600 in 400 s.
    b = ran("b", 600.0, 4000.0)
    assert running_horizon(snap(ONE, [b], now=NOW), CFG) == NOW + 400.0
    # Minimum run time ends first.
    c = replace(ran("c", 600.0, None), granted_at=NOW - 100.0)
    assert running_horizon(snap(ONE, [c], now=NOW), replace(CFG, min_runtime_s=300.0)) == NOW + 200.0
    # A directive deadline.
    d = replace(ran("d", 0.0, None), directive=Directive(DirectiveKind.PREEMPT, 1, NOW + 30.0, {}))
    assert running_horizon(snap(ONE, [d], now=NOW), CFG) == NOW + 30.0
    # The order moves with time: no horizon.
    assert running_horizon(snap(ONE, [a], now=NOW), replace(CFG, aging_s_per_priority=60.0)) == NOW


def test_valid_until_means_the_same_decisions() -> None:
    # A pending job that waited 100 s on a full GPU, a running job crossing queue 1 at NOW + 3,000:
    # every cycle before valid_until decides the same; at it, the decision changes (a preemption).
    holder = ran("holder", 600.0, None)
    new = waiting("new")
    sched = Scheduler(CFG)
    first = sched.run(snap(ONE, [holder, new], now=NOW))
    assert not any(isinstance(d, Preempt) for d in first.decisions)
    assert first.valid_until == min(NOW + 3000.0, NOW - 100.0 + CFG.reserve_after_s)
    for t in (NOW + 10.0, first.valid_until - 1.0):
        grown = replace(holder, attained_gpu_s=600.0 + (t - NOW))
        again = Scheduler(CFG).run(snap(ONE, [grown, new], now=t))
        assert [type(d) for d in again.decisions] == [type(d) for d in first.decisions]
    later = NOW + 3000.0 + 1.0
    crossed = Scheduler(CFG).run(snap(ONE, [replace(holder, attained_gpu_s=3601.0), new], now=later))
    assert any(isinstance(d, Preempt) for d in crossed.decisions)


def test_progress_fields_of_the_telemetry_summary() -> None:
    s = TelemetrySummary.from_dict({"job": "a", "remaining_s": 5400, "progress": 0.25})
    assert (s.remaining_s, s.progress) == (5400.0, 0.25)
    assert TelemetrySummary.from_dict(s.to_dict()) == s
    assert TelemetrySummary.from_dict({"job": "a"}).remaining_s is None  # optional
    for bad, field in (({"remaining_s": -1}, "remaining_s"), ({"progress": 1.5}, "progress"),
                       ({"remaining_s": float("nan")}, "remaining_s"), ({"remaining_s": "1h"}, "remaining_s")):
        with pytest.raises(SpecError) as err:
            TelemetrySummary.from_dict({"job": "a", **bad})
        assert field in err.value.field
    # The coordinator reads it leniently (a malformed value: unknown, LAS ranks the job).
    assert _remaining_from_telemetry({"job": "a", "remaining_s": 120.0}) == 120.0
    assert _remaining_from_telemetry({"job": "a", "summary": {"remaining_s": 60}}) == 60.0
    assert _remaining_from_telemetry({"job": "a", "remaining_s": -5}) is None
    assert _remaining_from_telemetry({"job": "a", "remaining_s": True}) is None
    assert _remaining_from_telemetry(None) is None


def test_grant_goes_to_the_shortest_declared_job() -> None:
    ds = run(snap(ONE, [waiting("long", 600.0, 3000.0, order=1), waiting("short", 600.0, 100.0, order=2)], now=NOW), CFG)
    assert isinstance(only(ds, "short"), Grant) and isinstance(only(ds, "long"), Queue)
