"""A plain Python training loop gated by TimeSliceGate (run as a process by test_timeslice.py).

Usage: python timeslice_loop.py ENDPOINT PREFIX JOB NODE GPU START_AT END_AT STEP_S OUT_JSON

Each "step" sleeps STEP_S (the GPU work of a real step: the process does not compete for the
CPU, so the split measured is the gate's, not the OS scheduler's). Between START_AT and END_AT
(wall clock, shared by the two processes) it counts the time spent in steps.
"""

from __future__ import annotations

import json
import sys
import time

from gpupool_sdk.client.timeslice import TimeSliceGate, TimeSliceSettings


def main() -> int:
    endpoint, prefix, job, node, gpu, start_at, end_at, step_s, out = sys.argv[1:10]
    gate = TimeSliceGate.start(job, node, gpu, endpoints=endpoint, prefix=prefix, settings=TimeSliceSettings(period_s=1.0))
    step = float(step_s)
    busy = 0.0
    steps = 0
    while time.time() < float(start_at):
        gate.step_boundary()
        time.sleep(step)
    end = float(end_at)
    while True:
        gate.step_boundary()
        if time.time() >= end:
            break
        t0 = time.monotonic()
        time.sleep(step)
        busy += time.monotonic() - t0
        steps += 1
    result = {"job": job, "busy_s": busy, "steps": steps, "held_s": gate.held_s, "waited_s": gate.waited_s, "turns": gate.turns}
    gate.close()
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
