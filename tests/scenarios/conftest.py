"""Fixtures of the scenario tests (the harness itself is in ``harness.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool_sdk.store.keyspace import Keyspace
from scenarios.harness import Pool


@pytest.fixture
def pool(etcd_endpoint: str, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """A scenario pool; on failure the process logs are printed."""
    p = Pool(etcd_endpoint, keyspace, tmp_path)
    try:
        yield p
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for f in sorted(tmp_path.glob("*.log")):
                sys.stderr.write(f"\n----- {f.name} (tail) -----\n{f.read_text(errors='replace')[-4000:]}\n")
        p.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
