"""Harness for the Lightning integration tests: a real pool (etcd, coordinator, agent) and real trainers.

* ``live_pool``: a coordinator and a ``gpupool agent --simulate`` subprocess on the session etcd,
  under this test's key prefix, with short timings (coordinator TTL 3 s, loop 0.2 s; job leases
  TTL 3 s through ``GPUPOOL_LEASE_TTL``...).
* Trainers are ``examples/lightning_train.py`` subprocesses, started directly or under ``gpupool run``.
* The elastic tests (``test_elastic_resize.py``: plain DDP; ``test_elastic_lightning.py``: a
  Lightning Trainer) share :func:`grow_and_shrink` (the live 1 -> 2 -> 1 scenario) and
  :func:`replay_by_hand` (the same world sizes at the same steps, without the pool).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from testkit import dump_logs_if_failed, stop_groups
from testkit import wait_for as shared_wait_for

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import Allocation, JobSpec, JobState, JobStatus
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.store.records import TelemetryRecord

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


def telemetry_step(pool: LivePool, job: str) -> int:
    """The step in ``job``'s last telemetry summary (0 before the first)."""
    got = pool.store.get_record(pool.keys.telemetry(job), TelemetryRecord)
    return int(got[0].summary.get("step", 0)) if got else 0


# -- the elastic scripts (examples/elastic_*_train.py) ------------------------------------------

ELASTIC_LINE = re.compile(r"^ELASTIC (\{.*\})$", flags=re.M)
#: Bound on one elastic phase (a torchrun restart of Lightning ranks on a loaded 2-core machine).
ELASTIC_LONG = 600.0


def elastic_segments(log: str) -> list[dict[str, Any]]:
    """The script's ``ELASTIC {...}`` lines (rank 0): segment starts and ends, in order."""
    return [json.loads(m) for m in ELASTIC_LINE.findall(log)]


def elastic_starts(log: str) -> list[dict[str, Any]]:
    return [s for s in elastic_segments(log) if s["segment"]]


def elastic_ends(log: str) -> list[dict[str, Any]]:
    return [s for s in elastic_segments(log) if not s["segment"]]


_SCRIPTS: dict[str, Any] = {}


def _inline(script: str, args: list[str]) -> str:
    """Run ``script``'s ``main(args)`` in this process; returns what it printed."""
    module = _SCRIPTS.get(script)
    if module is None:
        spec = importlib.util.spec_from_file_location(f"_elastic_{len(_SCRIPTS)}", script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPTS[script] = module
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(args) == 0
    return out.getvalue()


def run_segment(script: str, tmp: Path, world: int, stop: int, resume: Path | None = None, save: Path | None = None,
                out: Path | None = None, extra: tuple[str, ...] = (), inline: bool = False) -> dict[str, Any]:
    """One ``--no-pool`` segment of an elastic script at ``world`` ranks up to step ``stop``; its start line.

    ``world`` > 1 runs under torchrun (gloo). ``inline`` runs a 1-rank segment in this process
    (a reference computation: no Python, torch and Lightning start-up, same arithmetic).
    """
    args = ["--no-pool", "--steps", "1000000", "--stop-at", str(stop), *extra]
    if resume is not None:
        args += ["--resume", str(resume)]
    if save is not None:
        args += ["--save", str(save)]
    if out is not None:
        args += ["--out", str(out)]
    if inline and world == 1:
        stdout = _inline(script, args)
    else:
        cmd = [sys.executable, script, *args] if world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), script, *args]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=ELASTIC_LONG)
        assert res.returncode == 0, res.stdout + res.stderr[-6000:]
        stdout = res.stdout
    end = elastic_ends(stdout)
    assert end and end[-1]["end"] == stop and end[-1]["world"] == world, stdout
    return elastic_starts(stdout)[0]


def replay_by_hand(script: str, tmp: Path, plan: list[tuple[int, int, int]], out: Path,
                   extra: Callable[[int], tuple[str, ...]] = lambda world: ()) -> None:
    """Each ``(world, start, stop)`` from the previous segment's checkpoint; the last writes ``out``.

    The 1-rank segments run in this process (references, see :func:`run_segment`).
    """
    prev: Path | None = None
    for i, (world, start, stop) in enumerate(plan):
        last = i == len(plan) - 1
        save = None if last else tmp / f"hand-{i}.ckpt"
        got = run_segment(script, tmp, world, stop, prev, save=save, out=out if last else None, extra=extra(world),
                          inline=True)
        assert got["start"] == start and got["world"] == world, got
        prev = save


