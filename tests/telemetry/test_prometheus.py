"""Prometheus collectors: pool metrics read from a real etcd, parsed with prometheus_client.parser."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpupool_sdk.errors import StoreUnavailableError
from gpupool_sdk.resources import GiB, JobState, JobStatus, NodeInfo
from gpupool_sdk.telemetry.prometheus import JobMetrics, PoolMetricsCollector, pool_metrics, serve_metrics
from gpupool_sdk.telemetry.usage import UsageRecord
from gpupool_sdk.telemetry.view import PoolView, load_view

from ._data import NOW, populate, prices, telemetry


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _scrape(collector: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reg = CollectorRegistry()
    reg.register(collector)
    return _samples(generate_latest(reg).decode())


def _get(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


A0 = {"node": "node-a", "Hostname": "host-a", "UUID": "GPU-a0", "gpu": "0", "modelName": "H100-80GB"}
A1 = {**A0, "UUID": "GPU-a1", "gpu": "1"}


def test_pool_metrics_from_real_etcd(store: Any) -> None:
    populate(store)
    store.put(store.keys.node("node-a"), NodeInfo("node-a", "host-a", 1, 2, "simulated", NOW - 60))
    store.put(store.keys.job_status("waiting"), JobStatus(state=JobState.PENDING, queued_at=NOW - 300, term=1))
    m = _scrape(PoolMetricsCollector(lambda: load_view(store, clock=lambda: NOW), prices(), min_interval_s=0))
    assert _get(m, "gpupool_store_up") == 1
    assert _get(m, "gpupool_gpus", node="node-a", model="H100-80GB", health="healthy") == 1
    assert _get(m, "gpupool_gpus", node="node-a", model="H100-80GB", health="unhealthy") == 1
    assert _get(m, "gpupool_node_info", node="node-a", Hostname="host-a", backend="simulated") == 1
    # dcgm-exporter's label names: UUID, the index as gpu, Hostname, modelName
    assert _get(m, "gpupool_gpu_memory_bytes", **A0) == 80 * GiB
    assert _get(m, "gpupool_gpu_memory_allocated_bytes", **A0) == 60 * GiB
    assert _get(m, "gpupool_gpu_compute_allocated_ratio", **A0) == pytest.approx(0.75)
    assert _get(m, "gpupool_gpu_cordoned", **A1) == 1
    assert _get(m, "gpupool_gpu_healthy", **A1) == 0
    assert _get(m, "gpupool_gpu_healthy", **A0) == 1
    assert _get(m, "gpupool_gpu_utilization_ratio", **A0) == pytest.approx(0.8)
    assert _get(m, "gpupool_gpu_memory_used_bytes", **A0) == 28 * GiB
    assert _get(m, "gpupool_slice_memory_allocated_bytes", job_name="bert", **A0) == 40 * GiB
    assert _get(m, "gpupool_slice_compute_share_ratio", job_name="loader", **A0) == pytest.approx(0.25)
    assert _get(m, "gpupool_jobs", state="GRANTED", qos="guaranteed") == 1
    assert _get(m, "gpupool_jobs", state="GRANTED", qos="shared") == 1
    assert _get(m, "gpupool_jobs", state="PENDING", qos="guaranteed") == 1
    assert _get(m, "gpupool_pending_jobs", qos="guaranteed") == 1
    assert _get(m, "gpupool_pending_jobs", qos="shared") == 0
    assert _get(m, "gpupool_job_pending_seconds", job_name="waiting", qos="guaranteed") == pytest.approx(300)
    assert _get(m, "gpupool_job_info", job_name="bert", state="GRANTED", qos="guaranteed", priority="5", owner="nlp") == 1
    assert _get(m, "gpupool_job_phase_seconds", job_name="bert", phase="backward") == pytest.approx(0.2)
    assert _get(m, "gpupool_job_phase_ratio", job_name="loader", phase="data") > 0.5
    assert _get(m, "gpupool_job_steps_per_second", job_name="bert") == 2.5
    assert _get(m, "gpupool_job_memory_peak_bytes", job_name="bert") == 10 * GiB
    assert _get(m, "gpupool_slice_utilization_ratio", job_name="loader", UUID="GPU-a0") == pytest.approx(0.2)
    assert _get(m, "gpupool_job_gpu_seconds_total", job_name="bert", qos="guaranteed") == 7200
    assert _get(m, "gpupool_job_cost_usd_total", job_name="bert", owner="nlp") == 8.0
    # base units: bytes x seconds, USD per second
    assert _get(m, "gpupool_job_memory_byte_seconds_total", job_name="bert") == 0
    # bert: max(0.5, 40/80) * $4; loader: max(0.25, 20/80) * $4 * 0.5 (per hour)
    assert _get(m, "gpupool_job_cost_usd_per_second", job_name="bert", owner="nlp") == pytest.approx(2.0 / 3600)
    assert _get(m, "gpupool_job_cost_usd_per_second", job_name="loader", owner="cv") == pytest.approx(0.5 / 3600)
    assert _get(m, "gpupool_leader_term") == 7
    assert _get(m, "gpupool_malformed_values") == 1  # telemetry/broken, skipped
    # old-run finished long ago (last charged at time 0): its series have expired
    assert not any(dict(labels).get("job_name") == "old-run" for _, labels in m)
    assert not any(dict(labels).get("job") for _, labels in m), "the job label belongs to Prometheus"


def test_finished_job_series_expire_after_the_ttl() -> None:
    view = PoolView(now=NOW, usage={
        "done-recently": UsageRecord("done-recently", owner="a", gpu_seconds=10.0, last_seen=NOW - 60),
        "done-long-ago": UsageRecord("done-long-ago", owner="a", gpu_seconds=10.0, last_seen=NOW - 7200),
    })
    names = {
        dict(s.labels).get("job_name")
        for fam in pool_metrics(view, prices(), finished_ttl_s=900)
        for s in fam.samples
        if fam.name == "gpupool_job_gpu_seconds"
    }
    assert names == {"done-recently"}


def test_unreachable_store_answers_with_store_up_zero() -> None:
    def down() -> PoolView:
        raise StoreUnavailableError("etcd at 127.0.0.1:1 unreachable")

    m = _scrape(PoolMetricsCollector(down, prices()))
    assert _get(m, "gpupool_store_up") == 0
    assert not any(name == "gpupool_gpus" for name, _ in m)


def test_scrapes_within_min_interval_reuse_the_read() -> None:
    reads = []

    def source() -> PoolView:
        reads.append(1)
        return PoolView(now=0.0)

    t = [0.0]
    c = PoolMetricsCollector(source, prices(), min_interval_s=10.0, clock=lambda: t[0])
    _scrape(c)
    list(c.collect())
    assert len(reads) == 1
    t[0] = 11.0
    list(c.collect())
    assert len(reads) == 2


def test_serve_metrics_over_http(store: Any) -> None:
    populate(store)
    srv = serve_metrics(store, port=0, addr="127.0.0.1", prices=prices())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=30) as resp:
            m = _samples(resp.read().decode())
    finally:
        srv.close()
    assert _get(m, "gpupool_job_cost_usd_total", job_name="bert", owner="nlp") == 8.0


def test_job_side_exporter() -> None:
    jm = JobMetrics()
    assert _samples(generate_latest(jm.registry).decode()) == {}
    jm.update(telemetry("bert", checkpoint=0.1))
    srv = jm.serve(port=0)  # loopback by default
    assert srv.server.server_address[0] == "127.0.0.1"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=30) as resp:
            m = _samples(resp.read().decode())
    finally:
        srv.close()
    assert _get(m, "gpupool_job_phase_seconds", job_name="bert", phase="checkpoint") == pytest.approx(0.1)
    assert _get(m, "gpupool_job_gpu_utilization_ratio", job_name="bert") == pytest.approx(0.8)
    assert _get(m, "gpupool_job_step", job_name="bert") == 1234
