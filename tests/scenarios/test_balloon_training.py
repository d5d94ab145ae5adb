"""Balloon end to end: a real CPU training job is shrunk for a guaranteed job, keeps training, deflates back.

Real etcd, a real ``gpupool coordinator`` and ``gpupool agent --simulate`` (the scenario harness),
a real shared-QoS Lightning job (``balloon_job.py``: ``GpuPoolCallback`` on the host memory tier)
and a real guaranteed job (``client_proc.py``, ``PoolClient``). The directive travels
etcd -> the job's client helper process -> the callback -> the balloon controller, which offloads
Adam's state, and the ack carries the bytes reached; the coordinator shrinks the allocation and
grants the guaranteed job; when that job ends the coordinator deflates the shared one (quota back
in the same transaction as the directive), the job restores its optimizer state, acks, and
trains on to the end.

Every put and delete under the test's prefix is recorded by a watch started before anything
runs, so the assertions see each directive, ack and allocation value the keys ever held, however
quickly the protocol moved; nothing is timed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpupool_sdk.resources import Ack, Allocation, Directive, DirectiveKind, GiB, JobSpec, JobState, JobStatus
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.records import TelemetryRecord
from gpupool_sdk.store.types import WatchEvent
from scenarios.harness import ROOT, Pool, wait_for

R = TypeVar("R")

pytestmark = pytest.mark.slow

JOB = "shared-train"
URGENT = "urgent"
QUOTA = 30 * GiB  # on a 40 GiB GPU: 10 GiB left, the guaranteed job wants 20 GiB
URGENT_MEMORY = "20GiB"
# The peak the job reports: below its Adam state (about 316 KiB), so reaching the target takes an offload.
PEAK = 64 * 1024
EXTRA_STEPS = 5
JOB_DEADLINE = 120.0  # the job imports torch and Lightning on a loaded machine


@dataclass(frozen=True)
class Change:
    """One put (``value`` set) or delete (``value`` None) seen by the history watch."""

    revision: int
    key: str
    value: bytes | None


class History:
    """Every change under the pool's prefix, in revision order (a watch from before the scenario starts)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._changes: list[Change] = []
        _, revision = pool.store.get_prefix(pool.keys.root())
        self._watcher = pool.store.watch_prefix(
            pool.keys.root(), self._on_events, start_revision=revision + 1
        )

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            self._changes.extend(
                Change(e.kv.mod_revision, e.kv.key, e.kv.value if e.type == "put" else None) for e in events
            )

    def records(self, key: str, cls: type[R]) -> list[tuple[int, R]]:
        """``(revision, record)`` of every value ``key`` was given so far."""
        with self._lock:
            puts = [
                (c.revision, c.key, c.value) for c in self._changes if c.key == key and c.value is not None
            ]
        return [(rev, decode(k, v, cls)) for rev, k, v in puts]

    def deleted(self, key: str) -> list[int]:
        """Revisions at which ``key`` was deleted (by a delete or with its lease)."""
        with self._lock:
            return [c.revision for c in self._changes if c.key == key and c.value is None]

    def close(self) -> None:
        self._watcher.cancel()


def start_job(pool: Pool, stop_file: Path) -> subprocess.Popen[bytes]:
    """The shared training job, its output in ``job-<name>.log`` (printed by the fixture on failure)."""
    log = open(pool.tmp_path / f"job-{JOB}.log", "wb")  # noqa: SIM115 - closed with the process
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GPUPOOL_ENDPOINTS": pool.endpoint,
        "GPUPOOL_PREFIX": pool.keys.prefix,
    }
    for var in (
        "GPUPOOL_RUN_SOCKET",
        "GPUPOOL_LEASED",
        "GPUPOOL_DEVICES",
        "GPUPOOL_RESUME_FROM",
        "GPUPOOL_JOB",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "CUDA_VISIBLE_DEVICES",
    ):
        env.pop(var, None)
    p = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("balloon_job.py")),
            "--name",
            JOB,
            "--memory",
            "30GiB",
            "--peak-bytes",
            str(PEAK),
            "--stop-file",
            str(stop_file),
            "--extra-steps",
            str(EXTRA_STEPS),
            "--checkpoint-dir",
            str(pool.tmp_path / "ckpt"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
    )
    pool.procs.append(p)  # stopped by the fixture's teardown if the test fails first
    return p


