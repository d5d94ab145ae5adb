"""The client with real processes: SIGKILL of the trainer, helper death, fork-started DataLoader workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpupool_sdk.client import HelperDiedError, Lease, PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store import EtcdStore

from .leader_stub import AutoGrant, LeaderStub

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from gpupool_sdk import JobSpec, PoolClient
    from gpupool_sdk.config import LeaseTiming

    endpoint, prefix, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "gil":
        timing = LeaseTiming(ttl_s=2, keepalive_interval_s=0.3, retry_timeout_s=0.5)
    else:
        timing = LeaseTiming(ttl_s=30, keepalive_interval_s=2, retry_timeout_s=3)
    pool = PoolClient(endpoints=endpoint, prefix=prefix, timing=timing, node="node-a")
    lease = pool.acquire(JobSpec(name="trainer", memory="1GiB"), timeout=60)
    report = {"lease": lease.etcd_lease_id, "helper": pool.helper_pid, "grpc_loaded": "grpc" in sys.modules,
              "devices": lease.visible_devices}
    if mode == "gil":
        import ctypes
        print(json.dumps(report), flush=True)
        # libc sleep through ctypes.PyDLL keeps the GIL: no Python thread of this process runs.
        ctypes.PyDLL(None).sleep(int(sys.argv[4]))
        print(json.dumps({"active_after": lease.active and bool(lease.allocations)}), flush=True)
        lease.release()
        pool.close()
    elif mode == "dataloader":
        import multiprocessing
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Squares(Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                return torch.tensor([i * i], dtype=torch.float32)

        loader = DataLoader(Squares(), batch_size=8, num_workers=2,
                            multiprocessing_context=multiprocessing.get_context("fork"))
        total = 0.0
        for _ in range(2):
            for batch in loader:
                total += float(batch.sum())
        report["total"] = total
        report["active_after"] = lease.active and bool(lease.allocations)
        report["grpc_loaded_after"] = "grpc" in sys.modules
        print(json.dumps(report), flush=True)
        lease.release()
        pool.close()
    else:
        print(json.dumps(report), flush=True)
        while True:
            time.sleep(1)
    """
)


def wait_for(cond: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.05)


@pytest.fixture
def auto_grant(store: EtcdStore) -> Iterator[AutoGrant]:
    ag = LeaderStub(store).auto_grant()
    yield ag
    ag.stop()


def start_child(tmp_path: Path, endpoint: str, prefix: str, mode: str, *extra: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), endpoint, prefix, mode, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_trainer_frees_its_keys_long_before_the_ttl(
    tmp_path: Path, etcd_endpoint: str, store: EtcdStore, auto_grant: AutoGrant
) -> None:
    child = start_child(tmp_path, etcd_endpoint, store.keys.prefix, "hold")
    try:
        assert child.stdout is not None
        report = json.loads(child.stdout.readline() or "{}")
        assert report, child.stderr.read() if child.stderr else ""
        lease_id = report["lease"]
        assert report["grpc_loaded"] is False  # the trainer itself never loads gRPC
        assert report["devices"] == "0"
        info = store.lease_info(lease_id)
        assert info is not None and store.keys.allocation("node-a", "GPU-0", "trainer") in info.keys
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        # TTL is 30 s: the keys must vanish while the lease would still have well over 10 s
        # left. The deadline below is the state check's budget, not a latency claim.
        wait_for(lambda: store.lease_info(lease_id) is None, timeout=15)
        assert store.get(store.keys.job_spec("trainer")) is None
        wait_for(lambda: not pid_alive(report["helper"]), timeout=15)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_dataloader_fork_workers_while_a_lease_is_live(
    tmp_path: Path, etcd_endpoint: str, store: EtcdStore, auto_grant: AutoGrant
) -> None:
    child = start_child(tmp_path, etcd_endpoint, store.keys.prefix, "dataloader")
    try:
        out, err = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["total"] == 2 * sum(i * i for i in range(64))
    assert report["active_after"] is True
    assert report["grpc_loaded"] is False and report["grpc_loaded_after"] is False
    # Released cleanly at the end: the lease and its keys are gone.
    assert store.lease_info(report["lease"]) is None


