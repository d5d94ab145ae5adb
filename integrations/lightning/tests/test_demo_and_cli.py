"""`gpupool demo` end to end, and `gpupool run` argument checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GPUPOOL = [sys.executable, "-m", "gpupool_sdk.cli.main"]


def test_run_without_memory_names_the_option() -> None:
    r = subprocess.run([*GPUPOOL, "run", "--", sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--memory" in r.stderr and "e.g. --memory 20GiB" in r.stderr


def test_run_bad_job_name_names_the_field() -> None:
    r = subprocess.run([*GPUPOOL, "run", "--name", "Bad Name", "--memory", "1GiB", "--", sys.executable, "-c", "pass"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "name" in r.stderr


@pytest.mark.slow
def test_demo_preempts_resumes_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    r = subprocess.run([*GPUPOOL, "demo", "--workdir", str(workdir), "--timeout", "170"], capture_output=True,
                       text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "demo OK" in out
    assert "PREEMPTING" in out and "resuming from" in out and "(resumed at step" in out
    assert "per-job summary" in out
    # Every process the demo started is gone: nothing still holds its logs open for writing.
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


@pytest.mark.slow
def test_demo_interrupted_stops_every_process_it_started(tmp_path: Path) -> None:
    import signal
    import time

    workdir = tmp_path / "demo-int"
    p = subprocess.Popen([*GPUPOOL, "demo", "--workdir", str(workdir)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert p.stdout is not None
    endpoint = ""
    for line in p.stdout:  # interrupt once the jobs are training
        if "real etcd on " in line:
            endpoint = line.split("real etcd on ", 1)[1].split()[0]
        if "training" in line:
            break
    assert endpoint
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    assert "interrupted" in out
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # etcd, coordinator, agent and launchers all carry the endpoint on their command line.
        left = subprocess.run(["pgrep", "-f", f"{workdir}|{endpoint}"], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.5)
    assert not left, left
