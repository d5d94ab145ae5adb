"""``gpupool status``, ``cordon``/``uncordon``, ``drain``/``undrain`` and ``coordinator`` flags, as real processes."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from testkit import publish_gpus

from gpupool_sdk.cli.common import EXIT_NOT_FOUND, EXIT_UNREACHABLE, EXIT_USAGE
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import (
    Allocation,
    GiB,
    GpuReadings,
    JobSpec,
    JobState,
    JobStatus,
    LeaderRecord,
    QoS,
)
from gpupool_sdk.store import EtcdStore

ROOT = Path(__file__).resolve().parents[2]
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def gpupool(etcd_endpoint: str, store: EtcdStore) -> Run:
    def run(*args: str, endpoint: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpupool_sdk.cli.main", *args, "--endpoints", endpoint or etcd_endpoint,
             "--prefix", store.keys.prefix],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )

    return run


def _populate(store: EtcdStore) -> list[str]:
    ks = store.keys
    gpus = parse_cluster_spec("node-a:2xA100-40GB:pcie")
    publish_gpus(store, gpus)
    lease = store.grant_lease(600)  # the jobs' lease (not the agent's); long: a busy machine runs these slowly
    store.put(ks.job_spec("bert"), JobSpec(name="bert", gpus=1, memory="10GiB", priority=3), lease=lease)
    store.put(ks.job_status("bert"), JobStatus(JobState.GRANTED, "granted 1 slice on node-a", term=2, gpus=1), lease=lease)
    store.put(ks.allocation("node-a", gpus[0].uuid, "bert"),
              Allocation("bert", "node-a", gpus[0].uuid, 0, 10 * GiB, 1.0, QoS.GUARANTEED, 2), lease=lease)
    store.put(ks.job_spec("waiting"), JobSpec(name="waiting", gpus=1, memory="50GiB", priority=1), lease=lease)
    store.put(ks.job_status("waiting"), JobStatus(JobState.PENDING, "queued: no GPU with 50GiB", 1.0, 1.0), lease=lease)
    store.put(ks.leader(), LeaderRecord("coord-x", 2, time.time()), lease=store.grant_lease(600))
    return [g.uuid for g in gpus]


def test_status_json_shows_the_pool_and_reports_malformed_keys(store: EtcdStore, gpupool: Run, etcdctl: Run) -> None:
    uuids = _populate(store)
    etcdctl("put", store.keys.job_spec("hand-edited"), "{oops")
    etcdctl("put", store.keys.gpu("node-a", "GPU-bad"), '{"schema": 1, "kind": "GpuInfo"}')
    etcdctl("put", store.keys.readings("node-a", uuids[1]), '{"schema": 1, "utilization": 3}')
    r = gpupool("status", "-o", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["leader"]["id"] == "coord-x" and d["leader"]["term"] == 2
    assert [g["uuid"] for g in d["gpus"]] == uuids
    assert d["gpus"][0]["used_memory_bytes"] == 10 * GiB and d["gpus"][0]["jobs"] == ["bert"]
    jobs = {j["name"]: j for j in d["jobs"]}
    assert jobs["bert"]["state"] == "GRANTED" and jobs["bert"]["allocations"][0]["gpu_uuid"] == uuids[0]
    assert [q["name"] for q in d["queue"]] == ["waiting"]
    assert {p["key"] for p in d["problems"]} == {
        store.keys.job_spec("hand-edited"), store.keys.gpu("node-a", "GPU-bad"), store.keys.readings("node-a", uuids[1])}
    assert "utilization" in next(p["message"] for p in d["problems"] if "/readings/" in p["key"])
    assert d["gpus"][1]["readings"]["utilization"] is None  # garbage is shown as unknown


def test_status_shows_the_agents_device_readings(store: EtcdStore, gpupool: Run) -> None:
    gpus = parse_cluster_spec("node-a:2xA100-40GB:pcie")
    hot = dataclasses.replace(gpus[0].health, temperature_c=71.0)
    lease = publish_gpus(store, [dataclasses.replace(gpus[0], health=hot), gpus[1]])
    # usage readings live under a key of their own, as the agent writes them on its lease
    busy = GpuReadings(utilization=0.37, pcie_rx_bytes_per_s=2.0 * GiB, memory_used_bytes=GiB)
    store.put(store.keys.readings("node-a", gpus[0].uuid), busy, lease=lease)
    d = json.loads(gpupool("status", "-o", "json").stdout)
    r0, r1 = (g["readings"] for g in d["gpus"])
    assert (r0["utilization"], r0["pcie_rx_bytes_per_s"], r0["memory_used_bytes"]) == (0.37, 2.0 * GiB, GiB)
    assert r0["temperature_c"] == 71.0  # from the GPU record
    assert r1["utilization"] is None and r0["nvlink_tx_bytes_per_s"] is None and not d["problems"]
    plain = gpupool("status").stdout
    header = next(line for line in plain.splitlines() if line.startswith("NODE ") and " IDX " in line)
    row = next(line for line in plain.splitlines() if line.startswith("node-a ") and " 0 " in line[:12])
    assert row.index("37%") == header.index("DEV UTIL") and "PCIE TX/RX" not in header
    wide = gpupool("status", "-o", "wide").stdout
    header = next(line for line in wide.splitlines() if line.startswith("NODE ") and " IDX " in line)
    row = next(line for line in wide.splitlines() if line.startswith("node-a ") and " 0 " in line[:12])
    assert row.index("-/2.0GiB/s") == header.index("PCIE TX/RX")


def test_status_table_lists_problems_instead_of_crashing(store: EtcdStore, gpupool: Run, etcdctl: Run) -> None:
    _populate(store)
    etcdctl("put", store.keys.directive("bert"), "not json at all")
    r = gpupool("status")
    assert r.returncode == 0, r.stderr
    for text in ("coord-x", "bert", "GRANTED", "waiting", "Problems", "directives/bert"):
        assert text in r.stdout


def test_status_with_etcd_down_exits_3_naming_the_endpoint(gpupool: Run) -> None:
    r = gpupool("status", endpoint="127.0.0.1:9")
    assert r.returncode == EXIT_UNREACHABLE
    assert "127.0.0.1:9" in r.stderr


def test_status_watch_refreshes_until_interrupted(etcd_endpoint: str, store: EtcdStore) -> None:
    _populate(store)
    p = subprocess.Popen(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "status", "-o", "json", "-w", "0.2",
         "--endpoints", etcd_endpoint, "--prefix", store.keys.prefix],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert p.stdout is not None
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            # under -w, -o json is one compact object per line
            seen += line.startswith("{") and "cordoned" in json.loads(line)
        assert seen >= 2, "status -w should print the pool again and again"
        p.send_signal(signal.SIGINT)
        assert p.wait(20) in (0, 130)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_cordon_and_uncordon(store: EtcdStore, gpupool: Run) -> None:
    uuids = _populate(store)
    r = gpupool("cordon", uuids[1], "--reason", "ECC noise", "-o", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"gpu_uuid": uuids[1], "cordoned": True, "changed": True}
    assert store.get(store.keys.cordon(uuids[1])) is not None
    assert json.loads(gpupool("cordon", uuids[1], "-o", "json").stdout)["changed"] is False
    status = json.loads(gpupool("status", "-o", "json").stdout)
    assert [g["cordoned"] for g in status["gpus"]] == [False, True]
    assert status["intents"]["cordons"][uuids[1]]["reason"] == "ECC noise"
    assert "ECC noise" in gpupool("status").stdout
    r = gpupool("uncordon", uuids[1])
    assert r.returncode == 0 and "uncordoned" in r.stdout
    assert store.get(store.keys.cordon(uuids[1])) is None


def test_cordon_unknown_gpu_is_not_found_unless_forced(store: EtcdStore, gpupool: Run) -> None:
    _populate(store)
    r = gpupool("cordon", "GPU-nope")
    assert r.returncode == EXIT_NOT_FOUND and "GPU-nope" in r.stderr and "--force" in r.stderr
    assert store.get(store.keys.cordon("GPU-nope")) is None
    assert gpupool("cordon", "GPU-nope", "--force").returncode == 0
    r = gpupool("cordon", "bad/uuid")
    assert r.returncode == EXIT_USAGE and "gpu_uuid" in r.stderr


def test_drain_and_undrain(store: EtcdStore, gpupool: Run) -> None:
    _populate(store)
    assert gpupool("drain", "node-zz").returncode == EXIT_NOT_FOUND
    r = gpupool("drain", "node-a", "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] is True
    assert store.get(store.keys.drain("node-a")) is not None
    status = json.loads(gpupool("status", "-o", "json").stdout)
    assert status["draining"] == ["node-a"] and status["nodes"][0]["draining"] is True
    assert gpupool("undrain", "node-a").returncode == 0
    assert store.get(store.keys.drain("node-a")) is None


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--ttl", "3", "--loop-wait", "2", "--retry-timeout", "1"], "--loop-wait"),
        (["--overcommit-ratio", "0.5"], "--overcommit-ratio"),
        (["--ttl", "1"], "--ttl"),
    ],
)
def test_coordinator_rejects_bad_timing_naming_the_flag(gpupool: Run, args: list[str], flag: str) -> None:
    r = gpupool("coordinator", *args)
    assert r.returncode == EXIT_USAGE
    assert flag in r.stderr
