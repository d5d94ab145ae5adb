"""ResumableDataLoader (torchdata's StatefulDataLoader plus the sampler epoch): exact mid-epoch resume."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from gpupool_torch.data import ResumableDataLoader


def batches(it: Any) -> list[list[float]]:
    return [b[0].tolist() for b in it]


def take(dl: ResumableDataLoader, n: int) -> tuple[list[list[float]], dict[str, Any]]:
    it = iter(dl)
    got = [next(it)[0].tolist() for _ in range(n)]
    return got, dl.state_dict()


def test_resume_continues_after_what_was_consumed_then_runs_whole_epochs() -> None:
    ds = TensorDataset(torch.arange(10.0))
    _, state = take(ResumableDataLoader(ds, batch_size=2), 3)
    fresh = ResumableDataLoader(ds, batch_size=2)
    fresh.load_state_dict(state)
    assert batches(fresh) == [[6.0, 7.0], [8.0, 9.0]]
    assert len(batches(fresh)) == 5  # only the first iteration after a resume continues mid-epoch


def test_a_seeded_shuffle_resumes_in_the_same_order() -> None:
    ds = TensorDataset(torch.arange(32.0))
    whole = batches(ResumableDataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)))
    first, state = take(ResumableDataLoader(ds, batch_size=4, shuffle=True,
                                            generator=torch.Generator().manual_seed(5)), 3)
    fresh = ResumableDataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    fresh.load_state_dict(state)
    assert first + batches(fresh) == whole


def test_shuffling_sampler_resumes_in_the_saved_epochs_order() -> None:
    ds = TensorDataset(torch.arange(16.0))

    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0,
                                                                                shuffle=True, seed=3))

    ref = loader()
    ref.sampler.set_epoch(1)
    expected = batches(ref)
    dl = loader()
    dl.sampler.set_epoch(1)
    dl.mark_consumed(1, epoch=1)
    _, state = take(dl, 1)
    resumed = loader()  # a new process: its sampler starts at epoch 0
    resumed.load_state_dict(state)
    assert batches(resumed) == expected[1:]


def test_forked_workers() -> None:
    ds = TensorDataset(torch.arange(8.0))
    _, state = take(ResumableDataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork"), 2)
    dl = ResumableDataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
    dl.load_state_dict(state)
    assert batches(dl) == [[4.0, 5.0], [6.0, 7.0]]
