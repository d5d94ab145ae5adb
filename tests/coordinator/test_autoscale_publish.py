"""The leader publishes the autoscale signal in etcd and as metrics (real etcd, in-process coordinator)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator, CycleReport
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec, JobState
from gpupool_sdk.scheduler.autoscale import AutoscaleSettings, AutoscaleSignal
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.telemetry.coordinator_metrics import CoordinatorMetrics

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)
A = "A100-40GB"


@pytest.fixture
def coord(store: EtcdStore) -> Iterator[tuple[Coordinator, CoordinatorMetrics, list[CycleReport]]]:
    publish_gpus(store, parse_cluster_spec("node-a:2xA100-40GB:pcie,node-b:2xA100-40GB:pcie"), ttl_s=60)
    metrics = CoordinatorMetrics()
    reports: list[CycleReport] = []

    def on_cycle(r: CycleReport) -> None:
        reports.append(r)
        metrics.observe_cycle(r)

    c = Coordinator(store, SchedulerConfig(), TIMING, "auto", loop_wait_s=0.5, on_cycle=on_cycle,
                    autoscale=AutoscaleSettings(scale_up_after_s=0, scale_down_idle_s=1.0))
    metrics.watch(c)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    try:
        yield c, metrics, reports
    finally:
        c.stop()
        t.join(20)
        assert not t.is_alive()


def _signal(store: EtcdStore) -> AutoscaleSignal | None:
    got = store.get_record(store.keys.autoscale(), AutoscaleSignal)
    return got[0] if got else None


def test_signal_follows_the_queue_and_names_idle_nodes(store: EtcdStore, coord: tuple[Coordinator, CoordinatorMetrics, list[CycleReport]]) -> None:
    c, metrics, reports = coord
    wait_for(lambda: c.is_leader, what="leadership")
    leases = []
    for name in ("first", "second"):
        lease = store.grant_lease(30)
        leases.append(lease)
        store.create(store.keys.job_spec(name), JobSpec(name=name, gpus=4, memory="8GiB"), lease=lease)
    # One 4-GPU job runs on the 4 GPUs; the other waits: 4 GPUs short, +2 nodes of 2.
    s = wait_for(lambda: (x := _signal(store)) is not None and x.desired.get(A) == 4 and x, what="a scale-up signal")
    assert s.current[A] == 2 and s.pending_gpus[A] == 4 and "+2 node(s)" in s.reasons[A]
    # The cycle that granted one of them computed its signal from the pool after the grant (its
    # snapshot was read before): the granted job is not demand, its GPUs are not free.
    granting = [r for r in list(reports) if r.granted_jobs]
    assert granting and granting[0].autoscale is not None
    first = granting[0]
    assert first.snapshot is not None
    still_waiting = [v for v in first.snapshot.jobs.values() if v.state is JobState.PENDING and v.name not in first.granted_jobs]
    assert first.autoscale.pending_gpus.get(A, 0) == 4 * len(still_waiting) and first.autoscale.free_gpus[A] == 0
    reg = CollectorRegistry()
    reg.register(metrics)
    text = generate_latest(reg).decode()
    assert 'gpupool_autoscale_desired_nodes{gpu_type="A100-40GB"} 4.0' in text
    assert 'gpupool_autoscale_current_nodes{gpu_type="A100-40GB"} 2.0' in text
    # Both jobs end: once the nodes have been idle a second, both are named for scale-down.
    for lease in leases:
        store.revoke_lease(lease)
    s = wait_for(lambda: (x := _signal(store)) is not None and x.desired.get(A) == 0 and x, what="a scale-down signal")
    assert sorted(s.scale_down[A]) == ["node-a", "node-b"]
    got = store.get_record(store.keys.autoscale(), AutoscaleSignal)
    assert got is not None and got[1].lease == 0  # no lease: it outlives a leader change


def test_autoscale_off_publishes_nothing(store: EtcdStore) -> None:
    publish_gpus(store, parse_cluster_spec("node-a:1xA100-40GB:pcie"), ttl_s=60)
    reports: list[CycleReport] = []
    c = Coordinator(store, SchedulerConfig(), TIMING, "off", loop_wait_s=0.5, on_cycle=reports.append, autoscale=None)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(reports) >= 3, what="three cycles")
        assert store.get(store.keys.autoscale()) is None and all(r.autoscale is None for r in reports)
    finally:
        c.stop()
        t.join(20)
