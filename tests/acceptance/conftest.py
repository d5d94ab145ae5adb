"""Fixtures of the acceptance tests: one live pool (agent + coordinator processes) per module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from scenarios.harness import Pool

from gpupool_sdk.store.keyspace import Keyspace

AGENT_SPEC = "node-a:2xA100-40GB:pcie"


@pytest.fixture(scope="module")
def live_pool(etcd_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A pool on its own prefix with a real ``gpupool agent --simulate`` and one coordinator, shared by a module.

    Process logs are in ``pool.log("agent-0")`` / ``pool.log("coordinator-c1")``.
    """
    pool = Pool(etcd_endpoint, Keyspace(f"/gpupool-test/{uuid.uuid4().hex}"), tmp_path_factory.mktemp("acceptance-pool"))
    try:
        pool.gpus(AGENT_SPEC)
        pool.coordinator("c1")
        pool.wait_leader()
        yield pool
    finally:
        pool.close()
