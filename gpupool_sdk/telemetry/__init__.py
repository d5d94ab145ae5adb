"""Telemetry: phase timing, NVML sampling, Prometheus metrics, usage and cost, right-sizing advice.

Importing this package is cheap (no torch, no NVML, no prometheus_client): the names below are
loaded from their modules on first use.

* :mod:`~gpupool_sdk.telemetry.phases`: phase enum and timers (training side).
* :mod:`~gpupool_sdk.telemetry.summary`: :class:`TelemetrySummary`, the ``telemetry/{job}`` record.
* :mod:`~gpupool_sdk.telemetry.nvml_sampler`: :class:`NvmlSampler`, per-GPU/per-process NVML sampling.
* :mod:`~gpupool_sdk.telemetry.usage`: :class:`UsageRecord`, :class:`UsageLedger`, :func:`accrue` (``usage/{job}``).
* :mod:`~gpupool_sdk.telemetry.pricing`: :class:`PriceTable` (catalog prices + operator overrides).
* :mod:`~gpupool_sdk.telemetry.advice`: :func:`advise`, right-sizing rules.
* :mod:`~gpupool_sdk.telemetry.prometheus`: :class:`PoolMetricsCollector`, :func:`serve_metrics`, :class:`JobMetrics`.
* :mod:`~gpupool_sdk.telemetry.coordinator_metrics`: :class:`CoordinatorMetrics` (scheduler counters, leadership).
* :mod:`~gpupool_sdk.telemetry.agent_metrics`: :class:`AgentMetrics`, :func:`serve_agent_metrics` (per-GPU health).
* :mod:`~gpupool_sdk.telemetry.view` / :mod:`~gpupool_sdk.telemetry.report`: read-only pool view and reports.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "PHASES": "summary",
    "SliceTelemetry": "summary",
    "TelemetrySummary": "summary",
    "from_phase_timer": "summary",
    "GpuSample": "nvml_sampler",
    "NvmlSampler": "nvml_sampler",
    "NvmlSnapshot": "nvml_sampler",
    "OwnerTotal": "usage",
    "UsageLedger": "usage",
    "UsageRecord": "usage",
    "accrue": "usage",
    "hourly_cost": "usage",
    "ModelOffer": "pricing",
    "PriceTable": "pricing",
    "catalog_offers": "pricing",
    "Advice": "advice",
    "AdviceKind": "advice",
    "AdviceSettings": "advice",
    "advise": "advice",
    "JobMetrics": "prometheus",
    "MetricsServer": "prometheus",
    "PoolMetricsCollector": "prometheus",
    "serve_metrics": "prometheus",
    "CoordinatorMetrics": "coordinator_metrics",
    "reason_code": "coordinator_metrics",
    "AgentMetrics": "agent_metrics",
    "serve_agent_metrics": "agent_metrics",
    "PoolView": "view",
    "load_view": "view",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
