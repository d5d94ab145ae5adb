"""Sharing wired through the runtime, on a real GPU (marked ``gpu``; run by ``scripts/gpu_checks.sh``).

* The MPS limits the runtime puts into the environment at the grant are enforced by the driver when
  CUDA starts after it, and are not when CUDA started before (the ordering constraint, with its
  warning).
* Two processes whose steps are real CUDA work, each a ``PoolRuntime`` whose plan for a shared
  slice is time-slicing, share one GPU 0.7 / 0.3 through ``runtime.step_boundary()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import mps_control_daemon

from gpupool_sdk.resources import Allocation, GiB, QoS
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.keyspace import Keyspace

pytestmark = pytest.mark.gpu

NODE, GPU = "gpu-node", "GPU-real-0"

GRANT_THEN_CUDA = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING)
    from gpupool_sdk.resources import Allocation, GpuInfo, QoS
    from gpupool_sdk.runtime.runtime import DirectiveInbox
    from gpupool_sdk.runtime.sharing import JobSharing
    pipe, order = sys.argv[1], sys.argv[2]
    import torch
    if order == "cuda-first":
        torch.zeros(1, device="cuda")  # CUDA starts before the grant's environment
    gpu = GpuInfo(uuid="GPU-x", node="here", index=0, model="any", memory_bytes=80 << 30, mps_pipe_dir=pipe)
    grant = [Allocation("probe", "here", "GPU-x", 0, 2 << 30, 0.25, QoS.GUARANTEED)]
    plan = JobSharing("probe", DirectiveInbox()).on_grant(grant, "here", [gpu])  # what acquire() does
    try:
        torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        over = "allocated"
    except RuntimeError as e:
        over = "refused: " + str(e).splitlines()[0]
    print("RESULT " + json.dumps({"mechanism": plan.mechanism, "over_limit": over}))
    """
)


@pytest.fixture
def mps_daemon(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    with mps_control_daemon(tmp_path) as (pipe, _, env):
        yield pipe, env


def _probe(pipe: str, order: str) -> tuple[dict[str, str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    out = subprocess.run([sys.executable, "-c", GRANT_THEN_CUDA, pipe, order], env=env, capture_output=True,
                         text=True, timeout=180)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stderr


def test_runtime_mps_env_is_enforced_when_applied_before_cuda(mps_daemon: tuple[str, dict[str, str]]) -> None:
    pipe, _ = mps_daemon
    res, _ = _probe(pipe, "grant-first")
    assert res["mechanism"] == "mps" and res["over_limit"].startswith("refused"), res  # 3 GiB over a 2 GiB limit


def test_runtime_mps_env_after_cuda_started_warns_and_does_not_apply(mps_daemon: tuple[str, dict[str, str]]) -> None:
    pipe, _ = mps_daemon
    res, err = _probe(pipe, "cuda-first")
    assert res["over_limit"] == "allocated", res
    assert "CUDA was initialised in this process before the pool's grant" in err


LOOP = textwrap.dedent(
    """
    import json, sys, time, torch
    from gpupool_sdk.resources import Allocation, QoS
    from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
    endpoint, prefix, job, share, start_at, end_at = sys.argv[1:7]
    rt = PoolRuntime(RuntimeOptions(name=job, memory="4GiB", qos="guaranteed", compute_share=float(share),
                                    timeslice_period_s=1.0, preempt_signals=()))
    a = Allocation(job, "gpu-node", "GPU-real-0", 0, 4 << 30, float(share), QoS.GUARANTEED)
    rt.sharing.on_grant([a], "gpu-node", [], endpoints=endpoint, prefix=prefix)
    rt.start_training()
    rt.sharing.wait_started(60)
    x = torch.randn(4096, 4096, device="cuda")
    def step():
        for _ in range(8):
            y = x @ x
        torch.cuda.synchronize()
    busy, steps = 0.0, 0
    while time.time() < float(start_at):
        rt.step_boundary(lambda: steps, None); step()
    while True:
        rt.step_boundary(lambda: steps, None)
        if time.time() >= float(end_at):
            break
        t0 = time.monotonic(); step(); busy += time.monotonic() - t0; steps += 1
    gate = rt.sharing.gate
    print("RESULT " + json.dumps({"busy_s": busy, "steps": steps, "turns": gate.turns if gate else 0}))
    rt.stop_training()
    """
)


def test_two_runtimes_share_a_real_gpu_70_30(etcd_endpoint: str, store: EtcdStore, keyspace: Keyspace) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for job, share in (("job-a", 0.7), ("job-b", 0.3)):
        store.put(keyspace.allocation(NODE, GPU, job), Allocation(job, NODE, GPU, 0, 4 * GiB, share, QoS.GUARANTEED))
    start_at = time.time() + 30.0
    end_at = start_at + 30.0
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    procs = {job: subprocess.Popen([sys.executable, "-c", LOOP, etcd_endpoint, keyspace.prefix, job, str(share),
                                    str(start_at), str(end_at)], env=env, stdout=subprocess.PIPE, text=True)
             for job, share in (("job-a", 0.7), ("job-b", 0.3))}
    res = {}
    for job, p in procs.items():
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        res[job] = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    total = res["job-a"]["busy_s"] + res["job-b"]["busy_s"]
    frac = res["job-a"]["busy_s"] / total
    print(f"real GPU, 0.7/0.3 through the runtime: job-a {frac:.1%} of GPU step time; {res}")
    assert abs(frac - 0.7) <= 0.10 and min(r["turns"] for r in res.values()) >= 10
