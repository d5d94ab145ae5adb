"""A small training-job process for the scenarios: acquire through ``PoolClient``, obey directives.

Usage: ``python client_proc.py ENDPOINT PREFIX SPEC_JSON [--ignore-directives]``

Prints ``GRANTED <node>/<gpu_uuid> ...`` once granted, ``DIRECTIVE <kind> <seq>`` for each
directive, and exits 75 (EX_TEMPFAIL) after a cooperative preemption, 0 on SIGTERM, 3 if rejected,
4 (after printing ``LOST``) when its lease was taken away.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from gpupool_sdk.client import PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.errors import JobRejectedError
from gpupool_sdk.resources import DirectiveKind, JobSpec


def main() -> int:
    endpoint, prefix, spec_json = sys.argv[1:4]
    ignore = "--ignore-directives" in sys.argv[4:]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = JobSpec.from_dict(json.loads(spec_json))
    timing = LeaseTiming(ttl_s=5, keepalive_interval_s=1.0, retry_timeout_s=1.5)
    with PoolClient(endpoints=endpoint, prefix=prefix, timing=timing) as pool:
        try:
            lease = pool.acquire(spec, timeout=120)
        except JobRejectedError as exc:
            print(f"REJECTED {exc}", flush=True)
            return 3
        print("GRANTED " + " ".join(f"{a.node}/{a.gpu_uuid}" for a in lease.allocations), flush=True)
        step = 0
        while not stop.is_set() and lease.active:
            step += 1
            d = lease.poll_directive()
            if d is None:
                stop.wait(0.05)  # one "training step"
                continue
            print(f"DIRECTIVE {d.kind.value} {d.seq}", flush=True)
            if ignore:
                continue
            if d.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
                lease.ack(d, step=step, checkpoint=f"/ckpt/{spec.name}/step{step}.ckpt")
                lease.wait_released(timeout=60)
                lease.release()
                print("PREEMPTED", flush=True)
                return 75
        if lease.lost:
            print(f"LOST {lease.lost_reason}", flush=True)
            return 4
        lease.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
