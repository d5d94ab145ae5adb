"""Catalog of common data-centre GPU models with their published figures.

Every figure is the vendor's published peak for the SXM/board variant named (dense, i.e. without
structured sparsity), from the NVIDIA product datasheets listed in ``docs/inventory.md``. A
dtype a model cannot run natively on tensor cores or ALUs (``bf16`` on V100/T4, ``fp8`` before
Ada/Hopper) is absent from :attr:`GpuModel.tflops`, not zero.

``memory_bytes`` is the marketed capacity read in GiB (an "80GB" H100 is ``80 * GiB``); real
devices report slightly different totals through NVML (the NVML backend publishes what the device
reports). ``price_per_hour_usd`` is a typical public on-demand cloud list price per GPU-hour
(mid-2025), a default for cost accounting that operators override (see
:func:`parse_price_overrides`).

Example:
    >>> lookup_model("h100").name
    'H100-80GB'
    >>> lookup_model("A100-40GB").memory_bytes // GiB
    40
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from gpupool_sdk.errors import ConfigError, UnknownGpuModelError
from gpupool_sdk.resources.gpu import GpuHealth, GpuInfo
from gpupool_sdk.resources.units import GiB

PRICES_ENV = "GPUPOOL_GPU_PRICES"
"""Environment variable with price overrides: ``"H100-80GB=2.5,A100=1.2"`` (USD per GPU-hour)."""

#: Every dtype key :attr:`GpuModel.tflops` may hold.
DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")


@dataclass(frozen=True)
class GpuModel:
    """Published figures of one GPU model.

    Attributes:
        name: canonical catalog name, e.g. ``"H100-80GB"``.
        memory_bytes: marketed device memory, in bytes (GiB-based).
        sm_count: streaming multiprocessors.
        compute_capability: CUDA compute capability, ``"9.0"``.
        tflops: dense peak TFLOPS (TOPS for ``int8``) by dtype; ``fp64``/``fp32`` are the
            non-tensor rates, the others the tensor-core rates. Unsupported dtypes are absent.
        memory_bandwidth_gbps: peak memory bandwidth in GB/s.
        features: capability tags (``bf16``, ``fp8``, ``tf32``, ``tensor_cores``, ``mig``, ``nvlink``...).
        nvlink_links: NVLink links per GPU (0 when the model has none).
        tdp_w: maximum board power in watts.
        price_per_hour_usd: default on-demand price per GPU-hour, overridable by the operator.
        aliases: other names accepted by :func:`lookup_model` (case-insensitive).
    """

    name: str
    memory_bytes: int
    sm_count: int
    compute_capability: str
    tflops: Mapping[str, float] = field(hash=False)
    memory_bandwidth_gbps: float
    features: tuple[str, ...]
    nvlink_links: int
    tdp_w: int
    price_per_hour_usd: float
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tflops", MappingProxyType(dict(self.tflops)))

    def has(self, feature: str) -> bool:
        """True when the model has capability tag ``feature``."""
        return feature in self.features

    def gpu_info(
        self,
        *,
        uuid: str,
        node: str,
        index: int,
        nvlink_peers: tuple[str, ...] = (),
        nvlink_island: int | None = None,
        pcie_path: str = "",
        numa_node: int | None = None,
        health: GpuHealth | None = None,
        simulated: bool = False,
        memory_bytes: int | None = None,
    ) -> GpuInfo:
        """Build the :class:`GpuInfo` of one device of this model.

        Args:
            uuid: device UUID.
            node: node name.
            index: device index on the node.
            nvlink_peers: UUIDs reachable over NVLink.
            nvlink_island: NVLink domain id on the node, or None.
            pcie_path: PCIe switch path.
            numa_node: NUMA node, if known.
            health: health verdict (healthy by default).
            simulated: True for ``--simulate`` devices.
            memory_bytes: the device's own total memory, when it differs from the catalog's.
        """
        return GpuInfo(
            uuid=uuid,
            node=node,
            index=index,
            model=self.name,
            memory_bytes=self.memory_bytes if memory_bytes is None else memory_bytes,
            sm_count=self.sm_count,
            compute_capability=self.compute_capability,
            tflops=dict(self.tflops),
            memory_bandwidth_gbps=self.memory_bandwidth_gbps,
            features=self.features,
            nvlink_peers=nvlink_peers,
            nvlink_island=nvlink_island,
            pcie_path=pcie_path,
            numa_node=numa_node,
            health=health or GpuHealth(),
            simulated=simulated,
        )


_HOPPER = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8", "tensor_cores", "transformer_engine", "mig", "hbm")
_AMPERE = ("fp64", "fp32", "tf32", "bf16", "fp16", "int8", "tensor_cores", "mig", "hbm")

_MODELS: tuple[GpuModel, ...] = (
    GpuModel(
        name="H200-141GB",
        memory_bytes=141 * GiB,
        sm_count=132,
        compute_capability="9.0",
        tflops={"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
        memory_bandwidth_gbps=4800.0,
        features=(*_HOPPER, "nvlink"),
        nvlink_links=18,
        tdp_w=700,
        price_per_hour_usd=3.80,
        aliases=("H200", "H200-SXM", "H200-SXM-141GB"),
    ),
    GpuModel(
        name="H100-80GB",
        memory_bytes=80 * GiB,
        sm_count=132,
        compute_capability="9.0",
        tflops={"fp64": 34.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9},
        memory_bandwidth_gbps=3350.0,
        features=(*_HOPPER, "nvlink"),
        nvlink_links=18,
        tdp_w=700,
        price_per_hour_usd=2.99,
        aliases=("H100", "H100-SXM", "H100-SXM-80GB", "H100-SXM5-80GB"),
    ),
    GpuModel(
        name="H100-PCIe-80GB",
        memory_bytes=80 * GiB,
        sm_count=114,
        compute_capability="9.0",
        tflops={"fp64": 26.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "int8": 1513.0},
        memory_bandwidth_gbps=2000.0,
        # NVLink through a bridge between pairs of cards.
        features=(*_HOPPER, "nvlink"),
        nvlink_links=12,
        tdp_w=350,
        price_per_hour_usd=2.49,
        aliases=("H100-PCIe",),
    ),
    GpuModel(
        name="A100-80GB",
        memory_bytes=80 * GiB,
        sm_count=108,
        compute_capability="8.0",
        tflops={"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
        memory_bandwidth_gbps=2039.0,
        features=(*_AMPERE, "nvlink"),
        nvlink_links=12,
        tdp_w=400,
        price_per_hour_usd=1.79,
        aliases=("A100", "A100-SXM4-80GB", "A100-SXM-80GB"),
    ),
    GpuModel(
        name="A100-40GB",
        memory_bytes=40 * GiB,
        sm_count=108,
        compute_capability="8.0",
        tflops={"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0},
        memory_bandwidth_gbps=1555.0,
        features=(*_AMPERE, "nvlink"),
        nvlink_links=12,
        tdp_w=400,
        price_per_hour_usd=1.29,
        aliases=("A100-SXM4-40GB", "A100-SXM-40GB"),
    ),
    GpuModel(
        name="L40S-48GB",
        memory_bytes=48 * GiB,
        sm_count=142,
        compute_capability="8.9",
        # FP64 is not on the datasheet; AD102 runs it at 1/64 of the FP32 rate.
        tflops={"fp64": 1.4, "fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0, "int8": 733.0},
        memory_bandwidth_gbps=864.0,
        features=("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8", "tensor_cores", "transformer_engine"),
        nvlink_links=0,
        tdp_w=350,
        price_per_hour_usd=1.25,
        aliases=("L40S",),
    ),
    GpuModel(
        name="A10-24GB",
        memory_bytes=24 * GiB,
        sm_count=72,
        compute_capability="8.6",
        # FP64 is not on the datasheet; GA102 runs it at 1/64 of the FP32 rate.
        tflops={"fp64": 0.49, "fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0, "int8": 250.0},
        memory_bandwidth_gbps=600.0,
        features=("fp64", "fp32", "tf32", "bf16", "fp16", "int8", "tensor_cores"),
        nvlink_links=0,
        tdp_w=150,
        price_per_hour_usd=0.75,
        aliases=("A10",),
    ),
    GpuModel(
        name="T4-16GB",
        memory_bytes=16 * GiB,
        sm_count=40,
        compute_capability="7.5",
        # FP64 is not on the datasheet; TU104 runs it at 1/32 of the FP32 rate.
        tflops={"fp64": 0.25, "fp32": 8.1, "fp16": 65.0, "int8": 130.0},
        memory_bandwidth_gbps=320.0,
        features=("fp64", "fp32", "fp16", "int8", "tensor_cores"),
        nvlink_links=0,
        tdp_w=70,
        price_per_hour_usd=0.35,
        aliases=("T4",),
    ),
    GpuModel(
        name="V100-32GB",
        memory_bytes=32 * GiB,
        sm_count=80,
        compute_capability="7.0",
        # int8 is the DP4A (non-tensor-core) rate: four times the FP32 rate.
        tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125.0, "int8": 62.8},
        memory_bandwidth_gbps=900.0,
        features=("fp64", "fp32", "fp16", "int8", "tensor_cores", "hbm", "nvlink"),
        nvlink_links=6,
        tdp_w=300,
        price_per_hour_usd=0.80,
        aliases=("V100", "V100-SXM2-32GB"),
    ),
    GpuModel(
        name="V100-16GB",
        memory_bytes=16 * GiB,
        sm_count=80,
        compute_capability="7.0",
        tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125.0, "int8": 62.8},
        memory_bandwidth_gbps=900.0,
        features=("fp64", "fp32", "fp16", "int8", "tensor_cores", "hbm", "nvlink"),
        nvlink_links=6,
        tdp_w=300,
        price_per_hour_usd=0.55,
        aliases=("V100-SXM2-16GB",),
    ),
)

#: Canonical name -> model, in catalog order (newest first).
CATALOG: Mapping[str, GpuModel] = MappingProxyType({m.name: m for m in _MODELS})

_BY_KEY: dict[str, GpuModel] = {}
for _m in _MODELS:
    for _n in (_m.name, *_m.aliases):
        if _n.upper() in _BY_KEY:
            raise RuntimeError(f"duplicate catalog name or alias {_n!r}")  # a bug in this table
        _BY_KEY[_n.upper()] = _m


def known_names() -> list[str]:
    """Canonical catalog names, in catalog order."""
    return list(CATALOG)


def lookup_model(name: str, field_name: str = "model") -> GpuModel:
    """Find a catalog model by canonical name or alias, case-insensitively.

    A bare family name maps to the largest-memory SXM variant: ``H100`` is ``H100-80GB`` (SXM),
    ``A100`` is ``A100-80GB``, ``V100`` is ``V100-32GB``.

    Args:
        name: a name such as ``"H100-80GB"``, ``"h100"``, ``"A100-40GB"``.
        field_name: the field reported in the error.

    Returns:
        The catalog model.

    Raises:
        UnknownGpuModelError: ``name`` is not known; the message lists the known names.
    """
    model = _BY_KEY.get(name.strip().upper()) if isinstance(name, str) else None
    if model is None:
        raise UnknownGpuModelError(
            field_name,
            f"unknown GPU model {name!r}; known models: {', '.join(known_names())} "
            "(aliases: H200, H100, H100-PCIe, A100, L40S, A10, T4, V100)",
        )
    return model


# Family token -> catalog models of that family, for NVML product names.
_FAMILIES: dict[str, tuple[str, ...]] = {
    "H200": ("H200-141GB",),
    "H100": ("H100-80GB", "H100-PCIe-80GB"),
    "A100": ("A100-80GB", "A100-40GB"),
    "L40S": ("L40S-48GB",),
    "A10": ("A10-24GB",),
    "T4": ("T4-16GB",),
    "V100": ("V100-32GB", "V100-16GB"),
}
# Variants whose figures differ too much from the catalog entry of the family to borrow them.
_FOREIGN_TOKENS = frozenset({"NVL", "A10G", "A10M", "V100S"})
_MEM_TOKEN_RE = re.compile(r"^(\d+)GB$")


def match_nvml_name(name: str, memory_bytes: int | None = None) -> GpuModel | None:
    """Map an NVML product name to a catalog model, or None when it is not in the catalog.

    The family comes from the name (``"NVIDIA H100 80GB HBM3"``, ``"Tesla V100-SXM2-32GB"``,
    ``"NVIDIA A100-PCIE-40GB"``), the variant from ``PCIe`` in the name (H100) and from the
    memory size: the device's own total when given, else a ``NNGB`` token in the name. A device
    whose memory is more than 15 % away from every variant of its family is not matched.

    Args:
        name: the product name NVML reports (``nvmlDeviceGetName``).
        memory_bytes: the device's total memory, if known.

    Returns:
        The closest catalog model, or None.

    Example:
        >>> match_nvml_name("NVIDIA H100 80GB HBM3").name
        'H100-80GB'
    """
    tokens = [t for t in re.split(r"[\s_\-]+", name.upper()) if t]
    if any(t in _FOREIGN_TOKENS for t in tokens):
        return None
    family = next((t for t in tokens if t in _FAMILIES), None)
    if family is None:
        return None
    candidates = [CATALOG[n] for n in _FAMILIES[family]]
    if family == "H100":
        pcie = "PCIE" in tokens
        candidates = [m for m in candidates if ("PCIe" in m.name) == pcie]
    mem = memory_bytes
    if not mem:
        for t in tokens:
            m = _MEM_TOKEN_RE.match(t)
            if m:
                mem = int(m.group(1)) * GiB
    if not mem:
        return candidates[0]
    best = min(candidates, key=lambda c: abs(c.memory_bytes - mem))
    if abs(best.memory_bytes - mem) > 0.15 * best.memory_bytes:
        return None
    return best


def parse_price_overrides(text: str | None, field_name: str = PRICES_ENV) -> dict[str, float]:
    """Parse ``"H100-80GB=2.5,A100=1.2"`` into ``{canonical name: USD per GPU-hour}``.

    Args:
        text: the override list (for example the value of ``$GPUPOOL_GPU_PRICES``); empty or None
            gives no overrides.
        field_name: the field reported in errors.

    Raises:
        ConfigError: a piece is not ``MODEL=PRICE`` or the price is not a number >= 0.
        UnknownGpuModelError: a model is not in the catalog.
    """
    out: dict[str, float] = {}
    for piece in (text or "").split(","):
        piece = piece.strip()
        if not piece:
            continue
        model_name, sep, price_text = piece.partition("=")
        if not sep:
            raise ConfigError(field_name, f"{piece!r} is not MODEL=PRICE; write e.g. 'H100-80GB=2.5'")
        try:
            price = float(price_text)
        except ValueError:
            raise ConfigError(field_name, f"price {price_text!r} of {model_name!r} is not a number") from None
        if not price >= 0:
            raise ConfigError(field_name, f"price of {model_name!r} must be >= 0 USD per hour, got {price_text!r}")
        out[lookup_model(model_name, field_name).name] = price
    return out


def price_per_hour(model: str, overrides: Mapping[str, float] | None = None) -> float | None:
    """USD per GPU-hour of ``model``: the operator's override, else the catalog default.

    Args:
        model: a catalog name or alias (as published in ``GpuInfo.model``).
        overrides: canonical name -> price; None reads ``$GPUPOOL_GPU_PRICES``.

    Returns:
        The price, or None for a model outside the catalog (a real GPU the catalog does not know)
        that has no override.
    """
    if overrides is None:
        overrides = parse_price_overrides(os.environ.get(PRICES_ENV))
    try:
        canonical = lookup_model(model).name
    except UnknownGpuModelError:
        return overrides.get(model)
    return overrides.get(canonical, CATALOG[canonical].price_per_hour_usd)


def with_price(model: GpuModel, price_per_hour_usd: float) -> GpuModel:
    """A copy of ``model`` with another default price (for operator-built catalogs)."""
    if price_per_hour_usd < 0:
        raise ConfigError("price_per_hour_usd", f"must be >= 0, got {price_per_hour_usd}")
    return replace(model, price_per_hour_usd=price_per_hour_usd)
