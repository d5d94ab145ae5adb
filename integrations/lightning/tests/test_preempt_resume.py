"""Lightning jobs on a real pool: preempted mid-epoch, resumed, and compared with an uninterrupted run.

Real etcd, real coordinator and agent subprocesses, real Lightning trainers (CPU) as subprocesses,
a real high-priority job (PoolClient) that triggers the preemption.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store.records import TelemetryRecord
from integrations.lightning.tests.conftest import LivePool, wait_for

pytestmark = pytest.mark.slow

PER_EPOCH = 192 // 8
STEPS = 2 * PER_EPOCH
TRAIN = ["--epochs", "2", "--samples", "192", "--batch-size", "8", "--step-sleep", "0.1", "--memory", "30GiB"]


def trained_step(pool: LivePool, job: str) -> int:
    got = pool.store.get_record(pool.keys.telemetry(job), TelemetryRecord)
    return int(got[0].summary.get("step", 0)) if got else 0


def preempt_with_high_priority_job(pool: LivePool, job: str, gpus: int = 1) -> Any:
    """Wait until ``job`` is training mid-epoch, then acquire a priority-10 job that needs its GPU."""
    wait_for(lambda: trained_step(pool, job) >= 2, what=f"{job} to train a few steps (telemetry)")
    client = PoolClient(endpoints=pool.endpoint, prefix=pool.keys.prefix)
    lease = client.acquire(JobSpec(name="urgent", gpus=gpus, memory="30GiB", qos="guaranteed", priority=10),
                           timeout=120)
    return client, lease


def assert_same_weights(a_path: Path, b_path: Path, steps: int = STEPS) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a["global_step"] == b["global_step"] == steps
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.allclose(a["state_dict"][k], b["state_dict"][k], atol=1e-6), k


def test_preempted_mid_epoch_then_resumed_matches_uninterrupted_run(live_pool: LivePool, tmp_path: Path) -> None:
    live_pool.start("node-a:2xA100-40GB:nvlink")
    base = live_pool.trainer("base", "--name", "base", "--priority", "5", *TRAIN, "--out", str(tmp_path / "base.pt"))
    # The trainer holds the client itself here (pipes and threads to its spawned helper) and forks
    # DataLoader workers: the fork-safety case.
    low = live_pool.trainer("low", "--name", "low", "--priority", "0", *TRAIN, "--num-workers", "2")
    client, lease = preempt_with_high_priority_job(live_pool, "low")
    try:
        assert live_pool.wait_exit(low, "low") == 75, live_pool.log("low")
        log = live_pool.log("low")
        m = re.search(r"GPUPOOL_PREEMPTED rank=0 step=(\d+)", log)
        assert m, log
        step = int(m.group(1))
        assert 0 < step < STEPS and step % PER_EPOCH != 0  # stopped mid-epoch
        ckpt = live_pool.tmp / "ckpt" / f"low-preempt-step{step}.ckpt"
        assert ckpt.exists()
        resume = client.resume_info("low")
        assert resume is not None and resume.path == str(ckpt) and resume.step == step
        assert not live_pool.allocations("low")
    finally:
        lease.release()
        client.close()
    assert live_pool.wait_exit(base, "base") == 0, live_pool.log("base")
    again = live_pool.trainer("low-2", "--name", "low", "--priority", "0", *TRAIN, "--num-workers", "2",
                              "--out", str(tmp_path / "low.pt"))
    assert live_pool.wait_exit(again, "low-2") == 0, live_pool.log("low-2")
    out = live_pool.log("low-2")
    assert f'"resumed_from": "{ckpt}"' in out and '"preemptions": 1' in out and '"lease_generation": 2' in out
    assert_same_weights(tmp_path / "base.pt", tmp_path / "low.pt")


def test_gpupool_run_reruns_after_preemption_with_forked_loader_workers(live_pool: LivePool, tmp_path: Path) -> None:
    live_pool.start("node-a:2xA100-40GB:nvlink")
    base = live_pool.trainer("base", "--name", "base", "--priority", "5", *TRAIN, "--out", str(tmp_path / "base.pt"))
    low = live_pool.run("low", ["--name", "low", "--memory", "30GiB", "--priority", "0"],
                        *TRAIN, "--num-workers", "2", "--out", str(tmp_path / "low.pt"))
    client, lease = preempt_with_high_priority_job(live_pool, "low")
    try:
        wait_for(lambda: "preempted; queueing again" in live_pool.log("low"), what="gpupool run to re-queue low")
    finally:
        lease.release()
        client.close()
    assert live_pool.wait_exit(low, "low", timeout=180) == 0, live_pool.log("low")
    assert live_pool.wait_exit(base, "base") == 0, live_pool.log("base")
    log = live_pool.log("low")
    assert "resuming from" in log and "finished with exit code 0" in log
    assert_same_weights(tmp_path / "base.pt", tmp_path / "low.pt")


def test_two_process_ddp_ranks_checkpoint_at_the_same_step_and_resume(live_pool: LivePool, tmp_path: Path) -> None:
    live_pool.start("node-a:2xA100-40GB:nvlink")
    ddp = ["--gpus", "2", "--strategy", "ddp", *TRAIN]
    base = live_pool.trainer("base", "--name", "base", "--priority", "5", *ddp, "--out", str(tmp_path / "base.pt"))
    assert live_pool.wait_exit(base, "base", timeout=240) == 0, live_pool.log("base")
    low = live_pool.run("low", ["--name", "low", "--gpus", "2", "--memory", "30GiB", "--priority", "0"],
                        *ddp, "--out", str(tmp_path / "low.pt"))
    client, lease = preempt_with_high_priority_job(live_pool, "low")
    try:
        wait_for(lambda: "preempted; queueing again" in live_pool.log("low"), what="gpupool run to re-queue low")
        steps = re.findall(r"GPUPOOL_PREEMPTED rank=(\d) step=(\d+)", live_pool.log("low"))
        assert sorted(r for r, _ in steps) == ["0", "1"], live_pool.log("low")
        assert len({s for _, s in steps}) == 1  # both ranks stopped at the same global step
    finally:
        lease.release()
        client.close()
    assert live_pool.wait_exit(low, "low", timeout=240) == 0, live_pool.log("low")
    assert_same_weights(tmp_path / "base.pt", tmp_path / "low.pt", steps=STEPS // 2)  # each rank sees half
