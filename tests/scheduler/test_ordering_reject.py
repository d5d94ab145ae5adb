"""Ordering / anti-starvation and the reject stage (table-driven)."""

from __future__ import annotations

import pytest
from sched_helpers import gpus, job

from gpupool_sdk.resources import GiB
from gpupool_sdk.scheduler import SchedulerConfig, request_for
from gpupool_sdk.scheduler.ordering import effective_priority, is_starved, las_queue, order_pending
from gpupool_sdk.scheduler.reject import reject_reason, summarize

CFG = SchedulerConfig(aging_s_per_priority=60.0, max_wait_s=3600.0)


@pytest.mark.parametrize(
    ("priority", "queued_at", "now", "aging", "expected"),
    [(0, 0.0, 0.0, 60.0, 0.0), (0, 0.0, 120.0, 60.0, 2.0), (5, 100.0, 130.0, 60.0, 5.5), (3, 0.0, 1e6, 0.0, 3.0),
     (0, 50.0, 0.0, 60.0, 0.0)],
)
def test_effective_priority(priority: int, queued_at: float, now: float, aging: float, expected: float) -> None:
    view = job("a", memory="1GiB", priority=priority, queued_at=queued_at)
    assert effective_priority(view, now, SchedulerConfig(aging_s_per_priority=aging)) == pytest.approx(expected)


def test_waited_excludes_time_run() -> None:
    from dataclasses import replace

    from gpupool_sdk.scheduler.ordering import waited_s

    requeued = replace(job("r", memory="1GiB", gpus=2, queued_at=0.0), attained_gpu_s=2 * 300.0)  # ran 300 s
    assert waited_s(requeued, 1000.0) == 700.0
    granted = replace(requeued, granted_at=800.0, attained_gpu_s=2 * 500.0)  # 300 s before, 200 s now
    assert waited_s(granted, 1000.0) == 500.0  # frozen at its grant: 800 - 300
    assert waited_s(replace(granted, attained_gpu_s=0.0), 1000.0) == 800.0  # no history: queued until granted
    # A half-GPU job attains 0.5 GPU-s per second: 1,800 GPU-s is 3,600 s of running, not 1,800 s.
    half = replace(job("h", memory="1GiB", compute_share=0.5, queued_at=0.0), attained_gpu_s=1800.0)
    assert waited_s(half, 4000.0) == 400.0


def names(views: list, now: float, cfg: SchedulerConfig = CFG) -> list[str]:
    return [v.name for v in order_pending(views, now, cfg)]


def test_order_priority_then_fifo_then_name() -> None:
    views = [
        job("c", memory="1GiB", priority=1, order=3, queued_at=100.0),
        job("b", memory="1GiB", priority=1, order=2, queued_at=100.0),
        job("a", memory="1GiB", priority=0, order=1, queued_at=100.0),
        job("hi", memory="1GiB", priority=5, order=9, queued_at=100.0),
        job("b2", memory="1GiB", priority=1, order=2, queued_at=100.0),
    ]
    assert names(views, 100.0) == ["hi", "b", "b2", "c", "a"]


def test_aging_lets_old_low_priority_job_pass() -> None:
    old = job("old", memory="1GiB", priority=0, queued_at=0.0, order=1)
    new = job("new", memory="1GiB", priority=2, queued_at=290.0, order=2)
    assert names([old, new], 100.0) == ["new", "old"]
    assert names([old, new], 300.0) == ["old", "new"]  # 0 + 300/60 = 5 > 2 + 10/60


def test_starved_jobs_first_longest_wait_first() -> None:
    cfg = SchedulerConfig(aging_s_per_priority=0.0, max_wait_s=100.0)
    views = [
        job("vip", memory="1GiB", priority=100, queued_at=990.0),
        job("s1", memory="1GiB", priority=0, queued_at=850.0),
        job("s2", memory="1GiB", priority=0, queued_at=800.0),
    ]
    assert is_starved(views[1], 1000.0, cfg) and not is_starved(views[0], 1000.0, cfg)
    assert names(views, 1000.0, cfg) == ["s2", "s1", "vip"]


