"""Issue 13 end to end: a 2-node x 1-rank DDP job (gloo, CPU) under torchrun, one `gpupool run --nodes 2`
per (simulated) node, preempted by a higher-priority job: both nodes checkpoint at the same step,
exit 75, are requeued as one gang, resume, and finish with the weights of an uninterrupted 2-node run.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec
from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCRIPT = str(ROOT / "examples" / "readme_train.py")
#: readme_train.py held at a step until the callback has the directive (paused_train.py).
PAUSED = str(Path(__file__).with_name("paused_train.py"))
LONG = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gang(pool: LivePool, name: str, out: Path, pause_at: int | None = None) -> list[Any]:
    """``gpupool run --nodes 2`` on each node, running torchrun with readme_train.py (held at ``pause_at``)."""
    script = [PAUSED, "--pause-dir", str(pool.tmp), f"--pause-at={pause_at}"] if pause_at is not None else [SCRIPT]
    port = free_port()
    procs = []
    for rank, node in enumerate(("node-a", "node-b")):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", f"{name}-{port}", "--max-restarts", "0"]
        run = ["run", "--name", name, "--gpus", "2", "--nodes", "2", "--node-rank", str(rank), "--memory", "30GiB",
               "--", *torchrun, *script, "--epochs", "3", "--num-nodes", "2", "--out", str(out)]
        procs.append(pool.spawn(f"{name}-{node}", [sys.executable, "-m", "gpupool_sdk.cli.main", *run],
                                env={"GPUPOOL_NODE": node}))
    return procs


def test_two_node_gang_is_preempted_together_requeued_and_matches_an_uninterrupted_run(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:1xA100-40GB,node-b:1xA100-40GB")
    base = gang(live_pool, "base", tmp_path / "base.pt")
    for p, node in zip(base, ("node-a", "node-b"), strict=True):
        assert live_pool.wait_exit(p, f"base-{node}", LONG) == 0, live_pool.log(f"base-{node}")
    # Rank 0 is held inside step 10 (of 12 an epoch, 36 in all) until the directive reaches it:
    # the gang is training, and still training, when the preemption lands.
    procs = gang(live_pool, "ddp", tmp_path / "ddp.pt", pause_at=10)
    wait_for(lambda: (live_pool.tmp / "paused-at-10").exists(), LONG, what="the gang to train to step 10")
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix, node="node-b")
    try:
        lease = client.acquire(JobSpec(name="urgent", memory="30GiB", qos="guaranteed", priority=10, node="node-b"),
                               timeout=LONG)
        for node in ("node-a", "node-b"):
            wait_for(lambda n=node: "preempt" in live_pool.log(f"ddp-{n}") and "queueing again" in
                     live_pool.log(f"ddp-{n}"), LONG, what=f"{node} to be requeued")
        lease.release()
    finally:
        client.close()
    for p, node in zip(procs, ("node-a", "node-b"), strict=True):
        assert live_pool.wait_exit(p, f"ddp-{node}", LONG) == 0, live_pool.log(f"ddp-{node}")
    a, b = torch.load(tmp_path / "base.pt"), torch.load(tmp_path / "ddp.pt")
    assert a["global_step"] == b["global_step"]
    for k in a["state_dict"]:
        assert torch.allclose(a["state_dict"][k], b["state_dict"][k], atol=1e-6), k
    # Both nodes stopped at the step after the one the directive reached: one checkpoint, that step.
    assert [c.name for c in (live_pool.tmp / "ckpt").glob("ddp-preempt-step*.ckpt")] == ["ddp-preempt-step11.ckpt"]
