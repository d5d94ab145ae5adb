"""Sharing wired into the training runtime: two real Lightning jobs on ONE simulated GPU take turns.

Real etcd, a real coordinator and ``gpupool agent --simulate`` (the ``live_pool`` fixture), two
Lightning trainers (``timeslice_job.py``) leasing directly through ``GpuPoolCallback`` with compute
shares 0.7 and 0.3 of the same GPU. Nothing in the scripts mentions time-slicing: the runtime plans
it from the grant (a shared slice of a GPU without MPS), starts the gate at training start and
waits for its turn at each optimizer-step boundary.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

pytestmark = pytest.mark.slow

JOB = str(Path(__file__).with_name("timeslice_job.py"))
WINDOW_S = 60.0


def _status_sharing(pool: LivePool, gpu_uuid: str) -> str:
    r = subprocess.run([sys.executable, "-m", "gpupool_sdk.cli.main", "status", "-o", "json"], env=pool.env,
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return str(next(g["sharing"] for g in json.loads(r.stdout)["gpus"] if g["uuid"] == gpu_uuid))


def test_two_lightning_jobs_split_one_gpu_70_30_and_status_shows_timeslice(live_pool: LivePool, tmp_path: Path) -> None:
    live_pool.start("node-a:1xA100-40GB:pcie")
    window = tmp_path / "window.json"
    jobs = {"job-a": 0.7, "job-b": 0.3}
    procs = {}
    for job, share in jobs.items():
        # job-b parks its memory at every hand-over (host tier on the CPU) and restores it on its turn.
        offload = "always" if job == "job-b" else "auto"
        procs[job] = live_pool.spawn(job, [sys.executable, JOB, "--name", job, "--share", str(share),
                                           "--ready", str(tmp_path / f"{job}.ready"), "--window", str(window),
                                           "--out", str(tmp_path / f"{job}.json"), "--offload", offload],
                                     env={"GPUPOOL_NODE": "node-a"})
    wait_for(lambda: all((tmp_path / f"{j}.ready").exists() for j in jobs), timeout=180, what="both jobs training")
    gpu = {a.job: a.gpu_uuid for a in live_pool.allocations()}
    assert gpu["job-a"] == gpu["job-b"], f"not on one GPU: {gpu}"
    assert wait_for(lambda: _status_sharing(live_pool, gpu["job-a"]) == "timeslice", what="status to show timeslice")
    start = time.time() + 3.0
    # Written whole, then renamed: the jobs poll for the file and must never read it half-written.
    partial = window.with_suffix(".tmp")
    partial.write_text(json.dumps({"start_at": start, "end_at": start + WINDOW_S}))
    partial.replace(window)
    for job, p in procs.items():
        assert live_pool.wait_exit(p, job, timeout=WINDOW_S + 120) == 0, live_pool.log(job)[-3000:]
    res = {j: json.loads((tmp_path / f"{j}.json").read_text()) for j in jobs}
    total = res["job-a"]["busy_s"] + res["job-b"]["busy_s"]
    frac = {j: res[j]["busy_s"] / total for j in jobs}
    print("time-slicing through the runtime:", json.dumps({"fractions": frac, "results": res}))
    assert all(res[j]["mechanism"] == "timeslice" for j in jobs), res
    assert abs(frac["job-a"] - 0.7) <= 0.10 and abs(frac["job-b"] - 0.3) <= 0.10, frac
    assert min(res[j]["turns"] for j in jobs) >= 10, res
    # The hand-over offload moved Adam's state out at every hand-over of job-b and back on its turn.
    b = res["job-b"]
    assert b["parks"] >= 10 and b["parked_bytes"] > 0 and b["restored_bytes"] == b["parked_bytes"], b
    assert res["job-a"]["parks"] == 0  # "auto": 2 x 10 GiB fit the 40 GiB GPU, nothing to move
    # Both left the rotation: nothing is shared any more.
    assert wait_for(lambda: _status_sharing(live_pool, gpu["job-a"]) == "none", what="status to show none")
