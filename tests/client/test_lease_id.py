"""The job's etcd lease id is shown and logged in the form ``etcdctl`` takes (hex), and works there.

Issue 18 item 1: ``lease.etcd_lease_id`` is an int, and ``etcdctl lease timetolive`` refuses a
decimal id ("expecting ID in Hex"). Operators inspect what a job holds with
``etcdctl lease timetolive <id> --keys``, so the id shown must be the one etcdctl takes.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpupool_sdk.client import Lease, PoolClient
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store import EtcdStore

from .leader_stub import LeaderStub
from .test_pool_client import acquire_in_thread

ROOT = Path(__file__).resolve().parents[2]
Run = Callable[..., subprocess.CompletedProcess[str]]


def _granted(pool: PoolClient, store: EtcdStore) -> Lease:
    leader = LeaderStub(store)
    t, out = acquire_in_thread(pool, JobSpec(name="job-a", gpus=2, memory="1GiB"), timeout=60)
    assert leader.grant("job-a", [("node-a", "GPU-0", 0), ("node-a", "GPU-1", 1)])
    t.join(30)
    lease = out.get("lease")
    assert isinstance(lease, Lease), out
    return lease


def test_the_hex_lease_id_works_with_etcdctl_and_lists_the_jobs_keys(
    pool: PoolClient, store: EtcdStore, etcdctl: Run, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gpupool_sdk.client.lease"):
        lease = _granted(pool, store)
    assert int(lease.etcd_lease_hex, 16) == lease.etcd_lease_id > 0
    assert lease.etcd_lease_hex in repr(lease)
    # The log line is the command an operator can paste.
    assert f"etcdctl lease timetolive {lease.etcd_lease_hex} --keys" in caplog.text

    out = etcdctl("lease", "timetolive", lease.etcd_lease_hex, "--keys").stdout
    ks = store.keys
    for key in (ks.job_spec("job-a"), ks.job_status("job-a"), ks.allocation("node-a", "GPU-0", "job-a"),
                ks.allocation("node-a", "GPU-1", "job-a")):
        assert key in out, out
    assert "already expired" not in out

    # The same with etcdctl's JSON output: the lease it reports is the one we show.
    js = json.loads(etcdctl("lease", "timetolive", lease.etcd_lease_hex, "--keys", "-w", "json").stdout)
    assert js["id"] == lease.etcd_lease_id and js["ttl"] > 0
    lease.release()


def test_gpupool_status_shows_the_lease_as_etcdctl_takes_it(
    pool: PoolClient, store: EtcdStore, etcd_endpoint: str, etcdctl: Run
) -> None:
    lease = _granted(pool, store)

    def status(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpupool_sdk.cli.main", "status", *extra, "--endpoints", etcd_endpoint,
             "--prefix", store.keys.prefix],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    table = status()
    if "LEASE" not in table:  # the table may keep it for its wide form (`-o wide`)
        table = status("-o", "wide")
    assert "LEASE" in table
    row = next(ln for ln in table.splitlines() if "job-a" in ln and "GRANTED" in ln)
    assert lease.etcd_lease_hex in row
    job = next(j for j in json.loads(status("-o", "json"))["jobs"] if j["name"] == "job-a")
    assert job["lease"] == lease.etcd_lease_hex
    # What status shows is what etcdctl takes.
    assert store.keys.job_spec("job-a") in etcdctl("lease", "timetolive", job["lease"], "--keys").stdout
    lease.release()
