import pytest

from gpupool_sdk.errors import ConfigError, UnknownGpuModelError
from gpupool_sdk.inventory.catalog import (
    CATALOG,
    DTYPES,
    known_names,
    lookup_model,
    match_nvml_name,
    parse_price_overrides,
    price_per_hour,
)
from gpupool_sdk.resources import GiB, MiB

REQUIRED = [
    "H200-141GB",
    "H100-80GB",
    "H100-PCIe-80GB",
    "A100-80GB",
    "A100-40GB",
    "L40S-48GB",
    "A10-24GB",
    "T4-16GB",
    "V100-32GB",
    "V100-16GB",
]


def test_catalog_has_every_required_model():
    assert set(REQUIRED) <= set(CATALOG)


@pytest.mark.parametrize("name", REQUIRED)
def test_figures_are_consistent(name):
    m = CATALOG[name]
    assert m.memory_bytes > 0 and m.sm_count > 0 and m.tdp_w > 0 and m.price_per_hour_usd > 0
    assert set(m.tflops) <= set(DTYPES)
    assert all(v > 0 for v in m.tflops.values())
    assert m.tflops["fp32"] > m.tflops["fp64"]
    # tensor-core half precision is always far faster than plain fp32
    assert m.tflops["fp16"] >= 3 * m.tflops["fp32"]
    assert m.has("nvlink") == (m.nvlink_links > 0)
    assert m.has("bf16") == ("bf16" in m.tflops)
    assert m.has("fp8") == ("fp8" in m.tflops)
    major = int(m.compute_capability.split(".")[0])
    assert ("bf16" in m.tflops) == (major >= 8)
    assert m.memory_bytes == int(name.rsplit("-", 1)[1].removesuffix("GB")) * GiB


def test_published_figures_spot_checks():
    h100 = lookup_model("H100-80GB")
    assert (h100.sm_count, h100.compute_capability, h100.memory_bandwidth_gbps) == (132, "9.0", 3350.0)
    assert h100.tflops["bf16"] == pytest.approx(989.4)
    assert lookup_model("H200").memory_bandwidth_gbps == 4800.0
    assert lookup_model("A100-40GB").tflops["tf32"] == 156.0
    assert lookup_model("T4").tflops["int8"] == 130.0
    assert "mig" in lookup_model("A100").features and "mig" not in lookup_model("L40S").features


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("h100", "H100-80GB"),
        ("H100-SXM", "H100-80GB"),
        ("h100-pcie", "H100-PCIe-80GB"),
        ("A100", "A100-80GB"),
        (" a100-40gb ", "A100-40GB"),
        ("H200", "H200-141GB"),
        ("l40s", "L40S-48GB"),
        ("A10", "A10-24GB"),
        ("t4", "T4-16GB"),
        ("V100", "V100-32GB"),
        ("V100-16GB", "V100-16GB"),
    ],
)
def test_lookup_aliases_case_insensitive(alias, canonical):
    assert lookup_model(alias).name == canonical


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownGpuModelError) as e:
        lookup_model("B200", field_name="gpu_model")
    msg = str(e.value)
    assert msg.startswith("gpu_model:")
    for name in known_names():
        assert name in msg


def test_model_is_immutable_and_hashable():
    m = lookup_model("T4")
    with pytest.raises(TypeError):
        m.tflops["fp32"] = 1.0  # type: ignore[index]
    assert hash(m) == hash(lookup_model("T4-16GB"))


@pytest.mark.parametrize(
    ("nvml_name", "memory", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559 * MiB, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559 * MiB, "H100-PCIe-80GB"),
        ("NVIDIA H200", 143771 * MiB, "H200-141GB"),
        ("NVIDIA A100-SXM4-80GB", 81920 * MiB, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960 * MiB, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", None, "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", None, "A100-80GB"),
        ("NVIDIA L40S", 46068 * MiB, "L40S-48GB"),
        ("NVIDIA A10", 23028 * MiB, "A10-24GB"),
        ("Tesla T4", 15360 * MiB, "T4-16GB"),
        ("Tesla V100-SXM2-32GB", 32768 * MiB, "V100-32GB"),
        ("Tesla V100-SXM2-16GB", 16160 * MiB, "V100-16GB"),
        ("NVIDIA A10G", 23028 * MiB, None),
        ("NVIDIA H100 NVL", 95830 * MiB, None),
        ("NVIDIA GeForce RTX 4090", 24564 * MiB, None),
        ("NVIDIA A100 something", 10 * GiB, None),  # memory far from every A100 variant
    ],
)
def test_match_nvml_name(nvml_name, memory, expected):
    m = match_nvml_name(nvml_name, memory)
    assert (m.name if m else None) == expected


def test_price_overrides(monkeypatch):
    assert parse_price_overrides("h100=2.5, A100-40GB=1") == {"H100-80GB": 2.5, "A100-40GB": 1.0}
    assert parse_price_overrides("") == {}
    assert price_per_hour("H100-80GB", {}) == CATALOG["H100-80GB"].price_per_hour_usd
    assert price_per_hour("h100", {"H100-80GB": 9.0}) == 9.0
    assert price_per_hour("A10G", {}) is None
    monkeypatch.setenv("GPUPOOL_GPU_PRICES", "T4=0.1")
    assert price_per_hour("T4-16GB") == 0.1


@pytest.mark.parametrize("text", ["H100", "H100=abc", "H100=-1", "H100=nan"])
def test_price_override_errors_name_the_field(text):
    with pytest.raises(ConfigError) as e:
        parse_price_overrides(text)
    assert e.value.field == "GPUPOOL_GPU_PRICES"


def test_price_override_unknown_model():
    with pytest.raises(UnknownGpuModelError):
        parse_price_overrides("B300=1")
