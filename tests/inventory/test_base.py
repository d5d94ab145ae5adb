import json
import logging
import os

import pytest

from gpupool_sdk.inventory.base import InventoryBackend, SimulatedBackend, simulated_backends
from gpupool_sdk.resources import GpuHealth, GpuReadings


def test_one_backend_per_node_and_protocol():
    backends = simulated_backends("a:2xT4,b:4xH100:nvlink=2x2")
    assert [b.node for b in backends] == ["a", "b"]
    for b in backends:
        assert isinstance(b, InventoryBackend)
    info = backends[1].node_info()
    assert (info.name, info.gpu_count, info.backend, info.agent_pid) == ("b", 4, "simulated", os.getpid())


def test_idle_readings_are_healthy():
    (b,) = simulated_backends("2xH100", default_node="n")
    g = b.gpus()[0]
    assert g.health.healthy and g.health.temperature_c == 40.0 and g.health.power_w == 70.0
    assert g.health.ecc_double_bit == 0


def test_set_health_override():
    (b,) = simulated_backends("2xT4", default_node="n")
    b.set_health("GPU-sim-n-1", GpuHealth(healthy=False, reasons=("broken by test",)))
    gpus = b.gpus()
    assert gpus[0].healthy and not gpus[1].healthy and gpus[1].health.reasons == ("broken by test",)
    b.set_health("GPU-sim-n-1", None)
    assert b.gpus()[1].healthy
    with pytest.raises(KeyError):
        b.set_health("GPU-sim-other-0", GpuHealth())


def test_fault_file_flips_health_and_recovers(tmp_path):
    path = tmp_path / "faults.json"
    (b,) = simulated_backends("3xA100", default_node="n", fault_file=path)
    assert all(g.healthy for g in b.gpus())  # no file yet: no faults
    path.write_text(
        json.dumps(
            {
                "GPU-sim-n-0": {"temperature_c": 95},
                "GPU-sim-n-1": {"xid": 79},
                "GPU-sim-n-2": {"ecc_double_bit": 2},
                "GPU-sim-other-0": {"xid": 79},
            }
        )
    )
    gpus = b.gpus()
    assert [g.healthy for g in gpus] == [False, False, False]
    assert gpus[0].health.reasons == ("temperature 95C >= 90C",)
    assert gpus[1].health.xids == (79,)
    assert gpus[2].health.ecc_double_bit == 2
    path.write_text("{}")
    assert all(g.healthy for g in b.gpus())


def test_fault_file_gives_simulated_gpus_usage_readings(tmp_path):
    path = tmp_path / "faults.json"
    (b,) = simulated_backends("2xA100", default_node="n", fault_file=path)
    b.gpus()
    assert b.readings() == {}  # a simulated GPU has none of its own
    path.write_text(json.dumps({"GPU-sim-n-1": {"utilization": 0.9, "pcie_rx_bytes_per_s": 2e9},
                                "GPU-sim-other-0": {"utilization": 0.5}}))
    gpus = b.gpus()
    assert all(g.healthy for g in gpus)  # readings are never judged
    assert b.readings() == {"GPU-sim-n-1": GpuReadings(utilization=0.9, pcie_rx_bytes_per_s=2e9)}
    b.set_readings("GPU-sim-n-1", GpuReadings(utilization=0.1))  # set_readings wins over the file
    assert b.readings()["GPU-sim-n-1"].utilization == 0.1
    path.write_text("{}")
    b.set_readings("GPU-sim-n-1", None)
    b.gpus()
    assert b.readings() == {}


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", '{"GPU-sim-n-0": 5}', '{"GPU-sim-n-0": {"color": "red"}}', '{"GPU-sim-n-0": {"xid": "79"}}',
     '{"GPU-sim-n-0": {"utilization": 1.5}}', '{"GPU-sim-n-0": {"memory_used_bytes": -1}}'],
)
def test_malformed_fault_file_warns_and_keeps_previous(tmp_path, caplog, content):
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"GPU-sim-n-0": {"xid": 79}}))
    (b,) = simulated_backends("1xT4", default_node="n", fault_file=path)
    assert not b.gpus()[0].healthy
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.inventory.base"):
        assert not b.gpus()[0].healthy
        b.gpus()
    warnings = [r for r in caplog.records if "fault file" in r.getMessage()]
    assert len(warnings) == 1  # once per distinct problem, not on every refresh


def test_simulated_backend_direct():
    from gpupool_sdk.inventory.simulated import parse_nodes

    b = SimulatedBackend(parse_nodes("x:1xV100")[0])
    assert b.gpus()[0].model == "V100-32GB"
    b.close()
    b.close()
