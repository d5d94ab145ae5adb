"""Write gpupool-dashboard.json, the Grafana dashboard of a gpupool pool.

Several exporters report the same pool (each coordinator replica, ``gpupool metrics serve``):
pool-wide panels take ``max by`` the object's own labels before summing.

Run ``python deploy/monitoring/make_dashboard.py`` after editing the panels below; the JSON is
committed, and tests/deploy checks that it is what this script writes and that every query runs
on a real Prometheus (tests/telemetry/test_prometheus_live.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}

# (title, [(expr, legend)], unit, kind, width)
ROWS: list[tuple[str, list[tuple[str, list[tuple[str, str]], str, str, int]]]] = [
    ("Pool", [
        ("GPUs healthy", [("sum(max by (UUID) (gpupool_gpu_healthy))", "healthy")], "none", "stat", 4),
        ("GPUs unhealthy", [("count(max by (UUID) (gpupool_gpu_healthy) == 0) or vector(0)", "unhealthy")], "none", "stat", 4),
        ("Leader term", [("max(gpupool_leader_term)", "term")], "none", "stat", 4),
        ("etcd reachable", [("min(gpupool_store_up)", "store up")], "none", "stat", 4),
        ("Nodes", [("count(max by (node) (gpupool_node_info)) or vector(0)", "nodes")], "none", "stat", 4),
        ("Pending jobs", [("sum(max by (qos) (gpupool_pending_jobs))", "pending")], "none", "stat", 4),
        ("Memory granted / physical", [
            ("sum(max by (UUID) (gpupool_gpu_memory_allocated_bytes)) / sum(max by (UUID) (gpupool_gpu_memory_bytes))",
             "granted"),
        ], "percentunit", "timeseries", 12),
        ("Compute granted per GPU", [
            ("max by (Hostname, gpu) (gpupool_gpu_compute_allocated_ratio)", "{{Hostname}} gpu {{gpu}}"),
        ], "percentunit", "timeseries", 12),
        ("Measured SM utilisation per GPU", [
            ("max by (Hostname, gpu) (gpupool_gpu_utilization_ratio)", "{{Hostname}} gpu {{gpu}}"),
        ], "percentunit", "timeseries", 12),
        ("GPU temperature (agent)", [
            ("max by (Hostname, gpu) (gpupool_agent_gpu_temperature_celsius)", "{{Hostname}} gpu {{gpu}}"),
        ], "celsius", "timeseries", 12),
        ("Device utilisation per GPU (agent: any process)", [
            ("max by (Hostname, gpu) (gpupool_agent_gpu_utilization_ratio)", "{{Hostname}} gpu {{gpu}}"),
        ], "percentunit", "timeseries", 12),
        ("Memory bandwidth utilisation per GPU (agent)", [
            ("max by (Hostname, gpu) (gpupool_agent_gpu_memory_bandwidth_utilization_ratio)", "{{Hostname}} gpu {{gpu}}"),
        ], "percentunit", "timeseries", 12),
        ("PCIe and NVLink throughput per node (agent)", [
            ("sum by (Hostname) (gpupool_agent_gpu_pcie_tx_bytes_per_second)", "{{Hostname}} PCIe TX"),
            ("sum by (Hostname) (gpupool_agent_gpu_pcie_rx_bytes_per_second)", "{{Hostname}} PCIe RX"),
            ("sum by (Hostname) (gpupool_agent_gpu_nvlink_tx_bytes_per_second)", "{{Hostname}} NVLink TX"),
            ("sum by (Hostname) (gpupool_agent_gpu_nvlink_rx_bytes_per_second)", "{{Hostname}} NVLink RX"),
        ], "Bps", "timeseries", 12),
        ("Device memory used per GPU (agent: any process)", [
            ("max by (Hostname, gpu) (gpupool_agent_gpu_memory_used_bytes)", "{{Hostname}} gpu {{gpu}}"),
        ], "bytes", "timeseries", 12),
    ]),
    ("Queue and scheduler", [
        ("Pending jobs by QoS", [("max by (qos) (gpupool_pending_jobs)", "{{qos}}")], "none", "timeseries", 8),
        ("Longest waits", [("topk(10, max by (job_name, qos) (gpupool_job_pending_seconds))", "{{job_name}} ({{qos}})")],
         "s", "timeseries", 8),
        ("Queue wait p50 / p95", [
            ("histogram_quantile(0.5, sum by (le) (rate(gpupool_scheduler_queue_wait_seconds_bucket[$__rate_interval])))",
             "p50"),
            ("histogram_quantile(0.95, sum by (le) (rate(gpupool_scheduler_queue_wait_seconds_bucket[$__rate_interval])))",
             "p95"),
        ], "s", "timeseries", 8),
        ("Grants, preemptions, rejections", [
            ("sum by (qos) (rate(gpupool_scheduler_grants_total[$__rate_interval]))", "grants {{qos}}"),
            ("sum by (reason) (rate(gpupool_scheduler_preemptions_total[$__rate_interval]))", "preemptions {{reason}}"),
            ("sum by (reason) (rate(gpupool_scheduler_rejections_total[$__rate_interval]))", "rejections {{reason}}"),
        ], "ops", "timeseries", 12),
        ("Scheduling cycle p99", [
            ("histogram_quantile(0.99, sum by (le) (rate(gpupool_scheduler_cycle_duration_seconds_bucket[$__rate_interval])))",
             "p99"),
        ], "s", "timeseries", 6),
        ("Leader changes", [("sum(increase(gpupool_coordinator_leader_changes_total[1h]))", "per hour")],
         "none", "timeseries", 6),
    ]),
    ("Jobs", [
        ("Phase share of step time", [
            ("max by (job_name, phase) (gpupool_job_phase_ratio)", "{{job_name}} {{phase}}"),
        ], "percentunit", "timeseries", 12),
        ("Steps per second", [("max by (job_name) (gpupool_job_steps_per_second)", "{{job_name}}")],
         "none", "timeseries", 12),
        ("Memory peak per slice", [("max by (job_name) (gpupool_job_memory_peak_bytes)", "{{job_name}}")],
         "bytes", "timeseries", 12),
        ("Telemetry age", [("time() - max by (job_name) (gpupool_job_telemetry_timestamp_seconds)", "{{job_name}}")],
         "s", "timeseries", 12),
    ]),
    ("Cost", [
        ("Cost rate by owner", [
            ("sum by (owner) (max by (job_name, owner) (gpupool_job_cost_usd_per_second)) * 3600", "{{owner}}"),
        ], "currencyUSD", "timeseries", 12),
        ("Cost in the range by owner", [
            ("sum by (owner) (increase(gpupool_job_cost_usd_total[$__range]))", "{{owner}}"),
        ], "currencyUSD", "bargauge", 12),
    ]),
]


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, kind: str, x: int, y: int, w: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 4 if kind == "stat" else 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard document."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for title, targets, unit, kind, w in row:
            if x + w > 24:
                x, y, row_h = 0, y + row_h, 0
            p = _panel(pid, title, targets, unit, kind, x, y, w)
            panels.append(p)
            pid, x, row_h = pid + 1, x + w, max(row_h, p["gridPos"]["h"])
        y += row_h
    return {
        "uid": "gpupool-pool",
        "title": "gpupool: pool, queue, jobs, cost",
        "tags": ["gpupool"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The dashboard as the committed JSON text."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    Path(__file__).with_name("gpupool-dashboard.json").write_text(render())
