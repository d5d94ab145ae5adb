"""build_state: the whole prefix parsed into a snapshot; malformed values reported and skipped."""

from __future__ import annotations

from coordinator.kvkit import KS, NOW, Items, pool_items
from gpupool_sdk.coordinator.snapshot import DecodeCache, build_state
from gpupool_sdk.resources import (
    Ack,
    Allocation,
    Checkpoint,
    Directive,
    DirectiveKind,
    GiB,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    QoS,
)
from gpupool_sdk.store.records import ResumeRecord


def _pool() -> Items:
    return pool_items()


def test_jobs_carry_leases_allocations_directives_and_resume_data() -> None:
    it = _pool()
    uuid = "GPU-sim-node-a-0"
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=1, memory="10GiB"), lease=0xA)
    it.put(KS.job_status("a"), JobStatus(JobState.PREEMPTING, "r", 900.0, 800.0, 850.0, term=3, gpus=1), lease=0xA)
    it.put(KS.allocation("node-a", uuid, "a"), Allocation("a", "node-a", uuid, 0, 10 * GiB, 1.0, QoS.GUARANTEED, 3, 850.0), lease=0xA)
    it.put(KS.directive("a"), Directive(DirectiveKind.PREEMPT, 4, 1100.0), lease=0xA)
    it.put(KS.ack("a"), Ack(seq=3, step=10, checkpoint="/c", at=860.0), lease=0xA)
    it.put(KS.telemetry("a"), {"job": "a", "at": 1.0, "summary": {"memory_peak_bytes": 5 * GiB}}, lease=0xA)
    it.put(KS.checkpoint("a"), ResumeRecord("a", Checkpoint("/old", 1, 10.0), 2, 500.0, 100.0))
    it.put(KS.job_spec("b"), JobSpec(name="b", gpus=1, memory="1GiB"), lease=0xB)
    it.put(KS.checkpoint("b"), ResumeRecord("b", None, 1, 700.0, 5.0))
    it.put(KS.cordon(uuid), {"reason": "x"})
    it.put(KS.drain("node-z"), {})
    it.put(KS.leader(), LeaderRecord("c1", 3, 1.0), lease=0xC)
    state = build_state(it.kvs, KS, NOW, revision=it.rev, term=3)
    snap = state.snapshot
    assert set(snap.gpus) == {"GPU-sim-node-a-0", "GPU-sim-node-a-1"}
    assert snap.cordoned == frozenset({uuid}) and snap.draining == frozenset({"node-z"})
    a = snap.jobs["a"]
    assert a.state is JobState.PREEMPTING and len(a.allocations) == 1
    assert a.queued_at == 800.0 and a.granted_at == 850.0
    assert a.last_checkpoint_at == 860.0  # the ack's checkpoint, taken during this grant
    assert a.attained_gpu_s == 100.0 + (NOW - 850.0)
    assert a.directive is not None and a.directive.seq == 4 and a.ack is not None
    assert a.memory_peak_bytes == 5 * GiB
    assert state.jobs["a"].lease == 0xA and state.jobs["a"].resume is not None
    b = snap.jobs["b"]
    assert b.state is JobState.PENDING and b.queued_at == 700.0  # aging credit kept across restarts
    assert a.order < b.order
    assert state.leader is not None and state.leader.term == 3 and snap.term == 3
    assert state.problems == ()


