"""A training-job stand-in for the Prometheus test: acquire through ``PoolClient``, serve its own metrics.

Usage: ``python job_exporter_proc.py ENDPOINT PREFIX SPEC_JSON METRICS_PORT``

Serves :class:`~gpupool_sdk.telemetry.prometheus.JobMetrics` on 127.0.0.1 (the job-side default),
publishes a telemetry summary every half second, prints ``SERVING <port>`` once granted and
serving, and releases its slices on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from gpupool_sdk.client import PoolClient
from gpupool_sdk.config import LeaseTiming
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.telemetry.prometheus import JobMetrics
from gpupool_sdk.telemetry.summary import TelemetrySummary


def main() -> int:
    endpoint, prefix, spec_json, port = sys.argv[1:5]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = JobSpec.from_dict(json.loads(spec_json))
    timing = LeaseTiming(ttl_s=6, keepalive_interval_s=1.0, retry_timeout_s=2.0)
    metrics = JobMetrics()
    with PoolClient(endpoints=endpoint, prefix=prefix, timing=timing) as pool:
        lease = pool.acquire(spec, timeout=120)
        server = metrics.serve(int(port))
        print(f"SERVING {server.port}", flush=True)
        step = 0
        try:
            while not stop.is_set() and lease.active:
                step += 10
                summary = TelemetrySummary.build(
                    spec.name, step=step, steps_per_s=20.0, window_s=0.5,
                    phase_seconds={"data": 0.005, "forward": 0.015, "backward": 0.025, "optimizer": 0.005},
                    published_at=time.time(),
                )
                metrics.update(summary)
                lease.publish_telemetry(summary.to_dict())
                stop.wait(0.5)
        finally:
            server.close()
            if lease.active:
                lease.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
