"""PoolSession (plain PyTorch loop) takes turns on a shared GPU through the runtime, like the Lightning callback.

A real coordinator and ``gpupool agent --simulate`` (the scenario harness), two ``PoolSession`` loops
leasing directly with compute shares 0.7 and 0.3 of one GPU; nothing in the loop mentions
time-slicing. Shorter than the Lightning test (20 s): it checks the wiring of this adapter (turns
taken at ``step_end``, the larger share gets the larger part), not the precision of the split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from scenarios.harness import ROOT, Pool, wait_for  # noqa: E402
from testkit import dump_logs_if_failed  # noqa: E402

from gpupool_sdk.store.keyspace import Keyspace  # noqa: E402

pytestmark = pytest.mark.slow

LOOP = """
import json, sys, time, torch
from pathlib import Path
from gpupool_torch import PoolSession
name, share, ready, window, out = sys.argv[1:6]
torch.set_num_threads(1)
with PoolSession(name=name, memory="10GiB", qos="guaranteed", compute_share=float(share), timeslice_period_s=1.0,
                 preempt_signals=()) as pool:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pool.add_optimizer(opt)
    busy, steps, step, start, end = 0.0, 0, 0, None, None
    while end is None or time.time() < end:
        step += 1
        pool.step_begin()
        t0, w0 = time.monotonic(), time.time()
        loss = model(torch.ones(4, 8)).sum(); opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.01)
        if start is not None and start <= w0 < end:
            busy += time.monotonic() - t0; steps += 1
        if pool.step_end(step, lambda path: torch.save(model.state_dict(), path)):
            break
        Path(ready).touch()
        if start is None and Path(window).exists():
            w = json.loads(Path(window).read_text()); start, end = w["start_at"], w["end_at"]
    gate = pool.runtime.sharing.gate
    result = {"busy_s": busy, "steps": steps, "mechanism": pool.runtime.sharing.plan.mechanism,
              "turns": gate.turns if gate is not None else 0}
Path(out).write_text(json.dumps(result))
"""


@pytest.fixture
def pool(etcd_endpoint: str, keyspace: Keyspace, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """The scenario harness's pool (coordinator and agent processes); logs printed on failure."""
    p = Pool(etcd_endpoint, keyspace, tmp_path)
    try:
        yield p
    finally:
        dump_logs_if_failed(request, tmp_path, tail_chars=4000)
        p.close()


def test_two_pool_sessions_take_turns_on_one_gpu(pool: Pool, tmp_path: Path) -> None:
    pool.gpus("node-a:1xA100-40GB:pcie")
    pool.coordinator("c1", "--no-preemption")
    pool.wait_leader()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUPOOL_ENDPOINTS": pool.endpoint, "GPUPOOL_PREFIX": pool.keys.prefix,
           "GPUPOOL_NODE": "node-a", "GPUPOOL_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_JOB", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    window = tmp_path / "window.json"
    jobs = {"sess-a": 0.7, "sess-b": 0.3}
    procs = {}
    for job, share in jobs.items():
        log = open(tmp_path / f"{job}.log", "wb")  # noqa: SIM115 - closed with the process
        procs[job] = subprocess.Popen(
            [sys.executable, "-c", LOOP, job, str(share), str(tmp_path / f"{job}.ready"), str(window),
             str(tmp_path / f"{job}.json")], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        pool.procs.append(procs[job])
    wait_for(lambda: all((tmp_path / f"{j}.ready").exists() for j in jobs), 120, "both sessions stepping")
    # Both gates registered (the keeper starts on a thread at training start).
    wait_for(lambda: len(pool.store.get_prefix(pool.keys.timeslice_prefix("node-a", pool.gpu_uuids()[0]))[0]) >= 3,
             60, "both members and a turn in etcd")
    start = time.time() + 2.0
    # Written whole, then renamed: the loops poll for the file and must never read it half-written.
    partial = window.with_suffix(".tmp")
    partial.write_text(json.dumps({"start_at": start, "end_at": start + 20.0}))
    partial.replace(window)
    for job, p in procs.items():
        assert p.wait(timeout=120) == 0, (tmp_path / f"{job}.log").read_text()[-3000:]
    res = {j: json.loads((tmp_path / f"{j}.json").read_text()) for j in jobs}
    frac = res["sess-a"]["busy_s"] / (res["sess-a"]["busy_s"] + res["sess-b"]["busy_s"])
    print(f"PoolSession 0.7/0.3 over 20 s: {frac:.1%} / {1 - frac:.1%}; {res}")
    assert all(r["mechanism"] == "timeslice" and r["turns"] >= 5 for r in res.values()), res
    assert 0.55 <= frac <= 0.85, res
