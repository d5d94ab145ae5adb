"""Protocol stage (acks, deadlines) and health / drain stage (table-driven)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, only, run, running, snap, unhealthy

from gpupool_sdk.resources import Ack, Directive, DirectiveKind, GiB, JobState
from gpupool_sdk.scheduler import (
    Grant,
    Preempt,
    Queue,
    Release,
    Revoke,
    SchedulerConfig,
    Shrink,
    build_ledger,
)
from gpupool_sdk.scheduler.health import health_preemptions
from gpupool_sdk.scheduler.protocol import handle_protocol

POOL = gpus("a:2xH100-80GB:nvlink,b:2xH100-80GB:nvlink")
A0, A1, B0, B1 = POOL.values()


def directed(kind: DirectiveKind, *, seq: int = 3, deadline: float = 100.0, ack_seq: int | None = None,
             target: dict | None = None, ack_ok: bool = True, reached: int | None = None, **spec: object):
    base = job("v", memory=spec.pop("memory", "30GiB"), **spec)  # type: ignore[arg-type]
    view = running(base, [A0], state=JobState.PREEMPTING if kind is not DirectiveKind.BALLOON else JobState.GRANTED)
    ack = None if ack_seq is None else Ack(seq=ack_seq, step=42, checkpoint="/ck/42", ok=ack_ok, reached_bytes=reached)
    return replace(view, directive=Directive(kind=kind, seq=seq, deadline=deadline, target=target or {}), ack=ack)


CASES = [
    # (name, view, now, expected decision type or None, ledger freed?)
    ("preempt acked", directed(DirectiveKind.PREEMPT, ack_seq=3), 10.0, Release, True),
    ("preempt stale ack", directed(DirectiveKind.PREEMPT, ack_seq=2), 10.0, None, False),
    ("preempt past deadline", directed(DirectiveKind.PREEMPT, ack_seq=2), 101.0, Revoke, True),
    ("preempt at deadline not yet", directed(DirectiveKind.PREEMPT), 100.0, None, False),
    ("resize acked", directed(DirectiveKind.RESIZE, ack_seq=3, target={"gpus": 2}, gpus=1, max_gpus=2), 10.0, Release, True),
    ("resize past deadline", directed(DirectiveKind.RESIZE, target={"gpus": 2}, gpus=1, max_gpus=2), 200.0, Revoke, True),
    ("balloon acked", directed(DirectiveKind.BALLOON, ack_seq=3, reached=12 * GiB, target={"memory_bytes": 10 * GiB},
                               qos="shared"), 10.0, Shrink, True),
    ("balloon refused", directed(DirectiveKind.BALLOON, ack_seq=3, ack_ok=False, target={"memory_bytes": GiB},
                                 qos="shared"), 10.0, Preempt, False),
    ("balloon past deadline", directed(DirectiveKind.BALLOON, target={"memory_bytes": GiB}, qos="shared"), 101.0, Preempt,
     False),
    ("deflate needs nothing", directed(DirectiveKind.DEFLATE, ack_seq=3, qos="shared"), 10.0, None, False),
]


@pytest.mark.parametrize(("name", "view", "now", "kind", "freed"), CASES, ids=[c[0] for c in CASES])
def test_protocol(name: str, view, now: float, kind: type | None, freed: bool) -> None:
    s = snap(POOL, [view], now=now)
    cfg = SchedulerConfig()
    ledger = build_ledger(s, cfg)
    before = ledger.loads[0].copy()
    out = handle_protocol(s, ledger, cfg)
    if kind is None:
        assert out.decisions == []
    else:
        (d,) = out.decisions
        assert isinstance(d, kind) and d.job == "v"
    assert (ledger.loads[0] != before) is freed


def test_release_states_and_shrink_bytes() -> None:
    cfg = SchedulerConfig()
    s = snap(POOL, [directed(DirectiveKind.PREEMPT, ack_seq=3)], now=1.0)
    (d,) = handle_protocol(s, build_ledger(s, cfg), cfg).decisions
    assert isinstance(d, Release) and d.state is JobState.SUSPENDED and "step 42" in d.reason
    s = snap(POOL, [directed(DirectiveKind.RESIZE, ack_seq=3, target={"gpus": 2}, gpus=1, max_gpus=2)], now=1.0)
    out = handle_protocol(s, build_ledger(s, cfg), cfg)
    assert out.decisions[0].state is JobState.PENDING and out.requeued == {"v": 2}
    # A balloon ack above the current quota never grows it.
    s = snap(POOL, [directed(DirectiveKind.BALLOON, ack_seq=3, reached=50 * GiB, qos="shared")], now=1.0)
    (d,) = handle_protocol(s, build_ledger(s, cfg), cfg).decisions
    assert isinstance(d, Shrink) and d.memory_bytes == 30 * GiB
    # An ack below the target keeps the target: the offloaded state comes back for each optimizer step.
    s = snap(POOL, [directed(DirectiveKind.BALLOON, ack_seq=3, reached=0, target={"memory_bytes": 4 * GiB},
                             qos="shared")], now=1.0)
    (d,) = run(s)
    assert isinstance(d, Shrink) and d.memory_bytes == 4 * GiB


def test_acked_preempt_frees_room_for_waiting_job_in_same_cycle() -> None:
    g = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = g.values()
    victim = replace(
        running(job("low", memory="60GiB"), [gpu], state=JobState.PREEMPTING),
        directive=Directive(DirectiveKind.PREEMPT, seq=1, deadline=50.0, target={"for_job": "high"}),
        ack=Ack(seq=1, step=7, checkpoint="/ck"),
    )
    ds = run(snap(g, [victim, job("high", memory="60GiB", priority=5)], now=10.0))
    assert isinstance(only(ds, "low"), Release)
    assert isinstance(only(ds, "high"), Grant)
    assert [type(d).__name__ for d in ds] == ["Release", "Grant"]


def test_resized_job_replaced_with_target_count() -> None:
    g = gpus("a:4xH100-80GB:nvlink")
    first = list(g.values())[:2]
    view = replace(
        running(job("el", gpus=2, min_gpus=1, max_gpus=4, memory="40GiB"), first, state=JobState.PREEMPTING),
        directive=Directive(DirectiveKind.RESIZE, seq=2, deadline=99.0, target={"gpus": 4}),
        ack=Ack(seq=2, step=1),
    )
    ds = run(snap(g, [view], now=5.0))
    rel = only([d for d in ds if isinstance(d, Release)], "el")
    grant = only([d for d in ds if isinstance(d, Grant)], "el")
    assert rel.state is JobState.PENDING and len(grant.slices) == 4


HEALTH = [
    # (name, gpus transform, draining, cordoned, expect preempt)
    ("healthy stays", lambda g: g, frozenset(), frozenset(), False),
    ("unhealthy GPU", lambda g: {**g, A0.uuid: unhealthy(A0, "temperature 95C >= 90C")}, frozenset(), frozenset(), True),
    ("draining node", lambda g: g, frozenset({"a"}), frozenset(), True),
    ("cordon keeps running jobs", lambda g: g, frozenset(), frozenset({A0.uuid}), False),
    ("GPU vanished", lambda g: {k: v for k, v in g.items() if k != A0.uuid}, frozenset(), frozenset(), True),
    ("other node drained", lambda g: g, frozenset({"b"}), frozenset(), False),
]


@pytest.mark.parametrize(("name", "transform", "draining", "cordoned", "expect"), HEALTH, ids=[h[0] for h in HEALTH])
def test_health_preemptions(name: str, transform, draining: frozenset, cordoned: frozenset, expect: bool) -> None:
    view = running(job("r", memory="10GiB", preempt_grace_s=30.0), [A0])
    s = snap(transform(dict(POOL)), [view], now=100.0, draining=draining, cordoned=cordoned)
    got = health_preemptions(s, SchedulerConfig())
    if expect:
        (p,) = got
        assert p.job == "r" and p.deadline == 130.0 and "checkpoint" in p.reason
    else:
        assert got == []


def test_health_skips_jobs_already_directed() -> None:
    view = replace(
        running(job("r", memory="10GiB"), [A0], state=JobState.PREEMPTING),
        directive=Directive(DirectiveKind.PREEMPT, seq=1, deadline=1e9),
    )
    s = snap({**POOL, A0.uuid: unhealthy(A0)}, [view], now=1.0)
    assert health_preemptions(s, SchedulerConfig()) == []


def test_drained_node_job_preempted_and_replacement_elsewhere() -> None:
    view = running(job("r", memory="10GiB"), [A0])
    ds = run(snap(POOL, [view, job("n", memory="10GiB")], now=1.0, draining=frozenset({"a"})))
    assert isinstance(only(ds, "r"), Preempt) and "draining" in only(ds, "r").reason
    grant = only(ds, "n")
    assert isinstance(grant, Grant) and grant.slices[0].node == "b"


def test_all_gpus_unschedulable_queues_with_reason() -> None:
    ds = run(snap(POOL, [job("n", memory="10GiB")], cordoned=frozenset(POOL)))
    d = only(ds, "n")
    assert isinstance(d, Queue) and "unhealthy, cordoned or draining" in d.reason


def test_room_released_for_a_job_is_held_for_it() -> None:
    g = gpus("a:1xH100-80GB:nvlink")
    (gpu,) = g.values()
    victim = replace(
        running(job("low", memory="60GiB"), [gpu], state=JobState.PREEMPTING),
        directive=Directive(DirectiveKind.PREEMPT, seq=1, deadline=50.0, target={"for_job": "big"}),
        ack=Ack(seq=1, step=7),
    )
    # An older, higher job that fits comes first in the queue, but the room was made for "big".
    old = job("old", memory="10GiB", priority=9, queued_at=0.0, order=0)
    big = job("big", memory="60GiB", priority=5, queued_at=5.0, order=1)
    ds = run(snap(g, [victim, old, big], now=10.0))
    assert isinstance(only(ds, "big"), Grant)
    assert isinstance(only(ds, "old"), Queue)
    # Same shape: the older job's failure on the held room must not be taken as the answer for "big".
    same = job("old", memory="60GiB", priority=9, queued_at=0.0, order=0)
    ds = run(snap(g, [victim, same, big], now=10.0), SchedulerConfig(allow_preemption=False))
    assert isinstance(only(ds, "big"), Grant) and isinstance(only(ds, "old"), Queue)
    # Without a for_job the room is anyone's: the queue order decides.
    anon = replace(victim, directive=Directive(DirectiveKind.PREEMPT, seq=1, deadline=50.0))
    ds = run(snap(g, [anon, old, big], now=10.0))
    assert isinstance(only(ds, "old"), Grant)


def test_malformed_directive_targets_do_not_break_the_cycle() -> None:
    view = directed(DirectiveKind.RESIZE, ack_seq=3, target={"gpus": "many"}, gpus=1, max_gpus=2)
    ds = run(snap(POOL, [view], now=1.0))
    assert isinstance(ds[0], Release) and isinstance(only(ds[1:], "v"), Grant)
    bal = directed(DirectiveKind.BALLOON, ack_seq=3, target={"memory_bytes": None}, qos="shared")
    (d,) = run(snap(POOL, [bal], now=1.0))
    assert isinstance(d, Shrink) and d.memory_bytes == 30 * GiB
    # An ack below the target keeps the target: the offloaded state comes back for each optimizer step.
    s = snap(POOL, [directed(DirectiveKind.BALLOON, ack_seq=3, reached=0, target={"memory_bytes": 4 * GiB},
                             qos="shared")], now=1.0)
    (d,) = run(s)
    assert isinstance(d, Shrink) and d.memory_bytes == 4 * GiB
