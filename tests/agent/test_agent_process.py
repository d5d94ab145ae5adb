"""The agent as a real process against a real etcd, stopped with real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool_sdk.resources import GpuInfo, GpuReadings, NodeInfo
from gpupool_sdk.store.codec import decode

DEADLINE_S = 30.0


def wait_for(cond: Callable[[], Any], what: str, timeout: float = DEADLINE_S, proc: subprocess.Popen | None = None) -> Any:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"agent exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


class AgentProc:
    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def start_agent(etcd_endpoint, keyspace, tmp_path) -> Iterator[Callable[..., AgentProc]]:
    procs: list[AgentProc] = []

    def start(*args: str) -> AgentProc:
        log_path = tmp_path / f"agent-{len(procs)}.log"
        cmd = [
            sys.executable, "-m", "gpupool_sdk.cli.main", "agent",
            "--endpoints", etcd_endpoint, "--prefix", keyspace.prefix, "--refresh", "0.3", *args,
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ap = AgentProc(proc, log_path)
        procs.append(ap)
        return ap

    yield start
    for ap in procs:
        if ap.proc.poll() is None:
            ap.proc.kill()
            ap.proc.wait(timeout=DEADLINE_S)


def node_keys(store, node: str) -> dict[str, Any]:
    kvs, _ = store.get_prefix(store.keys.gpus_prefix(node))
    out = {kv.key: kv for kv in kvs}
    kv = store.get(store.keys.node(node))
    if kv is not None:
        out[kv.key] = kv
    return out


def gpus_of(store, node: str) -> dict[str, GpuInfo]:
    kvs, _ = store.get_prefix(store.keys.gpus_prefix(node))
    return {kv.key.rsplit("/", 1)[1]: decode(kv.key, kv.value, GpuInfo) for kv in kvs}


def test_keys_appear_with_valid_json_and_sigterm_removes_them_at_once(start_agent, store, etcdctl):
    agent = start_agent("--node", "node-a", "--simulate", "4xH100-80GB:nvlink", "--ttl", "10")
    keys = wait_for(lambda: len(node_keys(store, "node-a")) == 5 and node_keys(store, "node-a"), "5 keys", proc=agent.proc)

    for key, kv in keys.items():
        body = json.loads(kv.value)
        assert body["schema"] == 1
        assert body["kind"] == ("NodeInfo" if "/nodes/" in key else "GpuInfo")
        assert kv.lease != 0
    assert len({kv.lease for kv in keys.values()}) == 1  # everything on the agent's one lease
    node = decode(store.keys.node("node-a"), keys[store.keys.node("node-a")].value, NodeInfo)
    assert (node.gpu_count, node.backend, node.agent_pid) == (4, "simulated", agent.proc.pid)
    gpus = gpus_of(store, "node-a")
    assert sorted(gpus) == [f"GPU-sim-node-a-{i}" for i in range(4)]
    g0 = gpus["GPU-sim-node-a-0"]
    assert g0.model == "H100-80GB" and g0.simulated and g0.healthy and g0.nvlink_island == 0
    assert len(g0.nvlink_peers) == 3

    # the lease is visible to operators, with exactly the node's keys
    lease_hex = f"{next(iter(keys.values())).lease:x}"
    out = etcdctl("lease", "timetolive", lease_hex, "--keys").stdout
    assert "GPU-sim-node-a-3" in out and "nodes/node-a" in out

    assert agent.signal(signal.SIGTERM) == 0
    assert node_keys(store, "node-a") == {}  # gone as soon as the process has exited, no TTL wait


def test_sigint_also_revokes(start_agent, store):
    agent = start_agent("--node", "n1", "--simulate", "2xT4")
    wait_for(lambda: len(node_keys(store, "n1")) == 3, "keys", proc=agent.proc)
    assert agent.signal(signal.SIGINT) == 0
    assert node_keys(store, "n1") == {}


def test_sigkill_keys_expire_with_the_ttl(start_agent, store):
    agent = start_agent("--node", "node-k", "--simulate", "2xA100-40GB:pcie", "--ttl", "3")
    wait_for(lambda: len(node_keys(store, "node-k")) == 3, "keys", proc=agent.proc)
    agent.proc.kill()
    agent.proc.wait(timeout=DEADLINE_S)
    assert agent.proc.returncode == -signal.SIGKILL
    assert len(node_keys(store, "node-k")) == 3  # nobody revoked the lease: the keys outlive the process
    wait_for(lambda: node_keys(store, "node-k") == {}, "keys to expire with the 3 s lease")


def test_multi_node_one_lease_per_node(start_agent, store):
    agent = start_agent("--simulate", "node-a:2xH100-80GB:nvlink,node-b:4xA100-40GB:pcie,2*1xT4", "--ttl", "5")
    wait_for(
        lambda: all(node_keys(store, n) for n in ("node-a", "node-b", "node-00", "node-01")),
        "every node",
        proc=agent.proc,
    )
    leases = {n: {kv.lease for kv in node_keys(store, n).values()} for n in ("node-a", "node-b", "node-00", "node-01")}
    assert all(len(v) == 1 for v in leases.values())
    assert len({next(iter(v)) for v in leases.values()}) == 4
    assert sorted(gpus_of(store, "node-b")) == [f"GPU-sim-node-b-{i}" for i in range(4)]
    assert agent.signal(signal.SIGTERM) == 0
    assert all(node_keys(store, n) == {} for n in ("node-a", "node-b", "node-00", "node-01"))


def test_fault_file_flips_health(start_agent, store, tmp_path):
    faults = tmp_path / "faults.json"
    agent = start_agent("--node", "nf", "--simulate", "3xH100", "--fault-file", str(faults))
    wait_for(lambda: len(gpus_of(store, "nf")) == 3, "gpus", proc=agent.proc)
    assert all(g.healthy for g in gpus_of(store, "nf").values())

    faults.write_text(json.dumps({"GPU-sim-nf-1": {"xid": 79}, "GPU-sim-nf-2": {"temperature_c": 97}}))
    gpus = wait_for(
        lambda: (g := gpus_of(store, "nf")) and not g["GPU-sim-nf-1"].healthy and not g["GPU-sim-nf-2"].healthy and g,
        "GPUs 1 and 2 to turn unhealthy",
        proc=agent.proc,
    )
    assert gpus["GPU-sim-nf-0"].healthy
    assert any("xid 79" in r for r in gpus["GPU-sim-nf-1"].health.reasons)
    assert gpus["GPU-sim-nf-2"].health.reasons == ("temperature 97C >= 90C",)

    faults.write_text("{}")
    wait_for(lambda: all(g.healthy for g in gpus_of(store, "nf").values()), "recovery", proc=agent.proc)
    assert "is unhealthy" in agent.log()


def test_readings_are_published_under_their_own_keys_and_shown_by_status(start_agent, store, tmp_path, etcd_endpoint):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"GPU-sim-nr-1": {"utilization": 0.42, "pcie_rx_bytes_per_s": 2e9}}))
    agent = start_agent("--node", "nr", "--simulate", "2xH100", "--fault-file", str(faults), "--usage-interval", "0")
    key = store.keys.readings("nr", "GPU-sim-nr-1")
    kv = wait_for(lambda: store.get(key), "the readings key", proc=agent.proc)
    assert decode(key, kv.value, GpuReadings) == GpuReadings(utilization=0.42, pcie_rx_bytes_per_s=2e9)
    assert kv.lease == store.get(store.keys.node("nr")).lease  # the agent's lease
    assert store.get(store.keys.readings("nr", "GPU-sim-nr-0")) is None  # no readings: no key
    gpu_rev = store.get(store.keys.gpu("nr", "GPU-sim-nr-1")).mod_revision
    faults.write_text(json.dumps({"GPU-sim-nr-1": {"utilization": 0.07}}))
    wait_for(lambda: (kv := store.get(key)) and decode(key, kv.value, GpuReadings).utilization == 0.07, "new readings",
             proc=agent.proc)
    assert store.get(store.keys.gpu("nr", "GPU-sim-nr-1")).mod_revision == gpu_rev  # the GPU record is untouched
    status = subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "status", "-o", "json", "--endpoints", etcd_endpoint,
         "--prefix", store.keys.prefix], capture_output=True, text=True, timeout=DEADLINE_S, check=True)
    shown = {g["uuid"]: g["readings"] for g in json.loads(status.stdout)["gpus"]}
    assert shown["GPU-sim-nr-1"]["utilization"] == 0.07 and shown["GPU-sim-nr-0"]["utilization"] is None
    assert agent.signal(signal.SIGTERM) == 0
    assert store.get_prefix(store.keys.readings_prefix("nr"))[0] == []  # gone with the lease


def test_malformed_values_do_not_crash_the_agent(start_agent, store, etcdctl, tmp_path):
    faults = tmp_path / "faults.json"
    agent = start_agent("--node", "nm", "--simulate", "2xT4", "--fault-file", str(faults))
    wait_for(lambda: len(node_keys(store, "nm")) == 3, "keys", proc=agent.proc)
    own = store.keys.gpu("nm", "GPU-sim-nm-0")
    other = store.keys.gpu("other-node", "GPU-x")
    etcdctl("put", other, "{this is not json")
    etcdctl("put", own, '{"schema": 1, "kind": "GpuInfo", "uuid": 42}')
    etcdctl("put", store.keys.gpu("nm", "GPU-stray"), "hand-written")
    faults.write_text("[not, json")

    def repaired() -> bool:
        kv = store.get(own)
        return kv is not None and kv.lease != 0 and decode(own, kv.value, GpuInfo).uuid == "GPU-sim-nm-0"

    wait_for(repaired, "the agent to rewrite its own hand-edited key", proc=agent.proc)
    wait_for(lambda: store.get(store.keys.gpu("nm", "GPU-stray")) is None, "the stray key to be deleted", proc=agent.proc)
    assert store.get(other) is not None  # another node's keys are not the agent's business
    assert agent.proc.poll() is None
    log = agent.log()
    assert "malformed value" in log and "fault file" in log
    assert agent.signal(signal.SIGTERM) == 0


def test_revoked_lease_is_replaced(start_agent, store, etcdctl):
    agent = start_agent("--node", "nr", "--simulate", "2xL40S", "--ttl", "6")
    keys = wait_for(lambda: len(node_keys(store, "nr")) == 3 and node_keys(store, "nr"), "keys", proc=agent.proc)
    old_lease = next(iter(keys.values())).lease
    etcdctl("lease", "revoke", f"{old_lease:x}")

    def republished() -> bool:
        k = node_keys(store, "nr")
        return len(k) == 3 and all(kv.lease not in (0, old_lease) for kv in k.values())

    wait_for(republished, "the agent to register again under a new lease", proc=agent.proc)
    assert agent.signal(signal.SIGTERM) == 0


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "agent", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_gpu_and_no_simulate_says_to_simulate():
    from gpupool_sdk.inventory.nvml import nvml_available

    if nvml_available():
        pytest.skip("this machine has GPUs: the agent would publish them")
    r = _run_cli("--endpoints", "127.0.0.1:1")
    assert r.returncode == 2
    assert "--simulate" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--simulate", "4xB200"], "--simulate"),
        (["--simulate", "8xH100:nvlink=3x3"], "must equal the GPU count"),
        (["--simulate", "2xT4", "--ttl", "1"], "--ttl"),
        (["--simulate", "2xT4", "--refresh", "0"], "--refresh"),
        (["--simulate", "2xT4", "--usage-interval", "soon"], "--usage-interval"),
        (["--simulate", "2xT4", "--usage-interval", "-5"], "--usage-interval"),
        (["--fault-file", "/tmp/x.json"], "--simulate"),
        (["--node", "bad/name", "--simulate", "2xT4"], "--node"),
    ],
)
def test_bad_arguments_exit_2_with_the_flag(args, needle):
    r = _run_cli("--endpoints", "127.0.0.1:1", *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_unreachable_etcd_exits_3():
    r = _run_cli("--endpoints", "127.0.0.1:1", "--simulate", "1xT4", "--ttl", "2")
    assert r.returncode == 3, r.stderr
    assert "unreachable" in r.stderr


def test_survives_an_etcd_outage_and_registers_again(tmp_path, keyspace, start_agent):
    from gpupool_sdk.store import EtcdServer, EtcdStore

    server = EtcdServer(data_dir=tmp_path / "etcd-data", name="outage").start(timeout=60)
    store = EtcdStore(server.endpoint, keyspace=keyspace, timeout_s=2)
    try:
        # the last --endpoints wins: this agent talks to the private etcd that the test stops
        agent = start_agent("--node", "no", "--simulate", "2xT4", "--ttl", "3", "--endpoints", server.endpoint)
        keys = wait_for(lambda: len(node_keys(store, "no")) == 3 and node_keys(store, "no"), "keys", proc=agent.proc)
        old_lease = next(iter(keys.values())).lease

        server.stop()
        wait_for(lambda: "lost" in agent.log(), "the agent to notice its lease is lost", proc=agent.proc)
        server.start(timeout=60)

        def back_on_a_new_lease() -> bool:
            k = node_keys(store, "no")
            leases = {kv.lease for kv in k.values()}
            return len(k) == 3 and len(leases) == 1 and old_lease not in leases and store.lease_info(leases.pop()) is not None

        wait_for(back_on_a_new_lease, "the node to be published again under a new lease", proc=agent.proc)
        assert agent.signal(signal.SIGTERM) == 0
        assert node_keys(store, "no") == {}
    finally:
        store.close()
        server.stop()


def test_a_second_agent_with_the_same_node_refuses_then_takes_over_with_the_flag(start_agent, store):
    first = start_agent("--node", "dup", "--simulate", "2xT4", "--ttl", "10")
    keys = wait_for(lambda: len(node_keys(store, "dup")) == 3 and node_keys(store, "dup"), "keys", proc=first.proc)
    first_lease = next(iter(keys.values())).lease

    # Same host, but the first agent is alive: the second refuses, exits 1, names the owner and the fixes.
    second = start_agent("--node", "dup", "--simulate", "2xT4", "--ttl", "10")
    assert second.proc.wait(timeout=DEADLINE_S) == 1
    assert f"node dup is already published by the agent with pid {first.proc.pid}" in second.log()
    assert "another --node" in second.log() and "--take-over" in second.log()
    assert {kv.lease for kv in node_keys(store, "dup").values()} == {first_lease}

    # --take-over replaces it; the first agent stops at its next refresh (exit 1) instead of fighting.
    third = start_agent("--node", "dup", "--simulate", "2xT4", "--ttl", "10", "--take-over")
    assert first.proc.wait(timeout=DEADLINE_S) == 1
    assert f"node dup was taken over by the agent with pid {third.proc.pid}" in first.log()
    leases = {kv.lease for kv in node_keys(store, "dup").values()}
    assert len(leases) == 1 and leases != {first_lease}
    assert third.proc.poll() is None
    assert third.signal(signal.SIGTERM) == 0
