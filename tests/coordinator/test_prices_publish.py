"""The leader publishes the price table it accrues with at ``{prefix}/prices``; reports read it (real etcd)."""

from __future__ import annotations

import threading

from testkit import publish_gpus, wait_for

from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.view import load_view

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


def test_leader_publishes_its_price_table_once_per_term(store: EtcdStore) -> None:
    publish_gpus(store, parse_cluster_spec("node-a:1xA100-40GB:pcie"), ttl_s=60)
    table = PriceTable(overrides={"A100-40GB": 1.25}, qos_factor={"shared": 0.4}, default_per_hour_usd=0.5)  # type: ignore[dict-item]
    c = Coordinator(store, SchedulerConfig(), TIMING, "p1", loop_wait_s=0.2, prices=table)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    try:
        view = wait_for(lambda: (v := load_view(store)).prices is not None and v, what="the published price table")
        got = view.price_table()
        assert got.price_per_hour("A100-40GB", "shared") == 1.25 * 0.4
        assert got.price_per_hour("no-such-model") == 0.5
        kv = store.get(store.keys.prices())
        assert kv is not None and kv.lease == 0  # no lease: it outlives a leader change
        # Later cycles of the same term do not rewrite it.
        cycles = c.stats.cycles
        wait_for(lambda: c.stats.cycles >= cycles + 3, what="three more cycles")
        again = store.get(store.keys.prices())
        assert again is not None and again.mod_revision == kv.mod_revision
    finally:
        c.stop()
        t.join(20)
        assert not t.is_alive()
