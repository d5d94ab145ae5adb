"""Autoscale signal: demand by type, idle nodes named, hysteresis, bounds (table-driven, pure)."""

from __future__ import annotations

import pytest
from sched_helpers import gpus, job, running, snap

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    AutoscaleSignal,
    NodeState,
    PendingDemand,
    autoscale,
    node_states,
)

S = AutoscaleSettings(scale_up_after_s=60, scale_down_idle_s=600)
H = "H100-80GB"


def busy(name: str, n: int = 8, t: str = H) -> NodeState:
    return NodeState(name, t, 8, n, None)


def idle(name: str, since: float, t: str = H) -> NodeState:
    return NodeState(name, t, 8, 0, since)


@pytest.mark.parametrize(
    ("nodes", "pending", "now", "desired", "down"),
    [
        # nothing pending, nothing idle long enough: steady
        ([busy("a"), idle("b", 900.0)], [], 1000.0, 2, ()),
        # idle 600 s with nothing pending: named for scale-down
        ([busy("a"), idle("b", 400.0)], [], 1000.0, 1, ("b",)),
        # oldest idle first
        ([idle("a", 100.0), idle("b", 50.0), busy("c")], [], 1000.0, 1, ("b", "a")),
        # a pending job keeps idle nodes (they may be what it is waiting for)
        ([busy("a"), idle("b", 0.0)], [PendingDemand("j", H, 4, 990.0)], 1000.0, 2, ()),
        # pending 12 GPUs for long enough, 0 free: +2 nodes of 8
        ([busy("a")], [PendingDemand("j", H, 12, 0.0)], 1000.0, 3, ()),
        # too recent to count: no scale-up yet (hysteresis on the way up)
        ([busy("a")], [PendingDemand("j", H, 12, 990.0)], 1000.0, 1, ()),
        # free GPUs cover part of the demand
        ([busy("a", 4)], [PendingDemand("j", H, 12, 0.0)], 1000.0, 2, ()),
        # a job without a model counts for the type with the most nodes
        ([busy("a"), busy("b"), busy("c", t="T4-16GB")], [PendingDemand("j", None, 8, 0.0)], 1000.0, 3, ()),
    ],
)
def test_rule(nodes: list[NodeState], pending: list[PendingDemand], now: float, desired: int, down: tuple[str, ...]) -> None:
    s = autoscale(nodes, pending, now, S)
    assert s.desired[H] == desired
    assert s.scale_down.get(H, ()) == down
    assert s.current[H] == sum(1 for n in nodes if n.gpu_type == H)


def test_a_type_with_no_nodes_yet_is_asked_for() -> None:
    s = autoscale([busy("a")], [PendingDemand("j", "A100-80GB", 2, 0.0)], 1000.0, AutoscaleSettings(gpus_per_node={"A100-80GB": 4}))
    assert (s.current["A100-80GB"], s.desired["A100-80GB"]) == (0, 1)


def test_bounds_and_previous_signal_hold_while_pending() -> None:
    s = autoscale([busy("a")], [PendingDemand("j", H, 800, 0.0)], 1000.0, AutoscaleSettings(max_nodes=5))
    assert s.desired[H] == 5
    assert autoscale([], [], 0.0, AutoscaleSettings(min_nodes=2)).desired == {}
    assert autoscale([idle("a", 0.0)], [], 1000.0, AutoscaleSettings(min_nodes=1)).desired[H] == 1
    # Asked for 3 nodes; one has arrived and taken some of the queue: keep asking for 3 while jobs still wait.
    prev = AutoscaleSignal(900.0, {H: 3}, {H: 1})
    s = autoscale([busy("a"), busy("b")], [PendingDemand("j", H, 2, 950.0)], 1000.0, S, prev)
    assert s.desired[H] == 3
    # Queue empty: the previous request no longer holds.
    assert autoscale([busy("a"), busy("b")], [], 1000.0, S, prev).desired[H] == 2


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="scale_up_after_s"):
        AutoscaleSettings(scale_up_after_s=-1)
    with pytest.raises(ConfigError, match="min_nodes"):
        AutoscaleSettings(min_nodes=3, max_nodes=2)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        AutoscaleSettings(gpus_per_node={H: 0})


def test_signal_round_trips() -> None:
    s = autoscale([busy("a"), idle("b", 0.0)], [], 1000.0, S)
    assert AutoscaleSignal.from_dict(s.to_dict()) == s


def test_autoscaler_on_snapshots_tracks_idle_time() -> None:
    g = gpus("n0:2xH100-80GB,n1:2xH100-80GB,mig:1xA100-80GB:mig=3g.40gb+3g.40gb")
    holder = running(job("r", memory="10GiB", compute_share=0.5), [g["GPU-sim-n0-0"]])
    mig_holder = running(job("m", memory="10GiB", mig_profile="3g.40gb"), [g["MIG-sim-mig-0-1"]])
    states = {n.name: n for n in node_states(snap(g, [holder, mig_holder], now=5.0), {})}
    assert (states["mig"].gpus, states["mig"].busy_gpus, states["mig"].gpu_type) == (1, 1, "A100-80GB")
    assert (states["n0"].busy_gpus, states["n1"].busy_gpus, states["n1"].idle_since) == (1, 0, 5.0)
    a = Autoscaler(S)
    assert a.update(snap(g, [holder, mig_holder], now=0.0)).desired[H] == 2
    assert a.update(snap(g, [holder, mig_holder], now=599.0)).desired[H] == 2  # n1 idle 599 s: kept
    s = a.update(snap(g, [holder, mig_holder], now=600.0))
    assert s.desired[H] == 1 and s.scale_down[H] == ("n1",)
    # n1 gets a job: its idle clock restarts.
    s = a.update(snap(g, [holder, mig_holder, running(job("x", memory="1GiB"), [g["GPU-sim-n1-0"]])], now=700.0))
    assert s.desired[H] == 2
    assert a.update(snap(g, [holder, mig_holder], now=1000.0)).desired[H] == 2
    assert a.update(snap(g, [holder, mig_holder], now=1599.0)).desired[H] == 2  # idle since 1000
    assert a.update(snap(g, [holder, mig_holder], now=1600.0)).scale_down[H] == ("n1",)


def test_slices_granted_after_the_snapshot_are_busy_and_their_jobs_are_not_demand() -> None:
    """The coordinator's snapshot is read before its grants: the signal must describe the pool after them."""
    from gpupool_sdk.scheduler.types import SliceGrant

    g = gpus("n0:2xH100-80GB,n1:2xH100-80GB")
    waiting = job("w", gpus=2, memory="10GiB")
    snapshot = snap(g, [waiting], now=1000.0)
    before = Autoscaler(AutoscaleSettings(scale_up_after_s=0, scale_down_idle_s=0)).update(snapshot)
    assert before.pending_gpus[H] == 2 and before.free_gpus[H] == 4 and not before.scale_down.get(H)
    slices = tuple(SliceGrant("n1", g[f"GPU-sim-n1-{i}"].uuid, i, 10 << 30, 1.0) for i in range(2))
    after = Autoscaler(AutoscaleSettings(scale_up_after_s=0, scale_down_idle_s=0)).update(snapshot, {"w": slices})
    assert after.pending_gpus[H] == 0 and after.free_gpus[H] == 2
    # n0 is idle with nothing pending: named; n1 holds the grant: kept.
    assert after.scale_down[H] == ("n0",) and after.desired[H] == 1
