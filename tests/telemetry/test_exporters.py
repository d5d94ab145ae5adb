"""The coordinator's and the agent's own exporters: scheduler counters, leadership, per-GPU health."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpupool_sdk.agent import NodeAgent
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator.coordinator import CycleReport
from gpupool_sdk.inventory import simulated_backends
from gpupool_sdk.resources import GpuHealth, GpuReadings, JobSpec
from gpupool_sdk.scheduler import types as st
from gpupool_sdk.telemetry.agent_metrics import AgentMetrics, serve_agent_metrics
from gpupool_sdk.telemetry.coordinator_metrics import CoordinatorMetrics, reason_code

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _scrape(collector: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    reg.register(collector)
    return _samples(generate_latest(reg).decode())


def _view(name: str, qos: str, queued_at: float) -> st.JobView:
    spec = JobSpec(name=name, gpus=1, memory="10GiB" if qos != "exclusive" else 0, qos=qos)
    return st.JobView(spec=spec, queued_at=queued_at)


@pytest.mark.parametrize(
    ("reason", "for_job", "code"),
    [
        ("impossible: no GPU of model B200 in the pool (models: H100-80GB)", None, "no_such_model"),
        ("impossible: needs 96.0GiB per slice; the largest matching GPU has 80.0GiB", None, "memory_too_large"),
        ("impossible: needs 64 GPU(s) but only 8 in the pool match", None, "too_many_gpus"),
        ("impossible: no GPU offers feature(s) fp8 (offered: bf16)", None, "missing_feature"),
        ("xid 79 (GPU has fallen off the bus); checkpoint and move", None, "unhealthy_gpu"),
        ("preempted to make room for llm (priority 10)", "llm", "priority"),
        ("migrate: defragmenting GPU-0 for llm (12.0GiB per slice); s fits now on GPU-1 (a)", "llm", "migrate"),
        ("something new", None, "other"),
        ("something new", "llm", "priority"),
    ],
)
def test_reason_codes_are_a_small_vocabulary(reason: str, for_job: str | None, code: str) -> None:
    assert reason_code(reason, for_job) == code


def test_cycle_reports_feed_counters_and_histograms() -> None:
    now = 10_000.0
    snap = st.ClusterSnapshot(
        now=now,
        gpus={},
        jobs={
            "a": _view("a", "guaranteed", now - 42),
            "b": _view("b", "shared", now - 5),
            "c": _view("c", "guaranteed", now),
            "victim": _view("victim", "shared", now - 999),
        },
    )
    report = CycleReport(
        term=3,
        revision=1,
        decisions=4,
        duration_s=0.02,
        decided=(
            st.Reject("c", "impossible: no GPU of model B200 in the pool (models: H100-80GB)"),
            st.Preempt("victim", "preempted to make room for a (priority 5)", deadline=now + 60, for_job="a"),
            st.Queue("b", "queued: needs 1 x GPU"),
        ),
        granted_jobs=("a", "b"),
        snapshot=snap,
    )
    m = CoordinatorMetrics(lambda: (True, 3, 2, 1))
    m.observe_cycle(report)
    m.observe_cycle(CycleReport(term=3, revision=2, decisions=0, duration_s=3.0, snapshot=snap))
    m.observe_cycle(CycleReport(term=3, revision=2, decisions=0, duration_s=0.001, snapshot=snap, skipped=True))
    s = _scrape(m)
    assert s[("gpupool_scheduler_cycles_total", ())] == 3
    assert s[("gpupool_scheduler_cycles_skipped_total", ())] == 1
    assert s[("gpupool_scheduler_cycle_duration_seconds_count", ())] == 3
    assert s[("gpupool_scheduler_cycle_duration_seconds_bucket", (("le", "0.025"),))] == 2
    assert s[("gpupool_scheduler_grants_total", (("qos", "guaranteed"),))] == 1
    assert s[("gpupool_scheduler_grants_total", (("qos", "shared"),))] == 1
    assert s[("gpupool_scheduler_rejections_total", (("qos", "guaranteed"), ("reason", "no_such_model")))] == 1
    assert s[("gpupool_scheduler_preemptions_total", (("qos", "shared"), ("reason", "priority")))] == 1
    assert s[("gpupool_scheduler_decisions_total", (("kind", "Queue"),))] == 1
    assert s[("gpupool_scheduler_queue_wait_seconds_sum", (("qos", "guaranteed"),))] == pytest.approx(42)
    assert s[("gpupool_scheduler_queue_wait_seconds_bucket", (("le", "5.0"), ("qos", "shared")))] == 1
    assert s[("gpupool_coordinator_is_leader", ())] == 1
    assert s[("gpupool_coordinator_term", ())] == 3
    assert s[("gpupool_coordinator_leader_changes_total", ())] == 2
    assert s[("gpupool_coordinator_demotions_total", ())] == 1


def test_agent_exports_per_gpu_health_with_dcgm_labels(store: Any) -> None:
    (backend,) = simulated_backends("node-m:2xH100-80GB:nvlink")
    agent = NodeAgent(store, backend, TIMING, refresh_interval_s=0.2)
    try:
        agent.start()
        g0, g1 = sorted(backend.gpus(), key=lambda g: g.index)
        backend.set_health(g1.uuid, GpuHealth(healthy=False, reasons=("xid 79",), temperature_c=71.0, xids=(79,),
                                              ecc_double_bit=0))
        agent.refresh()
        srv = serve_agent_metrics([agent], port=0, addr="127.0.0.1")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=30) as resp:
                s = _samples(resp.read().decode())
        finally:
            srv.close()
        host = agent.last_node_info.hostname if agent.last_node_info else "node-m"

        def labels(g: Any, **extra: str) -> tuple[tuple[str, str], ...]:
            base = {"node": "node-m", "Hostname": host, "UUID": g.uuid, "gpu": str(g.index), "modelName": "H100-80GB"}
            return tuple(sorted({**base, **extra}.items()))

        assert s[("gpupool_agent_node_registered", (("Hostname", host), ("node", "node-m")))] == 1
        assert s[("gpupool_agent_gpu_healthy", labels(g0))] == 1
        assert s[("gpupool_agent_gpu_healthy", labels(g1))] == 0
        assert s[("gpupool_agent_gpu_memory_bytes", labels(g0))] == g0.memory_bytes
        assert s[("gpupool_agent_gpu_temperature_celsius", labels(g1))] == 71.0
        assert s[("gpupool_agent_gpu_xid", labels(g1, xid="79"))] == 1
        assert s[("gpupool_agent_gpu_ecc_double_bit_errors", labels(g1))] == 0
    finally:
        agent.stop(revoke=True)
    # after stop the agent reports it is no longer registered
    s = _scrape(AgentMetrics([agent]))
    assert s[("gpupool_agent_node_registered", (("Hostname", host), ("node", "node-m")))] == 0


def test_agent_exports_per_gpu_usage_only_where_known(store: Any) -> None:
    (backend,) = simulated_backends("node-u:2xH100-80GB:nvlink")
    agent = NodeAgent(store, backend, TIMING, refresh_interval_s=0.2)
    try:
        agent.start()
        g0, g1 = sorted(backend.gpus(), key=lambda g: g.index)
        backend.set_readings(g1.uuid, GpuReadings(
            utilization=0.87, memory_bandwidth_utilization=0.42, memory_used_bytes=71 << 30,
            pcie_tx_bytes_per_s=1.5e9, pcie_rx_bytes_per_s=3e9, nvlink_tx_bytes_per_s=120e9, nvlink_rx_bytes_per_s=118e9,
        ))
        agent.refresh()
        s = _scrape(AgentMetrics([agent]))
    finally:
        agent.stop(revoke=True)
    host = agent.last_node_info.hostname if agent.last_node_info else "node-u"

    def labels(g: Any) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"node": "node-u", "Hostname": host, "UUID": g.uuid, "gpu": str(g.index),
                             "modelName": "H100-80GB"}.items()))

    want = {
        "gpupool_agent_gpu_utilization_ratio": 0.87,
        "gpupool_agent_gpu_memory_bandwidth_utilization_ratio": 0.42,
        "gpupool_agent_gpu_memory_used_bytes": float(71 << 30),
        "gpupool_agent_gpu_pcie_tx_bytes_per_second": 1.5e9,
        "gpupool_agent_gpu_pcie_rx_bytes_per_second": 3e9,
        "gpupool_agent_gpu_nvlink_tx_bytes_per_second": 120e9,
        "gpupool_agent_gpu_nvlink_rx_bytes_per_second": 118e9,
    }
    for name, value in want.items():
        assert s[(name, labels(g1))] == value, name
        assert (name, labels(g0)) not in s, name  # a simulated GPU has no readings: no series, not a 0


def test_resizes_are_counted_apart_from_preemptions() -> None:
    now = 10_000.0
    held = _view("el", "guaranteed", now - 100)
    snap = st.ClusterSnapshot(now=now, gpus={}, jobs={"el": held, "el2": _view("el2", "shared", now - 100)})
    have = len(held.allocations)
    report = CycleReport(
        term=3,
        revision=1,
        decisions=3,
        duration_s=0.01,
        decided=(
            st.Resize("el", have + 1, "nothing pending: grow", deadline=now + 60),
            st.Resize("el2", 0, "shrink from 1 to 0 GPU(s) to make room for p", deadline=now + 60, for_job="p"),
            st.Withdraw("el", "resize to 2 GPU(s) refused at step 3: no", retry_at=now + 300),
        ),
        snapshot=snap,
    )
    m = CoordinatorMetrics()
    m.observe_cycle(report)
    s = _scrape(m)
    assert s[("gpupool_scheduler_resizes_total", (("direction", "grow"), ("qos", "guaranteed")))] == 1
    assert s[("gpupool_scheduler_resizes_total", (("direction", "shrink"), ("qos", "shared")))] == 1
    assert s[("gpupool_scheduler_resize_refusals_total", (("qos", "guaranteed"),))] == 1
    assert not [k for k in s if k[0] == "gpupool_scheduler_preemptions_total"]
