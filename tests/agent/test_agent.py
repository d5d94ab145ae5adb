"""NodeAgent in-process against a real etcd: publication, reconciliation, lease loss, stop."""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest
from testkit import wait_for

from gpupool_sdk.agent import NodeAgent, publishable, run_agents
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import ConfigError, NodeClaimedError
from gpupool_sdk.inventory import simulated_backends
from gpupool_sdk.resources import GpuHealth, GpuInfo, GpuReadings, NodeInfo
from gpupool_sdk.store.codec import decode

TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)


@pytest.fixture
def agents():
    made: list[NodeAgent] = []
    yield made
    for a in made:
        a.stop(revoke=True)


def make(store, agents, spec="n:4xH100-80GB:nvlink", **kw) -> NodeAgent:
    (backend,) = simulated_backends(spec)
    a = NodeAgent(store, backend, TIMING, refresh_interval_s=kw.pop("refresh", 0.2), **kw)
    agents.append(a)
    return a


def keys_of(store, node="n"):
    kvs, _ = store.get_prefix(store.keys.gpus_prefix(node))
    node_kv = store.get(store.keys.node(node))
    return {kv.key: kv for kv in [*kvs, *([node_kv] if node_kv else [])]}


def test_start_publishes_on_one_lease(store, agents):
    a = make(store, agents)
    lease = a.start()
    keys = keys_of(store)
    assert len(keys) == 5 and {kv.lease for kv in keys.values()} == {lease}
    info = store.get_record(store.keys.node("n"), NodeInfo)[0]
    assert info.gpu_count == 4 and info.backend == "simulated"
    assert sorted(store.lease_info(lease).keys) == sorted(keys)


def test_refresh_rewrites_only_changed_gpus(store, agents):
    a = make(store, agents)
    a.start()
    before = keys_of(store)
    assert a.refresh() == 0
    a.backend.set_health("GPU-sim-n-2", GpuHealth(healthy=False, reasons=("test",)))
    assert a.refresh() == 1
    after = keys_of(store)
    changed = [k for k in after if after[k].mod_revision != before[k].mod_revision]
    assert changed == [store.keys.gpu("n", "GPU-sim-n-2")]
    g = decode(changed[0], after[changed[0]].value, GpuInfo)
    assert not g.healthy and g.health.reasons == ("test",)


USAGE = GpuReadings(utilization=0.5, memory_bandwidth_utilization=0.2, memory_used_bytes=7 << 30, pcie_tx_bytes_per_s=1e9)


def _busy(a, uuid, **kw):
    """Give a simulated GPU usage readings (as NVML would read them)."""
    a.backend.set_readings(uuid, dataclasses.replace(USAGE, **kw))


def _readings(store, node="n"):
    kvs, _ = store.get_prefix(store.keys.readings_prefix(node))
    return {kv.key.rsplit("/", 1)[-1]: kv for kv in kvs}


def test_usage_readings_live_under_a_key_of_their_own_on_the_agents_lease(store, agents):
    clock = [1000.0]
    a = make(store, agents, usage_interval_s=10.0, clock=lambda: clock[0])
    _busy(a, "GPU-sim-n-2")
    lease = a.start()
    readings = _readings(store)
    assert set(readings) == {"GPU-sim-n-2"} and readings["GPU-sim-n-2"].lease == lease  # simulated GPUs: none
    assert decode(readings["GPU-sim-n-2"].key, readings["GPU-sim-n-2"].value, GpuReadings) == USAGE
    # the GPU record, the scheduler's input, carries none of them
    assert "utilization" not in store.get(store.keys.gpu("n", "GPU-sim-n-2")).value.decode()
    assert store.keys.readings("n", "GPU-sim-n-2") in store.lease_info(lease).keys
    a.stop(revoke=True)
    assert _readings(store) == {}  # a stopped (or dead) agent's readings vanish with its lease


def test_usage_readings_never_rewrite_the_gpu_record(store, agents):
    clock = [1000.0]
    a = make(store, agents, usage_interval_s=10.0, clock=lambda: clock[0])
    a.start()
    before = keys_of(store)
    _busy(a, "GPU-sim-n-2")
    clock[0] += 10.0
    assert a.refresh() == 1  # the readings key, nothing else
    assert keys_of(store) == before
    assert a.last_readings["GPU-sim-n-2"] == USAGE  # what the agent's metrics export
    a.backend.set_health("GPU-sim-n-2", GpuHealth(healthy=False, reasons=("test",)))
    assert a.refresh() == 1  # a health change is written at once, readings or not
    assert not store.get_record(store.keys.gpu("n", "GPU-sim-n-2"), GpuInfo)[0].healthy


