"""``gpupool place``'s pure answer: which nodes could take a shape now (scheduler/place_query.py)."""

from __future__ import annotations

from sched_helpers import gpus, job, running, snap

from gpupool_sdk.resources import JobSpec
from gpupool_sdk.scheduler.place_query import query_placement

POOL = "node-a:4xA100-80GB:pcie,node-b:4xA100-80GB:pcie,node-c:2xA100-80GB:pcie"


def test_nodes_are_ranked_best_fit_first() -> None:
    g = gpus(POOL)
    a = [x for x in g.values() if x.node == "node-a"]
    busy = running(job("busy", qos="exclusive", gpus=2), a[:2])
    ans = query_placement(snap(g, [busy]), JobSpec(name="q", gpus=2, memory="40GiB"))
    assert ans.fits
    # node-a and node-c have exactly 2 free GPUs (best fit), node-b 4; ties by name.
    assert [f.node for f in ans.ranked] == ["node-a", "node-c", "node-b"]
    assert ans.chosen == ("node-a",)
    assert all(u.node in {f.node for f in ans.ranked} or u.reason for u in ans.unfit)


def test_a_multi_node_shape_needs_that_many_nodes_with_room() -> None:
    g = gpus(POOL)
    ans = query_placement(snap(g, []), JobSpec(name="q", gpus=8, nodes=2, memory="40GiB"))
    assert ans.fits and ans.chosen == ("node-a", "node-b")  # node-c has only 2 GPUs
    (c,) = ans.unfit
    assert c.node == "node-c" and "2 of 2 matching GPUs have room for a slice, 4 needed" in c.reason
    ans = query_placement(snap(g, []), JobSpec(name="q", gpus=9, nodes=3, memory="40GiB"))
    assert not ans.fits and not ans.impossible
    assert ans.reason.startswith("only 2 of 3 nodes could take 3 x 40.0GiB")


def test_an_impossible_shape_says_so() -> None:
    ans = query_placement(snap(gpus(POOL), []), JobSpec(name="q", gpus=1, memory="100GiB"))
    assert not ans.fits and ans.impossible and "largest matching GPU has 80.0GiB" in ans.reason
