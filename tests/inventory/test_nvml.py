import logging

import pytest

from gpupool_sdk.inventory.base import InventoryBackend
from gpupool_sdk.inventory.nvml import NvmlBackend, NvmlUnavailableError, nvml_available
from tests.inventory.fake_nvml import FakeGpu, FakeNvml, MiB, nvswitch_box, two_island_box


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