def status(pool: Pool, job: str) -> JobStatus | None:
    got = pool.store.get_record(pool.keys.job_status(job), JobStatus)
    return got[0] if got else None


def allocations(pool: Pool, job: str) -> list[Allocation]:
    return [a for a in pool.allocations() if a.job == job]


def reported_peak(pool: Pool) -> int | None:
    got = pool.store.get_record(pool.keys.telemetry(JOB), TelemetryRecord)
    return got[0].summary.get("memory_peak_bytes") if got else None


def test_balloon_shrinks_a_training_job_which_keeps_training_and_deflates_back(pool: Pool) -> None:
    history = History(pool)
    try:
        run_scenario(pool, history)
    finally:
        history.close()


def run_scenario(pool: Pool, history: History) -> None:
    (uuid,) = pool.gpus("node-a:1xA100-40GB:pcie")
    # The pool trusts reported peaks (no balloon floor): the target falls below the job's Adam
    # state, so reaching it takes an offload. With the default floor (half the quota) this job
    # would be ballooned to 15 GiB, which it reaches by trimming alone.
    pool.coordinator("c1", "--set", "balloon_floor_fraction=0", "--set", "balloon_floor_bytes=0")
    pool.wait_leader()
    stop_file = pool.tmp_path / "stop"
    job = start_job(pool, stop_file)
    output = (pool.tmp_path / f"job-{JOB}.log").read_text

    # 1. Granted its full quota; it trains and reports a peak well under it.
    wait_for(lambda: reported_peak(pool) == PEAK, JOB_DEADLINE, f"{JOB} to train and report its memory peak")
    granted = status(pool, JOB)
    assert granted is not None and granted.state is JobState.GRANTED
    assert [a.memory_bytes for a in allocations(pool, JOB)] == [QUOTA]
    pool.check()

    # 2. A guaranteed job needs 20 GiB of the GPU: the shared job is ballooned, not preempted.
    urgent = pool.client(JobSpec(name=URGENT, gpus=1, memory=URGENT_MEMORY, qos="guaranteed", priority=5))
    directive_key = pool.keys.directive(JOB)
    ack_key = pool.keys.ack(JOB)
    alloc_key = pool.keys.allocation("node-a", uuid, JOB)
    pool.wait_output(urgent, "GRANTED", timeout=JOB_DEADLINE)
    # The watch delivers in revision order: once it has the grant, it has everything before it.
    urgent_grants = wait_for(
        lambda: [
            r
            for r, s in history.records(pool.keys.job_status(URGENT), JobStatus)
            if s.state is JobState.GRANTED
        ],
        what="the history watch to see the guaranteed job's grant",
    )
    directives = [d for _, d in history.records(directive_key, Directive)]
    assert [d.kind for d in directives] == [DirectiveKind.BALLOON], directives
    balloon = directives[0]
    target = int(balloon.target["memory_bytes"])
    assert target == int(PEAK * (1.0 + SchedulerConfig().peak_margin))  # its predicted peak
    assert balloon.target.get("for_job") == URGENT
    acks = [a for a in history.records(ack_key, Ack) if a[1].seq == balloon.seq]
    assert len(acks) == 1, acks
    ack_rev, ack = acks[0]
    assert ack.ok and ack.reached_bytes is not None and 0 <= ack.reached_bytes <= target, ack
    assert "offloaded" in ack.message and "offloaded 0B" not in ack.message, ack.message
    # The allocation shrank to the target (the larger of target and bytes reached: the offloaded
    # state comes back for each optimizer step), after the ack and before the grant.
    shrunk_to = max(ack.reached_bytes, target)
    shrunk = [(rev, a) for rev, a in history.records(alloc_key, Allocation) if a.memory_bytes != QUOTA]
    assert shrunk and shrunk[0][1].memory_bytes == shrunk_to and shrunk[0][0] > ack_rev, shrunk
    assert urgent_grants[0] > shrunk[0][0], "granted only once the memory was given back"
    assert [a.memory_bytes for a in allocations(pool, JOB)] == [shrunk_to]
    now = status(pool, JOB)
    assert now is not None and now.state is JobState.GRANTED  # shrunk, not preempted
    assert job.poll() is None, output()
    pool.check()

    # 3. The guaranteed job finishes: the quota comes back (allocation first, then the job is told).
    urgent.terminate()
    assert urgent.wait(30) == 0, pool.output(urgent)
    found = wait_for(
        lambda: next(
            ((r, d) for r, d in history.records(directive_key, Directive) if d.kind is DirectiveKind.DEFLATE),
            None,
        ),
        what="a deflate directive",
    )
    assert found is not None
    deflate_rev, deflate = found
    assert deflate.seq > balloon.seq and deflate.target["memory_bytes"] == QUOTA
    urgent_gone = history.deleted(pool.keys.job_status(URGENT))
    assert urgent_gone and urgent_gone[0] < deflate_rev, "deflated only once the guaranteed job had gone"
    # The quota came back in the directive's own transaction.
    assert [a.memory_bytes for r, a in history.records(alloc_key, Allocation) if r == deflate_rev] == [QUOTA]
    deflate_ack = wait_for(
        lambda: next((a for _, a in history.records(ack_key, Ack) if a.seq == deflate.seq), None),
        what="the job to ack the deflate",
    )
    assert deflate_ack is not None
    assert deflate_ack.ok and deflate_ack.step > ack.step, deflate_ack  # it trained on while shrunk
    assert "restored" in deflate_ack.message and "restored 0B" not in deflate_ack.message, deflate_ack.message
    assert deflate_ack.reached_bytes is not None and deflate_ack.reached_bytes > ack.reached_bytes
    wait_for(lambda: pool.store.get(directive_key) is None, what="the acked deflate directive to be retired")
    assert [a.memory_bytes for a in allocations(pool, JOB)] == [QUOTA]
    final_status = status(pool, JOB)
    assert final_status is not None and final_status.state is JobState.GRANTED
    pool.check()

    # 4. It trains on and finishes normally, its optimizer state intact through offload and restore.
    stop_file.touch()
    assert job.wait(JOB_DEADLINE) == 0, output()
    seen = re.search(r"^STOP_SEEN (\d+)$", output(), re.M)
    m = re.search(r"^RESULT (.*)$", output(), re.M)
    assert seen and m, output()
    result: dict[str, Any] = json.loads(m.group(1))
    steps = int(seen.group(1)) + EXTRA_STEPS
    assert int(seen.group(1)) >= deflate_ack.step > ack.step > 0
    assert result["global_step"] == result["optimizer_steps"] == steps, result
    assert result["adam_steps"] == [steps], result  # every parameter's state saw every step
    # All of the state is back in "device" memory (the host tier counts it there); the balloon had moved it out.
    assert ack.reached_bytes < deflate_ack.reached_bytes == result["optimizer_state_bytes"]
    assert result["matches_reference"], "weights differ from a plain run of the same steps without balloons"
    # It released everything on exit; over its whole life it got the two memory directives and no other.
    wait_for(lambda: history.deleted(pool.keys.job_status(JOB)), what=f"{JOB}'s keys to go with its lease")
    assert not allocations(pool, JOB) and status(pool, JOB) is None
    kinds = [d.kind for _, d in history.records(directive_key, Directive)]
    assert kinds == [DirectiveKind.BALLOON, DirectiveKind.DEFLATE], kinds
    assert {s.state for _, s in history.records(pool.keys.job_status(JOB), JobStatus)} == {JobState.GRANTED}
    pool.check()
