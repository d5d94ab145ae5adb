"""Step-level time-slicing through the training runtime: what a job alone pays, and the split two jobs get.

``run()`` starts a real etcd, then:

1. **Alone, side by side.** One job holds a slice of a GPU. Two :class:`PoolRuntime` objects
   run the same loop of fixed CPU work per step (~1 ms, timed by ``time.thread_time``) and call
   ``runtime.step_boundary()`` between steps: one whose sharing plan started its time-slicing gate
   (keeper process running, registered in etcd, no other member: the job is alone), one that
   shares nothing. In interleaved pairs (AB, BA, ...) so both halves see the same machine load;
   the figure is the median of the per-pair ratios of step time (gated / plain), next to the
   same ratio of two plain runs (the machine's noise floor). The gate itself, called directly,
   is measured the same way.
2. **Split 0.7 / 0.3.** Two processes, each a :class:`PoolRuntime` whose plan (from its
   allocation, as after a grant) is time-slicing, looping over 10 ms steps (sleeps: the GPU work
   of a real step) and ``runtime.step_boundary()``, on one GPU with allocations of compute share
   0.7 and 0.3, for ``split_s`` seconds: the fraction of the step time each gets.

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
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
from gpupool_sdk.store import EtcdServer, EtcdStore, Keyspace

NODE, GPU = "bench-node", "GPU-bench-0"

LOOP = """
import json, sys, time
from gpupool_sdk.resources import Allocation, QoS
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
from gpupool_sdk.runtime import PoolRuntime, RuntimeOptions
endpoint, prefix, job, share, start_at, end_at = sys.argv[1:7]
rt = PoolRuntime(RuntimeOptions(name=job, memory="1GiB", qos="guaranteed", compute_share=float(share),
                                timeslice_period_s=1.0, preempt_signals=()))
a = Allocation(job, "bench-node", "GPU-bench-0", 0, 1 << 30, float(share), QoS.GUARANTEED)
rt.sharing.on_grant([a], "bench-node", [], endpoints=endpoint, prefix=prefix)  # what acquire() does
rt.start_training()
rt.sharing.wait_started(60)
busy = 0.0
step = 0
while time.time() < float(start_at):
    rt.step_boundary(lambda: step, None); time.sleep(0.01)
while True:
    rt.step_boundary(lambda: step, None)
    if time.time() >= float(end_at):
        break
    t0 = time.monotonic(); time.sleep(0.01); busy += time.monotonic() - t0; step += 1
gate = rt.sharing.gate
print(json.dumps({"busy_s": busy, "turns": gate.turns if gate else 0, "mechanism": rt.sharing.plan.mechanism}))
rt.stop_training()
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


def _step_zero() -> int:
    return 0


def _runtime_work(steps: int, rt: PoolRuntime) -> float:
    """The same step, with the runtime's step boundary (what the Lightning callback and PoolSession call)."""
    t0 = time.thread_time()
    for _ in range(steps):
        rt.step_boundary(_step_zero, None)
        x = 0
        for i in range(20_000):
            x += i * i
    return (time.thread_time() - t0) / steps


def _pairs(pairs: int, a: Any, b: Any) -> tuple[float, list[float]]:
    """Median of ``a() / b()`` over interleaved pairs (AB, BA, ...), and the IQR."""
    ratios = []
    for i in range(pairs):
        if i % 2 == 0:
            y, x = b(), a()
        else:
            x, y = a(), b()
        ratios.append(x / y)
    q = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), [round(q[0], 4), round(q[2], 4)]


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
            gate_median, gate_iqr = _pairs(pairs, lambda: _work(steps, gate), lambda: _work(steps, None))
            control, _ = _pairs(pairs, lambda: _work(steps, None), lambda: _work(steps, None))
            gate_waited = gate.waited_s
        finally:
            gate.close()
        # Through the runtime: a runtime whose plan started its gate (alone) against one sharing nothing.
        opts = RuntimeOptions(name="alone", memory="1GiB", qos="guaranteed", compute_share=0.5, preempt_signals=())
        gated_rt, plain_rt = PoolRuntime(opts), PoolRuntime(opts)
        a = Allocation("alone", NODE, GPU, 0, 1 << 30, 0.5, QoS.GUARANTEED)
        gated_rt.sharing.on_grant([a], NODE, [], endpoints=server.endpoint, prefix=keys.prefix)
        gated_rt.start_training()
        gated_rt.sharing.wait_started(60)
        try:
            assert gated_rt.sharing.gate is not None and gated_rt.sharing.gate.alone
            _runtime_work(steps, plain_rt), _runtime_work(steps, gated_rt)  # warm up
            rt_median, rt_iqr = _pairs(pairs, lambda: _runtime_work(steps, gated_rt), lambda: _runtime_work(steps, plain_rt))
            rt_control, _ = _pairs(pairs, lambda: _runtime_work(steps, plain_rt), lambda: _runtime_work(steps, plain_rt))
            rt_waited = gated_rt.sharing.gate.waited_s
        finally:
            gated_rt.stop_training()
        alone = {
            "pairs": pairs,
            "steps_per_run": steps,
            "step_ms": round(1000 * statistics.median([_work(steps, None) for _ in range(3)]), 3),
            "runtime_gated_over_plain_median": round(rt_median, 4),
            "runtime_gated_over_plain_iqr": rt_iqr,
            "runtime_plain_over_plain_median": round(rt_control, 4),
            "runtime_waited_s": rt_waited,
            "gate_gated_over_plain_median": round(gate_median, 4),
            "gate_gated_over_plain_iqr": gate_iqr,
            "gate_plain_over_plain_median": round(control, 4),
            "gate_waited_s": gate_waited,
        }

        store.delete_prefix(keys.root())
        _alloc(store, keys, "job-a", 0.7)
        _alloc(store, keys, "job-b", 0.3)
        start_at = time.time() + 15.0
        end_at = start_at + split_s
        procs = {
            job: subprocess.Popen(
                [sys.executable, "-c", LOOP, server.endpoint, keys.prefix, job, str(share), str(start_at), str(end_at)],
                stdout=subprocess.PIPE,
            )
            for job, share in (("job-a", 0.7), ("job-b", 0.3))
        }
        res = {job: json.loads(p.communicate(timeout=split_s + 120)[0]) for job, p in procs.items()}
        total = res["job-a"]["busy_s"] + res["job-b"]["busy_s"]
        split = {
            "seconds": split_s,
            "job_a_share_0.7_fraction": round(res["job-a"]["busy_s"] / total, 4),
            "job_b_share_0.3_fraction": round(res["job-b"]["busy_s"] / total, 4),
            "turns_a": res["job-a"]["turns"],
            "turns_b": res["job-b"]["turns"],
            "mechanism": res["job-a"]["mechanism"],
            "gpu_busy_fraction": round(total / split_s, 4),
        }
        store.close()
        return {"alone": alone, "split": split}
    finally:
        server.stop()


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
