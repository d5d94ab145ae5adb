"""`gpupool run`'s pure parts: job names, exit descriptions, flags that reach the spec (issue 18, items 4 and 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpupool_sdk.cli.run_cmd import describe_exit, job_name_of, shell_code


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["python", "train.py", "--lr", "3"], "train"),
        (["python3.11", "-u", "/src/Train BERT.py"], "train-bert"),
        (["python", "-m", "my_pkg.finetune", "--epochs", "2"], "finetune"),
        (["torchrun", "--nproc-per-node", "2", "ddp_main.py"], "ddp_main"),
        (["python", "-c", "print(1)"], None),
        (["python"], None),
        (["./launch.sh"], "launch"),
    ],
)
def test_job_name_of_a_command(command: list[str], name: str | None) -> None:
    assert job_name_of(command) == name


def test_a_death_by_signal_is_described_as_such_and_mapped_as_shells_do() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(3) == "exit code 3"
    assert shell_code(-9) == 137 and shell_code(0) == 0 and shell_code(75) == 75


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpupool_sdk.cli.main", "run", *args], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "GPUPOOL_ENDPOINTS": "127.0.0.1:9"})


def test_python_c_needs_a_name() -> None:
    r = _run("--memory", "1GiB", "--", "python", "-c", "print(1)")
    assert r.returncode == 2 and "--name" in r.stderr and "python -c" in r.stderr


def test_run_flags_reach_the_spec_and_bad_ones_name_the_flag() -> None:
    r = _run("--memory", "1GiB", "--grace", "0", "--", "python", "x.py")
    assert r.returncode == 2 and "--grace" in r.stderr
    r = _run("--memory", "1GiB", "--max-restarts", "-1", "--", "python", "x.py")
    assert r.returncode == 2 and "--max-restarts" in r.stderr
    r = _run("--memory", "1GiB", "--preempt-grace", "-5", "--", "python", "x.py")
    assert r.returncode == 2 and "preempt_grace_s" in r.stderr
