"""Node-local leasing and multi-node gangs in the pure scheduler (scheduler/locality.py)."""

from __future__ import annotations

import pytest
from sched_helpers import gpus, job, only, run, running, snap

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import GangMember, JobSpec, JobState
from gpupool_sdk.scheduler import Grant, Preempt, Queue, Release
from gpupool_sdk.scheduler.locality import gang_problem

TWO = "node-a:2xA100-40GB:pcie,node-b:2xA100-40GB:pcie"


def members(name: str, *nodes: str, nnodes: int | None = None) -> tuple[GangMember, ...]:
    n = nnodes if nnodes is not None else len(nodes)
    return tuple(GangMember(job=name, node=node, node_rank=r, nnodes=n) for r, node in enumerate(nodes))


def test_a_job_on_node_a_is_granted_only_there() -> None:
    g = gpus(TWO)
    for node in ("node-a", "node-b"):
        d = only(run(snap(g, [job("x", memory="10GiB", node=node)])), "x")
        assert isinstance(d, Grant)
        assert {s.node for s in d.slices} == {node}


def test_a_job_on_a_full_node_waits_even_when_another_node_has_room() -> None:
    g = gpus(TWO)
    a = [x for x in g.values() if x.node == "node-a"]
    busy = running(job("busy", qos="exclusive", gpus=2, priority=5), a)
    d = only(run(snap(g, [busy, job("x", memory="10GiB", node="node-a")])), "x")
    assert isinstance(d, Queue)
    assert d.reason.startswith("queued: waiting for room on node node-a (1 other node has room)"), d.reason
    # The same job without a node takes node-b's room at once.
    d = only(run(snap(g, [busy, job("y", memory="10GiB")])), "y")
    assert isinstance(d, Grant) and {s.node for s in d.slices} == {"node-b"}


def test_a_node_restricted_job_preempts_only_on_its_node() -> None:
    g = gpus(TWO)
    a = [x for x in g.values() if x.node == "node-a"]
    b = [x for x in g.values() if x.node == "node-b"]
    low_a = running(job("low-a", qos="exclusive", gpus=2, priority=1), a)
    low_b = running(job("low-b", qos="exclusive", gpus=2, priority=0), b)
    out = run(snap(g, [low_a, low_b, job("hi", qos="exclusive", gpus=1, priority=10, node="node-a")]))
    preempted = {d.job for d in out if isinstance(d, Preempt)}
    # low-b is the cheaper victim, but its GPUs are on the wrong node.
    assert preempted == {"low-a"}


def test_a_job_on_an_unknown_node_waits_naming_it() -> None:
    d = only(run(snap(gpus(TWO), [job("x", memory="10GiB", node="node-z")])), "x")
    assert isinstance(d, Queue)
    assert "node-z: no GPU published (is its agent running?)" in d.reason
    assert "(2 other nodes have room)" in d.reason


def test_spec_node_and_nodes_are_validated() -> None:
    with pytest.raises(SpecError, match="node"):
        JobSpec(name="x", memory="1GiB", node="bad/name")
    with pytest.raises(SpecError, match="multiple of nodes"):
        JobSpec(name="x", memory="1GiB", gpus=3, nodes=2)
    with pytest.raises(SpecError, match="names no node"):
        JobSpec(name="x", memory="1GiB", gpus=2, nodes=2, node="node-a")
    with pytest.raises(SpecError, match="rigid"):
        JobSpec(name="x", memory="1GiB", gpus=2, nodes=2, max_gpus=4)
    spec = JobSpec(name="x", memory="1GiB", gpus=4, nodes=2)
    assert spec.gpus_per_node == 2
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert "node" not in JobSpec(name="y", memory="1GiB").to_dict()  # one-node specs read as before


@pytest.mark.parametrize(
    ("nodes", "nnodes", "expect"),
    [
        ((), 2, "waiting for 2 more gang members: 0 of 2 nodes joined (none yet)"),
        (("node-a",), 2, "waiting for 1 more gang member: 1 of 2 nodes joined (node-a as node rank 0)"),
        (("node-a", "node-b"), 3, "was started for 3 node(s) but the spec says nodes=2"),
        (("node-a", "node-b"), 2, None),
    ],
)
def test_gang_problem_table(nodes: tuple[str, ...], nnodes: int, expect: str | None) -> None:
    view = job("g", memory="1GiB", gpus=2, nodes=2)
    view = view.__class__(**{**view.__dict__, "members": members("g", *nodes, nnodes=nnodes)})
    got = gang_problem(view)
    if expect is None:
        assert got is None
    else:
        assert got is not None and expect in got


