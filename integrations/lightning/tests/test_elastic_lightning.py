"""Issue 15: an elastic *Lightning* job resumes mid-epoch at a new world size with the data order of an uninterrupted run.

* Lightning (both packages) keeps the elastic loader's sampler with several ranks
  (``use_distributed_sampler=True``, the default), where it replaces a per-rank loader's.
* By hand, no pool: ``examples/elastic_lightning_train.py`` checkpointed mid-epoch at 1 rank,
  resumed at 2 ranks (torchrun, gloo), then at 1 again, ends within float tolerance of an
  uninterrupted 1-rank run (the default ``keep_global`` rule).
* Live (the must-show of ``test_elastic_resize.py`` with a Lightning Trainer): etcd, a
  coordinator, a simulated agent and ``gpupool run --min-gpus 1 --max-gpus 2`` running the script
  under torchrun; the job grows to 2 ranks when a filler job leaves and shrinks back to 1 when a
  priority-10 job arrives, keeps one lease throughout, and its final weights equal those of the
  same world sizes at the same steps replayed by hand (and of a 1-rank run, within float tolerance).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from gpupool_sdk.client import PoolClient
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.store.records import TelemetryRecord
from gpupool_torch.data import ResumableDataLoader
from integrations.lightning.tests.conftest import ROOT, LivePool, wait_for

SCRIPT = str(ROOT / "examples" / "elastic_lightning_train.py")
LONG = 600.0
JOB = "elastic-pl"


def segments(log: str) -> list[dict[str, Any]]:
    """The script's ``ELASTIC {...}`` lines (rank 0): segment starts and ends, in order."""
    return [json.loads(m) for m in re.findall(r"^ELASTIC (\{.*\})$", log, flags=re.M)]


def starts(log: str) -> list[dict[str, Any]]:
    return [s for s in segments(log) if s["segment"]]


def ends(log: str) -> list[dict[str, Any]]:
    return [s for s in segments(log) if not s["segment"]]


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_keeps_the_elastic_sampler_with_several_ranks(package: str) -> None:
    pl = importlib.import_module(package)
    stage = importlib.import_module(f"{package}.trainer.states").RunningStage.TRAINING
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    ds = TensorDataset(torch.arange(16.0))
    elastic = ResumableDataLoader(ds, global_batch_size=4, shuffle=True, num_replicas=2, rank=0)
    assert trainer._data_connector._prepare_dataloader(elastic, shuffle=True, mode=stage) is elastic
    # A per-rank loader is rebuilt around Lightning's own distributed sampler (what broke a resize).
    plain = ResumableDataLoader(ds, batch_size=2, shuffle=True)
    rebuilt = trainer._data_connector._prepare_dataloader(plain, shuffle=True, mode=stage)
    assert rebuilt is not plain and isinstance(rebuilt.batch_sampler.sampler, DistributedSampler)


def run_segment(tmp: Path, world: int, stop: int, resume: Path | None, save: Path | None = None,
                out: Path | None = None, workers: int = 0) -> dict[str, Any]:
    """One ``--no-pool`` segment at ``world`` ranks up to step ``stop``; returns its start line."""
    args = [SCRIPT, "--no-pool", "--steps", "1000000", "--stop-at", str(stop), "--workers", str(workers)]
    if resume is not None:
        args += ["--resume", str(resume)]
    if save is not None:
        args += ["--save", str(save)]
    if out is not None:
        args += ["--out", str(out)]
    cmd = [sys.executable, *args] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]
    res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=LONG)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    end = ends(res.stdout)
    assert end and end[-1]["end"] == stop and end[-1]["world"] == world, res.stdout
    return starts(res.stdout)[0]


def replay_by_hand(tmp: Path, plan: list[tuple[int, int, int]], out: Path) -> None:
    """Each ``(world, start, stop)`` from the previous segment's checkpoint; the last writes ``out``."""
    prev: Path | None = None
    for i, (world, start, stop) in enumerate(plan):
        last = i == len(plan) - 1
        save = None if last else tmp / f"hand-{i}.ckpt"
        got = run_segment(tmp, world, stop, prev, save=save, out=out if last else None)
        assert got["start"] == start and got["world"] == world, got
        prev = save


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_lightning_run_resized_by_hand_1_2_1_mid_epoch_matches_one_rank_throughout(tmp_path: Path) -> None:
    # 72 samples, global batch 8: 9 steps an epoch; resized at steps 5 (mid-epoch 0) and 14 (mid-epoch 1),
    # with 2 DataLoader workers in the 2-rank segment.
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    assert run_segment(tmp_path, 1, 5, None, save=a)["start"] == 0
    assert run_segment(tmp_path, 2, 14, a, save=b, workers=2)["start"] == 5
    assert run_segment(tmp_path, 1, 22, b, out=tmp_path / "resized.pt")["start"] == 14
    replay_by_hand(tmp_path, [(1, 0, 22)], tmp_path / "one.pt")
    resized, one = torch.load(tmp_path / "resized.pt"), torch.load(tmp_path / "one.pt")
    assert resized["step"] == one["step"] == 22
    print(f"elastic lightning by hand: |1,2,1 - 1 rank| = {gap(resized['state_dict'], one['state_dict']):.3g}")
    for k in one["state_dict"]:
        assert torch.allclose(resized["state_dict"][k], one["state_dict"][k], rtol=0, atol=1e-5), k


