"""Inventory: the GPU catalog, simulated GPUs (``--simulate``) and the NVML backend.

* :mod:`~gpupool_sdk.inventory.catalog`: published figures of common models, ``lookup_model``.
* :mod:`~gpupool_sdk.inventory.simulated`: the ``--simulate`` grammar, ``parse_cluster_spec``.
* :mod:`~gpupool_sdk.inventory.health`: the health verdict, ``judge_health``.
* :mod:`~gpupool_sdk.inventory.base`: ``InventoryBackend`` and ``SimulatedBackend``.
* :mod:`~gpupool_sdk.inventory.nvml`: ``NvmlBackend`` (real GPUs, imported on demand).
"""

from gpupool_sdk.inventory.base import FaultFile, InventoryBackend, SimulatedBackend, simulated_backends
from gpupool_sdk.inventory.catalog import (
    CATALOG,
    GpuModel,
    known_names,
    lookup_model,
    match_nvml_name,
    parse_price_overrides,
    price_per_hour,
)
from gpupool_sdk.inventory.health import FATAL_XIDS, HealthSample, HealthThresholds, judge_health
from gpupool_sdk.inventory.simulated import NodeDecl, parse_cluster_spec, parse_nodes, simulated_uuid

__all__ = [
    "CATALOG",
    "FATAL_XIDS",
    "FaultFile",
    "GpuModel",
    "HealthSample",
    "HealthThresholds",
    "InventoryBackend",
    "NodeDecl",
    "SimulatedBackend",
    "judge_health",
    "known_names",
    "lookup_model",
    "match_nvml_name",
    "parse_cluster_spec",
    "parse_nodes",
    "parse_price_overrides",
    "price_per_hour",
    "simulated_backends",
    "simulated_uuid",
]
