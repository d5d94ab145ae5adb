"""Scenarios of operators and fairness: cordon, drain, unhealthy GPUs, anti-starvation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from gpupool_sdk.resources import DirectiveKind, GpuHealth, GpuInfo, JobState
from scenarios.harness import ROOT, Job, Pool, wait_for


def _cli(pool: Pool, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", *args, "--endpoints", pool.endpoint, "--prefix", pool.keys.prefix],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )


def test_cordon_blocks_new_grants_until_uncordon(pool: Pool) -> None:
    uuids = pool.gpus("node-a:2xA100-40GB:pcie")
    pool.coordinator("c1", "--no-preemption")
    r = _cli(pool, "cordon", uuids[0], "--reason", "fan noise")
    assert r.returncode == 0, r.stderr
    assert pool.store.get(pool.keys.cordon(uuids[0])) is not None
    a = pool.submit("a", gpus=1, qos="exclusive")
    assert a.wait_state(JobState.GRANTED) and a.allocations()[0].gpu_uuid == uuids[1]
    b = pool.submit("b", gpus=1, qos="exclusive")
    b.wait_state(JobState.PENDING)
    time.sleep(1.0)  # a few cycles: the cordoned GPU stays unused
    assert not b.allocations()
    r = _cli(pool, "uncordon", uuids[0])
    assert r.returncode == 0, r.stderr
    b.wait_state(JobState.GRANTED)
    assert b.allocations()[0].gpu_uuid == uuids[0]
    # Cordoning a GPU that runs a job leaves the job running.
    assert _cli(pool, "cordon", uuids[1]).returncode == 0
    time.sleep(1.0)
    assert a.state() is JobState.GRANTED and a.directive() is None
    pool.check()


def _drained_job_moves(pool: Pool, job: Job, trigger: str) -> None:
    d = job.wait_directive()
    assert d.kind is DirectiveKind.PREEMPT, f"{trigger}: expected a preempt directive, got {d}"
    job.ack(d, step=77)
    job.wait_state(JobState.SUSPENDED)
    job.release()  # the client exits 75; `gpupool run` starts it again under the same name


def test_drain_preempts_checkpoint_first_and_the_job_runs_elsewhere(pool: Pool) -> None:
    pool.gpus("node-a:1xH100-80GB:pcie,node-b:1xH100-80GB:pcie")
    pool.coordinator("c1")
    job = pool.submit("train", gpus=1, qos="exclusive")
    job.wait_state(JobState.GRANTED)
    node = job.allocations()[0].node
    other = "node-b" if node == "node-a" else "node-a"
    r = _cli(pool, "drain", node)
    assert r.returncode == 0, r.stderr
    _drained_job_moves(pool, job, "drain")
    resume = wait_for(lambda: pool.resume("train"), what="checkpoints/train")
    assert resume.last_checkpoint is not None and resume.last_checkpoint.step == 77
    again = pool.submit("train", gpus=1, qos="exclusive")
    again.wait_state(JobState.GRANTED)
    assert again.allocations()[0].node == other
    # Nothing new lands on the draining node.
    blocked = pool.submit("blocked", gpus=1, qos="exclusive")
    blocked.wait_state(JobState.PENDING)
    assert not blocked.allocations()
    assert _cli(pool, "undrain", node).returncode == 0
    blocked.wait_state(JobState.GRANTED)
    assert blocked.allocations()[0].node == node
    pool.check()


def test_unhealthy_gpu_has_its_job_preempted(pool: Pool, tmp_path: Path) -> None:
    faults = tmp_path / "faults.json"
    faults.write_text("{}")
    pool.gpus("node-a:2xH100-80GB:pcie", fault_file=faults)
    pool.coordinator("c1")
    job = pool.submit("train", gpus=1, qos="exclusive")
    job.wait_state(JobState.GRANTED)
    alloc = job.allocations()[0]
    if pool.has_agent():
        # The agent reads the fault file on its next refresh and publishes the GPU as unhealthy.
        faults.write_text(json.dumps({alloc.gpu_uuid: {"ecc_double_bit": 2}}))
    else:
        got = pool.store.get_record(pool.keys.gpu(alloc.node, alloc.gpu_uuid), GpuInfo)
        assert got is not None
        gpu, kv = got
        sick = replace(gpu, health=GpuHealth(healthy=False, reasons=("ecc double-bit errors: 2",)))
        pool.store.put(kv.key, sick, lease=kv.lease)  # what the agent writes on a fatal ECC error
    _drained_job_moves(pool, job, "unhealthy GPU")
    again = pool.submit("train", gpus=1, qos="exclusive")
    again.wait_state(JobState.GRANTED)
    assert again.allocations()[0].gpu_uuid != alloc.gpu_uuid
    pool.check()


def test_low_priority_job_eventually_runs_under_a_stream_of_higher_ones(pool: Pool) -> None:
    pool.gpus("node-a:1xA100-40GB:pcie")
    # One priority point per 0.2 s waited: the low job outranks priority-5 newcomers after ~1 s.
    pool.coordinator("c1", "--no-preemption", "--aging", "0.2")
    first = pool.submit("high-0", gpus=1, qos="exclusive", priority=5)
    first.wait_state(JobState.GRANTED)
    low = pool.submit("low", gpus=1, qos="exclusive", priority=0)
    running, n = first, 1
    deadline = time.monotonic() + 60
    while low.state() is not JobState.GRANTED:
        assert time.monotonic() < deadline, "the low-priority job starved"
        # Keep a fresh higher-priority job waiting at all times, then let the running one finish.
        nxt = pool.submit(f"high-{n}", gpus=1, qos="exclusive", priority=5)
        n += 1
        nxt.wait_state(JobState.PENDING)
        time.sleep(0.3)
        running.release()
        pool.check()
        granted = wait_for(
            lambda nxt=nxt: nxt if nxt.state() is JobState.GRANTED else (low if low.state() is JobState.GRANTED else None),
            what="the next grant",
        )
        if granted is low:
            break
        running = nxt
    assert low.state() is JobState.GRANTED
    assert n >= 2, "the low job should have waited behind at least one higher-priority job"
    pool.check()
