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

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec, JobState, JobStatus
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.records import TelemetryRecord
from gpupool_sdk.store.types import WatchEvent
from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SCRIPT = str(ROOT / "examples" / "elastic_ddp_train.py")
LONG = 600.0
JOB = "elastic"


def segments(log: str) -> list[dict[str, Any]]:
    """The script's ``ELASTIC {...}`` lines (rank 0): segment starts and ends, in order."""
    return [json.loads(m) for m in re.findall(r"^ELASTIC (\{.*\})$", log, flags=re.M)]


def starts(log: str) -> list[dict[str, Any]]:
    return [s for s in segments(log) if s["segment"]]


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


def step_of(pool: LivePool) -> int:
    got = pool.store.get_record(pool.keys.telemetry(JOB), TelemetryRecord)
    return int(got[0].summary.get("step", 0)) if got else 0


def replay_by_hand(tmp: Path, worlds: list[tuple[int, int, int]], out: Path) -> None:
    """Run the same loop without the pool: each ``(world, start, stop)`` from the previous checkpoint."""
    prev: Path | None = None
    for i, (world, start, stop) in enumerate(worlds):
        save = tmp / f"hand-{i}.ckpt"
        args = [SCRIPT, "--no-pool", "--steps", "1000000", "--stop-at", str(stop), "--save", str(save)]
        if prev is not None:
            args += ["--resume", str(prev)]
        if i == len(worlds) - 1:
            args += ["--out", str(out)]
        if world == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=LONG)
        assert res.returncode == 0, res.stdout + res.stderr
        ends = [s for s in segments(res.stdout) if not s["segment"]]
        assert ends and ends[-1]["end"] == stop and ends[-1]["world"] == world, res.stdout
        assert starts(res.stdout)[0]["start"] == start, res.stdout
        prev = save


def test_elastic_job_grows_and_shrinks_live_keeping_its_lease_and_matches_a_replay_by_hand(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:2xA100-40GB")
    etcd = EtcdLog(live_pool)
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    finish = tmp_path / "finish"
    out = tmp_path / "pool.pt"
    try:
        filler = client.acquire(JobSpec(name="filler", qos="exclusive"), timeout=LONG)
        torchrun = (f'exec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node "$GPUPOOL_DEVICES" '
                    f"--max-restarts 0 {SCRIPT} --steps 1000000 --step-sleep 0.05 --finish-file {finish} --out {out}")
        proc = live_pool.gpupool(JOB, "run", "--name", JOB, "--gpus", "2", "--min-gpus", "1", "--max-gpus", "2",
                                 "--qos", "exclusive", "--", "sh", "-c", torchrun)

        # 1 slice while the filler holds the other GPU.
        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 1 and step_of(live_pool) >= 5, LONG,
                 what="the job to train on 1 slice")
        assert starts(live_pool.log(JOB))[0]["world"] == 1
        assert len(live_pool.allocations(JOB)) == 1

        # Room appears: the coordinator grows the job to 2 slices; torchrun runs 2 ranks.
        filler.release()
        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 2, LONG, what="the job to restart after the grow")
        grown = starts(live_pool.log(JOB))[1]
        assert grown["world"] == 2, live_pool.log(JOB)
        wait_for(lambda: step_of(live_pool) >= grown["start"] + 5, LONG, what="the job to train on 2 slices")
        assert len(live_pool.allocations(JOB)) == 2

        # A higher-priority job arrives: the job shrinks back to 1 slice for it.
        urgent = client.acquire(JobSpec(name="urgent", qos="exclusive", priority=10), timeout=LONG)
        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 3, LONG, what="the job to restart after the shrink")
        shrunk = starts(live_pool.log(JOB))[2]
        assert shrunk["world"] == 1, live_pool.log(JOB)
        wait_for(lambda: step_of(live_pool) >= shrunk["start"] + 5, LONG, what="the job to train on 1 slice again")
        assert len(live_pool.allocations(JOB)) == 1 and len(live_pool.allocations("urgent")) == 1
        during = etcd.snapshot()

        finish.write_text("done")
        assert live_pool.wait_exit(proc, JOB, LONG) == 0, live_pool.log(JOB)
        urgent.release()
    finally:
        client.close()
        etcd.close()

    log = live_pool.log(JOB)
    segs = starts(log)
    end = [s for s in segments(log) if not s["segment"]][-1]
    assert [s["world"] for s in segs] == [1, 2, 1], log
    assert 0 == segs[0]["start"] < segs[1]["start"] < segs[2]["start"] < end["end"], segs

    # Never lost the grant: one etcd lease for every grant and every segment, never queued again.
    granted = re.findall(r"granted after [0-9.]+s: devices \S+, lease ([0-9a-f]+)", log)
    assert len(granted) == 3 and len(set(granted)) == 1, log
    assert {s["lease"] for s in segs} == set(granted), segs
    assert "queueing again" not in log and log.count(f"queueing {JOB}") == 1, log
    assert log.count("waiting for the re-grant on lease") == 2, log

    lease_id = int(granted[0], 16)
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
    plan = [(1, 0, segs[1]["start"]), (2, segs[1]["start"], segs[2]["start"]), (1, segs[2]["start"], end["end"])]
    replay_by_hand(tmp_path, plan, tmp_path / "hand.pt")
    pool_w, hand_w = torch.load(out), torch.load(tmp_path / "hand.pt")
    assert pool_w["step"] == hand_w["step"] == end["end"]
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], hand_w["state_dict"][k], rtol=0, atol=1e-6), k

    # The default rule (keep the global batch and the rate): an uninterrupted 1-rank run of the same
    # steps reaches the same weights up to floating-point summation order.
    replay_by_hand(tmp_path, [(1, 0, end["end"])], tmp_path / "one.pt")
    one_w = torch.load(tmp_path / "one.pt")
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], one_w["state_dict"][k], rtol=0, atol=1e-5), k

    def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    print(f"elastic: worlds 1,2,1 from steps 0,{segs[1]['start']},{segs[2]['start']} to {end['end']} on lease "
          f"{granted[0]}; |pool - by hand| = {gap(pool_w['state_dict'], hand_w['state_dict']):.3g}, "
          f"|pool - 1 rank throughout| = {gap(pool_w['state_dict'], one_w['state_dict']):.3g}")
