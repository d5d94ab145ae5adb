"""ResumableDataLoader: mid-epoch resume skips what was consumed, in the right epoch's order."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from gpupool_torch.data import ResumableDataLoader


def batches(dl: ResumableDataLoader) -> list[list[float]]:
    return [b[0].tolist() for b in dl]


def test_resume_skips_consumed_batches() -> None:
    ds = TensorDataset(torch.arange(10.0))
    dl = ResumableDataLoader(ds, batch_size=2)
    dl.mark_consumed(3, epoch=0)
    fresh = ResumableDataLoader(ds, batch_size=2)
    fresh.load_state_dict(dl.state_dict())
    assert batches(fresh) == [[6.0, 7.0], [8.0, 9.0]]
    assert len(batches(fresh)) == 5  # only the first iteration after a resume skips


def test_state_at_epoch_end_skips_nothing() -> None:
    dl = ResumableDataLoader(TensorDataset(torch.arange(4.0)), batch_size=2)
    dl.load_state_dict({"consumed": 2, "epoch": 0})
    assert len(batches(dl)) == 2


def test_shuffling_sampler_resumes_in_the_saved_epochs_order() -> None:
    ds = TensorDataset(torch.arange(16.0))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(1)
    expected = batches(ResumableDataLoader(ds, batch_size=2, sampler=sampler))
    resumed = ResumableDataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3))
    resumed.load_state_dict({"consumed": 1, "epoch": 1})
    assert batches(resumed) == expected[1:]


def test_forked_workers() -> None:
    dl = ResumableDataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2,
                             multiprocessing_context="fork")
    dl.load_state_dict({"consumed": 2, "epoch": 0})
    assert batches(dl) == [[4.0, 5.0], [6.0, 7.0]]
