"""A gang member process for the multi-node scenarios: join through ``PoolClient.join``.

Usage: ``python gang_proc.py ENDPOINT PREFIX SPEC_JSON``. The node comes from ``GPUPOOL_NODE``,
the ranks from the launcher's variables (torchrun's ``GROUP_RANK`` / ``WORLD_SIZE``...), as in a
real multi-node launch. ``--deaf-rank N`` makes node rank N ignore directives.

Prints ``GRANTED <node>/<gpu_uuid> ...`` (the whole gang) and ``DEVICES <indices>`` (this node's)
once granted, ``DIRECTIVE <kind> <seq>`` for each directive; every node acks a preemption. Exits
75 after a cooperative preemption, 0 on SIGTERM, 4 (after printing ``LOST``) when its lease was
taken away (another member left, or node rank 0 did).
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from gpupool_sdk.client import PoolClient
from gpupool_sdk.client.launch import launch_info
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.resources import DirectiveKind, JobSpec


def main() -> int:
    endpoint, prefix, spec_json = sys.argv[1:4]
    extra = sys.argv[4:]
    deaf = int(extra[extra.index("--deaf-rank") + 1]) if "--deaf-rank" in extra else -1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = JobSpec.from_dict(json.loads(spec_json))
    import os

    rank = launch_info(os.environ).node_rank
    timing = LeaseTiming(ttl_s=5, keepalive_interval_s=1.0, retry_timeout_s=1.5)
    with PoolClient(endpoints=endpoint, prefix=prefix, timing=timing) as pool:
        lease = pool.join(spec, timeout=120)
        print("GRANTED " + " ".join(f"{a.node}/{a.gpu_uuid}" for a in lease.allocations), flush=True)
        print(f"DEVICES {lease.visible_devices}", flush=True)
        step = 0
        while not stop.is_set() and lease.active:
            step += 1
            d = lease.poll_directive()
            if d is None:
                stop.wait(0.05)
                continue
            print(f"DIRECTIVE {d.kind.value} {d.seq}", flush=True)
            if rank == deaf:
                continue
            if d.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
                # Every node acks once its ranks stopped (node rank 0 with the checkpoint it saved).
                ckpt = f"/ckpt/{spec.name}/step{step}.ckpt" if rank == 0 else None
                lease.ack(d, step=step, checkpoint=ckpt)
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
