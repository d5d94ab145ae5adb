import logging
import time

import pytest

from gpupool_sdk.inventory.base import InventoryBackend
from gpupool_sdk.inventory.nvml import NvmlBackend, NvmlUnavailableError, nvml_available
from gpupool_sdk.resources import GpuReadings
from tests.inventory.fake_nvml import FakeGpu, FakeNvml, MiB, mig_box, nvswitch_box, two_island_box


@pytest.fixture
def fake_sysfs(tmp_path):
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = tmp_path / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return tmp_path


@pytest.fixture
def box(fake_sysfs):
    nv = FakeNvml(two_island_box())
    backend = NvmlBackend(node="gpu-box", nvml=nv, sysfs_root=fake_sysfs)
    yield nv, backend
    backend.close()


def test_identity(box):
    nv, backend = box
    assert isinstance(backend, InventoryBackend)
    gpus = backend.gpus()
    assert [g.index for g in gpus] == list(range(8))
    g = gpus[0]
    assert g.uuid == "GPU-fake-0000-aaaa-bbbb" and g.node == "gpu-box"
    assert g.model == "H100-80GB" and not g.simulated
    assert g.memory_bytes == 81559 * MiB  # what the device reports, not the catalog's figure
    assert g.sm_count == 132  # 16896 CUDA cores / 128 per SM (attributes NotSupported)
    assert g.compute_capability == "9.0"
    assert g.tflops["fp8"] > 1900 and g.memory_bandwidth_gbps == 3350.0
    info = backend.node_info()
    assert (info.name, info.gpu_count, info.backend, info.driver_version) == ("gpu-box", 8, "nvml", "560.35.03")


def test_nvlink_islands_from_link_state(box):
    _, backend = box
    gpus = backend.gpus()
    assert [g.nvlink_island for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert set(gpus[0].nvlink_peers) == {gpus[i].uuid for i in (1, 2, 3)}
    assert set(gpus[6].nvlink_peers) == {gpus[i].uuid for i in (4, 5, 7)}
    assert all("nvlink" in g.features for g in gpus)


def test_nvlink_from_p2p_status(fake_sysfs):
    nv = FakeNvml(two_island_box(), p2p=True, link_api=False)
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)
    assert [g.nvlink_island for g in backend.gpus()] == [0, 0, 0, 0, 1, 1, 1, 1]
    backend.close()


def test_nvswitch_fabric_is_one_island(fake_sysfs):
    backend = NvmlBackend(node="n", nvml=FakeNvml(nvswitch_box(4)), sysfs_root=fake_sysfs)
    gpus = backend.gpus()
    assert {g.nvlink_island for g in gpus} == {0}
    assert all(len(g.nvlink_peers) == 3 for g in gpus)
    backend.close()


def test_no_nvlink(fake_sysfs):
    gpus = [FakeGpu(index=i, name="NVIDIA L40S", memory_bytes=46068 * MiB, cc=(8, 9), cores=18176, switch_group=i) for i in range(2)]
    backend = NvmlBackend(node="n", nvml=FakeNvml(gpus), sysfs_root=fake_sysfs)
    out = backend.gpus()
    assert [g.nvlink_island for g in out] == [None, None]
    assert all(g.nvlink_peers == () and "nvlink" not in g.features for g in out)
    assert out[0].model == "L40S-48GB" and out[0].sm_count == 142
    assert out[0].pcie_path != out[1].pcie_path
    backend.close()


def test_pcie_groups_and_numa(box):
    _, backend = box
    gpus = backend.gpus()
    paths = [g.pcie_path for g in gpus]
    assert paths[0] == paths[1] and paths[2] == paths[3] and paths[0] != paths[2]
    assert len(set(paths)) == 4
    assert paths[0] == f"pci:{gpus[0].pcie_path.split(':', 1)[1]}" and paths[0].startswith("pci:00000000:18")
    # GPU 7's NUMA id is NotSupported: found through its CPU affinity (cpus 4-7 -> node 1)
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_numa_from_sysfs_pci(tmp_path):
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:18:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    nv = FakeNvml([FakeGpu(index=0, numa=None)])
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=tmp_path)
    assert backend.gpus()[0].numa_node == 1
    backend.close()


def test_sm_count_from_attributes_wins(fake_sysfs):
    nv = FakeNvml([FakeGpu(index=0, sm_attr=114, cores=None)])
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)
    assert backend.gpus()[0].sm_count == 114
    backend.close()