def test_gang_duplicate_rank_is_named() -> None:
    view = job("g", memory="1GiB", gpus=2, nodes=2)
    dup = (GangMember("g", "node-a", 0, 2), GangMember("g", "node-b", 0, 2))
    got = gang_problem(view.__class__(**{**view.__dict__, "members": dup}))
    assert got is not None and "both joined as node rank 0" in got


def _gang(name: str, *nodes: str, **spec: object) -> object:
    view = job(name, nodes=2, **spec)  # type: ignore[arg-type]
    return view.__class__(**{**view.__dict__, "members": members(name, *nodes, nnodes=2)})


def test_a_gang_waits_for_every_member_then_gets_each_nodes_part_at_once() -> None:
    g = gpus(TWO)
    half = _gang("g", "node-a", memory="10GiB", gpus=4)
    d = only(run(snap(g, [half])), "g")
    assert isinstance(d, Queue) and "waiting for 1 more gang member" in d.reason
    full = _gang("g", "node-b", "node-a", memory="10GiB", gpus=4)
    d = only(run(snap(g, [full])), "g")
    assert isinstance(d, Grant)
    per = {}
    for s in d.slices:
        per[s.node] = per.get(s.node, 0) + 1
    assert per == {"node-a": 2, "node-b": 2}


def test_a_gang_is_all_or_nothing_across_its_nodes() -> None:
    g = gpus(TWO)
    b0 = [x for x in g.values() if x.node == "node-b"][:1]
    other = running(job("other", qos="exclusive", gpus=1, priority=50), b0)
    gang = _gang("g", "node-a", "node-b", memory="10GiB", gpus=4, qos="guaranteed")
    out = run(snap(g, [other, gang]))
    d = only(out, "g")
    # node-a has room for its 2 slices, node-b only for 1: nothing is granted on either.
    assert isinstance(d, Queue), d
    assert "waiting for room on nodes node-a, node-b" in d.reason
    assert not any(isinstance(x, Grant) for x in out)


def test_a_gang_that_lost_a_member_is_released_on_every_node() -> None:
    g = gpus(TWO)
    both = list(g.values())
    full = _gang("g", "node-a", "node-b", memory="10GiB", gpus=4)
    held = running(full, both)
    assert not [d for d in run(snap(g, [held])) if isinstance(d, Release)]
    lost_b = held.__class__(**{**held.__dict__, "members": held.members[:1]})
    out = run(snap(g, [lost_b, job("next", memory="10GiB", node="node-b", gpus=2)]))
    rel = only(out, "g")
    assert isinstance(rel, Release) and rel.state is JobState.PENDING
    assert "no half-gang keeps a slice" in rel.reason and "1 of 2 nodes joined" in rel.reason
    # Its slices are free in the same cycle: the next job on node-b is granted there.
    assert isinstance(only(out, "next"), Grant)


def test_a_preempted_gang_is_released_only_when_every_node_acked() -> None:
    from dataclasses import replace as _replace

    from gpupool_sdk.resources import Ack, Directive, DirectiveKind

    g = gpus(TWO)
    held = running(_gang("g", "node-a", "node-b", memory="10GiB", gpus=4), list(g.values()))
    d = Directive(kind=DirectiveKind.PREEMPT, seq=3, deadline=100.0)
    rank0_acked = _replace(held, state=JobState.PREEMPTING, directive=d, ack=Ack(seq=3, step=7))
    out = run(snap(g, [rank0_acked], now=10.0))
    assert not [x for x in out if isinstance(x, Release)]  # node-b's ranks may still run
    both = _replace(rank0_acked, members=(held.members[0], _replace(held.members[1], acked_seq=3)))
    rel = only(run(snap(g, [both], now=10.0)), "g")
    assert isinstance(rel, Release) and rel.state is JobState.SUSPENDED


def test_a_hopeless_preemption_on_one_node_says_nothing_about_another() -> None:
    g = gpus(TWO)
    a = [x for x in g.values() if x.node == "node-a"]
    b = [x for x in g.values() if x.node == "node-b"]
    strong_a = running(job("strong-a", qos="exclusive", gpus=2, priority=50), a)
    weak_b = running(job("weak-b", qos="exclusive", gpus=2, priority=0), b)
    x = job("x", qos="exclusive", gpus=1, priority=10, node="node-a", order=1)
    y = job("y", qos="exclusive", gpus=1, priority=10, node="node-b", order=2)
    out = run(snap(g, [strong_a, weak_b, x, y]))
    assert isinstance(only(out, "x"), Queue)  # nobody on node-a may be preempted for it
    assert {d.job for d in out if isinstance(d, Preempt)} == {"weak-b"}  # y's search was not cut short
