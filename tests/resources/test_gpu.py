"""GpuHealth / GpuInfo records: the per-GPU usage readings round-trip, old records decode, bad values are named."""

from __future__ import annotations

import json

import pytest

from gpupool_sdk.errors import SchemaError, SpecError
from gpupool_sdk.resources import GiB, GpuHealth, GpuInfo
from gpupool_sdk.store.codec import decode, encode

BUSY = GpuHealth(
    temperature_c=61.0,
    power_w=450.0,
    utilization=0.87,
    memory_bandwidth_utilization=0.42,
    memory_used_bytes=71 * GiB,
    pcie_tx_bytes_per_s=1.5e9,
    pcie_rx_bytes_per_s=3.0e9,
    nvlink_tx_bytes_per_s=120e9,
    nvlink_rx_bytes_per_s=118e9,
)


def _gpu(health: GpuHealth) -> GpuInfo:
    return GpuInfo(uuid="GPU-1", node="n", index=0, model="H100-80GB", memory_bytes=80 * GiB, health=health)


def test_usage_readings_round_trip():
    assert GpuHealth.from_dict(BUSY.to_dict()) == BUSY
    assert GpuInfo.from_dict(_gpu(BUSY).to_dict()) == _gpu(BUSY)
    assert decode("k", encode(_gpu(BUSY)), GpuInfo) == _gpu(BUSY)


def test_unknown_readings_are_not_written_and_old_records_decode():
    d = GpuHealth(temperature_c=40.0).to_dict()
    # written only when known, so an idle or simulated GPU's record is what older releases wrote
    assert set(d) == {"healthy", "reasons", "temperature_c", "power_w", "ecc_double_bit", "xids"}
    old = {"healthy": True, "reasons": [], "temperature_c": 40, "power_w": None, "ecc_double_bit": 0, "xids": []}
    h = GpuHealth.from_dict(old)
    assert h.utilization is None and h.pcie_tx_bytes_per_s is None and h.memory_used_bytes is None


def test_without_usage_keeps_the_verdict_and_drops_the_readings():
    h = BUSY.without_usage()
    assert h == GpuHealth(temperature_c=61.0, power_w=450.0)
    assert GpuHealth().without_usage() == GpuHealth()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("pcie_tx_bytes_per_s", "fast", "expected float"),
        ("nvlink_rx_bytes_per_s", -1.0, "must not be negative"),
        ("utilization", 1.5, "ratio"),
        ("memory_bandwidth_utilization", True, "boolean"),
        ("memory_used_bytes", 1.5, "expected int"),
    ],
)
def test_a_hand_edited_bad_reading_names_the_field(field, value, says):
    d = _gpu(BUSY).to_dict()
    d["health"][field] = value
    with pytest.raises(SpecError) as e:
        GpuInfo.from_dict(d)
    assert e.value.field == f"gpu.health.{field}" and says in str(e.value)
    raw = json.loads(encode(_gpu(BUSY)))
    raw["health"][field] = value
    with pytest.raises(SchemaError, match=field):
        decode("/gpupool/v1/gpus/n/GPU-1", json.dumps(raw).encode(), GpuInfo)