def test_gpu_outside_catalog(fake_sysfs):
    nv = FakeNvml([FakeGpu(index=0, name="NVIDIA A10G", memory_bytes=23028 * MiB, cc=(8, 6), cores=None)])
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)
    g = backend.gpus()[0]
    assert g.model == "A10G" and g.tflops == {} and g.sm_count == 0
    assert {"bf16", "tf32", "tensor_cores"} <= set(g.features) and "fp8" not in g.features
    backend.close()


def test_health_readings_and_unsupported_fields(box):
    nv, backend = box
    gpus = backend.gpus()
    assert all(g.healthy for g in gpus)
    assert gpus[0].health.temperature_c == 40.0 and gpus[0].health.power_w == 90.0
    assert gpus[0].health.ecc_double_bit == 0
    assert gpus[5].health.power_w is None  # NotSupported on that GPU, and not a health problem


def test_temperature_and_ecc_make_unhealthy(box):
    nv, backend = box
    nv.gpus[1].temperature = 93.0
    nv.gpus[2].ecc = 3
    gpus = backend.gpus()
    assert not gpus[1].healthy and gpus[1].health.reasons == ("temperature 93C >= 90C",)
    assert not gpus[2].healthy and gpus[2].health.reasons == ("ecc double-bit errors: 3",)
    nv.gpus[1].temperature = 60.0
    assert backend.gpus()[1].healthy


def test_xid_events_are_drained_without_blocking_and_stick(box, caplog):
    nv, backend = box
    assert nv.registered == set(range(8))
    nv.inject_xid(3, 79)
    nv.inject_xid(4, 31)  # an application fault: recorded, not fatal
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.inventory.nvml"):
        gpus = backend.gpus()
    assert not gpus[3].healthy and gpus[3].health.xids == (79,)
    assert gpus[4].healthy and gpus[4].health.xids == (31,)
    assert not nv.events
    assert not backend.gpus()[3].healthy  # fatal XIDs stay until the agent restarts
    assert any("XID 79" in r.getMessage() for r in caplog.records)


def test_lost_gpu_is_unhealthy(box):
    nv, backend = box
    nv.gpus[6].lost = True
    g = backend.gpus()[6]
    assert not g.healthy and g.health.reasons[0].startswith("gpu is lost")


def test_ecc_unsupported_is_unknown_not_unhealthy(fake_sysfs):
    nv = FakeNvml([FakeGpu(index=0, name="NVIDIA A10", memory_bytes=23028 * MiB, cc=(8, 6), ecc=None, temperature=None)])
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)
    g = backend.gpus()[0]
    assert g.healthy and g.health.ecc_double_bit is None and g.health.temperature_c is None
    backend.close()


def test_close_releases_nvml(box):
    nv, backend = box
    backend.close()
    backend.close()
    assert nv.shutdowns == 1 and nv.event_sets_freed == 1


def test_init_failure_says_to_simulate():
    nv = FakeNvml([], init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailableError) as e:
        NvmlBackend(nvml=nv)
    assert "--simulate" in str(e.value) and e.value.field == "nvml"
    assert not nvml_available(nv)


def test_no_gpu_is_unavailable():
    nv = FakeNvml([])
    with pytest.raises(NvmlUnavailableError):
        NvmlBackend(nvml=nv)
    assert nv.shutdowns == 1  # initialised, then released
    assert not nvml_available(nv)
    assert nvml_available(FakeNvml([FakeGpu(index=0)]))


def _real_nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _real_nvml_works(), reason="NVML does not initialise here (no NVIDIA driver or GPU)")
def test_real_gpu_inventory():
    backend = NvmlBackend()
    try:
        gpus = backend.gpus()
        assert gpus and all(g.uuid.startswith(("GPU-", "MIG-")) for g in gpus)
        for g in gpus:
            assert g.memory_bytes > 0 and g.compute_capability
            assert g.health.temperature_c is None or 0 < g.health.temperature_c < 120
            print(g.to_dict())  # what a real device looks like, for docs/inventory.md
        assert backend.node_info().driver_version
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_nvml_works(), reason="NVML does not initialise here (no NVIDIA driver or GPU)")
def test_real_gpu_usage_readings():
    backend = NvmlBackend()
    try:
        backend.gpus()
        time.sleep(1.0)  # let the PCIe/NVLink counters and their timestamps move between the two readings
        gpus = backend.gpus()
        readings = backend.readings()
        for g in gpus:
            h = readings.get(g.uuid, GpuReadings())
            print(g.index, h.to_dict())  # for docs/inventory.md
            if g.is_mig:
                assert g.uuid not in readings
                continue
            assert h.utilization is not None and 0.0 <= h.utilization <= 1.0
            assert h.memory_bandwidth_utilization is not None and 0.0 <= h.memory_bandwidth_utilization <= 1.0
            assert h.memory_used_bytes is not None and 0 <= h.memory_used_bytes <= g.memory_bytes
            for rate in (h.pcie_tx_bytes_per_s, h.pcie_rx_bytes_per_s, h.nvlink_tx_bytes_per_s, h.nvlink_rx_bytes_per_s):
                assert rate is None or rate >= 0.0
            if not g.nvlink_peers:
                assert h.nvlink_tx_bytes_per_s is None
            assert GpuReadings.from_dict(h.to_dict()) == h  # a real device's figures pass the value's checks
    finally:
        backend.close()


