"""Step-level time-slicing: what a job alone pays, and the split two sharing jobs get.

``run()`` starts a real etcd, then:

1. **Alone, side by side.** One job holds a slice of a GPU and runs a :class:`TimeSliceGate`
   (with its keeper process, registered in etcd, no other member). A loop of fixed CPU work
   per step (~1 ms, timed by ``time.thread_time``) runs with and without ``gate.step_boundary()``
   between steps, in interleaved pairs (AB, BA, ...) so both halves see the same machine load;
   the figure is the median of the per-pair ratios of step time (gated / plain), next to the
   same ratio of two plain runs (the machine's noise floor).
2. **Split 0.7 / 0.3.** Two processes, each a loop of 10 ms steps (sleeps: the GPU work of a real
   step) with a gate, on one GPU with allocations of compute share 0.7 and 0.3, for
   ``split_s`` seconds: the fraction of the step time each gets.

Run: ``python benchmarks/bench_timeslice.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from gpupool_sdk.client.timeslice import TimeSliceGate
from gpupool_sdk.resources import Allocation, QoS
from gpupool_sdk.store import EtcdServer, EtcdStore, Keyspace

NODE, GPU = "bench-node", "GPU-bench-0"

LOOP = """
import json, sys, time
from gpupool_sdk.client.timeslice import TimeSliceGate, TimeSliceSettings
endpoint, prefix, job, start_at, end_at = sys.argv[1:6]
gate = TimeSliceGate.start(job, "bench-node", "GPU-bench-0", endpoints=endpoint, prefix=prefix,
                           settings=TimeSliceSettings(period_s=1.0))
busy = 0.0
while time.time() < float(start_at):
    gate.step_boundary(); time.sleep(0.01)
while True:
    gate.step_boundary()
    if time.time() >= float(end_at):
        break
    t0 = time.monotonic(); time.sleep(0.01); busy += time.monotonic() - t0
print(json.dumps({"busy_s": busy, "turns": gate.turns}))
gate.close()
"""


def _work(steps: int, gate: TimeSliceGate | None) -> float:
    """Seconds of thread CPU time per step of a ~1 ms busy step."""
    t0 = time.thread_time()
    for _ in range(steps):
        if gate is not None:
            gate.step_boundary()
        x = 0
        for i in range(20_000):
            x += i * i
    return (time.thread_time() - t0) / steps


def _alloc(store: EtcdStore, keys: Keyspace, job: str, share: float) -> None:
    store.put(
        keys.allocation(NODE, GPU, job),
        Allocation(job, NODE, GPU, 0, 1 << 30, share, QoS.GUARANTEED),
    )


def run(pairs: int = 60, steps: int = 300, split_s: float = 60.0) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-ts-"))
    server = EtcdServer(data_dir=tmp / "etcd", name="bench").start(timeout=60)
    try:
        keys = Keyspace(f"/bench/{uuid.uuid4().hex}")
        store = EtcdStore(server.endpoint, keyspace=keys)
        _alloc(store, keys, "alone", 0.5)
        gate = TimeSliceGate.start("alone", NODE, GPU, endpoints=server.endpoint, prefix=keys.prefix)
        try:
            _work(steps, None), _work(steps, gate)  # warm up
            ratios, control = [], []
            for i in range(pairs):
                if i % 2 == 0:
                    plain, gated = _work(steps, None), _work(steps, gate)
                else:
                    gated, plain = _work(steps, gate), _work(steps, None)
                ratios.append(gated / plain)
                control.append(_work(steps, None) / _work(steps, None))  # plain vs plain: the noise floor
            waited = gate.waited_s
        finally:
            gate.close()
        q = statistics.quantiles(ratios, n=4)
        alone = {
            "pairs": pairs,
            "steps_per_run": steps,
            "step_ms": round(1000 * statistics.median([_work(steps, None) for _ in range(3)]), 3),
            "gated_over_plain_median": round(statistics.median(ratios), 4),
            "gated_over_plain_iqr": [round(q[0], 4), round(q[2], 4)],
            "plain_over_plain_median": round(statistics.median(control), 4),
            "waited_s": waited,
        }

        store.delete_prefix(keys.root())
        _alloc(store, keys, "job-a", 0.7)
        _alloc(store, keys, "job-b", 0.3)
        start_at = time.time() + 15.0
        end_at = start_at + split_s
        procs = {
            job: subprocess.Popen(
                [sys.executable, "-c", LOOP, server.endpoint, keys.prefix, job, str(start_at), str(end_at)],
                stdout=subprocess.PIPE,
            )
            for job in ("job-a", "job-b")
        }
        res = {job: json.loads(p.communicate(timeout=split_s + 120)[0]) for job, p in procs.items()}
        total = res["job-a"]["busy_s"] + res["job-b"]["busy_s"]
        split = {
            "seconds": split_s,
            "job_a_share_0.7_fraction": round(res["job-a"]["busy_s"] / total, 4),
            "job_b_share_0.3_fraction": round(res["job-b"]["busy_s"] / total, 4),
            "turns_a": res["job-a"]["turns"],
            "turns_b": res["job-b"]["turns"],
            "gpu_busy_fraction": round(total / split_s, 4),
        }
        store.close()
        return {"alone": alone, "split": split}
    finally:
        server.stop()


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