def test_las_queues_within_priority_level() -> None:
    cfg = SchedulerConfig(aging_s_per_priority=0.0, las_threshold_gpu_s=(3600.0, 36000.0))
    from dataclasses import replace

    fresh = replace(job("fresh", memory="1GiB", order=3), attained_gpu_s=0.0)
    mid = replace(job("mid", memory="1GiB", order=1), attained_gpu_s=5000.0)
    heavy = replace(job("heavy", memory="1GiB", order=0), attained_gpu_s=1e6)
    hi = replace(job("hi", memory="1GiB", priority=1, order=5), attained_gpu_s=1e6)
    assert [las_queue(v, cfg) for v in (fresh, mid, heavy)] == [0, 1, 2]
    assert names([heavy, mid, fresh, hi], 0.0, cfg) == ["hi", "fresh", "mid", "heavy"]
    assert names([heavy, mid, fresh], 0.0, SchedulerConfig(aging_s_per_priority=0.0)) == ["heavy", "mid", "fresh"]


def test_las_config_validated() -> None:
    from gpupool_sdk.errors import ConfigError

    with pytest.raises(ConfigError, match="las_threshold_gpu_s"):
        SchedulerConfig(las_threshold_gpu_s=(10.0, 5.0))


POOL = "a:8xH100-80GB:nvlink=2x4,b:2xA100-40GB:pcie"

REJECT = [
    # (name, job kwargs, ratio, expected substring or None)
    ("fits", {"memory": "70GiB"}, 1.0, None),
    ("too much memory", {"memory": "90GiB"}, 1.0, "largest matching GPU has 80.0GiB"),
    ("model absent", {"memory": "1GiB", "gpu_model": "B200-192GB"}, 1.0, "no GPU of model B200-192GB"),
    ("feature absent", {"memory": "1GiB", "features": ("quantum",)}, 1.0, "no GPU offers feature(s) quantum"),
    ("feature only on small GPUs", {"memory": "50GiB", "gpu_model": "A100-40GB"}, 1.0, "largest matching GPU has 40.0GiB"),
    ("too many slices", {"memory": "1GiB", "gpus": 11}, 1.0, "only 10 in the pool match"),
    ("elastic min fits", {"memory": "1GiB", "gpus": 11, "min_gpus": 4, "max_gpus": 12}, 1.0, None),
    ("spread impossible", {"memory": "1GiB", "gpus": 3, "topology": "spread"}, 1.0, "only 2 node(s)"),
    ("exclusive any size", {"qos": "exclusive", "gpus": 10}, 1.0, None),
    ("shared over ratio", {"memory": "100GiB", "qos": "shared"}, 1.0, "largest matching GPU"),
    ("shared within ratio", {"memory": "100GiB", "qos": "shared", "peak": 50 * GiB}, 1.5, None),
    ("shared peak too big", {"memory": "100GiB", "qos": "shared", "peak": 90 * GiB}, 1.5, "largest matching GPU"),
]


@pytest.mark.parametrize(("name", "kw", "ratio", "expected"), REJECT, ids=[r[0] for r in REJECT])
def test_reject_reason(name: str, kw: dict, ratio: float, expected: str | None) -> None:
    kw = dict(kw)
    peak = kw.pop("peak", None)
    view = job("j", peak=peak, **kw)
    cfg = SchedulerConfig(overcommit_ratio=ratio, peak_margin=0.0)
    why = reject_reason(request_for(view, cfg), summarize(gpus(POOL).values()), ratio)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why


def test_empty_pool_rejects_nothing() -> None:
    assert reject_reason(request_for(job("j", memory="1TiB"), SchedulerConfig()), [], 1.0) is None
