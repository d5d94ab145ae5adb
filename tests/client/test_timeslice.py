"""Step-level time-slicing: the pure turn rules, and two real gated loops sharing one GPU through etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from testkit import wait_for

from gpupool_sdk.client.timeslice import (
    TimeSliceGate,
    TimeSliceSettings,
    Turn,
    next_holder,
    plan_turn,
    quantum_s,
)
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Allocation, QoS
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

LOOP = Path(__file__).with_name("timeslice_loop.py")
NODE, GPU = "node-a", "GPU-sim-node-a-0"
S = TimeSliceSettings(period_s=1.0, overrun_s=5.0)

# ---------------------------------------------------------------------- pure rules


def test_quantum_is_proportional_to_share() -> None:
    assert quantum_s("a", {"a": 0.7, "b": 0.3}, 1.0) == pytest.approx(0.7)
    assert quantum_s("b", {"a": 0.7, "b": 0.3}, 1.0) == pytest.approx(0.3)
    assert quantum_s("a", {"a": 0.5, "b": 0.5, "c": 1.0}, 2.0) == pytest.approx(0.5)
    assert quantum_s("x", {"a": 1.0}, 2.0) == 2.0  # not a member: the period


@pytest.mark.parametrize(
    ("members", "after", "want"),
    [(["a", "b", "c"], None, "a"), (["a", "b", "c"], "a", "b"), (["a", "b", "c"], "c", "a"), (["a", "c"], "b", "c"), (["b"], "b", "b")],
)
def test_next_holder_rotates_in_name_order(members: list[str], after: str | None, want: str) -> None:
    assert next_holder(members, after) == want


@pytest.mark.parametrize(
    ("me", "members", "turn", "now", "handing", "want"),
    [
        # alone, or not a member: nothing to write
        ("a", {"a": 0.7}, None, 10.0, None, None),
        ("a", {"b": 0.3, "c": 0.2}, None, 10.0, None, None),
        # no turn yet: the first member in name order gets it
        ("b", {"a": 0.7, "b": 0.3}, None, 10.0, None, Turn("a", 1, 10.0, 0.7)),
        # the holder left: the next after it
        ("a", {"a": 0.7, "c": 0.3}, Turn("b", 4, 9.0, 0.5), 10.0, None, Turn("c", 5, 10.0, 0.3)),
        # the holder hands over its own seq
        ("a", {"a": 0.7, "b": 0.3}, Turn("a", 4, 9.0, 0.7), 10.0, 4, Turn("b", 5, 10.0, 0.3)),
        # a stale hand-over (an older seq) is ignored
        ("a", {"a": 0.7, "b": 0.3}, Turn("a", 4, 9.0, 0.7), 10.0, 3, None),
        # someone else's quantum, within the overrun: wait
        ("a", {"a": 0.7, "b": 0.3}, Turn("b", 4, 9.0, 0.3), 14.0, None, None),
        # past quantum + overrun: taken from it
        ("a", {"a": 0.7, "b": 0.3}, Turn("b", 4, 9.0, 0.3), 14.4, None, Turn("a", 5, 14.4, 0.7)),
        # the holder itself never steals from itself
        ("a", {"a": 0.7, "b": 0.3}, Turn("a", 4, 0.0, 0.7), 100.0, None, None),
    ],
)
def test_plan_turn(me: str, members: dict[str, float], turn: Turn | None, now: float, handing: int | None, want: Turn | None) -> None:
    got = plan_turn(me, members, turn, now, S, handing_over=handing)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert (got.holder, got.seq, got.since) == (want.holder, want.seq, want.since)
        assert got.quantum_s == pytest.approx(want.quantum_s)


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="period_s"):
        TimeSliceSettings(period_s=0)
    with pytest.raises(ConfigError, match="overrun_s"):
        TimeSliceSettings(overrun_s=float("inf"))
    assert TimeSliceSettings(period_s=4).overrun == 8.0


# ---------------------------------------------------------------------- real processes, real etcd


def _grant(store: EtcdStore, keys: Keyspace, job: str, share: float) -> None:
    a = Allocation(job=job, node=NODE, gpu_uuid=GPU, gpu_index=0, memory_bytes=1 << 30, compute_share=share, mode=QoS.GUARANTEED)
    store.put(keys.allocation(NODE, GPU, job), a)


def _loop(endpoint: str, keys: Keyspace, job: str, start_at: float, end_at: float, out: Path, step_s: float = 0.01) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(LOOP), endpoint, keys.prefix, job, NODE, GPU, str(start_at), str(end_at), str(step_s), str(out)],
        start_new_session=True,
    )


def _finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_two_jobs_split_step_time_by_share(etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace, tmp_path: Path) -> None:
    """Shares 0.7 / 0.3 on one GPU: 70 % / 30 % of the step time over a minute, within 10 points."""
    _grant(store, keyspace, "job-a", 0.7)
    _grant(store, keyspace, "job-b", 0.3)
    start_at = time.time() + 15.0  # both processes are up and in the rotation by then
    end_at = start_at + 60.0
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [_loop(etcd_endpoint, keyspace, "job-a", start_at, end_at, outs[0]), _loop(etcd_endpoint, keyspace, "job-b", start_at, end_at, outs[1])]
    _finish(procs, timeout=end_at - time.time() + 60)
    a, b = (json.loads(o.read_text()) for o in outs)
    share_a = a["busy_s"] / (a["busy_s"] + b["busy_s"])
    print(f"time-slicing 0.7/0.3: job-a {share_a:.1%}, job-b {1 - share_a:.1%} of step time; turns {a['turns']}/{b['turns']}")
    assert abs(share_a - 0.7) <= 0.10
    assert a["turns"] >= 10 and b["turns"] >= 10  # they really took turns
    # The keepers left with their processes: membership and turn keys are gone.
    kvs, _ = store.get_prefix(keyspace.timeslice_prefix(NODE, GPU))
    assert kvs == []


def test_without_gates_the_split_is_even(etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace, tmp_path: Path) -> None:
    """Control: the same loops with only one gated member are not throttled (both run all the time)."""
    _grant(store, keyspace, "job-a", 0.7)  # job-b holds no allocation: job-a is alone in the rotation
    start_at = time.time() + 10.0
    end_at = start_at + 5.0
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [_loop(etcd_endpoint, keyspace, "job-a", start_at, end_at, outs[0]), _loop(etcd_endpoint, keyspace, "job-b", start_at, end_at, outs[1])]
    _finish(procs, timeout=end_at - time.time() + 60)
    a, b = (json.loads(o.read_text()) for o in outs)
    assert a["turns"] == 0 and b["turns"] == 0 and a["waited_s"] == 0.0
    assert a["busy_s"] / (a["busy_s"] + b["busy_s"]) == pytest.approx(0.5, abs=0.1)


def test_a_killed_holder_hands_the_gpu_on(etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace) -> None:
    """SIGKILL of the job holding the turn: its keeper revokes its lease and the other job runs alone."""
    _grant(store, keyspace, "job-a", 0.5)
    _grant(store, keyspace, "job-b", 0.5)
    gate = TimeSliceGate.start("job-b", NODE, GPU, endpoints=etcd_endpoint, prefix=keyspace.prefix, settings=S)
    victim = subprocess.Popen(
        [sys.executable, str(LOOP), etcd_endpoint, keyspace.prefix, "job-a", NODE, GPU, str(time.time() + 600), str(time.time() + 600), "0.05", "/dev/null"],
        start_new_session=True,
    )
    try:
        wait_for(lambda: gate.state.members == 2, timeout=60, what="both jobs in the rotation")
        wait_for(lambda: (gate.step_boundary(), gate.turns >= 2)[1], timeout=60, what="job-b took turns")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        wait_for(lambda: gate.alone, timeout=30, what="job-b alone after job-a was killed")
        # Its allocation stays (the leader has not released it yet) but it takes no turns: job-b never blocks.
        t0 = gate.waited_s
        for _ in range(50):
            gate.step_boundary()
        assert gate.waited_s == t0
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
        gate.close()


def test_gate_with_a_scripted_keeper_hands_over_pauses_resumes_and_opens_when_the_keeper_dies() -> None:
    import threading
    from multiprocessing import Pipe

    ours, keeper = Pipe(duplex=True)
    events: list[str] = []
    gate = TimeSliceGate("a", ours, on_pause=lambda: events.append("pause"), on_resume=lambda: events.append("resume"))
    try:
        assert gate.alone
        gate.step_boundary()  # alone: nothing happens
        assert gate.turns == 0
        keeper.send({"op": "state", "alone": False, "holder": "a", "seq": 1, "quantum_s": 0.2, "members": 2})
        wait_for(lambda: not gate.alone, what="the gate to see a sharer")
        gate.step_boundary()  # our turn: taken at once
        assert gate.turns == 1 and events == []
        time.sleep(0.25)  # quantum used
        t = threading.Thread(target=gate.step_boundary)
        t.start()
        assert keeper.poll(10) and keeper.recv() == {"op": "done", "seq": 1}
        wait_for(lambda: events == ["pause"], what="the pause hook")
        keeper.send({"op": "state", "alone": False, "holder": "b", "seq": 2, "quantum_s": 0.2, "members": 2})
        time.sleep(0.2)
        assert t.is_alive()  # b's turn: we wait
        keeper.send({"op": "state", "alone": False, "holder": "a", "seq": 3, "quantum_s": 0.2, "members": 2})
        t.join(10)
        assert not t.is_alive() and events == ["pause", "resume"] and gate.turns == 2
        keeper.close()  # the keeper dies: the gate opens rather than blocking training
        wait_for(lambda: gate.alone, what="the gate to open")
        time.sleep(0.25)
        gate.step_boundary()
        assert gate.turns == 2
    finally:
        gate.close()


def test_gates_learn_whether_the_sharers_memory_fits_and_report_contention(
    etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace
) -> None:
    """The keeper tells the gate whether the GPU's quotas fit its memory (the hand-over offload's cue)."""
    from testkit import publish_gpus

    from gpupool_sdk.inventory.simulated import parse_cluster_spec
    from gpupool_sdk.resources import GiB

    (gpu,) = parse_cluster_spec(f"{NODE}:1xA100-40GB:pcie")
    assert gpu.uuid == GPU
    publish_gpus(store, [gpu])

    def grant(job: str, gib: int) -> None:
        store.put(keyspace.allocation(NODE, GPU, job),
                  Allocation(job, NODE, GPU, 0, gib * GiB, 0.5, QoS.SHARED))

    grant("job-a", 30)
    grant("job-b", 30)  # 60 GiB of quotas on a 40 GiB GPU (shared, overcommitted)
    seen: list[bool] = []
    a = TimeSliceGate.start("job-a", NODE, GPU, endpoints=etcd_endpoint, prefix=keyspace.prefix, settings=S,
                            on_contention=seen.append)
    b = TimeSliceGate.start("job-b", NODE, GPU, endpoints=etcd_endpoint, prefix=keyspace.prefix, settings=S)
    try:
        wait_for(lambda: a.state.fits is False and b.state.fits is False and b.state.members == 2, timeout=60,
                 what="both to see 60 GiB on 40")
        assert seen == [True]
        grant("job-b", 5)
        wait_for(lambda: a.state.fits is True and b.state.fits is True, timeout=60, what="35 GiB to fit 40")
        b.close()
        wait_for(lambda: a.alone, timeout=60, what="job-a alone")
        assert seen == [True, False]
    finally:
        b.close()
        a.close()