def test_unreadable_gpu_is_skipped_and_topology_still_holds(fake_sysfs, caplog):
    gpus = two_island_box()
    gpus[1].unreadable = True
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.inventory.nvml"):
        backend = NvmlBackend(node="n", nvml=FakeNvml(gpus), sysfs_root=fake_sysfs)
    out = backend.gpus()
    assert [g.index for g in out] == [0, 2, 3, 4, 5, 6, 7]
    assert [g.nvlink_island for g in out] == [0, 0, 0, 1, 1, 1, 1]
    assert set(out[0].nvlink_peers) == {out[1].uuid, out[2].uuid}
    assert backend.node_info().gpu_count == 7
    assert "GPU 1 cannot be read" in caplog.text
    backend.close()


def test_every_gpu_unreadable_is_unavailable(fake_sysfs):
    gpus = [FakeGpu(index=0, unreadable=True)]
    with pytest.raises(NvmlUnavailableError):
        NvmlBackend(node="n", nvml=FakeNvml(gpus), sysfs_root=fake_sysfs)


# ------------------------------------------------------------------------------- usage readings

KiB = 1024


def _read(backend):
    """One refresh: the usage readings of each published GPU, in index order (all None: unknown)."""
    gpus = backend.gpus()
    readings = backend.readings()
    return [readings.get(g.uuid, GpuReadings()) for g in gpus]


def _backend(fake_sysfs, gpus, **kw):
    nv = FakeNvml(gpus, **kw)
    return nv, NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)


def test_usage_readings(box):
    nv, backend = box
    g0 = nv.gpus[0]
    g0.util, g0.memory_used, g0.pcie_kb_s = (75, 40), 10 * 1024 * MiB, (1000, 2000)
    h = _read(backend)[0]
    assert (h.utilization, h.memory_bandwidth_utilization) == (0.75, 0.40)
    assert h.memory_used_bytes == 10 * 1024 * MiB
    # no PCIe byte counters on this GPU: nvmlDeviceGetPcieThroughput, KB/s -> bytes/s
    assert (h.pcie_tx_bytes_per_s, h.pcie_rx_bytes_per_s) == (1000.0 * KiB, 2000.0 * KiB)
    assert (h.nvlink_tx_bytes_per_s, h.nvlink_rx_bytes_per_s) == (None, None)  # one counter reading is no rate
    assert backend.gpus()[0].healthy


def test_nvlink_rate_from_two_counter_readings(box):
    nv, backend = box
    nv.gpus[0].nvlink_kib = (1_000, 5_000)
    backend.gpus()
    nv.gpus[0].nvlink_kib = (1_000 + 4_096, 5_000 + 1_024)
    nv.clock_us += 2_000_000  # NVML stamps each field value; the rate is over the stamps, not the agent's clock
    h = _read(backend)[0]
    assert (h.nvlink_tx_bytes_per_s, h.nvlink_rx_bytes_per_s) == (4_096 * KiB / 2, 1_024 * KiB / 2)
    # asked for the sum over all links (scope UINT_MAX) in the one field-values call
    tx = FakeNvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert (tx, 0xFFFFFFFF) in nv.field_ids[-1]
    nv.gpus[0].nvlink_kib = (0, 0)  # counters went back (driver reload): no rate this time, not a negative one
    nv.clock_us += 2_000_000
    h = _read(backend)[0]
    assert (h.nvlink_tx_bytes_per_s, h.nvlink_rx_bytes_per_s) == (None, None)
    nv.clock_us += 1_000_000
    assert _read(backend)[0].nvlink_tx_bytes_per_s == 0.0


