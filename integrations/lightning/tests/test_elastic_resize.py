"""Issue 15 must-show: an elastic job grows 1 -> 2 slices and shrinks back, live, never losing its grant.

Real processes: etcd, a coordinator, ``gpupool agent --simulate`` (two simulated GPUs; whole-GPU
``exclusive`` jobs, so that no balloon or overcommit can make room instead), and
``gpupool run --min-gpus 1 --max-gpus 2`` running ``examples/elastic_ddp_train.py`` under torchrun
with one gloo rank per slice (``--nproc-per-node "$GPUPOOL_DEVICES"``). Another job holds the
second GPU at first; when it leaves, the coordinator grows the job (a ``resize`` directive: every
rank checkpoints, rank 0 acks, torchrun is started again with 2 ranks); when a higher-priority job
arrives the coordinator shrinks it back to 1. A watch on etcd records every write meanwhile: the
job keeps one etcd lease and one spec key throughout, its status never says PENDING after the
first grant (each resize's release and re-grant is one transaction), and it is never queued again.
The final weights equal those of the same sequence of world sizes replayed by hand (``--no-pool``)
at the same steps.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from gpupool_sdk.resources import JobState, JobStatus
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.types import WatchEvent
from integrations.lightning.tests.conftest import ROOT, LivePool, grow_and_shrink, max_gap, replay_by_hand

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCRIPT = str(ROOT / "examples" / "elastic_ddp_train.py")
JOB = "elastic"


class EtcdLog:
    """Every write under the pool's prefix, in revision order (a real etcd watch)."""

    def __init__(self, pool: LivePool) -> None:
        self.store = EtcdStore(pool.endpoint, keyspace=pool.keys)
        self.events: list[WatchEvent] = []
        self._lock = threading.Lock()
        _, rev = self.store.get_prefix(pool.keys.root())
        self.watcher = self.store.watch_prefix(pool.keys.root(), self._on, start_revision=rev + 1)

    def _on(self, events: list[WatchEvent]) -> None:
        with self._lock:
            self.events.extend(events)

    def snapshot(self) -> list[WatchEvent]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self.store.close()


def test_elastic_job_grows_and_shrinks_live_keeping_its_lease_and_matches_a_replay_by_hand(
    live_pool: LivePool, tmp_path: Path
) -> None:
    out = tmp_path / "pool.pt"
    torchrun = (f'exec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node "$GPUPOOL_DEVICES" '
                f"--max-restarts 0 {SCRIPT} --steps 1000000 --step-sleep 0.05 --finish-file {live_pool.tmp / 'finish'} "
                f"--out {out}")
    during: list[WatchEvent] = []
    etcd = EtcdLog(live_pool)
    try:
        run = grow_and_shrink(live_pool, JOB, torchrun, steps_each=5, at_shrunk=lambda: during.extend(etcd.snapshot()))
    finally:
        etcd.close()
    segs, end = run.starts, run.end

    # The etcd writes up to the shrink: one lease and one spec key throughout, no PENDING after the first grant.
    lease_id = int(run.lease_hex, 16)
    spec_key = live_pool.keys.job_spec(JOB)
    mine = [e for e in during if e.kv.key == spec_key or e.kv.key == live_pool.keys.job_status(JOB)
            or (e.kv.key.startswith(live_pool.keys.allocations_prefix()) and e.kv.key.endswith(f"/{JOB}"))]
    assert [e for e in during if e.kv.key == spec_key and e.type == "delete"] == [], "the job's spec key disappeared"
    assert {e.kv.lease for e in mine if e.type == "put"} == {lease_id}, "a key of the job was written on another lease"
    statuses = [decode(e.kv.key, e.kv.value, JobStatus) for e in during
                if e.kv.key == live_pool.keys.job_status(JOB) and e.type == "put"]
    first_grant = next(i for i, s in enumerate(statuses) if s.state is JobState.GRANTED)
    after = statuses[first_grant:]
    seen = [(s.state.value, s.gpus, s.reason) for s in after]
    # Never PENDING after the first grant: each resize's release and re-grant is one transaction,
    # so the status goes from PREEMPTING (the resize directive) straight to GRANTED at the target.
    assert not any(s.state is JobState.PENDING for s in after), seen
    regrants = [i for i, s in enumerate(after) if s.state is JobState.GRANTED and "acknowledged" in s.reason]
    assert len(regrants) == 2, seen
    for n, (i, want) in enumerate(zip(regrants, (2, 1), strict=True), start=1):
        assert after[i].reason.startswith(f"resize to {want} GPU(s) acknowledged"), after[i].reason
        assert after[i].gpus == want and after[i].resizes == n and after[i].preemptions == 0, after[i]
        assert after[i - 1].state is JobState.PREEMPTING, seen
    assert not any("queued" in s.reason for s in after), seen

    # The final weights equal those of the same world sizes at the same steps, replayed by hand.
    replay_by_hand(SCRIPT, tmp_path, run.plan(), tmp_path / "hand.pt")
    pool_w, hand_w = torch.load(out), torch.load(tmp_path / "hand.pt")
    assert pool_w["step"] == hand_w["step"] == end["end"]
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], hand_w["state_dict"][k], rtol=0, atol=1e-6), k

    # The default rule (keep the global batch and the rate): an uninterrupted 1-rank run of the same
    # steps reaches the same weights up to floating-point summation order.
    replay_by_hand(SCRIPT, tmp_path, [(1, 0, end["end"])], tmp_path / "one.pt")
    one_w = torch.load(tmp_path / "one.pt")
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], one_w["state_dict"][k], rtol=0, atol=1e-5), k

    print(f"elastic: worlds 1,2,1 from steps 0,{segs[1]['start']},{segs[2]['start']} to {end['end']} on lease "
          f"{run.lease_hex}; |pool - by hand| = {max_gap(pool_w['state_dict'], hand_w['state_dict']):.3g}, "
          f"|pool - 1 rank throughout| = {max_gap(pool_w['state_dict'], one_w['state_dict']):.3g}")
