"""Queue reasons name the GPUs and nodes that take no new slices, and why (issue 18 item 7).

Before: "queued: every matching GPU is unhealthy, cordoned or draining" named nothing, and a
node-restricted job on a node with no schedulable GPU got a guess ("agent not running, drained
or cordoned?"). Now the reason says which GPU on which node, and why, bounded in length.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, only, run, snap, unhealthy

from gpupool_sdk.resources import GpuInfo
from gpupool_sdk.scheduler import Grant, Queue
from gpupool_sdk.scheduler.health import HEALTH_TEXT_MAX, UNUSABLE_SHOWN, unusable_gpus

TWO = gpus("node-a:2xA100-40GB:pcie,node-b:2xA100-40GB:pcie")
A0, A1, B0, B1 = TWO.values()
HEAD = "queued: every matching GPU is unhealthy, cordoned or draining: "


def sick(g: GpuInfo, why: str = "xid 79") -> GpuInfo:
    return unhealthy(g, why)


# (case, GPUs, cordoned, draining, the job's extra spec fields, expected reason)
CASES = [
    (
        "one unhealthy (its XID), one cordoned, a draining node counted once",
        {A0.uuid: sick(A0), A1.uuid: A1, B0.uuid: B0, B1.uuid: B1},
        {A1.uuid},
        {"node-b"},
        {},
        HEAD + "GPU-sim-node-a-0 on node-a: unhealthy (xid 79); GPU-sim-node-a-1 on node-a: cordoned; "
        "node-b: draining (2 GPUs)",
    ),
    (
        "every GPU cordoned: all four named, nothing more",
        TWO,
        set(TWO),
        set(),
        {},
        HEAD + "GPU-sim-node-a-0 on node-a: cordoned; GPU-sim-node-a-1 on node-a: cordoned; "
        "GPU-sim-node-b-0 on node-b: cordoned; GPU-sim-node-b-1 on node-b: cordoned",
    ),
    (
        "both nodes draining",
        TWO,
        set(),
        {"node-a", "node-b"},
        {},
        HEAD + "node-a: draining (2 GPUs); node-b: draining (2 GPUs)",
    ),
    (
        "an unhealthy GPU of another model is not named",
        {**gpus("node-a:1xA100-40GB:pcie"), **{g.uuid: sick(g, "ecc") for g in gpus("node-h:1xH100-80GB:nvlink").values()}},
        set(),
        {"node-a"},
        {"gpu_model": "A100-40GB"},
        HEAD + "node-a: draining (1 GPU)",
    ),
    (
        "a node-restricted job on a draining node: which node and why, not a guess",
        TWO,
        set(),
        {"node-a"},
        {"node": "node-a"},
        "queued: waiting for room on node node-a (1 other node has room): node-a: draining (2 GPUs)",
    ),
    (
        "a node-restricted job whose node's GPUs are unhealthy",
        {A0.uuid: sick(A0, "xid 48"), A1.uuid: sick(A1, "temperature 95C"), B0.uuid: B0, B1.uuid: B1},
        set(),
        set(),
        {"node": "node-a"},
        "queued: waiting for room on node node-a (1 other node has room): "
        "GPU-sim-node-a-0 on node-a: unhealthy (xid 48); GPU-sim-node-a-1 on node-a: unhealthy (temperature 95C)",
    ),
    (
        "a node with no agent",
        TWO,
        set(),
        set(),
        {"node": "node-z"},
        "queued: waiting for room on node node-z (2 other nodes have room): "
        "node-z: no GPU published (is its agent running?)",
    ),
]


@pytest.mark.parametrize(
    ("gpu_map", "cordoned", "draining", "extra", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_queue_reason_names_gpus_nodes_and_why(
    gpu_map: dict[str, GpuInfo], cordoned: set[str], draining: set[str], extra: dict[str, object], expected: str
) -> None:
    s = snap(gpu_map, [job("n", memory="10GiB", **extra)], cordoned=frozenset(cordoned), draining=frozenset(draining))
    d = only(run(s), "n")
    assert isinstance(d, Queue)
    assert d.reason == expected


def test_many_unusable_gpus_are_bounded_first_few_then_a_count() -> None:
    pool = gpus(",".join(f"n{i:02d}:4xA100-40GB:pcie" for i in range(25)))  # 100 GPUs
    long_why = "xid 79 (GPU has fallen off the bus), " * 10
    bad = {u: sick(g, long_why) for u, g in pool.items()}
    d = only(run(snap(bad, [job("n", memory="10GiB")])), "n")
    assert isinstance(d, Queue)
    items = d.reason[len(HEAD):].split("; ")
    assert len(items) == UNUSABLE_SHOWN + 1
    assert items[0].startswith("GPU-sim-n00-0 on n00: unhealthy (xid 79 (GPU has fallen off the bus)")
    assert items[-1] == f"+{100 - UNUSABLE_SHOWN} more (see `gpupool status`)"
    # Each health text is clipped; the whole reason stays short whatever the pool's size.
    assert all(len(i) <= len("GPU-sim-n00-0 on n00: unhealthy ()") + HEALTH_TEXT_MAX for i in items)
    assert len(d.reason) < 600


def test_the_job_is_granted_once_a_gpu_is_back() -> None:
    s = snap(TWO, [job("n", memory="10GiB")], cordoned=frozenset({A0.uuid, A1.uuid, B0.uuid}))
    assert isinstance(only(run(s), "n"), Grant)


def test_empty_pool_and_no_match_say_so() -> None:
    empty = snap({}, [])
    assert unusable_gpus(empty) == "no GPU is published yet (start `gpupool agent` on each GPU machine)"
    assert unusable_gpus(snap(TWO, []), gpu_model="H100-80GB") == "no published GPU matches"
    other = replace(B0, node="node-c")
    assert unusable_gpus(snap({other.uuid: other}, []), gpu_model="H100-80GB", nodes=["node-c"]) == (
        "node-c: no matching GPU published"
    )
