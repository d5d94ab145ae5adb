"""A training-job stand-in for the fault suite: acquire, hold, release, again, logging what it believes.

Usage: ``python fault_client.py ENDPOINTS PREFIX NODE SPEC_JSON LOG_PATH SEED``

Every event is one JSON line in LOG_PATH with the wall time ``t``: ``granted`` (lease id, GPUs,
QoS), ``releasing`` (it stops using its slices: before a release or an ack), ``released``,
``lost`` (the lease was taken away; it stopped using its slices when its lease said so), and
``error`` (acquire failed: the type and message). The fault runner reads these logs to check that
no two clients believed they held the same exclusive GPU at overlapping times, and liveness.

The process group holds the client and its I/O helper: the runner kills one or both.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import threading
import time
from typing import Any

from gpupool_sdk.client import PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.resources import DirectiveKind, JobSpec

#: The clients' lease timing (TTL 5 s): short, so killed clients' slices come back quickly.
TIMING = LeaseTiming(ttl_s=5, keepalive_interval_s=1.0, retry_timeout_s=1.5)


def main() -> int:
    endpoints, prefix, node, spec_json, log_path, seed = sys.argv[1:7]
    rng = random.Random(int(seed))
    spec = JobSpec.from_dict(json.loads(spec_json))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 - line-buffered for the whole run

    def log(ev: str, **kw: Any) -> None:
        out.write(json.dumps({"ev": ev, "t": time.time(), "job": spec.name, **kw}) + "\n")

    log("start")
    with PoolClient(endpoints=endpoints, prefix=prefix, timing=TIMING, node=node, timeout_s=2.0) as pool:
        while not stop.is_set():
            try:
                lease = pool.acquire(spec, timeout=60)
            except GpupoolError as exc:
                log("error", error=type(exc).__name__, message=str(exc)[:300])
                stop.wait(0.3)
                continue
            log("granted", lease=f"{lease.etcd_lease_id:x}", term=lease.term,
                gpus=[a.gpu_uuid for a in lease.allocations], qos=spec.qos_class.value)
            until = time.monotonic() + rng.uniform(0.5, 3.0)
            outcome = "held"
            d = None
            while not stop.is_set() and time.monotonic() < until:
                if not lease.active:
                    outcome = "lost"
                    break
                d = lease.poll_directive()
                if d is not None and d.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
                    outcome = "preempted"
                    break
                time.sleep(0.02)  # one "training step"
            if outcome == "lost" or lease.lost:
                log("lost", reason=str(lease.lost_reason)[:300])
                continue
            log("releasing", why=outcome)
            try:
                if outcome == "preempted" and d is not None:
                    lease.ack(d, step=1, checkpoint=f"/ckpt/{spec.name}")
                    lease.wait_released(timeout=30)
                lease.release()
                log("released")
            except GpupoolError as exc:
                log("release_error", error=type(exc).__name__, message=str(exc)[:300])
            stop.wait(rng.uniform(0.0, 0.5))
    log("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
