"""Balloon floor (issue 18 item 6): a balloon never shrinks a shared job below what it can train in.

On the CPU a shared job reports a memory peak of a few hundred bytes; the balloon target was its
predicted peak (263 B + 10 % = 290 B), so a guaranteed job "made room" by shrinking the shared
one to 290 B per slice, and both ran. Now the target is never below
``max(declared x balloon_floor_fraction, balloon_floor_bytes)``; when the floor does not free
enough, the pending job preempts instead (when its priority lets it), else it waits.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, run, running, snap

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB, MiB
from gpupool_sdk.scheduler import Balloon, Preempt, Queue, SchedulerConfig
from gpupool_sdk.scheduler.config import load_policy_config
from gpupool_sdk.scheduler.preempt import balloon_floor, balloon_targets

NOW = 1000.0
CPU_PEAK = 263  # what a CPU demo job reported; predicted peak 290 B with the default 10 % margin


def shared(peak: int | None, memory: str = "30GiB", priority: int = 0, quota: int | None = None):  # type: ignore[no-untyped-def]
    (gpu,) = gpus("a:1xA100-40GB:nvlink").values()
    view = job("s", memory=memory, qos="shared", priority=priority, peak=peak)
    return replace(running(view, [gpu], memory=quota), granted_at=0.0)


# (case, shared job's reported peak, pending guaranteed job's memory and priority,
#  expected decision for the shared job, expected balloon target per slice, decision for the pending job)
CASES = [
    # The reported defect: the floor (half of 30GiB) frees 25GiB, not the 30GiB needed: preempt.
    ("cpu peak, higher priority: preempted, not ballooned to 290 B", CPU_PEAK, "30GiB", 10, Preempt, None, Queue),
    # Same priority: no preemption allowed, and no balloon below the floor either: the job waits.
    ("cpu peak, same priority: waits, shared job untouched", CPU_PEAK, "30GiB", 0, None, None, Queue),
    # The floor frees enough: balloon to the floor, not to 290 B.
    ("cpu peak, floor frees enough: balloon to the floor", CPU_PEAK, "20GiB", 10, Balloon, 15 * GiB, Queue),
    # A measured peak above the floor is trusted: balloon to the predicted peak.
    ("real peak above the floor: balloon to it", 18 * GiB, "20GiB", 10, Balloon, int(18 * GiB * 1.1), Queue),
    # Unknown peak: predicted at the whole quota, no balloon; preempt.
    ("no peak reported: preempted", None, "20GiB", 10, Preempt, None, Queue),
]


@pytest.mark.parametrize(
    ("peak", "memory", "priority", "shared_decision", "target", "pending_decision"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_guaranteed_job_against_a_shared_job_with_a_tiny_peak(
    peak: int | None, memory: str, priority: int, shared_decision: type | None, target: int | None,
    pending_decision: type,
) -> None:
    s = shared(peak)
    pool = gpus("a:1xA100-40GB:nvlink")
    urgent = job("urgent", memory=memory, qos="guaranteed", priority=priority, queued_at=NOW)  # no aging credit
    ds = run(snap(pool, [s, urgent], now=NOW))
    mine = [d for d in ds if d.job == "s"]
    if shared_decision is None:
        assert mine == [], ds
    else:
        assert [type(d) for d in mine] == [shared_decision], ds
    balloons = [d for d in ds if isinstance(d, Balloon)]
    if target is None:
        assert balloons == [], ds
    else:
        assert [b.target_bytes for b in balloons] == [target]
    assert all(b.target_bytes >= 256 * MiB for b in balloons)  # never "290B per slice"
    (pend,) = [d for d in ds if d.job == "urgent"]
    assert isinstance(pend, pending_decision), ds


def test_balloon_to_the_floor_says_so_and_names_the_reported_peak() -> None:
    ds = run(snap(gpus("a:1xA100-40GB:nvlink"), [shared(CPU_PEAK), job("urgent", memory="20GiB", priority=10)], now=NOW))
    (b,) = [d for d in ds if isinstance(d, Balloon)]
    assert "balloon floor 15.0GiB per slice" in b.reason
    assert "predicted peak 289B" in b.reason or "predicted peak 290B" in b.reason, b.reason
    assert b.reason.endswith("to make room for urgent")


# (case, declared memory, quota held now, reported peak, config, expected target or None = not balloonable)
TARGETS = [
    ("cpu peak: floor is half the declared memory", "30GiB", None, CPU_PEAK, SchedulerConfig(), 15 * GiB),
    ("peak above the floor: predicted peak", "30GiB", None, 20 * GiB, SchedulerConfig(), 22 * GiB),
    ("absolute floor above the fraction", "400MiB", None, CPU_PEAK, SchedulerConfig(), 256 * MiB),
    ("declared below the absolute floor: never ballooned", "200MiB", None, CPU_PEAK, SchedulerConfig(), None),
    ("already at the floor: not ballooned again", "30GiB", 15 * GiB, CPU_PEAK, SchedulerConfig(), None),
    ("fraction 1: never ballooned", "30GiB", None, CPU_PEAK, SchedulerConfig(balloon_floor_fraction=1.0), None),
    ("operator trusts peaks: fraction 0, absolute floor only", "30GiB", None, CPU_PEAK,
     SchedulerConfig(balloon_floor_fraction=0.0), 256 * MiB),
    ("both floors 0: the old behaviour, the predicted peak", "30GiB", None, CPU_PEAK,
     SchedulerConfig(balloon_floor_fraction=0.0, balloon_floor_bytes=0), int(CPU_PEAK * 1.1)),
]


@pytest.mark.parametrize(
    ("memory", "quota", "peak", "config", "expected"), [t[1:] for t in TARGETS], ids=[t[0] for t in TARGETS]
)
def test_balloon_targets_respect_the_floor(
    memory: str, quota: int | None, peak: int, config: SchedulerConfig, expected: int | None
) -> None:
    targets = balloon_targets([shared(peak, memory=memory, quota=quota)], float("inf"), config)
    assert targets.get("s") == expected


def test_floor_is_capped_by_the_declared_memory() -> None:
    assert balloon_floor(30 * GiB, SchedulerConfig()) == 15 * GiB
    assert balloon_floor(100 * MiB, SchedulerConfig()) == 100 * MiB


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"balloon_floor_fraction": 1.5}, "balloon_floor_fraction"),
        ({"balloon_floor_fraction": -0.1}, "balloon_floor_fraction"),
        ({"balloon_floor_fraction": float("nan")}, "balloon_floor_fraction"),
        ({"balloon_floor_bytes": -1}, "balloon_floor_bytes"),
        ({"balloon_floor_bytes": 1.5}, "balloon_floor_bytes"),
    ],
)
def test_bad_floor_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_floor_settings_load_from_the_policy_file_overrides() -> None:
    cfg = load_policy_config(None, {"balloon_floor_fraction": 0.25, "balloon_floor_bytes": 1 << 30}).scheduler
    assert (cfg.balloon_floor_fraction, cfg.balloon_floor_bytes) == (0.25, 1 << 30)


@pytest.mark.parametrize("ratio", [1.0, 1.5, 2.0])
def test_no_deflate_while_the_guaranteed_job_it_made_room_for_holds_the_gpu(ratio: float) -> None:
    """Balloon, grant, then no immediate deflate even with shared overcommit: next to a guaranteed
    reservation shared quotas count in full (with ratio 1.5 the pool used to give the 30 GiB
    back in the cycle after the grant, undoing the balloon)."""
    pool = gpus("a:1xA100-40GB:nvlink")
    (gpu,) = pool.values()
    cfg = SchedulerConfig(overcommit_ratio=ratio)
    ballooned = shared(64 * 1024, quota=15 * GiB)
    urgent = replace(running(job("urgent", memory="20GiB", priority=10), [gpu]), granted_at=NOW)
    assert [d for d in run(snap(pool, [ballooned, urgent], now=NOW), cfg) if d.job == "s"] == []
    # The guaranteed job is gone: the quota comes back.
    (d,) = run(snap(pool, [ballooned], now=NOW), cfg)
    assert d.job == "s" and type(d).__name__ == "Deflate"


def test_the_demo_layout_under_the_deployment_defaults_preempts_instead_of_a_290_byte_balloon() -> None:
    """`gpupool demo`'s pool as reported: two A100-40GB, shared etl-low (prio 0) and tuning (prio 3)
    with 30 GiB each and CPU-sized peaks, then guaranteed urgent (prio 10, 30 GiB), under the
    policy a deployment runs (DEFAULT_SCHEDULER)."""
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER

    pool = gpus("demo-node:2xA100-40GB:nvlink")
    g0, g1 = pool.values()
    etl = replace(running(job("etl-low", memory="30GiB", qos="shared", priority=0, peak=CPU_PEAK), [g0]), granted_at=0.0)
    tuning = replace(running(job("tuning", memory="30GiB", qos="shared", priority=3, peak=CPU_PEAK), [g1]), granted_at=0.0)
    urgent = job("urgent", memory="30GiB", qos="guaranteed", priority=10, queued_at=NOW)
    ds = run(snap(pool, [etl, tuning, urgent], now=NOW), DEFAULT_SCHEDULER)
    assert [(type(d).__name__, d.job) for d in ds] == [("Preempt", "etl-low"), ("Queue", "urgent")], ds
    # The same pool without the floor is the reported defect.
    old = replace(DEFAULT_SCHEDULER, balloon_floor_fraction=0.0, balloon_floor_bytes=0)
    (balloon,) = [d for d in run(snap(pool, [etl, tuning, urgent], now=NOW), old) if isinstance(d, Balloon)]
    assert balloon.target_bytes < 300
