"""The short fault-injection runs (issue 12): real processes on loopback, every fault kind once or more.

Marked ``slow``. Each injects every fault kind of its etcd setup at least once (in a seeded
order, one at a time, each waiting for the pool to recover: a new leader, the agent's GPUs
published again). The long variant is ``python scripts/faults.py --duration 600`` (figures in
``docs/reliability.md``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.chaos import CLUSTER_KINDS, SINGLE_KINDS, FaultConfig, FaultRun, summarize

# Long (a minute or two each): started first. They run inside the parallel phase of scripts/test since
# the GPU guard (docs/reliability.md: 40 of 40 passed under load and beside other tests).
pytestmark = [pytest.mark.slow]


def _run(cfg: FaultConfig, tmp_path: Path) -> None:
    report = FaultRun(cfg, tmp_path / "run").run()
    print(summarize(report))
    assert not report.violations, summarize(report)
    missing = set(cfg.fault_kinds()) - set(report.faults)
    assert not missing, f"fault kinds never injected: {sorted(missing)}"
    assert report.samples > 0 and report.grants > cfg.clients and report.history_events > 0


def test_faults_single_etcd(tmp_path: Path) -> None:
    """Leader, agents and clients killed and paused; a granted client's lease revoked through etcd;
    etcd killed and restarted on its data dir (once past the clients' TTL); garbage under every key kind."""
    _run(FaultConfig(duration_s=10, etcd_members=1, coordinators=2, nodes=("node-a:2xH100-80GB:nvlink",
                     "node-b:2xH100-80GB:nvlink"), clients=4, gap_s=0.5, seed=12, kinds=SINGLE_KINDS), tmp_path)


def test_faults_three_member_etcd(tmp_path: Path) -> None:
    """Members of a 3-member etcd killed (the raft leader too) and paused, with the other faults."""
    _run(FaultConfig(duration_s=10, etcd_members=3, coordinators=2, nodes=("node-a:2xH100-80GB:nvlink",),
                     clients=3, gap_s=0.5, seed=13, kinds=CLUSTER_KINDS), tmp_path)
