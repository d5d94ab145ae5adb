"""Run the real ``gpupool`` command line as subprocesses, one at a time or several in parallel."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Nothing listens on the discard port: every connection is refused at once.
DEAD_ENDPOINT = "127.0.0.1:9"


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPOOL_ENDPOINTS", "GPUPOOL_PREFIX")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def gpupool(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``gpupool ARGS`` in a fresh process (no GPUPOOL_* variables unless ``env`` gives them)."""
    return subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", *args],
        capture_output=True, text=True, cwd=ROOT, env=_env(env), timeout=timeout,
    )


def gpupool_many(
    argvs: Sequence[Sequence[str]], env: dict[str, str] | None = None, workers: int = 4
) -> list[subprocess.CompletedProcess[str]]:
    """Several ``gpupool`` runs side by side (``workers`` at a time), results in order."""
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(lambda a: gpupool(*a, env=env), argvs))


def explain(r: subprocess.CompletedProcess[str]) -> str:
    """The command, its exit code and its output, for assertion messages."""
    return f"{' '.join(map(str, r.args[3:]))} -> rc {r.returncode}\nstdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-1500:]}"
