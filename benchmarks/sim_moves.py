"""Where the jobs moved for fragmentation go: a ``gpupool simulate`` run that also times the moves.

Runs ``gpupool simulate`` with the given arguments (its output unchanged on stdout) while
recording the ``gpupool`` policy's decisions, and prints on stderr one JSON line about the moves
(``migrate_for_fragmentation``): per move, how long the mover waited to run again (from the cycle
that moved it to its next grant), whether it landed on the GPU it was checked against, and how
long the job it made room for waited from its first move to its grant (``docs/simulation.md`` 5f).

Usage::

    python benchmarks/sim_moves.py --trace /tmp/alibaba_gpushare.csv --cluster 1*8xT4-16GB \\
        --max-duration 86400 --time-scale 0.2 --policy gpupool -o json --set migrate_for_fragmentation=true
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from gpupool_sdk.scheduler.migrate import MIGRATE_PREFIX
from gpupool_sdk.scheduler.types import Grant, Preempt
from gpupool_sdk.sim.pool_policy import PoolPolicy


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    from gpupool_sdk.cli.main import cli

    moved: dict[str, tuple[float, str]] = {}  # mover -> (time of its move, GPU it was checked against)
    first_move: dict[str, float] = {}  # job made room for -> time of its first move
    waits: list[float] = []
    landed = 0
    room: list[float] = []
    real = PoolPolicy.schedule

    def recording(self: PoolPolicy, sim: Any) -> Any:
        nonlocal landed
        out = real(self, sim)
        for d in out:
            if isinstance(d, Preempt) and d.reason.startswith(MIGRATE_PREFIX):
                dest = d.reason.split(" fits now on ")[1].split()[0]
                moved[d.job] = (sim.now, dest)
                if d.for_job is not None:
                    first_move.setdefault(d.for_job, sim.now)
            elif isinstance(d, Grant):
                hit = moved.pop(d.job, None)
                if hit is not None:
                    waits.append(sim.now - hit[0])
                    landed += any(s.gpu_uuid == hit[1] for s in d.slices)
                t = first_move.pop(d.job, None)
                if t is not None:
                    room.append(sim.now - t)
        return out

    PoolPolicy.schedule = recording  # type: ignore[method-assign]
    try:
        cli.main(["simulate", *sys.argv[1:]], standalone_mode=False)
    finally:
        PoolPolicy.schedule = real  # type: ignore[method-assign]
    summary = {
        "moves_regranted": len(waits),
        "never_regranted": len(moved),
        "landed_on_destination": landed,
        "mover_wait_median_s": _pct(waits, 0.5),
        "mover_wait_p90_s": _pct(waits, 0.9),
        "mover_wait_over_120_s": sum(w > 120 for w in waits),
        "mover_wait_over_1000_s": sum(w > 1000 for w in waits),
        "mover_wait_max_s": max(waits, default=0.0),
        "mover_wait_sum_s": sum(waits),
        "room_wait_median_s": _pct(room, 0.5),
        "room_wait_p90_s": _pct(room, 0.9),
        "room_wait_mean_s": statistics.fmean(room) if room else 0.0,
    }
    print(json.dumps(summary), file=sys.stderr)


if __name__ == "__main__":
    main()
