"""Usage ledger arithmetic and the cost model (pure, table-driven)."""

from __future__ import annotations

import pytest

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import GiB, QoS
from gpupool_sdk.store.codec import decode, encode
from gpupool_sdk.telemetry.usage import UsageLedger, UsageRecord, accrue, hourly_cost, slice_share

from ._data import alloc, gpu, prices

GPUS = {"GPU-a0": gpu("GPU-a0", model="H100-80GB", memory_gib=80), "GPU-b0": gpu("GPU-b0", model="T4", memory_gib=16)}
TABLE = prices({"H100-80GB": 4.0})  # T4 unpriced


@pytest.mark.parametrize(
    ("allocation", "gpu_s", "cost"),
    [
        # compute share dominates: 0.5 * 1h, 0.5 * $4
        (alloc("j", memory_gib=20, share=0.5), 1800.0, 2.0),
        # memory dominates the charge (60/80 = 0.75) but GPU-seconds follow compute
        (alloc("j", memory_gib=60, share=0.25), 900.0, 3.0),
        # exclusive: the whole GPU
        (alloc("j", memory_gib=80, share=1.0, mode=QoS.EXCLUSIVE), 3600.0, 4.0),
        # shared: half price
        (alloc("j", memory_gib=20, share=0.5, mode=QoS.SHARED), 1800.0, 1.0),
        # unpriced model: GPU-seconds count, cost does not
        (alloc("j", gpu_uuid="GPU-b0", memory_gib=8, share=0.5), 1800.0, 0.0),
        # a GPU no longer published: counted as "unknown", unpriced
        (alloc("j", gpu_uuid="GPU-gone", share=0.5), 1800.0, 0.0),
        # another job's slice is ignored
        (alloc("other", share=0.5), 0.0, 0.0),
    ],
)
def test_accrue_one_hour(allocation, gpu_s: float, cost: float) -> None:  # type: ignore[no-untyped-def]
    rec = accrue(UsageRecord.new("j", now=100.0), [allocation], GPUS, 3600.0, TABLE)
    assert rec.gpu_seconds == pytest.approx(gpu_s)
    assert rec.cost_usd == pytest.approx(cost)
    assert rec.last_seen == 3700.0
    if gpu_s:
        assert rec.memory_gib_seconds == pytest.approx(allocation.memory_bytes / GiB * 3600)
        assert sum(rec.gpu_seconds_by_model.values()) == pytest.approx(gpu_s)
    if gpu_s and not cost:
        assert rec.unpriced_gpu_seconds == pytest.approx(gpu_s)


def test_accrue_adds_up_and_splits_by_model() -> None:
    rec = UsageRecord.new("j", owner="nlp")
    slices = [alloc("j", "GPU-a0", 40, 0.5), alloc("j", "GPU-b0", 8, 0.25)]
    for _ in range(4):
        rec = accrue(rec, slices, GPUS, 900.0, TABLE, now=None)
    assert rec.gpu_seconds == pytest.approx(3600 * 0.75)
    assert rec.gpu_seconds_by_model == pytest.approx({"H100-80GB": 1800.0, "T4": 900.0})
    assert rec.cost_usd == pytest.approx(2.0)
    assert hourly_cost(slices, GPUS, TABLE) == pytest.approx(2.0)


def test_zero_interval_changes_only_last_seen() -> None:
    rec = accrue(UsageRecord.new("j"), [alloc("j")], GPUS, 0.0, TABLE, now=42.0)
    assert (rec.gpu_seconds, rec.cost_usd, rec.last_seen) == (0.0, 0.0, 42.0)


@pytest.mark.parametrize("dt", [-1.0, float("nan"), "5"])
def test_bad_interval_is_rejected(dt: object) -> None:
    with pytest.raises(SpecError, match="dt_s"):
        accrue(UsageRecord.new("j"), [], GPUS, dt, TABLE)  # type: ignore[arg-type]


def test_slice_share_is_capped() -> None:
    assert slice_share(alloc("j", memory_gib=100, share=0.5), GPUS["GPU-a0"]) == 1.0
    assert slice_share(alloc("j", memory_gib=10, share=0.3), None) == 0.3


def test_record_round_trip_and_validation() -> None:
    rec = accrue(UsageRecord.new("j", owner="o", qos="shared"), [alloc("j", mode=QoS.SHARED)], GPUS, 60.0, TABLE)
    assert decode("/p/usage/j", encode(rec), UsageRecord) == rec
    assert UsageRecord.from_dict({"job": "j"}).qos is QoS.GUARANTEED
    with pytest.raises(SpecError, match="qos"):
        UsageRecord("j", qos="gold")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="cost_usd"):
        UsageRecord("j", cost_usd=-1.0)


def test_ledger_accrues_jobs_with_slices_and_totals_by_owner() -> None:
    ledger = UsageLedger.from_records([UsageRecord("old", owner="cv", cost_usd=10.0, gpu_seconds=100.0)])
    changed = ledger.accrue_all(
        {"a": [alloc("a", share=0.5)], "b": [alloc("b", share=0.25, mode=QoS.SHARED)], "idle": []},
        {"a": "nlp", "b": "nlp"},
        GPUS,
        dt_s=3600.0,
        prices=TABLE,
        now=5000.0,
    )
    assert [r.job for r in changed] == ["a", "b"]
    a = ledger.get("a")
    assert a is not None and a.first_seen == 1400.0 and a.last_seen == 5000.0 and a.owner == "nlp"
    totals = {t.owner: t for t in ledger.by_owner()}
    assert totals["cv"].cost_usd == 10.0
    assert totals["nlp"].jobs == 2
    # a: 0.5 * $4 = 2; b: max(0.25, 20/80) * $4 * 0.5 = 0.5
    assert totals["nlp"].cost_usd == pytest.approx(2.5)
    assert ledger.total_cost_usd() == pytest.approx(12.5)
    assert ledger.by_owner()[0].owner == "cv"
