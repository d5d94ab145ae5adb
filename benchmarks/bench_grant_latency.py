"""Grant latency through etcd on loopback: from a job's submit to the GRANTED status it sees.

Setup: an embedded etcd, a real ``gpupool coordinator`` process, 16 simulated H100s published
under an agent-like lease, and N small jobs (1 GiB, 5 % compute, ``guaranteed``) submitted one at
a time following the lease protocol: grant the job's lease, create ``jobs/{job}/spec`` on it,
then wait on a watch (no polling) for ``jobs/{job}/status`` = GRANTED. Jobs stay alive, so the
pool grows to N jobs and later cycles read and schedule a larger pool.

Two figures per job: ``submit`` (lease grant + spec create + wait, what a client experiences)
and ``spec_to_grant`` (from the spec write to the watch event: coordinator wake-up, snapshot,
schedule, fenced transaction, watch delivery).

Run: ``python benchmarks/bench_grant_latency.py [N]`` or through ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.resources import JobSpec, JobState, JobStatus, NodeInfo
from gpupool_sdk.store import EtcdServer, EtcdStore, Keyspace, WatchEvent
from gpupool_sdk.store.codec import decode

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "node-a:8xH100-80GB:nvlink,node-b:8xH100-80GB:nvlink"


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_pct(values, 0.50) * 1000, 2),
        "p90_ms": round(_pct(values, 0.90) * 1000, 2),
        "p99_ms": round(_pct(values, 0.99) * 1000, 2),
        "max_ms": round(max(values) * 1000, 2),
        "mean_ms": round(statistics.fmean(values) * 1000, 2),
    }


def run(n: int = 200) -> dict[str, Any]:
    """Submit ``n`` jobs one at a time and measure submit-to-grant latency (seconds -> ms figures)."""
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-grant-"))
    server = EtcdServer(data_dir=tmp / "etcd", name="bench").start(timeout=60)
    keys = Keyspace("/gpupool-bench/grant")
    store = EtcdStore(server.endpoint, keyspace=keys)
    coord_log = open(tmp / "coordinator.log", "wb")  # noqa: SIM115 - closed below
    coord: subprocess.Popen[bytes] | None = None
    granted: dict[str, float] = {}
    cond = threading.Condition()

    def on_events(events: list[WatchEvent]) -> None:
        t = time.perf_counter()
        for e in events:
            if e.type != "put" or not e.kv.key.endswith("/status"):
                continue
            status = decode(e.kv.key, e.kv.value, JobStatus)
            if status.state is JobState.GRANTED:
                job = e.kv.key.split("/")[-2]
                with cond:
                    granted.setdefault(job, t)
                    cond.notify_all()

    try:
        store.delete_prefix(keys.root())
        agent_lease = store.grant_lease(60)
        gpus = parse_cluster_spec(CLUSTER)
        for g in gpus:
            store.put(keys.gpu(g.node, g.uuid), g, lease=agent_lease)
        for node in sorted({g.node for g in gpus}):  # the coordinator uses GPUs only with their node key
            store.put(keys.node(node), NodeInfo(name=node, hostname="bench", agent_pid=os.getpid(),
                                                gpu_count=sum(g.node == node for g in gpus), backend="simulated",
                                                started_at=time.time()), lease=agent_lease)
        coord = subprocess.Popen(
            [sys.executable, "-m", "gpupool_sdk.cli.main", "coordinator", "--endpoints", server.endpoint,
             "--prefix", keys.prefix, "--id", "bench", "--ttl", "10", "--loop-wait", "2", "--log-level", "warning"],
            stdout=coord_log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        deadline = time.monotonic() + 30
        while store.get(keys.leader()) is None:
            if time.monotonic() > deadline or coord.poll() is not None:
                raise RuntimeError(f"the coordinator did not lead; see {tmp / 'coordinator.log'}")
            time.sleep(0.05)
        watcher = store.watch_prefix(keys.jobs_prefix(), on_events, start_revision=store.revision() + 1)
        watcher.wait_ready(10)

        submit: list[float] = []
        spec_to_grant: list[float] = []
        leases: list[int] = []
        for i in range(n):
            name = f"bench-{i:04d}"
            spec = JobSpec(name=name, gpus=1, memory="1GiB", compute_share=0.05, qos="guaranteed")
            t0 = time.perf_counter()
            lease = store.grant_lease(10)
            t1 = time.perf_counter()
            if not store.create(keys.job_spec(name), spec, lease=lease):
                raise RuntimeError(f"{name} exists")
            leases.append(lease)
            with cond:
                if not cond.wait_for(lambda name=name: name in granted, timeout=30):
                    raise RuntimeError(f"{name} not granted within 30 s; see {tmp / 'coordinator.log'}")
                t_grant = granted[name]
            submit.append(t_grant - t0)
            spec_to_grant.append(t_grant - t1)
            if i % 20 == 19:
                for lid in leases[-20:]:
                    store.refresh_lease(lid)  # keep the pool populated while the run goes on
                store.refresh_lease(agent_lease)
        watcher.cancel()
        return {
            "command": "python benchmarks/bench_grant_latency.py",
            "jobs": n,
            "gpus": len(parse_cluster_spec(CLUSTER)),
            "submit_to_grant": _ms(submit),
            "spec_write_to_grant": _ms(spec_to_grant),
            # Later jobs see a fuller pool (every cycle reads and schedules all live jobs).
            "p50_ms_by_quarter": [
                round(_pct(submit[q * n // 4 : (q + 1) * n // 4], 0.5) * 1000, 2) for q in range(4) if n >= 4
            ],
            "goal_p99_ms": 50,
            "meets_goal": _pct(submit, 0.99) * 1000 < 50,
            "cpus": os.cpu_count(),
        }
    finally:
        if coord is not None and coord.poll() is None:
            coord.terminate()
            try:
                coord.wait(15)
            except subprocess.TimeoutExpired:
                coord.kill()
        coord_log.close()
        store.close()
        server.stop()


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 200), indent=2))
