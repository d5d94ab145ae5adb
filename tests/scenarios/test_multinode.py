"""Node-local leasing and multi-node gangs with real processes: two agents declaring two
simulated nodes on one machine, a real coordinator, job processes that say which node they are on
(``GPUPOOL_NODE``) and gang members that take their ranks from torchrun's variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpupool_sdk.resources import JobSpec, JobState
from scenarios.harness import DEADLINE, ROOT, Pool, wait_for

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _own_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The agents' node files go to this test's own runtime directory (inherited by every process).
    monkeypatch.setenv("GPUPOOL_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("GPUPOOL_NODE", raising=False)


def two_agents(pool: Pool) -> None:
    """node-a and node-b, each published by an agent process of its own (one A100 each)."""
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.gpus("node-b:1xA100-40GB:pcie")


def spawn(
    pool: Pool, name: str, script: str, spec: JobSpec, env: dict[str, str], *extra: str
) -> subprocess.Popen[bytes]:
    log = open(pool.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(
        [sys.executable, str(HERE / script), pool.endpoint, pool.keys.prefix, json.dumps(spec.to_dict()), *extra],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )
    pool.procs.append(p)
    pool._names[p.pid] = name
    return p


def member(pool: Pool, spec: JobSpec, node: str, node_rank: int, *extra: str) -> subprocess.Popen[bytes]:
    """A gang member as torchrun --nnodes 2 --nproc-per-node 1 would start it on ``node``."""
    env = {"GPUPOOL_NODE": node, "TORCHELASTIC_RUN_ID": spec.name, "WORLD_SIZE": str(spec.nodes),
           "RANK": str(node_rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(node_rank),
           "GROUP_WORLD_SIZE": str(spec.nodes)}
    return spawn(pool, f"{spec.name}-{node}", "gang_proc.py", spec, env, *extra)


def status_reason(pool: Pool, job: str) -> str:
    from gpupool_sdk.resources import JobStatus

    got = pool.store.get_record(pool.keys.job_status(job), JobStatus)
    return got[0].reason if got else ""


def job_allocs(pool: Pool, job: str) -> list[str]:
    return sorted(f"{a.node}/{a.gpu_uuid}" for a in pool.allocations() if a.job == job)


def test_a_job_on_node_a_never_gets_node_b_even_when_only_b_has_room(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1", "--no-preemption")
    blocker = pool.submit("blocker", gpus=1, qos="exclusive", node="node-a")
    blocker.wait_state(JobState.GRANTED)
    x = spawn(pool, "x", "client_proc.py", JobSpec(name="x", memory="10GiB"), {"GPUPOOL_NODE": "node-a"})
    wait_for(lambda: "waiting for room on node node-a (1 other node has room)" in status_reason(pool, "x"),
             DEADLINE, f"x to wait for node-a (now {status_reason(pool, 'x')!r})")
    # node-b stays idle, and x holds nothing, over several coordinator cycles.
    for _ in range(6):
        assert job_allocs(pool, "x") == []
        time.sleep(0.5)
    blocker.release()
    out = pool.wait_output(x, "GRANTED")
    assert "GRANTED node-a/" in out and "node-b" not in out
    assert [a.split("/")[0] for a in job_allocs(pool, "x")] == ["node-a"]
    pool.check()


def test_without_gpupool_node_two_agents_on_one_machine_are_a_clear_error(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1")
    x = spawn(pool, "x", "client_proc.py", JobSpec(name="x", memory="10GiB"), {})
    assert x.wait(DEADLINE) != 0
    out = pool.output(x)
    assert "several nodes (node-a, node-b)" in out and "GPUPOOL_NODE" in out
    assert pool.store.get(pool.keys.job_spec("x")) is None  # nothing was submitted


def test_with_one_agent_the_node_comes_from_its_file(pool: Pool) -> None:
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.coordinator("c1")
    # The agent writes its file once its nodes are published (just after the GPUs appear).
    run_dir = Path(os.environ["GPUPOOL_RUNTIME_DIR"])
    (agent_file,) = wait_for(lambda: list(run_dir.glob("agent-*.json")), DEADLINE, "the agent's node file")
    assert json.loads(agent_file.read_text())["nodes"] == ["node-a"]
    x = spawn(pool, "x", "client_proc.py", JobSpec(name="x", memory="10GiB"), {})
    pool.wait_output(x, "GRANTED node-a/")
    from gpupool_sdk.store.codec import decode

    kv = pool.store.get(pool.keys.job_spec("x"))
    assert kv is not None and decode(kv.key, kv.value, JobSpec).node == "node-a"


def test_a_gang_is_granted_on_both_nodes_together_and_released_whole_when_one_member_dies(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1")
    spec = JobSpec(name="ddp", gpus=2, nodes=2, memory="10GiB")
    b = member(pool, spec, "node-b", 1)  # the second node joins first: nothing is granted yet
    wait_for(lambda: pool.store.get(pool.keys.job_member("ddp", "node-b")), DEADLINE, "node-b to join")
    time.sleep(1.5)
    assert job_allocs(pool, "ddp") == []
    a = member(pool, spec, "node-a", 0)
    out_a = pool.wait_output(a, "DEVICES")
    out_b = pool.wait_output(b, "DEVICES")
    held = job_allocs(pool, "ddp")
    assert [h.split("/")[0] for h in held] == ["node-a", "node-b"]
    for out in (out_a, out_b):  # each member sees the whole gang, and its own node's device
        assert all(h in out for h in held) and "DEVICES 0" in out
    # Every allocation of the gang hangs on node rank 0's lease (the spec's).
    spec_kv = pool.store.get(pool.keys.job_spec("ddp"))
    assert spec_kv is not None
    kvs, _ = pool.store.get_prefix(pool.keys.allocations_prefix())
    assert {kv.lease for kv in kvs if kv.key.endswith("/ddp")} == {spec_kv.lease}

    os.kill(b.pid, signal.SIGKILL)  # node-b's process dies: its helper revokes its member lease
    assert a.wait(DEADLINE) == 4
    out_a = pool.output(a)
    assert "LOST" in out_a and "released on every node" in out_a and "node-a as node rank 0" in out_a
    assert job_allocs(pool, "ddp") == []  # no half-gang keeps a slice
    pool.check()


def test_a_gang_loses_every_member_when_node_rank_0_dies(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1")
    spec = JobSpec(name="ddp", gpus=2, nodes=2, memory="10GiB")
    a = member(pool, spec, "node-a", 0)
    b = member(pool, spec, "node-b", 1)
    pool.wait_output(a, "DEVICES")
    pool.wait_output(b, "DEVICES")
    os.kill(a.pid, signal.SIGKILL)
    assert b.wait(DEADLINE) == 4
    # Its spec lease and its member lease go together: node-b hears either of the two.
    out = pool.output(b)
    assert "LOST" in out and ("node rank 0 of gang 'ddp' left" in out or "released on every node" in out), out
    wait_for(lambda: not job_allocs(pool, "ddp"), DEADLINE, "the gang's slices to be freed")
    wait_for(lambda: pool.store.get(pool.keys.job_member("ddp", "node-b")) is None, DEADLINE, "node-b's member key to go")


def test_a_preemption_reaches_every_member_and_frees_both_nodes(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1")
    spec = JobSpec(name="ddp", gpus=2, nodes=2, memory="30GiB", priority=1)
    a = member(pool, spec, "node-a", 0)
    b = member(pool, spec, "node-b", 1)
    pool.wait_output(a, "DEVICES")
    pool.wait_output(b, "DEVICES")
    urgent = spawn(pool, "urgent", "client_proc.py", JobSpec(name="urgent", memory="30GiB", priority=10),
                   {"GPUPOOL_NODE": "node-b"})
    assert a.wait(DEADLINE) == 75 and b.wait(DEADLINE) == 75
    for p in (a, b):
        assert "DIRECTIVE preempt" in pool.output(p)
    out = pool.wait_output(urgent, "GRANTED")
    assert "GRANTED node-b/" in out
    assert job_allocs(pool, "ddp") == []
    pool.check()


def test_a_preempted_gang_keeps_every_node_until_every_node_acked(pool: Pool) -> None:
    two_agents(pool)
    pool.coordinator("c1")
    spec = JobSpec(name="ddp", gpus=2, nodes=2, memory="30GiB", priority=1, preempt_grace_s=8)
    a = member(pool, spec, "node-a", 0, "--deaf-rank", "1")
    b = member(pool, spec, "node-b", 1, "--deaf-rank", "1")  # node-b's ranks never stop
    pool.wait_output(a, "DEVICES")
    pool.wait_output(b, "DEVICES")
    urgent = spawn(pool, "urgent", "client_proc.py", JobSpec(name="urgent", memory="30GiB", priority=10),
                   {"GPUPOOL_NODE": "node-a"})
    pool.wait_output(b, "DIRECTIVE preempt")
    wait_for(lambda: pool.store.get(pool.keys.ack("ddp")), DEADLINE, "node rank 0's ack")
    # Node rank 0 acked, node-b did not: the gang keeps both nodes (node-b's ranks may still run).
    for _ in range(4):
        assert [h.split("/")[0] for h in job_allocs(pool, "ddp")] == ["node-a", "node-b"]
        assert "GRANTED" not in pool.output(urgent)
        time.sleep(0.5)
    # At the deadline the leader revokes node rank 0's lease: every node's slices go at once.
    out = pool.wait_output(urgent, "GRANTED", timeout=DEADLINE + 10)
    assert "GRANTED node-a/" in out
    assert job_allocs(pool, "ddp") == []
    assert b.wait(DEADLINE) == 4 and "LOST" in pool.output(b)
    pool.check()


def test_gpupool_place_answers_from_the_live_pool(pool: Pool) -> None:
    pool.gpus("node-a:2xA100-80GB:pcie,node-b:4xA100-80GB:pcie", agent=False)
    busy = pool.submit("busy", gpus=1, qos="exclusive", node="node-b")
    # No coordinator needed for the question; the allocation is written as the leader would.
    from gpupool_sdk.resources import Allocation, QoS

    uuid = "GPU-sim-node-b-0"
    pool.store.put(pool.keys.allocation("node-b", uuid, "busy"),
                   Allocation(job="busy", node="node-b", gpu_uuid=uuid, gpu_index=0, memory_bytes=80 << 30,
                              compute_share=1.0, mode=QoS.EXCLUSIVE), lease=busy.lease)

    def place(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpupool_sdk.cli.main", "place", "--endpoints", pool.endpoint,
             "--prefix", pool.keys.prefix, "-o", "json", *args],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )

    r = place("--gpus", "2", "--memory", "40GiB")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fits"] and doc["chosen"] == ["node-a"]  # best fit: node-a has exactly 2 free
    assert [n["node"] for n in doc["ranked"]] == ["node-a", "node-b"]
    r = place("--gpus-per-node", "3", "--nodes", "2", "--memory", "40GiB")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert not doc["fits"] and doc["reason"].startswith("only 1 of 2 nodes")
    assert {u["node"]: u["reason"] for u in doc["unfit"]}["node-a"].startswith("2 of 2 matching GPUs")
    r = place("--gpus", "3", "--nodes", "2", "--memory", "40GiB")
    assert r.returncode == 2 and "--gpus" in r.stderr
