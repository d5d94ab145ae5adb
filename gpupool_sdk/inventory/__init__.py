"""Inventory: the GPU catalog, simulated GPUs (``--simulate``) and the NVML backend."""

from gpupool_sdk.inventory.catalog import (
    CATALOG,
    GpuModel,
    known_names,
    lookup_model,
    match_nvml_name,
    parse_price_overrides,
    price_per_hour,
)
from gpupool_sdk.inventory.simulated import NodeDecl, parse_cluster_spec, parse_nodes, simulated_uuid

__all__ = [
    "CATALOG",
    "GpuModel",
    "NodeDecl",
    "known_names",
    "lookup_model",
    "match_nvml_name",
    "parse_cluster_spec",
    "parse_nodes",
    "parse_price_overrides",
    "price_per_hour",
    "simulated_uuid",
]