def test_pcie_rate_from_byte_counters_without_the_slow_call(fake_sysfs):
    nv, backend = _backend(fake_sysfs, [FakeGpu(index=0, pcie_bytes=(10_000, 20_000), pcie_kb_s=(7, 7))])
    assert _read(backend)[0].pcie_tx_bytes_per_s is None  # first reading of the counters
    nv.gpus[0].pcie_bytes = (10_000 + 8_000_000, 20_000 + 2_000_000)
    nv.clock_us += 4_000_000
    h = _read(backend)[0]
    assert (h.pcie_tx_bytes_per_s, h.pcie_rx_bytes_per_s) == (2_000_000.0, 500_000.0)
    # nvmlDeviceGetPcieThroughput samples for 20 ms per direction: never called when the counters work
    assert nv.calls.get("pcie_throughput", 0) == 0
    backend.close()


def test_gpu_without_nvlink_reads_no_nvlink(fake_sysfs):
    nv, backend = _backend(fake_sysfs, [FakeGpu(index=0)])
    for _ in range(2):
        nv.clock_us += 1_000_000
        h = _read(backend)[0]
    assert (h.nvlink_tx_bytes_per_s, h.nvlink_rx_bytes_per_s) == (None, None)
    assert h.pcie_tx_bytes_per_s == 0.0
    nvlink_ids = {FakeNvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, FakeNvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX}
    assert not {f for asked in nv.field_ids for f, _ in asked} & nvlink_ids
    backend.close()


def test_pynvml_without_nvlink_throughput_fields_leaves_nvlink_unknown(fake_sysfs):
    nv = FakeNvml(two_island_box())
    nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = None  # an old pynvml
    backend = NvmlBackend(node="n", nvml=nv, sysfs_root=fake_sysfs)
    for _ in range(2):
        nv.clock_us += 1_000_000
        h = _read(backend)[0]
    assert h.nvlink_tx_bytes_per_s is None and h.pcie_tx_bytes_per_s == 0.0
    backend.close()


def test_unsupported_usage_is_unknown_and_other_errors_warn_once(fake_sysfs, caplog):
    gpus = [FakeGpu(index=0, util=None, pcie_kb_s=None), FakeGpu(index=1, usage_error=999)]  # 999: NVML_ERROR_UNKNOWN
    nv, backend = _backend(fake_sysfs, gpus)
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.inventory.nvml"):
        for _ in range(3):
            nv.clock_us += 1_000_000
            out = backend.gpus()
    readings = backend.readings()
    for g in out:
        h = readings.get(g.uuid, GpuReadings())
        assert g.healthy, g.health.reasons  # an unreadable usage figure is not a health problem
        assert (h.utilization, h.memory_bandwidth_utilization, h.pcie_tx_bytes_per_s, h.pcie_rx_bytes_per_s) == (
            None, None, None, None)
    assert readings[out[0].uuid].memory_used_bytes == 0  # memory info still read
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [w for w in warnings if out[0].uuid in w]  # NotSupported: silently unknown
    mine = [w for w in warnings if out[1].uuid in w]
    assert mine and len(mine) == len(set(mine))  # each failing read warned about once, not every refresh
    assert any("utilization" in w for w in mine) and any("pcie" in w for w in mine)
    backend.close()


def test_usage_costs_one_call_per_metric_per_gpu_per_refresh(box):
    nv, backend = box
    backend.gpus()
    before = dict(nv.calls)
    backend.gpus()
    delta = {k: v - before.get(k, 0) for k, v in nv.calls.items()}
    n = len(nv.gpus)
    assert delta["utilization"] == n and delta["memory"] == n and delta["field_values"] == n
    assert delta["pcie_throughput"] == 2 * n  # no PCIe counters on this box: TX and RX, one call each


def test_mig_instances_carry_no_device_wide_usage(fake_sysfs):
    gpus = mig_box()
    gpus[0].util, gpus[1].util = (90, 50), (30, 10)
    nv, backend = _backend(fake_sysfs, gpus)
    out = backend.gpus()
    readings = backend.readings()
    inst = [g for g in out if g.is_mig]
    whole = [g for g in out if not g.is_mig]
    assert len(inst) == 2 and len(whole) == 1
    # NVML's figures are the whole GPU's: shown against one instance they would mislead
    assert not any(g.uuid in readings for g in inst) and set(readings) == {whole[0].uuid}
    assert readings[whole[0].uuid].utilization == 0.30
    backend.close()