def max_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two state dicts of the same tensors."""
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@dataclass
class ElasticRun:
    """What :func:`grow_and_shrink` saw: the job's log, its segment starts, its end line, its one lease."""

    log: str
    starts: list[dict[str, Any]]
    end: dict[str, Any]
    lease_hex: str

    def plan(self) -> list[tuple[int, int, int]]:
        """The ``(world, start, stop)`` segments the pool chose, for :func:`replay_by_hand`."""
        s = self.starts
        return [(1, 0, s[1]["start"]), (2, s[1]["start"], s[2]["start"]), (1, s[2]["start"], self.end["end"])]


def grow_and_shrink(pool: LivePool, job: str, command: str, steps_each: int,
                    at_shrunk: Callable[[], None] = lambda: None) -> ElasticRun:
    """The live elastic scenario on a pool of two simulated GPUs, whole-GPU (``exclusive``) jobs.

    ``gpupool run --min-gpus 1 --max-gpus 2 -- sh -c COMMAND`` (``COMMAND`` starts torchrun with
    ``--nproc-per-node "$GPUPOOL_DEVICES"`` and stops at the first step where ``{tmp}/finish``
    exists) starts on 1 slice while a filler job holds the other GPU, grows to 2 when the filler
    leaves, shrinks back to 1 when a priority-10 job arrives, and trains ``steps_each`` steps at
    each size; ``at_shrunk`` runs before the job is told to finish. Asserted here: the worlds
    1, 2, 1 at increasing steps, the allocations at each size, one lease for every grant and
    segment, never queued again.
    """
    pool.start("node-a:2xA100-40GB")
    client = PoolClient(endpoints=pool.endpoint, prefix=pool.keys.prefix)
    finish = pool.tmp / "finish"

    def started(n: int, world: int, what: str) -> dict[str, Any]:
        wait_for(lambda: len(elastic_starts(pool.log(job))) >= n, ELASTIC_LONG, what=f"the job to start {what}")
        seg = elastic_starts(pool.log(job))[n - 1]
        assert seg["world"] == world, pool.log(job)
        wait_for(lambda: telemetry_step(pool, job) >= seg["start"] + steps_each, ELASTIC_LONG,
                 what=f"the job to train {what}")
        assert len(pool.allocations(job)) == world
        return seg

    try:
        filler = client.acquire(JobSpec(name="filler", qos="exclusive"), timeout=ELASTIC_LONG)
        proc = pool.gpupool(job, "run", "--name", job, "--gpus", "2", "--min-gpus", "1", "--max-gpus", "2",
                            "--qos", "exclusive", "--", "sh", "-c", command)
        started(1, 1, "on 1 slice")
        filler.release()  # room: the coordinator grows the job to 2 slices; torchrun runs 2 ranks
        started(2, 2, "on 2 slices after the grow")
        # A higher-priority job arrives: the job shrinks back to 1 slice for it.
        urgent = client.acquire(JobSpec(name="urgent", qos="exclusive", priority=10), timeout=ELASTIC_LONG)
        started(3, 1, "on 1 slice after the shrink")
        assert len(pool.allocations("urgent")) == 1
        at_shrunk()
        finish.write_text("done")
        assert pool.wait_exit(proc, job, ELASTIC_LONG) == 0, pool.log(job)
        urgent.release()
    finally:
        client.close()

    log = pool.log(job)
    starts, end = elastic_starts(log), elastic_ends(log)[-1]
    assert [s["world"] for s in starts] == [1, 2, 1], log
    assert 0 == starts[0]["start"] < starts[1]["start"] < starts[2]["start"] < end["end"], starts
    # Never lost the grant: one etcd lease for every grant and every segment, never queued again.
    granted = re.findall(r"granted after [0-9.]+s: devices \S+, lease ([0-9a-f]+)", log)
    assert len(granted) == 3 and len(set(granted)) == 1, log
    assert {s["lease"] for s in starts} == set(granted), starts
    assert "queueing again" not in log and log.count(f"queueing {job}") == 1, log
    assert log.count("waiting for the re-grant on lease") == 2, log
    return ElasticRun(log, starts, end, granted[0])
