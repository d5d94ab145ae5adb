"""Filter stage: static checks and capacity by QoS class (table-driven)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, unhealthy

from gpupool_sdk.resources import GiB, QoS
from gpupool_sdk.scheduler import GpuLoad, SchedulerConfig, SliceRequest, fits, predicted_peak, request_for
from gpupool_sdk.scheduler.filter import matches_static, unfit_reason, unschedulable_reason

G80 = 80 * GiB


def req(qos: str, memory_gib: float, compute: float = 1.0, peak_gib: float | None = None) -> SliceRequest:
    mem = int(memory_gib * GiB)
    peak = mem if peak_gib is None else int(peak_gib * GiB)
    return SliceRequest(job="j", qos=QoS(qos), memory=mem, compute=compute, peak=peak)


def load(**kw: float) -> GpuLoad:
    out = GpuLoad(phys=G80)
    for k, v in kw.items():
        setattr(out, k, int(v * GiB) if k in ("reserved", "shared_quota", "shared_peak") else v)
    return out


FITS = [
    # (name, load, request, ratio, expected)
    ("idle takes guaranteed", load(), req("guaranteed", 80), 1.0, True),
    ("guaranteed too big", load(reserved=40, compute=0.5, slices=1), req("guaranteed", 41, 0.5), 1.0, False),
    ("guaranteed exact", load(reserved=40, compute=0.5, slices=1), req("guaranteed", 40, 0.5), 1.0, True),
    ("guaranteed compute full", load(reserved=10, compute=1.0, slices=1), req("guaranteed", 10, 0.1), 1.0, False),
    ("guaranteed compute sums to 1", load(reserved=10, compute=0.7, slices=1), req("guaranteed", 10, 0.3), 1.0, True),
    ("guaranteed never overcommitted by shared quota", load(shared_quota=60, shared_peak=20, slices=2),
     req("guaranteed", 30, 0.5), 2.0, False),
    ("shared compute not reserved", load(shared_quota=10, shared_peak=10, slices=1, compute=0.0),
     req("guaranteed", 70, 1.0), 1.0, True),
    ("exclusive needs idle", load(shared_quota=1, shared_peak=1, slices=1), req("exclusive", 0), 1.0, False),
    ("exclusive on idle", load(), req("exclusive", 0), 1.0, True),
    ("exclusive min memory", load(), req("exclusive", 90), 1.0, False),
    ("nobody joins exclusive (shared)", load(reserved=80, compute=1.0, exclusive=1, slices=1), req("shared", 1), 4.0, False),
    ("nobody joins exclusive (guaranteed)", load(reserved=80, compute=1.0, exclusive=1, slices=1),
     req("guaranteed", 0.001, 0.01), 1.0, False),
    ("shared no overcommit", load(shared_quota=60, shared_peak=60, slices=1), req("shared", 30), 1.0, False),
    ("shared within ratio, peaks fit", load(shared_quota=60, shared_peak=30, slices=1),
     req("shared", 60, peak_gib=30), 1.5, True),
    ("shared ratio exceeded", load(shared_quota=60, shared_peak=30, slices=1), req("shared", 61, peak_gib=30), 1.5, False),
    ("shared peaks exceed physical", load(shared_quota=60, shared_peak=50, slices=1),
     req("shared", 40, peak_gib=31), 2.0, False),
    ("shared peaks plus guaranteed reservation", load(reserved=40, compute=0.5, shared_quota=20, shared_peak=20, slices=2),
     req("shared", 30, peak_gib=21), 2.0, False),
    ("shared quota counts guaranteed reservation", load(reserved=40, compute=0.5, slices=1), req("shared", 81, peak_gib=10),
     1.5, False),
]


@pytest.mark.parametrize(("name", "gpu_load", "request_", "ratio", "expected"), FITS, ids=[f[0] for f in FITS])
def test_fits(name: str, gpu_load: GpuLoad, request_: SliceRequest, ratio: float, expected: bool) -> None:
    assert fits(gpu_load, request_, ratio) is expected
    assert (unfit_reason(gpu_load, request_, ratio) is None) is expected


def test_load_add_remove_round_trip() -> None:
    gl = GpuLoad(phys=G80)
    ops = [(QoS.GUARANTEED, 10 * GiB, 0.3, 10 * GiB), (QoS.SHARED, 20 * GiB, 0.5, 5 * GiB), (QoS.GUARANTEED, 5 * GiB, 0.1, 0)]
    for op in ops:
        gl.add(*op)
    assert gl.reserved == 15 * GiB and gl.shared_quota == 20 * GiB and gl.shared_peak == 5 * GiB
    for op in reversed(ops):
        gl.remove(*op)
    assert gl == GpuLoad(phys=G80)


@pytest.mark.parametrize(
    ("features", "model", "expected"),
    [((), None, True), (("bf16",), None, True), (("bf16", "nope"), None, False), ((), "h100-80gb", True), ((), "A100-40GB", False)],
)
def test_matches_static(features: tuple[str, ...], model: str | None, expected: bool) -> None:
    g = next(iter(gpus("n:1xH100-80GB:nvlink").values()))
    assert matches_static(g, features, model) is expected


def test_unschedulable_reasons() -> None:
    g = next(iter(gpus("n:1xH100-80GB:nvlink").values()))
    assert unschedulable_reason(g, frozenset(), frozenset()) is None
    assert "unhealthy (ecc" in str(unschedulable_reason(unhealthy(g, "ecc double-bit errors: 2"), (), ()))
    assert "draining" in str(unschedulable_reason(g, (), {"n"}))
    assert "cordoned" in str(unschedulable_reason(g, {g.uuid}, ()))


@pytest.mark.parametrize(
    ("peak_gib", "margin", "expected_gib"),
    [(None, 0.1, 40), (10, 0.1, 11), (10, 0.0, 10), (39, 0.1, 40), (0, 0.1, 40)],
)
def test_predicted_peak(peak_gib: int | None, margin: float, expected_gib: float) -> None:
    view = job("s", memory="40GiB", qos="shared", peak=None if peak_gib is None else peak_gib * GiB)
    got = predicted_peak(view, 40 * GiB, SchedulerConfig(peak_margin=margin))
    assert got == pytest.approx(expected_gib * GiB, abs=1)


def test_request_for_shapes() -> None:
    cfg = SchedulerConfig()
    r = request_for(job("e", gpus=4, min_gpus=2, max_gpus=8, memory="10GiB"), cfg)
    assert (r.count, r.min_count, r.qos, r.peak) == (4, 2, QoS.GUARANTEED, 10 * GiB)
    r = request_for(job("x", qos="exclusive"), cfg)
    assert (r.compute, r.memory) == (1.0, 0)
    r = request_for(job("s", memory="10GiB", qos="shared", peak=5 * GiB), cfg, count=1)
    assert r.peak == int(5 * GiB * 1.1)
    assert replace(r, job="other").shape == r.shape