def test_usage_readings_are_published_once_per_interval_when_they_change(store, agents):
    clock = [1000.0]
    a = make(store, agents, usage_interval_s=10.0, clock=lambda: clock[0])
    a.start()
    _busy(a, "GPU-sim-n-1")
    clock[0] += 5.0
    assert a.refresh() == 0
    clock[0] += 5.0  # one interval since the start's publication
    assert a.refresh() == 1
    key = store.keys.readings("n", "GPU-sim-n-1")
    assert store.get_record(key, GpuReadings)[0].utilization == 0.5
    _busy(a, "GPU-sim-n-1", utilization=0.6)
    clock[0] += 9.0
    assert a.refresh() == 0
    clock[0] += 1.0
    assert a.refresh() == 1
    clock[0] += 10.0
    assert a.refresh() == 0  # unchanged readings are never rewritten, however old
    a.backend.set_readings("GPU-sim-n-1", None)  # no longer known (say, MIG mode enabled)
    clock[0] += 10.0
    assert a.refresh() == 1 and _readings(store) == {}


def test_garbage_and_strays_under_the_readings_prefix_are_repaired(store, agents):
    clock = [1000.0]
    a = make(store, agents, usage_interval_s=10.0, clock=lambda: clock[0])
    _busy(a, "GPU-sim-n-0")
    lease = a.start()
    store.put(store.keys.readings("n", "GPU-sim-n-0"), b"{oops", lease=lease)
    store.put(store.keys.readings("n", "GPU-gone"), USAGE, lease=lease)
    clock[0] += 10.0
    assert a.refresh() == 2
    assert set(_readings(store)) == {"GPU-sim-n-0"}
    assert store.get_record(store.keys.readings("n", "GPU-sim-n-0"), GpuReadings)[0] == USAGE


@pytest.mark.parametrize(("interval", "writes", "keys"), [(None, 0, set()), (0.0, 1, {"GPU-sim-n-0"})])
def test_usage_interval_none_never_and_zero_every_refresh(store, agents, interval, writes, keys):
    a = make(store, agents, usage_interval_s=interval)
    a.start()
    _busy(a, "GPU-sim-n-0")
    assert a.refresh() == writes
    assert set(_readings(store)) == keys


def _claim(store, lease: int, host: str, pid: int) -> None:
    store.put(store.keys.node("n"), NodeInfo("n", host, pid, 9, "simulated", 0.0), lease=lease)
    store.put(store.keys.gpu("n", "GPU-gone"), b"{}", lease=lease)
    store.put(store.keys.gpu("n", "GPU-sim-n-0"), b"garbage", lease=lease)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (pids are not reused this fast)


def test_register_takes_over_and_cleans_a_previous_incarnation(store, agents, caplog):
    # The previous agent of this host was killed and restarted within its TTL: its lease is still
    # alive, but its process is gone, so the new agent takes the node over quietly.
    old_lease = store.grant_lease(30)
    _claim(store, old_lease, socket.gethostname(), _dead_pid())
    a = make(store, agents)
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.agent.agent"):
        lease = a.start()
    keys = keys_of(store)
    assert store.keys.gpu("n", "GPU-gone") not in keys
    assert len(keys) == 5 and {kv.lease for kv in keys.values()} == {lease}
    assert "gone from this host" in caplog.text and "taking it over" in caplog.text
    assert store.lease_info(old_lease).keys == []  # nothing of ours stays on the old lease


def test_an_expired_claim_is_taken_over(store, agents, caplog):
    old_lease = store.grant_lease(30)
    _claim(store, old_lease, "other-host", 4242)
    store.revoke_lease(old_lease)  # its keys vanish with it; write a stale node key by hand on a dead lease
    dead = store.grant_lease(1)
    _claim(store, dead, "other-host", 4242)
    wait_for(lambda: store.lease_info(dead) is None, what="the 1 s lease to expire")
    a = make(store, agents)
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.agent.agent"):
        lease = a.start()
    assert {kv.lease for kv in keys_of(store).values()} == {lease}


