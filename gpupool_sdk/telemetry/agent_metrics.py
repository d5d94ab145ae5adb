"""The node agent's metrics: per-GPU health, memory, temperature, power, ECC, XID and usage.

:class:`AgentMetrics` reads what each :class:`~gpupool_sdk.agent.agent.NodeAgent` of the process
read at its last refresh (no NVML call per scrape). The usage series (utilisation, memory
bandwidth, memory used, PCIe and NVLink bytes/s) are exported only for GPUs whose reading is known:
a simulated GPU, a MIG instance or an unsupported call gives no series rather than a 0. They are
every refresh's readings (:attr:`~gpupool_sdk.agent.agent.NodeAgent.last_readings`, the
:class:`~gpupool_sdk.resources.GpuReadings` the agent publishes under ``readings/{node}/{gpu}``
at most once per ``--usage-interval``; see :mod:`gpupool_sdk.agent.agent`). GPU series carry dcgm-exporter's labels
(``UUID``, ``gpu`` = index, ``Hostname``, ``modelName``) and the pool's ``node``.
``gpupool agent --metrics-port 9401 --metrics-addr ADDR`` serves it.

Example:
    >>> from prometheus_client import CollectorRegistry, generate_latest
    >>> reg = CollectorRegistry()
    >>> reg.register(AgentMetrics([]))
    >>> b"gpupool_agent_nodes 0.0" in generate_latest(reg)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpupool_sdk.telemetry.prometheus import GPU_LABELS, MetricsServer, _serve, gpu_label_values


class AgentMetrics(Collector):
    """Collector over the node agents of one process.

    Args:
        agents: the :class:`~gpupool_sdk.agent.agent.NodeAgent` objects (one per node).
    """

    def __init__(self, agents: Sequence[Any]) -> None:
        self._agents = list(agents)

    def collect(self) -> Iterator[Metric]:
        gl = list(GPU_LABELS)
        nodes = GaugeMetricFamily("gpupool_agent_nodes", "Nodes this agent process publishes.")
        nodes.add_metric([], len(self._agents))
        registered = GaugeMetricFamily(
            "gpupool_agent_node_registered", "1 while the node is published under a live etcd lease.",
            labels=["node", "Hostname"],
        )
        refreshes = CounterMetricFamily("gpupool_agent_refreshes", "Health refreshes done.", labels=["node"])
        registrations = CounterMetricFamily(
            "gpupool_agent_registrations", "Times the node was (re)registered under a new lease.", labels=["node"]
        )
        healthy = GaugeMetricFamily("gpupool_agent_gpu_healthy", "1 when the GPU passes every health rule.", labels=gl)
        mem = GaugeMetricFamily("gpupool_agent_gpu_memory_bytes", "Physical device memory.", labels=gl)
        temp = GaugeMetricFamily("gpupool_agent_gpu_temperature_celsius", "GPU core temperature.", labels=gl)
        power = GaugeMetricFamily("gpupool_agent_gpu_power_watts", "GPU power draw.", labels=gl)
        ecc = GaugeMetricFamily(
            "gpupool_agent_gpu_ecc_double_bit_errors",
            "Volatile (since driver load) uncorrectable ECC errors; above 0 the GPU is unhealthy.",
            labels=gl,
        )
        xid = GaugeMetricFamily(
            "gpupool_agent_gpu_xid", "1 for each XID code the agent has seen on the GPU.", labels=[*gl, "xid"]
        )
        usage = {
            name: GaugeMetricFamily(metric, help_text, labels=gl)
            for name, metric, help_text in (
                ("utilization", "gpupool_agent_gpu_utilization_ratio",
                 "Fraction of the last sample period a kernel ran on the GPU (any process; NVML utilization.gpu)."),
                ("memory_bandwidth_utilization", "gpupool_agent_gpu_memory_bandwidth_utilization_ratio",
                 "Fraction of the last sample period device memory was read or written (NVML utilization.memory)."),
                ("memory_used_bytes", "gpupool_agent_gpu_memory_used_bytes",
                 "Device memory in use by every process on the GPU."),
                ("pcie_tx_bytes_per_s", "gpupool_agent_gpu_pcie_tx_bytes_per_second", "PCIe throughput, GPU to host."),
                ("pcie_rx_bytes_per_s", "gpupool_agent_gpu_pcie_rx_bytes_per_second", "PCIe throughput, host to GPU."),
                ("nvlink_tx_bytes_per_s", "gpupool_agent_gpu_nvlink_tx_bytes_per_second",
                 "NVLink data sent, summed over the GPU's links."),
                ("nvlink_rx_bytes_per_s", "gpupool_agent_gpu_nvlink_rx_bytes_per_second",
                 "NVLink data received, summed over the GPU's links."),
            )
        }
        for a in self._agents:
            info = a.last_node_info
            host = info.hostname if info is not None else None
            registered.add_metric([a.node, host or a.node], 1 if a.registered else 0)
            refreshes.add_metric([a.node], a.refreshes)
            registrations.add_metric([a.node], a.registrations)
            readings = a.last_readings
            for g in sorted(a.last_gpus, key=lambda g: (g.index, g.uuid)):
                lv = gpu_label_values(g, host)
                h = g.health
                healthy.add_metric(lv, 1 if h.healthy else 0)
                mem.add_metric(lv, g.memory_bytes)
                if h.temperature_c is not None:
                    temp.add_metric(lv, h.temperature_c)
                if h.power_w is not None:
                    power.add_metric(lv, h.power_w)
                if h.ecc_double_bit is not None:
                    ecc.add_metric(lv, h.ecc_double_bit)
                for code in h.xids:
                    xid.add_metric([*lv, str(code)], 1)
                r = readings.get(g.uuid)
                for name, family in usage.items():
                    value = getattr(r, name) if r is not None else None
                    if value is not None:
                        family.add_metric(lv, value)
        yield from (nodes, registered, refreshes, registrations, healthy, mem, temp, power, ecc, xid)
        yield from usage.values()


def serve_agent_metrics(agents: Sequence[Any], port: int, addr: str) -> MetricsServer:
    """Serve :class:`AgentMetrics` at ``http://addr:port/metrics`` on a daemon thread.

    Raises:
        ConfigError: the port is invalid or taken.
    """
    registry = CollectorRegistry()
    registry.register(AgentMetrics(agents))
    return _serve(registry, port, addr)
