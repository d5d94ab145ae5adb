"""Issue 12, failure 4: the client rides out etcd restarts and member elections.

Each test runs its own real etcd (killed with SIGKILL and restarted on the same data dir, or a
3-member raft group whose leader is killed), a coordinator in this process, and real
``PoolClient`` helper processes. Job leases have a 60 s TTL: etcd restarts every lease's TTL when
it restarts, so a name left taken by a release that never reached etcd would stay taken for a
minute; the tests show it is free as soon as etcd answers again.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from testkit import publish_gpus, wait_for

from gpupool_sdk.client import PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.coordinator import Coordinator
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store import EtcdCluster, EtcdServer, EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

COORD_TIMING = LeaseTiming(ttl_s=3, keepalive_interval_s=0.5, retry_timeout_s=1.0)
JOB_TIMING = LeaseTiming(ttl_s=60, keepalive_interval_s=2.0, retry_timeout_s=3.0)
ACQUIRE_S = 120.0  # generous: a busy machine restarts etcd slowly


@dataclass
class Pool:
    endpoints: str
    keys: Keyspace
    store: EtcdStore

    def client(self) -> PoolClient:
        return PoolClient(endpoints=self.endpoints, prefix=self.keys.prefix, timing=JOB_TIMING, node="node-a",
                          timeout_s=1.0)

    def spec_lease(self, job: str) -> int | None:
        kv = self.store.get(self.keys.job_spec(job))
        return kv.lease if kv is not None else None


def _run_pool(endpoints: str) -> Iterator[Pool]:
    keys = Keyspace(f"/gpupool-test/{uuid.uuid4().hex}")
    store = EtcdStore(endpoints, keyspace=keys, timeout_s=2.0)
    publish_gpus(store, parse_cluster_spec("node-a:2xA100-40GB:pcie"), ttl_s=600)
    coord_store = EtcdStore(endpoints, keyspace=keys, timeout_s=2.0)
    coord = Coordinator(coord_store, SchedulerConfig(), COORD_TIMING, "outage", loop_wait_s=0.5)
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    try:
        yield Pool(endpoints, keys, store)
    finally:
        coord.stop()
        t.join(30)
        coord_store.close()
        store.close()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    # die_with_parent off: the tests restart etcd from helper threads, whose exit must not kill it.
    server = EtcdServer(data_dir=tmp_path / "etcd", die_with_parent=False)
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pool(etcd: EtcdServer) -> Iterator[Pool]:
    yield from _run_pool(etcd.endpoint)


def _spec(name: str) -> JobSpec:
    return JobSpec(name=name, gpus=1, memory="1GiB", qos="shared")


def test_acquire_waits_out_an_etcd_restart_within_its_timeout(etcd: EtcdServer, pool: Pool) -> None:
    with pool.client() as client:
        client.resume_info("warm-up")  # the helper is up before etcd goes away
        etcd.kill()
        restart = threading.Timer(2.0, lambda: etcd.start(timeout=60))
        restart.start()
        try:
            lease = client.acquire(_spec("during-restart"), timeout=ACQUIRE_S)  # was: StoreUnavailableError
        finally:
            restart.join()
        assert lease.allocations and lease.active
        lease.release()


def test_a_release_during_an_outage_frees_the_name_when_etcd_returns(etcd: EtcdServer, pool: Pool) -> None:
    with pool.client() as client:
        lease = client.acquire(_spec("relaunch"), timeout=ACQUIRE_S)
        old = lease.etcd_lease_id
        etcd.kill()
        lease.release()  # cannot reach etcd: the helper keeps the revocation for later
        etcd.start(timeout=60)
        # The same name again at once: was JobAlreadyRunningError for a whole TTL (60 s here).
        again = client.acquire(_spec("relaunch"), timeout=ACQUIRE_S)
        assert again.etcd_lease_id != old and again.allocations
        assert pool.store.lease_info(old) is None
        again.release()


def test_a_client_closed_during_an_outage_revokes_its_lease_when_etcd_returns(etcd: EtcdServer, pool: Pool) -> None:
    first = pool.client()
    lease = first.acquire(_spec("closed"), timeout=ACQUIRE_S)
    old, helper = lease.etcd_lease_id, first._proc
    assert helper is not None
    etcd.kill()
    first.close()  # the training process finishes while etcd is down; its helper stays to revoke
    assert helper.poll() is None, "the helper keeps retrying the revocation"
    etcd.start(timeout=60)
    helper.wait(90)  # it exits once the revocation went through (or after REVOKE_RETRY_S)
    assert pool.store.lease_info(old) is None, "revoked once etcd answered, not left to its 60 s TTL"
    assert pool.spec_lease("closed") is None
    with pool.client() as second:
        second.acquire(_spec("closed"), timeout=ACQUIRE_S).release()


def test_a_job_restarted_under_its_name_takes_over_its_own_stale_lease(etcd: EtcdServer, pool: Pool) -> None:
    first = pool.client()
    lease = first.acquire(_spec("crashed"), timeout=ACQUIRE_S)
    old = lease.etcd_lease_id
    etcd.kill()
    assert first.helper_pid is not None
    os.kill(first.helper_pid, signal.SIGKILL)  # nothing will ever revoke the lease
    etcd.start(timeout=60)
    assert pool.spec_lease("crashed") == old  # etcd restarted its TTL: 60 s more
    with pool.client() as second:
        again = second.acquire(_spec("crashed"), timeout=ACQUIRE_S)  # was: JobAlreadyRunningError
        assert again.etcd_lease_id != old and again.allocations
        assert pool.store.lease_info(old) is None
        again.release()
    first.close()


def test_another_live_holder_still_blocks_the_name(pool: Pool) -> None:
    from gpupool_sdk.client.protocol import JobAlreadyRunningError

    with pool.client() as first, pool.client() as second:
        lease = first.acquire(_spec("taken"), timeout=ACQUIRE_S)
        with pytest.raises(JobAlreadyRunningError, match="already running"):
            second.acquire(_spec("taken"), timeout=ACQUIRE_S)
        assert lease.active
        lease.release()


def test_acquire_rides_out_the_election_after_the_raft_leader_is_killed(tmp_path: Path) -> None:
    cluster = EtcdCluster(3, data_root=tmp_path / "cluster", die_with_parent=False)  # restarted from a gRPC process
    cluster.start(timeout=90)
    try:
        for p in _run_pool(cluster.endpoints):
            with p.client() as client:
                client.resume_info("warm-up")
                leader = wait_for(lambda: (i := cluster.leader_index()) is not None and (i,), what="a raft leader")[0]
                cluster.kill(leader)  # the client's first endpoint may be the one killed
                lease = client.acquire(_spec("election"), timeout=ACQUIRE_S)  # was: StoreUnavailableError
                assert lease.allocations
                lease.release()
                cluster.start_member(leader)
    finally:
        cluster.stop()
