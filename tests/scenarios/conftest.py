"""Fixtures of the scenario tests (the harness itself is in ``harness.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import dump_logs_if_failed

from gpupool_sdk.store.keyspace import Keyspace
from scenarios.harness import Pool


@pytest.fixture
def pool(etcd_endpoint: str, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """A scenario pool; on failure the process logs are printed."""
    p = Pool(etcd_endpoint, keyspace, tmp_path)
    try:
        yield p
    finally:
        dump_logs_if_failed(request, tmp_path, tail_chars=4000)
        p.close()