def test_helper_death_marks_the_lease_lost(etcd_endpoint: str, store: EtcdStore) -> None:
    leader = LeaderStub(store)
    timing = LeaseTiming(ttl_s=5, keepalive_interval_s=1, retry_timeout_s=1.5)
    with PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=timing, node="node-a") as pool:
        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.setdefault("lease", pool.acquire(JobSpec(name="j", memory="1GiB"), timeout=60)))
        t.start()
        leader.grant("j")
        t.join(30)
        lease = box["lease"]
        assert isinstance(lease, Lease)
        lost: list[GpupoolError] = []
        lease.add_lost_callback(lost.append)
        assert pool.helper_pid is not None
        os.kill(pool.helper_pid, signal.SIGKILL)
        wait_for(lambda: lost)
        assert isinstance(lost[0], HelperDiedError) and lease.allocations == ()


def test_helper_keeps_the_lease_alive_past_its_ttl(etcd_endpoint: str, store: EtcdStore) -> None:
    leader = LeaderStub(store)
    timing = LeaseTiming(ttl_s=2, keepalive_interval_s=0.3, retry_timeout_s=0.5)
    with PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=timing, node="node-a") as pool:
        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.setdefault("lease", pool.acquire(JobSpec(name="j", memory="1GiB"), timeout=60)))
        t.start()
        leader.grant("j")
        t.join(30)
        lease = box["lease"]
        assert isinstance(lease, Lease)
        # Observe the lease over three TTLs: it must exist every time we look.
        for _ in range(12):
            info = store.lease_info(lease.etcd_lease_id)
            assert info is not None and info.granted_ttl == 2
            time.sleep(0.5)
        assert lease.active and not lease.lost
        lease.release()
        assert store.lease_info(lease.etcd_lease_id) is None


def test_etcd_unreachable_at_acquire_is_a_typed_error() -> None:
    from gpupool_sdk.errors import StoreUnavailableError
    from gpupool_sdk.store.launcher import free_port

    dead = f"127.0.0.1:{free_port()}"
    with PoolClient(endpoints=dead, timeout_s=0.5) as pool, pytest.raises(StoreUnavailableError, match=dead):
        pool.acquire(JobSpec(name="j", memory="1GiB"), timeout=5)


def test_keepalive_failing_beyond_the_ttl_fences_the_lease(tmp_path: Path) -> None:
    from gpupool_sdk.errors import LeaseLostError
    from gpupool_sdk.store import EtcdServer, Keyspace

    server = EtcdServer(data_dir=tmp_path / "d", name="fence").start()
    store = EtcdStore(server.endpoint, keyspace=Keyspace("/fence"), timeout_s=1)
    timing = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)
    try:
        leader = LeaderStub(store)
        with PoolClient(endpoints=server.endpoint, prefix="/fence", timing=timing, timeout_s=1, node="node-a") as pool:
            box: dict[str, object] = {}
            t = threading.Thread(target=lambda: box.setdefault("lease", pool.acquire(JobSpec(name="j", memory="1GiB"), timeout=60)))
            t.start()
            leader.grant("j")
            t.join(30)
            lease = box["lease"]
            assert isinstance(lease, Lease) and lease.allocations
            lost: list[GpupoolError] = []
            lease.add_lost_callback(lost.append)
            server.kill()
            wait_for(lambda: lost)
            assert isinstance(lost[0], LeaseLostError) and "stepping down" in str(lost[0])
            assert lease.lost and lease.allocations == () and lease.visible_devices == ""
    finally:
        store.close()
        server.stop()


def test_lease_stays_alive_while_the_training_thread_holds_the_gil(
    tmp_path: Path, etcd_endpoint: str, store: EtcdStore, auto_grant: AutoGrant
) -> None:
    hold_s = 6  # three TTLs of 2 s
    child = start_child(tmp_path, etcd_endpoint, store.keys.prefix, "gil", str(hold_s))
    try:
        assert child.stdout is not None
        report = json.loads(child.stdout.readline() or "{}")
        assert report, child.stderr.read() if child.stderr else ""
        # While the child is stuck holding its GIL, look at the lease repeatedly: always there.
        seen = 0
        while child.poll() is None and seen < 2 * hold_s:
            assert store.lease_info(report["lease"]) is not None
            seen += 1
            time.sleep(0.25)
        after = json.loads(child.stdout.readline() or "{}")
        assert after.get("active_after") is True
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
