import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.health import FATAL_XIDS, HealthSample, HealthThresholds, judge_health
from gpupool_sdk.resources import GpuReadings


@pytest.mark.parametrize(
    ("sample", "healthy", "reason"),
    [
        (HealthSample(), True, None),
        (HealthSample(temperature_c=45.0, power_w=300.0, ecc_double_bit=0), True, None),
        (HealthSample(temperature_c=89.9), True, None),
        (HealthSample(temperature_c=90.0), False, "temperature 90C >= 90C"),
        (HealthSample(ecc_double_bit=2), False, "ecc double-bit errors: 2"),
        (HealthSample(xids=(79,)), False, "xid 79 (GPU has fallen off the bus)"),
        (HealthSample(xids=(13, 31, 43)), True, None),  # application-caused XIDs are not fatal
        (HealthSample(lost=True), False, "gpu is lost"),
        (HealthSample(ecc_double_bit=None, temperature_c=None), True, None),
    ],
)
def test_rules(sample, healthy, reason):
    h = judge_health(sample)
    assert h.healthy is healthy
    if reason:
        assert any(r.startswith(reason) for r in h.reasons), h.reasons
    else:
        assert h.reasons == ()


def test_every_rule_that_fires_is_a_reason_and_readings_are_kept():
    h = judge_health(HealthSample(temperature_c=99.0, power_w=650.0, ecc_double_bit=1, xids=(48, 48, 31)))
    assert not h.healthy and len(h.reasons) == 3
    assert (h.temperature_c, h.power_w, h.ecc_double_bit, h.xids) == (99.0, 650.0, 1, (31, 48))


def test_fatal_xid_list():
    assert set(FATAL_XIDS) == {48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}


def test_thresholds_are_configurable():
    th = HealthThresholds(max_temperature_c=80, fatal_xids=frozenset({31}))
    assert not judge_health(HealthSample(temperature_c=85.0), th).healthy
    assert not judge_health(HealthSample(xids=(31,)), th).healthy
    assert judge_health(HealthSample(xids=(79,)), th).healthy


@pytest.mark.parametrize("bad", [0, -5, 200, float("nan"), "90", True])
def test_bad_threshold_names_field(bad):
    with pytest.raises(ConfigError) as e:
        HealthThresholds(max_temperature_c=bad)
    assert e.value.field == "max_temperature_c"


def test_usage_readings_are_never_judged_nor_carried_into_the_verdict():
    readings = GpuReadings(
        utilization=1.0,
        memory_bandwidth_utilization=0.95,
        memory_used_bytes=80 * 1024**3,
        pcie_tx_bytes_per_s=25e9,
        pcie_rx_bytes_per_s=1e9,
        nvlink_tx_bytes_per_s=400e9,
        nvlink_rx_bytes_per_s=390e9,
    )
    h = judge_health(HealthSample(temperature_c=50.0, readings=readings))
    assert h.healthy and h.reasons == ()  # a saturated GPU is busy, not broken
    assert h == judge_health(HealthSample(temperature_c=50.0))  # the verdict (the GPU record) holds no usage
    assert HealthSample().readings == GpuReadings() and not GpuReadings().known
