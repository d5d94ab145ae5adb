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
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from gpupool_torch.data import ResumableDataLoader
from integrations.lightning.tests.conftest import (
    ROOT,
    LivePool,
    grow_and_shrink,
    max_gap,
    replay_by_hand,
    run_segment,
)

SCRIPT = str(ROOT / "examples" / "elastic_lightning_train.py")
JOB = "elastic-pl"


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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_lightning_run_resized_by_hand_1_2_1_mid_epoch_matches_one_rank_throughout(tmp_path: Path) -> None:
    # 72 samples, global batch 8: 9 steps an epoch; resized at steps 5 (mid-epoch 0) and 14 (mid-epoch 1),
    # with 2 DataLoader workers in the 2-rank segment.
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    assert run_segment(SCRIPT, tmp_path, 1, 5, None, save=a)["start"] == 0
    assert run_segment(SCRIPT, tmp_path, 2, 14, a, save=b, extra=("--workers", "2"))["start"] == 5
    assert run_segment(SCRIPT, tmp_path, 1, 22, b, out=tmp_path / "resized.pt")["start"] == 14
    # The reference (one rank throughout) runs in this process; the resized run above is all processes.
    replay_by_hand(SCRIPT, tmp_path, [(1, 0, 22)], tmp_path / "one.pt")
    resized, one = torch.load(tmp_path / "resized.pt"), torch.load(tmp_path / "one.pt")
    assert resized["step"] == one["step"] == 22
    print(f"elastic lightning by hand: |1,2,1 - 1 rank| = {max_gap(resized['state_dict'], one['state_dict']):.3g}")
    for k in one["state_dict"]:
        assert torch.allclose(resized["state_dict"][k], one["state_dict"][k], rtol=0, atol=1e-5), k


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_elastic_lightning_job_grows_and_shrinks_live_and_matches_a_replay_by_hand(
    live_pool: LivePool, tmp_path: Path
) -> None:
    out = tmp_path / "pool.pt"
    torchrun = (f'exec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node "$GPUPOOL_DEVICES" '
                f"--max-restarts 0 {SCRIPT} --name {JOB} --steps 1000000 --step-sleep 0.1 "
                f"--finish-file {live_pool.tmp / 'finish'} --out {out}")
    run = grow_and_shrink(live_pool, JOB, torchrun, steps_each=4)
    end = run.end["end"]

    # Resized mid-epoch (9 steps an epoch) or not, the batches were those of the same global
    # order: the weights equal the same world sizes at the same steps replayed by hand ...
    replay_by_hand(SCRIPT, tmp_path, run.plan(), tmp_path / "hand.pt")
    pool_w, hand_w = torch.load(out), torch.load(tmp_path / "hand.pt")
    assert pool_w["step"] == hand_w["step"] == end
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], hand_w["state_dict"][k], rtol=0, atol=1e-6), k
    # ... and a 1-rank run of the same steps, up to floating-point summation order.
    replay_by_hand(SCRIPT, tmp_path, [(1, 0, end)], tmp_path / "one.pt")
    one_w = torch.load(tmp_path / "one.pt")
    for k in pool_w["state_dict"]:
        assert torch.allclose(pool_w["state_dict"][k], one_w["state_dict"][k], rtol=0, atol=1e-5), k
    segs = run.starts
    print(f"elastic lightning: worlds 1,2,1 from steps 0,{segs[1]['start']},{segs[2]['start']} to {end} on "
          f"lease {run.lease_hex}; |pool - by hand| = {max_gap(pool_w['state_dict'], hand_w['state_dict']):.3g}, "
          f"|pool - 1 rank throughout| = {max_gap(pool_w['state_dict'], one_w['state_dict']):.3g}")
