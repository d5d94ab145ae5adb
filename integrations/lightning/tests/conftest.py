"""Harness for the Lightning integration tests: a real pool (etcd, coordinator, agent) and real trainers.

* ``live_pool``: a coordinator and a ``gpupool agent --simulate`` subprocess on the session etcd,
  under this test's key prefix, with short timings (coordinator TTL 3 s, loop 0.2 s; job leases
  TTL 3 s through ``GPUPOOL_LEASE_TTL``...).
* Trainers are ``examples/lightning_train.py`` subprocesses, started directly or under ``gpupool run``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from testkit import dump_logs_if_failed, stop_groups
from testkit import wait_for as shared_wait_for

from gpupool_sdk.resources import Allocation, JobState, JobStatus
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = str(ROOT / "examples" / "lightning_train.py")
DEADLINE = 90.0


def wait_for(cond: Callable[[], T], timeout: float = DEADLINE, what: str = "condition", interval: float = 0.1) -> T:
    """:func:`testkit.wait_for` with a longer default bound: Lightning trainers start slowly on a busy machine."""
    return shared_wait_for(cond, timeout, what, interval)


class LivePool:
    """One test's pool: its prefix, its processes, and helpers to start trainers."""

    def __init__(self, endpoint: str, keys: Keyspace, tmp_path: Path) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self.tmp = tmp_path
        self.store = EtcdStore(endpoint, keyspace=keys)
        self.procs: list[subprocess.Popen[Any]] = []
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "GPUPOOL_ENDPOINTS": endpoint,
            "GPUPOOL_PREFIX": keys.prefix,
            "GPUPOOL_LEASE_TTL": "3",
            "GPUPOOL_KEEPALIVE_INTERVAL": "0.5",
            "GPUPOOL_RETRY_TIMEOUT": "1.0",
            "GPUPOOL_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        }
        for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_DEVICES", "GPUPOOL_RESUME_FROM", "GPUPOOL_JOB",
                    "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            self.env.pop(var, None)

    def spawn(self, label: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        log = open(self.tmp / f"{label}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp, env={**self.env, **(env or {})},
                             start_new_session=True)
        self.procs.append(p)
        return p

    def gpupool(self, label: str, *args: str) -> subprocess.Popen[Any]:
        return self.spawn(label, [sys.executable, "-m", "gpupool_sdk.cli.main", *args])

    def start(self, simulate: str) -> None:
        self.gpupool("coordinator", "coordinator", "--ttl", "3", "--loop-wait", "0.2", "--preempt-grace", "60",
                     "--aging", "100000", "--log-level", "info")
        self.gpupool("agent", "agent", "--simulate", simulate, "--ttl", "3")
        wait_for(lambda: self.store.get_prefix(self.keys.gpus_prefix())[0], what=f"the agent to publish {simulate}")

    def trainer(self, label: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        """``examples/lightning_train.py ARGS`` (the callback leases directly)."""
        return self.spawn(label, [sys.executable, EXAMPLE, *args], env)

    def run(self, label: str, run_args: list[str], *args: str) -> subprocess.Popen[Any]:
        """``gpupool run RUN_ARGS -- python examples/lightning_train.py ARGS``."""
        return self.gpupool(label, "run", *run_args, "--", sys.executable, EXAMPLE, *args)

    def log(self, label: str) -> str:
        p = self.tmp / f"{label}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def status(self, job: str) -> JobStatus | None:
        got = self.store.get_record(self.keys.job_status(job), JobStatus)
        return got[0] if got else None

    def state(self, job: str) -> JobState | None:
        s = self.status(job)
        return s.state if s else None

    def allocations(self, job: str | None = None) -> list[Allocation]:
        allocs = [a for a, _ in self.store.list_records(self.keys.allocations_prefix(), Allocation)]
        return [a for a in allocs if job is None or a.job == job]

    def wait_exit(self, p: subprocess.Popen[Any], label: str, timeout: float = DEADLINE) -> int:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{label} did not exit within {timeout:g}s; log:\n{self.log(label)[-4000:]}") from None

    def close(self) -> None:
        stop_groups(self.procs, grace_s=10)
        try:
            self.store.delete_prefix(self.keys.root())
        finally:
            self.store.close()


@pytest.fixture
def live_pool(etcd_endpoint: str, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LivePool]:
    """A real pool on the session etcd; process logs are printed when the test fails."""
    p = LivePool(etcd_endpoint, keyspace, tmp_path)
    try:
        yield p
    finally:
        dump_logs_if_failed(request, tmp_path)
        p.close()


