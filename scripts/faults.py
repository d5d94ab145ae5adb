#!/usr/bin/env python
"""The long fault-injection run (issue 12): ``python scripts/faults.py --duration 600``.

Runs the engine of ``tests/faults/chaos.py`` (real etcd, coordinators, agents and job clients on
loopback, killed and paused with real signals, garbage under every key kind) and prints the
figures that ``docs/reliability.md`` reports: faults by kind, violations with their evidence,
failover latency (new leader, first grant) p50/p99/max, time to the first grant after an etcd
restart. Exit code 0 when no invariant was violated, 1 otherwise.

With ``--members both`` (the default) the duration is split between a single-member etcd
(killed and restarted on its data dir) and a 3-member one (members and the raft leader killed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from faults.chaos import FaultConfig, FaultRun, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of faults in all (default 600)")
    ap.add_argument("--members", choices=["1", "3", "both"], default="both", help="etcd members (default both)")
    ap.add_argument("--coordinators", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--nodes", default="node-a:4xH100-80GB:nvlink,node-b:4xH100-80GB:nvlink",
                    help="one simulated agent per comma-separated entry")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between two faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=None, help="logs and report.json (default: a temporary dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the combined figures here")
    args = ap.parse_args(argv)
    if not args.duration > 0:
        ap.error("--duration must be > 0 seconds")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpupool-faults-"))
    members = [1, 3] if args.members == "both" else [int(args.members)]
    share = args.duration / len(members)
    results = {}
    bad = 0
    for m in members:
        cfg = FaultConfig(duration_s=share, etcd_members=m, coordinators=args.coordinators,
                          nodes=tuple(args.nodes.split(",")), clients=args.clients, gap_s=args.gap,
                          seed=args.seed + m)
        t0 = time.monotonic()
        print(f"== {m}-member etcd, {share:.0f}s of faults ({work / f'etcd{m}'})", flush=True)
        report = FaultRun(cfg, work / f"etcd{m}", log=lambda s: print(s, flush=True)).run()
        print(summarize(report), flush=True)
        print(f"   wall time {time.monotonic() - t0:.0f}s", flush=True)
        results[f"etcd_members_{m}"] = {"figures": report.figures(), "violations": report.violations}
        bad += len(report.violations)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"logs and reports under {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
