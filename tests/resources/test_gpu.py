"""GpuReadings / GpuHealth / GpuInfo records: readings round-trip, old records decode, bad values are named."""

from __future__ import annotations

import json

import pytest

from gpupool_sdk.errors import SchemaError, SpecError
from gpupool_sdk.resources import GiB, GpuHealth, GpuInfo, GpuReadings
from gpupool_sdk.resources.gpu import READING_FIELDS, device_readings
from gpupool_sdk.store.codec import decode, encode

BUSY = GpuReadings(
    utilization=0.87,
    memory_bandwidth_utilization=0.42,
    memory_used_bytes=71 * GiB,
    pcie_tx_bytes_per_s=1.5e9,
    pcie_rx_bytes_per_s=3.0e9,
    nvlink_tx_bytes_per_s=120e9,
    nvlink_rx_bytes_per_s=118e9,
)
KEY = "/gpupool/v1/readings/n/GPU-1"


def _gpu(health: GpuHealth) -> GpuInfo:
    return GpuInfo(uuid="GPU-1", node="n", index=0, model="H100-80GB", memory_bytes=80 * GiB, health=health)


def test_readings_round_trip_with_a_schema_version():
    assert GpuReadings.from_dict(BUSY.to_dict()) == BUSY
    raw = encode(BUSY)
    assert json.loads(raw)["schema"] == 1 and json.loads(raw)["kind"] == "GpuReadings"
    assert decode(KEY, raw, GpuReadings) == BUSY


def test_unknown_readings_are_not_written():
    assert GpuReadings().to_dict() == {} and not GpuReadings().known
    assert GpuReadings(pcie_rx_bytes_per_s=0.0).to_dict() == {"pcie_rx_bytes_per_s": 0.0}


def test_a_gpu_record_carries_no_usage_and_an_older_agents_record_still_decodes():
    d = GpuHealth(temperature_c=40.0).to_dict()
    assert set(d) == {"healthy", "reasons", "temperature_c", "power_w", "ecc_double_bit", "xids"}
    # what an agent of the previous release wrote: the usage readings inside the health verdict
    old = _gpu(GpuHealth(temperature_c=61.0, power_w=450.0)).to_dict()
    old["health"].update(BUSY.to_dict())
    got = decode("/gpupool/v1/gpus/n/GPU-1", encode(old, kind="GpuInfo"), GpuInfo)
    assert got == _gpu(GpuHealth(temperature_c=61.0, power_w=450.0))  # the readings are ignored


def test_device_readings_join_the_record_and_the_readings():
    shown = device_readings(GpuHealth(temperature_c=61.0, power_w=450.0), BUSY)
    assert list(shown) == ["temperature_c", "power_w", *READING_FIELDS]
    assert shown["temperature_c"] == 61.0 and shown["utilization"] == 0.87
    none = device_readings(GpuHealth(), None)
    assert set(none) == set(shown) and not any(none.values())


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
    d = BUSY.to_dict()
    d[field] = value
    with pytest.raises(SpecError) as e:
        GpuReadings.from_dict(d)
    assert e.value.field == f"readings.{field}" and says in str(e.value)
    raw = json.loads(encode(BUSY))
    raw[field] = value
    with pytest.raises(SchemaError, match=field) as se:
        decode(KEY, json.dumps(raw).encode(), GpuReadings)
    assert KEY in str(se.value)
