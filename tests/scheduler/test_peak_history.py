"""Predicted peaks from a job's history of window peaks (scheduler/peak_history.py, filter.predicted_peak)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, run, snap

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB
from gpupool_sdk.scheduler import Grant, Scheduler, SchedulerConfig
from gpupool_sdk.scheduler.filter import predicted_peak
from gpupool_sdk.scheduler.peak_history import history_peak, percentile


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [([5], 0.9, 5.0), ([1, 2, 3, 4, 5], 0.5, 3.0), ([1, 2, 3, 4, 5], 1.0, 5.0), ([1, 2, 3, 4, 5], 0.9, 4.6),
     ([10, 20], 0.0, 10.0)],
)
def test_percentile(values: list[int], q: float, want: float) -> None:
    assert percentile(values, q) == pytest.approx(want)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        percentile([1], 1.5)


def test_history_rule_replaces_the_single_peak_rule_from_enough_windows() -> None:
    cfg = SchedulerConfig(peak_margin=0.1, peak_history_min=4, peak_percentile=1.0, peak_history_margin=0.05)
    hist = (10 * GiB, 6 * GiB, 7 * GiB)
    view = replace(job("a", memory="40GiB", qos="shared", peak=6 * GiB), memory_peak_history=hist)
    # 3 windows < 4: the latest peak x 1.1 (the window that missed the 10 GiB phase)
    assert predicted_peak(view, 40 * GiB, cfg) == int(6 * GiB * 1.1)
    view = replace(view, memory_peak_history=(*hist, 6 * GiB))
    assert predicted_peak(view, 40 * GiB, cfg) == history_peak(view.memory_peak_history, 1.0, 0.05) == int(10.5 * GiB)
    assert predicted_peak(view, 8 * GiB, cfg) == 8 * GiB  # capped at the quota
    # 0 = the history is never used
    assert predicted_peak(view, 40 * GiB, replace(cfg, peak_history_min=0)) == int(6 * GiB * 1.1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("peak_history_min", -1), ("peak_history_min", 33), ("peak_history_min", 1.5), ("peak_percentile", 1.2),
     ("peak_percentile", float("nan")), ("peak_history_margin", -0.1)],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: value})


def test_scheduler_packs_by_history_and_the_cycle_cache_sees_history_changes() -> None:
    # One 80 GiB GPU holding a shared job predicted at 40 GiB; a second asks for 48 GiB of quota.
    g = gpus("node-a:1xH100-80GB")
    cfg = SchedulerConfig(overcommit_ratio=2.0, peak_history_min=4, peak_margin=0.1, peak_history_margin=0.0)
    from sched_helpers import running

    holder = running(job("holder", memory="48GiB", qos="shared", peak=40 * GiB), g.values(),
                     memory_peak_history=(40 * GiB,) * 4)
    low = (30 * GiB, 30 * GiB, 30 * GiB, 30 * GiB)
    high = (30 * GiB, 45 * GiB, 30 * GiB, 30 * GiB)
    new = replace(job("new", memory="48GiB", qos="shared", peak=30 * GiB, order=1), memory_peak_history=low)
    decisions = run(snap(g, [holder, new]), cfg)
    assert any(isinstance(d, Grant) and d.job == "new" for d in decisions)  # 40 + 30 <= 80
    # The same scheduler object, the same latest peak, a history that now holds a 45 GiB window:
    sched = Scheduler(cfg)
    sched.schedule(snap(g, [holder, replace(new, spec=new.spec)]))
    again = sched.schedule(snap(g, [holder, replace(new, memory_peak_history=high)]))
    assert not any(isinstance(d, Grant) and d.job == "new" for d in again)  # 40 + 45 > 80