def step_of(pool: LivePool) -> int:
    got = pool.store.get_record(pool.keys.telemetry(JOB), TelemetryRecord)
    return int(got[0].summary.get("step", 0)) if got else 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_elastic_lightning_job_grows_and_shrinks_live_and_matches_a_replay_by_hand(
    live_pool: LivePool, tmp_path: Path
) -> None:
    live_pool.start("node-a:2xA100-40GB")
    client = PoolClient(endpoints=live_pool.endpoint, prefix=live_pool.keys.prefix)
    finish = tmp_path / "finish"
    out = tmp_path / "pool.pt"
    try:
        filler = client.acquire(JobSpec(name="filler", qos="exclusive"), timeout=LONG)
        torchrun = (f'exec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node "$GPUPOOL_DEVICES" '
                    f"--max-restarts 0 {SCRIPT} --name {JOB} --steps 1000000 --step-sleep 0.1 "
                    f"--finish-file {finish} --out {out}")
        proc = live_pool.gpupool(JOB, "run", "--name", JOB, "--gpus", "2", "--min-gpus", "1", "--max-gpus", "2",
                                 "--qos", "exclusive", "--", "sh", "-c", torchrun)

        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 1 and step_of(live_pool) >= 4, LONG,
                 what="the job to train on 1 slice")
        assert starts(live_pool.log(JOB))[0]["world"] == 1

        filler.release()  # room: the coordinator grows the job to 2 slices
        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 2, LONG, what="the job to restart after the grow")
        grown = starts(live_pool.log(JOB))[1]
        assert grown["world"] == 2, live_pool.log(JOB)
        wait_for(lambda: step_of(live_pool) >= grown["start"] + 4, LONG, what="the job to train on 2 slices")
        assert len(live_pool.allocations(JOB)) == 2

        urgent = client.acquire(JobSpec(name="urgent", qos="exclusive", priority=10), timeout=LONG)
        wait_for(lambda: len(starts(live_pool.log(JOB))) >= 3, LONG, what="the job to restart after the shrink")
        shrunk = starts(live_pool.log(JOB))[2]
        assert shrunk["world"] == 1, live_pool.log(JOB)
        wait_for(lambda: step_of(live_pool) >= shrunk["start"] + 4, LONG, what="the job to train on 1 slice again")
        assert len(live_pool.allocations(JOB)) == 1

        finish.write_text("done")
        assert live_pool.wait_exit(proc, JOB, LONG) == 0, live_pool.log(JOB)
        urgent.release()
    finally:
        client.close()

    log = live_pool.log(JOB)
    segs = starts(log)
    end = ends(log)[-1]
    assert [s["world"] for s in segs] == [1, 2, 1], log
    assert 0 == segs[0]["start"] < segs[1]["start"] < segs[2]["start"] < end["end"], segs
    granted = re.findall(r"granted after [0-9.]+s: devices \S+, lease ([0-9a-f]+)", log)
    assert len(granted) == 3 and len(set(granted)) == 1, log  # one lease: never lost, never queued again
    assert {s["lease"] for s in segs} == set(granted), segs
    assert "queueing again" not in log, log

    # Resized mid-epoch (9 steps an epoch) or not, the batches were those of the same global
    # order: the weights equal the same world sizes at the same steps replayed by hand ...
    plan = [(1, 0, segs[1]["start"]), (2, segs[1]["start"], segs[2]["start"]), (1, segs[2]["start"], end["end"])]
    replay_by_hand(tmp_path, plan, tmp_path / "hand.pt")
    pool_w, hand_w = torch.load(out), torch.load(tmp_path / "hand.pt")
    assert pool_w["step"] == hand_w["step"] == end["end"]
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], hand_w["state_dict"][k], rtol=0, atol=1e-6), k
    # ... and a 1-rank run of the same steps, up to floating-point summation order.
    replay_by_hand(tmp_path, [(1, 0, end["end"])], tmp_path / "one.pt")
    one_w = torch.load(tmp_path / "one.pt")
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], one_w["state_dict"][k], rtol=0, atol=1e-5), k
    print(f"elastic lightning: worlds 1,2,1 from steps 0,{segs[1]['start']},{segs[2]['start']} to {end['end']} on "
          f"lease {granted[0]}; |pool - by hand| = {gap(pool_w['state_dict'], hand_w['state_dict']):.3g}, "
          f"|pool - 1 rank throughout| = {gap(pool_w['state_dict'], one_w['state_dict']):.3g}")
