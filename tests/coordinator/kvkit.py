"""Keys as one etcd range read returns them, for the snapshot tests (no etcd: ``build_state`` input)."""

from __future__ import annotations

from typing import Any

from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import LeaderRecord, NodeInfo
from gpupool_sdk.store.codec import encode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.types import KeyValue

KS = Keyspace("/t")
NOW = 1000.0


class Items:
    """Keys in put order: revisions grow, leases as given; ``raw`` stores bytes as they are."""

    def __init__(self) -> None:
        self.kvs: list[KeyValue] = []
        self.rev = 0

    def put(self, key: str, value: Any, lease: int = 0, raw: bytes | None = None) -> None:
        self.rev += 1
        body = raw if raw is not None else (encode(value, kind="dict") if isinstance(value, dict) else encode(value))
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        self.kvs.append(KeyValue(key, body, self.rev, self.rev, 1, lease))


def pool_items(cluster: str = "node-a:2xA100-40GB:pcie", leader: bool = False) -> Items:
    """An agent's GPU and node keys for ``cluster`` (one node), and a leader key when asked."""
    it = Items()
    gpus = parse_cluster_spec(cluster)
    for g in gpus:
        it.put(KS.gpu(g.node, g.uuid), g, lease=7)
    node = gpus[0].node
    it.put(KS.node(node), NodeInfo(name=node, hostname="test", agent_pid=1, gpu_count=len(gpus), backend="simulated",
                                   started_at=0.0), lease=7)  # fmt: skip
    if leader:
        it.put(KS.leader(), LeaderRecord("c1", 3, 1.0), lease=0xC)
    return it
