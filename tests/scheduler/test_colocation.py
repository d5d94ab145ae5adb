"""Colocation-aware placement of shared slices (``SchedulerConfig.colocation_aware``): pure policy."""

from __future__ import annotations

from dataclasses import replace

from sched_helpers import gpus, job, only, run, running, snap

from gpupool_sdk.resources import GiB, GpuInfo, QoS
from gpupool_sdk.scheduler import Grant, Holding, JobView, Ledger, SchedulerConfig, SliceRequest
from gpupool_sdk.scheduler.placement import COLOCATION_TIE_BYTES, place


def _two_busy_gpus(busy_util: float | None, light_util: float | None) -> tuple[dict[str, GpuInfo], list[JobView]]:
    # Two T4s, each half used by one shared job; GPU 0 (first in best-fit order) holds the busy one.
    g = gpus("node-a:2xT4-16GB")
    first, second = list(g.values())
    busy = replace(running(job("busy", memory="8GiB", qos="shared"), [first]), gpu_util=busy_util)
    light = replace(running(job("light", memory="8GiB", qos="shared"), [second]), gpu_util=light_util)
    return g, [busy, light]


def _placed_on(config: SchedulerConfig, busy_util: float | None, light_util: float | None, util: float | None) -> str:
    g, held = _two_busy_gpus(busy_util, light_util)
    new = replace(job("new", memory="4GiB", qos="shared"), gpu_util=util)
    d = only(run(snap(g, [*held, new]), config), "new")
    assert isinstance(d, Grant)
    uuid = d.slices[0].gpu_uuid
    return "busy" if uuid == list(g.values())[0].uuid else "light"


def test_shared_job_goes_next_to_the_lighter_partner() -> None:
    assert _placed_on(SchedulerConfig(colocation_aware=True), 0.9, 0.2, 0.5) == "light"


def test_off_keeps_plain_best_fit_order() -> None:
    assert _placed_on(SchedulerConfig(colocation_aware=False), 0.9, 0.2, 0.5) == "busy"


def test_unknown_utilisation_counts_as_half_busy() -> None:
    # An unmeasured holder (0.5) is lighter than one measured at 0.9, heavier than one at 0.2.
    assert _placed_on(SchedulerConfig(colocation_aware=True), 0.9, None, None) == "light"
    assert _placed_on(SchedulerConfig(colocation_aware=True), None, 0.2, None) == "light"
    assert _placed_on(SchedulerConfig(colocation_aware=True), None, 0.9, None) == "busy"


def test_equal_sums_keep_best_fit_order() -> None:
    assert _placed_on(SchedulerConfig(colocation_aware=True), 0.4, 0.4, 0.5) == "busy"


def test_fit_beats_utilisation_beyond_the_tie_window() -> None:
    # GPU 0 is the tighter fit by more than the tie window: best fit wins even next to a busy partner.
    g = gpus("node-a:2xT4-16GB")
    ledger = Ledger(g.values(), g.keys(), 1.0)
    tight = 8 * GiB
    loose = tight - int(COLOCATION_TIE_BYTES) - 1 * GiB
    ledger.reserve("busy", [Holding(0, QoS.SHARED, tight, 0.5, tight, 0.95)])
    ledger.reserve("light", [Holding(1, QoS.SHARED, loose, 0.5, loose, 0.05)])
    req = SliceRequest(job="new", qos=QoS.SHARED, memory=2 * GiB, compute=0.5, peak=2 * GiB, colocate=True)
    assert place(ledger, req) == [0]
    ledger.unreserve("light")
    near = tight - 256 * 2**20
    ledger.reserve("light", [Holding(1, QoS.SHARED, near, 0.5, near, 0.05)])
    assert place(ledger, req) == [1]  # within the window: the lighter partner
    assert place(ledger, replace(req, colocate=False)) == [0]


def test_idle_gpus_are_not_affected() -> None:
    # Spreading onto idle GPUs (spread_idle_above) is unchanged: no partners to choose.
    g = gpus("node-a:4xT4-16GB")
    cfg = SchedulerConfig(colocation_aware=True, spread_idle_above=0.25)
    off = SchedulerConfig(colocation_aware=False, spread_idle_above=0.25)
    first = list(g.values())[0]
    held = replace(running(job("x", memory="8GiB", qos="shared"), [first]), gpu_util=0.1)
    new = job("new", memory="4GiB", qos="shared")
    a = only(run(snap(g, [held, new]), cfg), "new")
    b = only(run(snap(g, [held, new]), off), "new")
    assert isinstance(a, Grant) and isinstance(b, Grant)
    assert a.slices[0].gpu_uuid == b.slices[0].gpu_uuid != first.uuid
