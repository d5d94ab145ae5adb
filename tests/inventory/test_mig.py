"""MIG on the inventory side: profiles, the --simulate layout, the NVML backend on the fake NVML, gpupool mig."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpupool_sdk.cli import mig_cmd
from gpupool_sdk.errors import ConfigError, SpecError
from gpupool_sdk.inventory import mig_admin
from gpupool_sdk.inventory.mig import parse_layout, profile_of
from gpupool_sdk.inventory.nvml import NvmlBackend, mig_profile_name
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import GiB, GpuInfo
from tests.inventory.fake_nvml import A100_80_PROFILES, FakeGpu, FakeNvml, MiB, mig_box


def test_profiles_of_a_model() -> None:
    p = profile_of("A100-80GB", "3G.40GB")
    assert (p.name, p.compute_slices, p.memory_gb, p.sm_count) == ("3g.40gb", 3, 40, 42)
    assert profile_of("H100-80GB", "7g.80gb").sm_count == 132
    with pytest.raises(SpecError, match="not a MIG profile of A100-40GB.*3g.20gb"):
        profile_of("A100-40GB", "3g.40gb")
    with pytest.raises(SpecError, match="T4-16GB has no MIG"):
        profile_of("T4-16GB", "1g.5gb")


@pytest.mark.parametrize(
    ("layout", "error"),
    [
        ("7g.80gb+1g.10gb", "8 compute slices"),
        ("4g.40gb+4g.40gb", "8 compute slices"),
        ("", "declares no MIG instances"),
        ("2g.20gb+2g.20gb+2g.20gb+1g.20gb", "need 80 GiB|has 80"),
    ],
)
def test_bad_layouts_name_the_problem(layout: str, error: str) -> None:
    if error.startswith("need"):
        assert parse_layout(layout, "A100-80GB", 80 * GiB)  # 80 GiB fits exactly
        return
    with pytest.raises(SpecError, match=error):
        parse_layout(layout, "A100-80GB", 80 * GiB)


def test_simulated_mig_node_publishes_instances_not_the_parent() -> None:
    gpus = parse_cluster_spec("node-a:2xA100-80GB:mig=3g.40gb+2g.20gb+1g.10gb+me,node-b:1xA100-80GB")
    a = [g for g in gpus if g.node == "node-a"]
    assert [g.uuid for g in a] == [f"MIG-sim-node-a-{i}-{k}" for i in range(2) for k in range(3)]
    assert [g.mig_profile for g in a[:3]] == ["3g.40gb", "2g.20gb", "1g.10gb+me"]
    assert [g.sm_count for g in a[:3]] == [42, 28, 14]
    assert [g.memory_bytes // GiB for g in a[:3]] == [40, 20, 10]
    assert {g.mig_parent for g in a[:3]} == {"GPU-sim-node-a-0"} and {g.index for g in a[3:]} == {1}
    assert all("mig-instance" in g.features and "nvlink" not in g.features and not g.nvlink_peers for g in a)
    assert "mig:3g.40gb" in a[0].features
    (b,) = [g for g in gpus if g.node == "node-b"]
    assert b.mig_profile is None and "mig" in b.features and "mig-instance" not in b.features
    # The record round-trips through its JSON form.
    assert GpuInfo.from_dict(a[0].to_dict()) == a[0]
    assert "mig_profile" not in b.to_dict()


def test_simulated_mig_errors() -> None:
    with pytest.raises(SpecError, match="T4-16GB has no MIG"):
        parse_cluster_spec("1xT4:mig=1g.5gb")
    with pytest.raises(SpecError, match="twice"):
        parse_cluster_spec("1xA100:mig=1g.10gb:mig=1g.10gb")


def test_profile_names_from_nvml_attributes() -> None:
    assert mig_profile_name(3, 3, 40192) == "3g.40gb"
    assert mig_profile_name(1, 1, 9728) == "1g.10gb"
    assert mig_profile_name(7, 7, 81152) == "7g.80gb"
    assert mig_profile_name(3, 1, 40192) == "1c.3g.40gb"


def test_nvml_backend_publishes_mig_instances(tmp_path) -> None:  # type: ignore[no-untyped-def]
    nv = FakeNvml(mig_box())
    backend = NvmlBackend(node="m", nvml=nv, sysfs_root=tmp_path)
    try:
        gpus = backend.gpus()
        assert [g.uuid for g in gpus] == ["MIG-fake-0000-1", "MIG-fake-0000-2", "GPU-fake-0001-aaaa-bbbb"]
        mig0 = gpus[0]
        assert mig0.mig_profile == "3g.40gb" and mig0.memory_bytes == 40192 * MiB and mig0.sm_count == 42
        assert mig0.mig_parent == "GPU-fake-0000-aaaa-bbbb" and mig0.index == 0 and mig0.model == "A100-80GB"
        assert gpus[2].mig_profile is None and gpus[2].sm_count == 108
        assert backend.node_info().gpu_count == 3
        # An operator adds an instance: the next refresh publishes it, no restart.
        mig_admin.create_instances(nv, 0, "1g.10gb")
        assert [g.mig_profile for g in backend.gpus()][:3] == ["3g.40gb", "3g.40gb", "1g.10gb"]
        # Health comes from the parent: a hot parent makes its instances unhealthy.
        nv.gpus[0].temperature = 95
        assert not any(g.healthy for g in backend.gpus() if g.mig_parent == "GPU-fake-0000-aaaa-bbbb")
    finally:
        backend.close()


def test_mig_admin_create_destroy_and_errors() -> None:
    nv = FakeNvml(mig_box())
    states = mig_admin.list_gpus(nv)
    assert states[0].mig_current is True and [p for p, _ in states[0].instances] == ["3g.40gb", "3g.40gb"]
    assert "1g.10gb+me" in states[0].profiles and states[1].mig_current is False and states[1].instances == ()
    with pytest.raises(mig_admin.MigAdminError, match="no room left"):
        mig_admin.create_instances(nv, 0, "2g.20gb")  # 3 + 3 + 2 > 7 slices
    with pytest.raises(ConfigError, match="not offered by GPU 0; use one of"):
        mig_admin.create_instances(nv, 0, "5g.50gb")
    with pytest.raises(mig_admin.MigAdminError, match="MIG mode is not enabled on GPU 1.*gpupool mig enable --gpu 1"):
        mig_admin.create_instances(nv, 1, "3g.40gb")
    with pytest.raises(ConfigError, match="GPU index 5 does not exist"):
        mig_admin.create_instances(nv, 5, "3g.40gb")
    nv.gpus[0].gis[0].busy = True
    with pytest.raises(mig_admin.MigAdminError, match="in use by a process"):
        mig_admin.destroy_instances(nv, 0)
    nv.gpus[0].gis[0].busy = False
    assert mig_admin.destroy_instances(nv, 0, "3g.40gb") == 2
    assert nv.gpus[0].gis == []
    assert mig_admin.set_mig_mode(nv, 1, True) is True
    assert mig_admin.create_instances(nv, 1, "7g.80gb") == ["7g.80gb"]
    nv.gpus[0].reset_needed = True
    assert mig_admin.set_mig_mode(nv, 0, False) is False  # pending until a GPU reset
    with pytest.raises(mig_admin.MigAdminError, match="does not support MIG"):
        mig_admin.set_mig_mode(FakeNvml([FakeGpu(index=0)]), 0, True)


def test_gpupool_mig_command_on_the_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(index=0, name="NVIDIA A100-SXM4-80GB", memory_bytes=81920 * MiB, cc=(8, 0), mig_current=0,
                    mig_profiles=dict(A100_80_PROFILES))]
    nv = FakeNvml(gpus)
    monkeypatch.setattr(mig_cmd, "load_nvml", lambda: nv)
    run = CliRunner().invoke
    r = run(mig_cmd.mig, ["create", "--gpu", "0", "--profile", "3g.40gb"])
    assert r.exit_code == 1 and "gpupool mig enable --gpu 0" in r.output
    assert run(mig_cmd.mig, ["enable", "--gpu", "0"]).exit_code == 0
    r = run(mig_cmd.mig, ["create", "--gpu", "0", "--profile", "3g.40gb", "--count", "2"])
    assert r.exit_code == 0 and "created 2 x 3g.40gb" in r.output
    r = run(mig_cmd.mig, ["list", "-o", "json"])
    doc = json.loads(r.output)
    assert [i["profile"] for i in doc["gpus"][0]["instances"]] == ["3g.40gb", "3g.40gb"]
    r = run(mig_cmd.mig, ["create", "--gpu", "0", "--profile", "9g.1gb"])
    assert r.exit_code == 2 and "use one of" in r.output
    r = run(mig_cmd.mig, ["destroy", "--gpu", "0"])
    assert r.exit_code == 0 and "destroyed 2" in r.output


def test_gpupool_mig_without_nvml_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(mig_cmd, "load_nvml", broken)
    r = CliRunner().invoke(mig_cmd.mig, ["list"])
    assert r.exit_code == 2 and "NVML is not usable" in r.output


@pytest.mark.gpu
def test_real_nvml_mig_state_and_instances_published() -> None:
    """On a GPU machine: MIG mode is read through real NVML; a GPU in MIG mode is published as its instances."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        pytest.skip(f"NVML does not initialise here: {e}")
    try:
        states = mig_admin.list_gpus(pynvml)
    finally:
        pynvml.nvmlShutdown()
    print(json.dumps([s.to_dict() for s in states], indent=2))
    backend = NvmlBackend()
    try:
        published = backend.gpus()
    finally:
        backend.close()
    for s in states:
        mine = [g for g in published if g.index == s.index]
        if s.mig_current:
            assert {g.uuid for g in mine} == {u for _, u in s.instances}
            assert all(g.mig_profile and g.uuid.startswith("MIG-") for g in mine)
        else:
            assert [g.uuid for g in mine] == [s.uuid] and mine[0].mig_profile is None
