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
