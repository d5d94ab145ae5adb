"""Lease loss fences the trainer; `gpupool run` Ctrl-C releases; the plain-loop adapter survives a preemption."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store.records import TelemetryRecord
from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "examples" / "torch_loop_train.py")


def training(pool: LivePool, job: str, min_step: int = 1) -> bool:
    got = pool.store.get_record(pool.keys.telemetry(job), TelemetryRecord)
    return bool(got) and int(got[0].summary.get("step", 0)) >= min_step


def test_revoked_lease_stops_training_with_a_clear_error_and_emergency_checkpoint(live_pool: LivePool) -> None:
    live_pool.start("node-a:1xA100-40GB")
    p = live_pool.trainer("victim", "--name", "victim", "--memory", "30GiB", "--epochs", "50", "--step-sleep", "0.1")
    wait_for(lambda: training(live_pool, "victim"), what="the victim to train")
    kv = live_pool.store.get(live_pool.keys.job_spec("victim"))
    assert kv is not None and kv.lease
    assert live_pool.store.revoke_lease(kv.lease)  # what a forced preemption does
    rc = live_pool.wait_exit(p, "victim")
    log = live_pool.log("victim")
    assert rc not in (0, 75), log
    assert "PoolLeaseLostError" in log and "lost its GPU lease" in log
    assert list((live_pool.tmp / "ckpt").glob("victim-emergency-step*.ckpt")), log


def test_gpupool_run_ctrl_c_checkpoints_the_script_and_releases(live_pool: LivePool) -> None:
    live_pool.start("node-a:1xA100-40GB")
    run = live_pool.run("job", ["--name", "job", "--memory", "30GiB"], "--epochs", "50", "--step-sleep", "0.1")
    wait_for(lambda: training(live_pool, "job"), what="the job to train")
    assert live_pool.allocations("job")
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole foreground group
    # SIGINT is a preemption: the script checkpoints at its next step, exits 75, the launcher too.
    assert live_pool.wait_exit(run, "job") == 75, live_pool.log("job")
    assert "checkpointed; exit 75" in live_pool.log("job")
    assert list((live_pool.tmp / "ckpt").glob("job-signal-step*.ckpt"))
    wait_for(lambda: not live_pool.allocations("job") and live_pool.status("job") is None,
             what="the job's slices and status to be released")


def test_plain_torch_loop_is_preempted_and_resumes_under_gpupool_run(live_pool: LivePool, tmp_path: Path) -> None:
    live_pool.start("node-a:1xA100-40GB")
    args = ["--steps", "150", "--step-sleep", "0.05"]
    base = live_pool.spawn("base", [sys.executable, LOOP, "--name", "base", "--memory", "10GiB", *args,
                                    "--out", str(tmp_path / "base.pt")])
    assert live_pool.wait_exit(base, "base") == 0, live_pool.log("base")
    run = live_pool.gpupool("loop", "run", "--name", "loop", "--memory", "30GiB", "--", sys.executable, LOOP, *args,
                            "--out", str(tmp_path / "loop.pt"))
    wait_for(lambda: training(live_pool, "loop", 5), what="the loop to train")
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    try:
        lease = client.acquire(JobSpec(name="urgent", memory="30GiB", qos="guaranteed", priority=10), timeout=120)
        wait_for(lambda: "preempted; queueing again" in live_pool.log("loop"), what="the loop to be re-queued")
        lease.release()
    finally:
        client.close()
    assert live_pool.wait_exit(run, "loop", timeout=180) == 0, live_pool.log("loop")
    a, b = torch.load(tmp_path / "base.pt"), torch.load(tmp_path / "loop.pt")
    assert a["step"] == b["step"] == 150
    for k in a["state_dict"]:
        assert torch.allclose(a["state_dict"][k], b["state_dict"][k], atol=1e-6), k