def test_a_live_agent_elsewhere_keeps_its_node(store, agents):
    # Another host's agent holds node n under a live lease: a second agent with the same --node
    # refuses to start, names the owner and the fixes, and writes nothing.
    other = store.grant_lease(30)
    _claim(store, other, "other-host", 4242)
    before = keys_of(store)
    a = make(store, agents)
    with pytest.raises(NodeClaimedError, match=r"node n is already published by the agent with pid 4242 on other-host.*--take-over"):
        a.start()
    assert keys_of(store) == before
    assert not a.registered


def test_take_over_replaces_a_live_agent_which_then_stops(store, agents):
    # Two agents in one test process: the second publishes as another host's agent would.
    first = make(store, agents)
    first_lease = first.start()
    store.put(store.keys.node("n"), NodeInfo("n", "host-a", 4242, 4, "simulated", 0.0), lease=first_lease)
    second = make(store, agents, take_over=True)
    info = second.backend.node_info
    second.backend.node_info = lambda: dataclasses.replace(info(), hostname="host-b", agent_pid=4343)  # type: ignore[method-assign]
    lease = second.start()
    assert {kv.lease for kv in keys_of(store).values()} == {lease}
    # The first agent notices at its next refresh and stops instead of rewriting the node.
    with pytest.raises(NodeClaimedError, match="node n was taken over by the agent with pid 4343 on host-b"):
        wait_for(lambda: first.tick() and False, what="the first agent to notice")
    assert {kv.lease for kv in keys_of(store).values()} == {lease}


def test_stop_revokes(store, agents):
    a = make(store, agents)
    lease = a.start()
    a.stop()
    assert keys_of(store) == {}
    assert store.lease_info(lease) is None
    assert a.lease_id is None


def test_lost_lease_re_registers(store, agents):
    a = make(store, agents)
    old = a.start()
    store.revoke_lease(old)
    assert keys_of(store) == {}

    def ticked_back() -> bool:
        a.tick()
        return a.registered and a.lease_id not in (None, old) and len(keys_of(store)) == 5

    wait_for(ticked_back, what="the agent to register again")
    assert a.registrations == 2
    # the old lease's keeper reporting its loss late does not unsettle the new registration
    time.sleep(TIMING.keepalive_interval_s * 3)
    a.tick()
    assert a.registrations == 2 and a.registered


def test_backend_failure_is_logged_not_raised(store, agents, caplog):
    a = make(store, agents)
    a.start()

    def broken() -> list[GpuInfo]:
        raise RuntimeError("NVML exploded")

    a.backend.gpus = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.agent.agent"):
        wait_for(lambda: a.tick() > 0 and "NVML exploded" in caplog.text, what="the failure to be logged")
    assert a.registered
    assert len(keys_of(store)) == 5  # what was published stays published


def test_run_agents_until_stopped(store):
    backends = simulated_backends("a:2xT4,b:2xT4")
    wake, stop = threading.Event(), threading.Event()
    agents = [NodeAgent(store, b, TIMING, refresh_interval_s=0.2, wake=wake) for b in backends]
    ready = threading.Event()
    t = threading.Thread(target=run_agents, args=(agents, stop, wake, lambda _: ready.set()))
    t.start()
    assert ready.wait(30)
    assert len(keys_of(store, "a")) == 3 and len(keys_of(store, "b")) == 3
    assert agents[0].lease_id != agents[1].lease_id
    stop.set()
    wake.set()
    t.join(30)
    assert not t.is_alive()
    assert keys_of(store, "a") == {} and keys_of(store, "b") == {}


def test_publishable_rounds_noisy_readings():
    (b,) = simulated_backends("n:1xT4")
    g = b.gpus()[0]
    noisy = GpuInfo(**{**g.__dict__, "health": GpuHealth(temperature_c=40.4, power_w=71.9)})
    p = publishable(noisy)
    assert (p.health.temperature_c, p.health.power_w) == (40.0, 70.0)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), "60", True])
def test_bad_usage_interval(store, bad):
    (b,) = simulated_backends("n:1xT4")
    with pytest.raises(ConfigError) as e:
        NodeAgent(store, b, TIMING, usage_interval_s=bad)
    assert e.value.field == "usage_interval_s"


@pytest.mark.parametrize("bad", [0, -1, float("inf"), True])
def test_bad_refresh_interval(store, bad):
    (b,) = simulated_backends("n:1xT4")
    with pytest.raises(ConfigError) as e:
        NodeAgent(store, b, TIMING, refresh_interval_s=bad)
    assert e.value.field == "refresh_interval_s"