def test_malformed_values_are_reported_and_skipped() -> None:
    it = _pool()
    it.put(KS.job_spec("ok"), JobSpec(name="ok", gpus=1, memory="1GiB"), lease=1)
    it.put(KS.job_spec("broken"), None, lease=2, raw=b"{not json")
    it.put(KS.job_spec("liar"), JobSpec(name="someone-else", gpus=1, memory="1GiB"), lease=3)
    it.put(KS.job_spec("neg"), None, lease=4, raw=b'{"schema":1,"kind":"JobSpec","name":"neg","gpus":-1,"memory_bytes":1}')
    it.put(KS.gpu("node-a", "GPU-x"), None, lease=7, raw=b'{"schema":2}')
    it.put(KS.allocation("node-a", "GPU-sim-node-a-0", "ok"), None, lease=1, raw=b"[]")
    it.put(KS.prefix + "/unknown/thing", None, raw=b"whatever")
    state = build_state(it.kvs, KS, NOW)
    assert set(state.snapshot.jobs) == {"ok"}
    bad = {p.key: p.message for p in state.problems}
    assert set(bad) == {
        KS.job_spec("broken"),
        KS.job_spec("liar"),
        KS.job_spec("neg"),
        KS.gpu("node-a", "GPU-x"),
        KS.allocation("node-a", "GPU-sim-node-a-0", "ok"),
    }
    assert "JSON" in bad[KS.job_spec("broken")]
    assert "gpus" in bad[KS.job_spec("neg")]
    assert "schema" in bad[KS.gpu("node-a", "GPU-x")]


def test_decode_cache_reuses_unchanged_values_and_forgets_deleted_keys() -> None:
    it = _pool()
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=1, memory="1GiB"), lease=1)
    it.put(KS.job_spec("bad"), None, lease=2, raw=b"nope")
    cache = DecodeCache()
    first = build_state(it.kvs, KS, NOW, cache=cache)
    misses = cache.misses
    second = build_state(it.kvs, KS, NOW, cache=cache)
    assert cache.misses == misses and cache.hits >= misses
    assert second.snapshot.jobs["a"].spec is first.snapshot.jobs["a"].spec
    assert [p.key for p in second.problems] == [KS.job_spec("bad")]  # still reported every cycle
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=2, memory="1GiB"), lease=1)
    third = build_state(it.kvs, KS, NOW, cache=cache)
    assert third.snapshot.jobs["a"].spec.gpus == 2
    it.kvs = [kv for kv in it.kvs if kv.key != KS.job_spec("bad")]
    build_state(it.kvs, KS, NOW, cache=cache)
    assert KS.job_spec("bad") not in cache.reported


def test_gang_members_on_their_own_leases_and_only_those_of_the_grant() -> None:
    from gpupool_sdk.resources import GangMember

    it = _pool()
    it.put(KS.job_spec("g"), JobSpec(name="g", gpus=2, nodes=2, memory="10GiB"), lease=0xA)
    it.put(KS.job_member("g", "node-a"), GangMember("g", "node-a", 0, 2), lease=0xB)
    it.put(KS.job_member("g", "node-b"), GangMember("g", "node-b", 1, 2), lease=0xC)
    it.put(KS.job_member("x", "node-a"), GangMember("x", "node-a", 0, 2), lease=0xD)  # waits for its spec
    it.put(KS.job_member("g", "node-c"), GangMember("g", "node-c", 1, 2), lease=7)  # on the agent's lease
    state = build_state(it.kvs, KS, NOW)
    assert [m.node for m in state.snapshot.jobs["g"].members] == ["node-a", "node-b"]
    assert [p.key for p in state.problems] == [KS.job_member("g", "node-c")]
    uuid = "GPU-sim-node-a-0"
    it.put(KS.allocation("node-a", uuid, "g"), Allocation("g", "node-a", uuid, 0, 10 * GiB, 1.0, QoS.GUARANTEED, 1, 0.0),
           lease=0xA)
    it.put(KS.job_status("g"), JobStatus(JobState.GRANTED, "granted", 0.0, 0.0, 0.0, term=1, gpus=1), lease=0xA)
    # node-b's process restarted after the grant: its new member key is not the one granted with.
    it.put(KS.job_member("g", "node-b"), GangMember("g", "node-b", 1, 2), lease=0xE)  # created anew
    assert [m.node for m in build_state(it.kvs, KS, NOW).snapshot.jobs["g"].members] == ["node-a"]
