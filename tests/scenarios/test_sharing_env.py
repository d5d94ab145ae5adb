"""The grant's sharing environment reaches the job's process (real pool, CPU only).

A real coordinator and a real ``gpupool agent --simulate ... --mps-pipe-dir DIR`` (an MPS daemon
run by someone else: its GPUs carry ``mps_pipe_dir``). A guaranteed slice with compute share 0.3
and 10 GiB must reach the training process as ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M`` and the pipe directory, before the script's CUDA
could start: in ``gpupool run``'s child environment, and in ``os.environ`` of a process that leases
directly (and so in the processes it starts). Without MPS, the plan is time-slicing and no MPS
variable is set. The real GPU check is ``test_mps_limits_hold_on_a_real_gpu`` (``scripts/gpu_checks.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.harness import ROOT, Pool, wait_for

MPS_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")

SHOW_ENV = (
    "import json, os; "
    f"print('ENV ' + json.dumps({{k: os.environ.get(k) for k in {list(MPS_VARS) + ['GPUPOOL_SHARING']!r}}}))"
)

DIRECT = """
import json, os, subprocess, sys
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
rt = PoolRuntime(RuntimeOptions(name="direct-job", memory="10GiB", qos="guaranteed", compute_share=0.3))
rt.acquire()
child = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True).stdout
print("PLAN " + json.dumps(rt.sharing.plan.to_dict()))
print(child.strip().replace("ENV ", "CHILD "))
rt.close()
"""


def _env(pool: Pool) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUPOOL_ENDPOINTS": pool.endpoint, "GPUPOOL_PREFIX": pool.keys.prefix,
           "GPUPOOL_NODE": "node-a", "GPUPOOL_CHECKPOINT_DIR": str(pool.tmp_path / "ckpt")}  # not the repository's cwd
    for var in (*MPS_VARS, "GPUPOOL_SHARING", "GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_JOB", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def _line(out: str, tag: str) -> dict[str, str | None]:
    line = next((ln for ln in out.splitlines() if ln.startswith(tag + " ")), None)
    assert line is not None, f"no {tag} line in:\n{out[-3000:]}"
    return dict(json.loads(line[len(tag) + 1:]))


def _start(pool: Pool, tmp_path: Path, mps: bool) -> str:
    pipe = str(tmp_path / "mps" / "pipe")
    extra = ["--mps-pipe-dir", pipe] if mps else ["--mps", "off"]
    pool._spawn("agent", ["agent", "--endpoints", pool.endpoint, "--prefix", pool.keys.prefix,
                          "--simulate", "node-a:1xA100-40GB:pcie", "--ttl", "6", "--refresh", "0.5", *extra])
    wait_for(lambda: pool.gpu_uuids(), what="the agent to publish its GPU")
    pool.coordinator("c1", "--no-preemption")
    pool.wait_leader()
    return pipe


@pytest.mark.parametrize("mps", [True, False], ids=["mps", "no-mps"])
def test_gpupool_run_sets_the_grants_sharing_env_in_the_script(pool: Pool, tmp_path: Path, mps: bool) -> None:
    pipe = _start(pool, tmp_path, mps)
    r = subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "run", "--name", "run-job", "--gpus", "1", "--memory", "10GiB",
         "--qos", "guaranteed", "--compute-share", "0.3", "--acquire-timeout", "60", "--",
         sys.executable, "-c", SHOW_ENV],
        env=_env(pool), capture_output=True, text=True, cwd=ROOT, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    env = _line(r.stdout, "ENV")
    plan = json.loads(env.pop("GPUPOOL_SHARING") or "{}")
    if mps:
        assert env == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                       "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}
        assert plan["mechanism"] == "mps"
    else:
        assert env == dict.fromkeys(MPS_VARS)
        assert plan["mechanism"] == "timeslice" and plan["compute_share"] == 0.3 and plan["node"] == "node-a"


def test_a_direct_lease_puts_the_mps_env_into_its_process_before_cuda(pool: Pool, tmp_path: Path) -> None:
    pipe = _start(pool, tmp_path, mps=True)
    r = subprocess.run([sys.executable, "-c", DIRECT, SHOW_ENV], env=_env(pool), capture_output=True, text=True,
                       cwd=ROOT, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _line(r.stdout, "PLAN")["mechanism"] == "mps"
    child = _line(r.stdout, "CHILD")
    assert child["CUDA_MPS_PIPE_DIRECTORY"] == pipe and child["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert child["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"


ATTACHED = """
import json
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
rt = PoolRuntime(RuntimeOptions(preempt_signals=()))
rt.acquire()  # attached to the launcher: reads its plan from $GPUPOOL_SHARING
rt.start_training()
rt.sharing.wait_started(60)
gate = rt.sharing.gate
print("GATE " + json.dumps({"mechanism": rt.sharing.plan.mechanism, "running": gate is not None,
                            "gpu": rt.sharing.plan.gpu_uuid, "share": rt.sharing.plan.compute_share}))
rt.finish(0)
"""


def test_under_gpupool_run_the_script_runs_the_gate_from_the_launchers_plan(pool: Pool, tmp_path: Path) -> None:
    _start(pool, tmp_path, mps=False)
    r = subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "run", "--name", "attached-job", "--gpus", "1", "--memory",
         "10GiB", "--qos", "guaranteed", "--compute-share", "0.4", "--acquire-timeout", "60", "--",
         sys.executable, "-c", ATTACHED],
        env=_env(pool), capture_output=True, text=True, cwd=ROOT, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = _line(r.stdout, "GATE")
    assert got == {"mechanism": "timeslice", "running": True, "gpu": pool.gpu_uuids()[0], "share": 0.4}, got


def test_gpupool_run_that_cannot_tell_its_node_says_so_before_queueing(pool: Pool, tmp_path: Path) -> None:
    """One agent publishing two simulated nodes from this machine and no ``GPUPOOL_NODE``: the
    launcher exits 2 naming ``GPUPOOL_NODE``, and never says it is queueing (before, it printed
    "queueing <job>" first, then the error: an operator read that the job was queued)."""
    runtime = tmp_path / "runtime"
    pool._spawn("agent", ["agent", "--endpoints", pool.endpoint, "--prefix", pool.keys.prefix,
                          "--simulate", "node-a:1xA100-40GB:pcie,node-b:1xA100-40GB:pcie", "--ttl", "6",
                          "--refresh", "0.5"], env={"GPUPOOL_RUNTIME_DIR": str(runtime)})  # fmt: skip
    wait_for(lambda: len(pool.gpu_uuids()) == 2, what="the agent to publish both nodes")
    env = {**_env(pool), "GPUPOOL_RUNTIME_DIR": str(runtime)}
    env.pop("GPUPOOL_NODE")
    r = subprocess.run(
        [sys.executable, "-m", "gpupool_sdk.cli.main", "run", "--name", "which-node", "--gpus", "1", "--memory", "1GiB",
         "--acquire-timeout", "30", "--", sys.executable, "-c", "print('ran')"],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "GPUPOOL_NODE" in out and "ran" not in r.stdout, out
    assert "queueing" not in out, out
