"""Gangs near etcd's ``--max-txn-ops``, end to end: real etcd, ``gpupool coordinator`` and ``gpupool agent
--simulate "17*8xT4"`` processes (136 simulated T4s), jobs through ``PoolClient.acquire``.

A grant is one fenced transaction with an operation per slice. Before the limit was known, a
130-slice gang on an etcd with the default 128 made every cycle fail with "too many operations in
txn request", and no other job was granted either.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from scenarios.harness import DEADLINE, Pool
from testkit import dump_logs_if_failed

from gpupool_sdk.client import PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import JobRejectedError
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.launcher import EtcdServer

JOB_TIMING = LeaseTiming(ttl_s=6, keepalive_interval_s=1.0, retry_timeout_s=2.0)
SIMULATE = "17*8xT4"


@pytest.fixture(scope="module")
def default_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd with its own default ``--max-txn-ops`` (128), as an operator's etcd usually runs."""
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd-default") / "data", name="gpupool-txn128", max_txn_ops=None)
    server.start(timeout=60)
    try:
        yield server
    finally:
        server.stop()


def _pool(endpoint: str, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest, *flags: str) -> Iterator[tuple[Pool, PoolClient]]:
    pool = Pool(endpoint, keyspace, tmp_path)
    client = PoolClient(endpoints=endpoint, prefix=keyspace.prefix, timing=JOB_TIMING, in_process=True, node="*")
    try:
        pool.gpus(SIMULATE)
        pool.coordinator("c1", *flags)
        pool.wait_leader()
        yield pool, client
    finally:
        client.close()
        dump_logs_if_failed(request, tmp_path, tail_chars=4000)
        pool.close()


@pytest.fixture
def on_default_etcd(default_etcd: EtcdServer, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Pool, PoolClient]]:
    """etcd and coordinator both at the default limit (the coordinator's --etcd-max-txn-ops is 128)."""
    yield from _pool(default_etcd.endpoint, keyspace, tmp_path, request)


@pytest.fixture
def coordinator_told_too_much(default_etcd: EtcdServer, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Pool, PoolClient]]:
    """A misconfiguration: the coordinator believes 1024, etcd runs with 128."""
    yield from _pool(default_etcd.endpoint, keyspace, tmp_path, request, "--etcd-max-txn-ops", "1024")


@pytest.fixture
def on_launcher_etcd(etcd_server: EtcdServer, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Pool, PoolClient]]:
    """The session etcd (started by EtcdServer: --max-txn-ops 1024) and a coordinator told the same."""
    assert etcd_server.max_txn_ops == 1024
    yield from _pool(etcd_server.endpoint, keyspace, tmp_path, request, "--etcd-max-txn-ops", "1024")


def test_gang_over_the_default_limit_is_rejected_once_and_the_pool_keeps_granting(on_default_etcd: tuple[Pool, PoolClient]) -> None:
    pool, client = on_default_etcd
    with pytest.raises(JobRejectedError) as info:
        client.acquire(JobSpec(name="big", gpus=130, memory="1GiB"), timeout=DEADLINE * 2)
    reason = str(info.value)
    assert "a gang of 130 slices needs 134 operations in one etcd transaction" in reason
    assert "--etcd-max-txn-ops 128" in reason and "--max-txn-ops >= 134" in reason
    # The largest gang the default allows (its release needs 124 + 4 = 128 operations) is granted,
    # and so is a small job next to it: the coordinator kept scheduling.
    fits = client.acquire(JobSpec(name="fits", gpus=124, memory="1GiB"), timeout=DEADLINE * 2)
    assert len(fits.allocations) == 124
    small = client.acquire(JobSpec(name="small", gpus=1, memory="1GiB"), timeout=DEADLINE * 2)
    assert len(small.allocations) == 1
    pool.check()
    # The oversized grant was never sent to etcd.
    assert "too many operations in txn request" not in pool.log("coordinator-c1")


def test_coordinator_limit_above_etcds_turns_etcds_refusal_into_a_rejection(coordinator_told_too_much: tuple[Pool, PoolClient]) -> None:
    pool, client = coordinator_told_too_much
    with pytest.raises(JobRejectedError) as info:
        client.acquire(JobSpec(name="big", gpus=130, memory="1GiB"), timeout=DEADLINE * 2)
    reason = str(info.value)
    assert "etcd refused a transaction of 133 operations" in reason  # 130 puts + status; 3 + 130 compares
    assert "--etcd-max-txn-ops 1024" in reason and "--max-txn-ops >= 134" in reason
    small = client.acquire(JobSpec(name="small", gpus=1, memory="1GiB"), timeout=DEADLINE * 2)
    assert len(small.allocations) == 1
    pool.check()


def test_gang_of_130_is_granted_when_etcd_and_coordinator_allow_1024(on_launcher_etcd: tuple[Pool, PoolClient]) -> None:
    pool, client = on_launcher_etcd
    big = client.acquire(JobSpec(name="big", gpus=130, memory="1GiB"), timeout=DEADLINE * 2)
    assert len(big.allocations) == 130
    assert len({a.node for a in big.allocations}) == 17
    assert len([a for a in pool.allocations() if a.job == "big"]) == 130
    pool.check()
