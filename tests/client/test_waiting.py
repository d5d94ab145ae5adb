"""A waiting job says why: no GPUs published, no leader, then the PENDING reason (real etcd, real client)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from gpupool_sdk.client import PoolClient
from gpupool_sdk.client.waiting import WaitReporter, explain_wait
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.resources import JobSpec, JobState, JobStatus, NodeInfo
from gpupool_sdk.store import EtcdStore

from .leader_stub import LeaderStub

TIMING = LeaseTiming(ttl_s=6, keepalive_interval_s=1.0, retry_timeout_s=2.0)


@pytest.mark.parametrize(
    ("status", "nodes", "says"),
    [
        (None, [], "no agent has published any GPU"),
        (None, ["node-a"], "no coordinator has answered"),
        (None, None, "no coordinator has answered"),
        (JobStatus(JobState.PENDING, "queued: needs 2 x A100 among 1 matching"), None,
         "PENDING: queued: needs 2 x A100 among 1 matching"),
    ],
)
def test_explain_wait(status: JobStatus | None, nodes: list[str] | None, says: str) -> None:
    line = explain_wait("bert", status, 42.0, nodes)
    assert line.startswith("job bert waiting 42s: ") and says in line


def test_reporter_repeats_at_growing_intervals_and_says_a_change_at_once(caplog: pytest.LogCaptureFixture) -> None:
    status: list[JobStatus | None] = [None]
    rep = WaitReporter("j", lambda: status[0], lambda: [], first_after_s=0.05, repeat_s=(0.2, 10.0))
    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.client"):
        rep.start()
        deadline = time.monotonic() + 20
        while len(rep.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        status[0] = JobStatus(JobState.PENDING, "queued: busy")
        while not any("queued: busy" in x for x in rep.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        rep.stop()
    assert "no agent has published any GPU" in rep.lines[0] and "no agent" in rep.lines[1]
    assert "PENDING: queued: busy" in rep.lines[-1]
    assert len(rep.lines) == 3, rep.lines  # the 10 s repeat did not come yet: the change was said at once
    assert [r.getMessage() for r in caplog.records if r.name == "gpupool_sdk.client"][-1] == rep.lines[-1]


@pytest.fixture
def client(etcd_endpoint: str, store: EtcdStore) -> Iterator[PoolClient]:
    c = PoolClient(endpoints=etcd_endpoint, prefix=store.keys.prefix, timing=TIMING, node="node-a")
    try:
        yield c
    finally:
        c.close()


def test_acquire_logs_why_it_waits_within_seconds(
    client: PoolClient, store: EtcdStore, caplog: pytest.LogCaptureFixture
) -> None:
    spec = JobSpec(name="patient", gpus=1, memory="1Gi")
    got: dict[str, object] = {}

    def run() -> None:
        try:
            got["lease"] = client.acquire(spec, timeout=120)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            got["error"] = exc

    def said(text: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records if r.name == "gpupool_sdk.client")

    def wait_said(text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not said(text):
            assert time.monotonic() < deadline, f"never logged {text!r}: {[r.getMessage() for r in caplog.records]}"
            time.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="gpupool_sdk.client"):
        t = threading.Thread(target=run, daemon=True)
        t.start()
        # Nothing published, no coordinator: the first line names the missing GPUs.
        wait_said("job patient waiting")
        assert said("no agent has published any GPU")
        # An agent publishes its node: now the missing leader is named (the line changes at once).
        lease = store.grant_lease(30)
        store.put(store.keys.node("node-a"), NodeInfo("node-a", "host-a", 1, 1, "simulated", time.time()), lease=lease)
        wait_said("no coordinator has answered")
        # A leader writes the PENDING reason: that reason is logged.
        leader = LeaderStub(store)
        leader.wait_spec("patient")
        leader.pending("patient", "queued: needs 1 x GPU with 1.0GiB free among 0 matching")
        wait_said("PENDING: queued: needs 1 x GPU with 1.0GiB free among 0 matching")
        leader.grant("patient")
        t.join(60)
    assert "lease" in got, got
    n = len(caplog.records)
    time.sleep(0.5)
    assert not any("waiting" in r.getMessage() for r in caplog.records[n:]), "silent once granted"
    store.revoke_lease(lease)
