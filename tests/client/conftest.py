"""Fixtures of the client tests: a ``PoolClient`` on node-a against the test's real etcd, and a leader stub."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpupool_sdk.client import PoolClient
from gpupool_sdk.store import EtcdStore

from .leader_stub import LeaderStub
from .test_pool_client import TIMING


@pytest.fixture
def pool(etcd_endpoint: str, store: EtcdStore) -> Iterator[PoolClient]:
    client = PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=TIMING, node="node-a")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def leader(store: EtcdStore) -> LeaderStub:
    return LeaderStub(store)
