"""ElasticDistributedSampler / ResumableDataLoader(global_batch_size=): a position that survives a resize.

The data order of an elastic loader must not depend on the world size: at every world size the
ranks' batches of step k together are global batch k of the same order, and a state taken at one
world size continues at another with the next global batch, so that a run resized at any steps
sees the batches of an uninterrupted run.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

from gpupool_sdk.errors import ConfigError
from gpupool_torch.data import ResumableDataLoader
from gpupool_torch.elastic_sampler import ElasticDistributedSampler

N, G = 30, 4  # 30 samples: 8 global batches of 4 per epoch (the last one completed from the start)


def dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(float(n)))


def loader(world: int, rank: int, n: int = N, **kw: Any) -> ResumableDataLoader:
    opts: dict[str, Any] = {"global_batch_size": G, "shuffle": True, "seed": 11, **kw}
    return ResumableDataLoader(dataset(n), num_replicas=world, rank=rank, **opts)


def global_steps(world: int, state: dict[str, Any] | None, steps: int, **kw: Any
                 ) -> tuple[list[list[int]], dict[str, Any]]:
    """``steps`` global batches at ``world`` ranks from ``state`` (each rank's share joined in rank order).

    Crosses epoch ends like a training loop does (a new iteration per epoch, with ``set_epoch``).
    Returns the global batches and rank 0's state after them (what a checkpoint stores).
    """
    loaders = [loader(world, r, **kw) for r in range(world)]
    for dl in loaders:
        if state is not None:
            dl.load_state_dict(state)
    its = [iter(dl) for dl in loaders]
    epoch = loaders[0].sampler.epoch
    out: list[list[int]] = []
    while len(out) < steps:
        try:
            parts = [next(it)[0].long().tolist() for it in its]
        except StopIteration:
            epoch += 1
            for dl in loaders:
                dl.sampler.set_epoch(epoch)
            its = [iter(dl) for dl in loaders]
            continue
        out.append([i for part in parts for i in part])
    return out, loaders[0].state_dict()


def test_the_ranks_take_contiguous_shares_of_the_same_global_batches_at_every_world_size() -> None:
    one, _ = global_steps(1, None, 8)
    assert sorted(i for b in one[:7] for i in b) == sorted(set(i for b in one[:7] for i in b))  # no repeats
    for world in (2, 4):
        assert global_steps(world, None, 8)[0] == one
    s = ElasticDistributedSampler(dataset(), G, shuffle=True, seed=11, num_replicas=2, rank=1)
    order = s.global_order(0)
    assert list(s) == [i for b in range(0, len(order), G) for i in order[b + 2 : b + 4]]
    assert len(s) == 8 * 2 and s.per_rank_batch == 2


def test_a_state_carried_across_world_sizes_1_2_1_replays_the_uninterrupted_order() -> None:
    whole, _ = global_steps(1, None, 20)  # two and a half epochs
    a, state = global_steps(1, None, 5)
    assert state["gpupool_elastic_position"] == {**state["gpupool_elastic_position"], "epoch": 0, "consumed": 20}
    b, state = global_steps(2, state, 6)  # crosses the end of epoch 0
    c, state = global_steps(1, state, 5)
    d, _ = global_steps(4, state, 4)
    assert a + b + c + d == whole


def test_a_state_taken_at_the_end_of_an_epoch_starts_the_next_one() -> None:
    whole, _ = global_steps(1, None, 12)
    dl = loader(1, 0)
    first = [b[0].long().tolist() for b in dl]  # the whole of epoch 0
    assert len(first) == 8
    state = dl.state_dict()
    rest, _ = global_steps(2, state, 4)
    assert first + rest == whole


def test_workers_saved_with_and_loaded_without_keep_the_position() -> None:
    whole, _ = global_steps(1, None, 8)
    a, state = global_steps(2, None, 3, num_workers=2, multiprocessing_context="fork")
    b, state = global_steps(1, state, 2)
    c, _ = global_steps(2, state, 3, num_workers=2, multiprocessing_context="fork")
    assert a + b + c == whole


def test_drop_last_drops_the_incomplete_global_batch_and_padding_completes_it() -> None:
    dropped = ElasticDistributedSampler(dataset(), G, drop_last=True, num_replicas=2, rank=0)
    assert dropped.steps_per_epoch == 7 and len(dropped) == 14
    padded = ElasticDistributedSampler(dataset(), G, num_replicas=1, rank=0)
    assert padded.global_order(0)[-4:] == [28, 29, 0, 1]


def test_configuration_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="global_batch"):
        loader(3, 0)  # 4 samples do not split over 3 ranks
    with pytest.raises(ConfigError, match="batch_size"):
        ResumableDataLoader(dataset(), global_batch_size=G, batch_size=2)
    with pytest.raises(ConfigError, match="generator"):
        ResumableDataLoader(dataset(), global_batch_size=G, generator=torch.Generator())
    with pytest.raises(ConfigError, match="global_batch_size"):
        ElasticDistributedSampler(dataset(3), G, drop_last=True, num_replicas=1, rank=0)
    _, state = global_steps(1, None, 2)
    with pytest.raises(ConfigError, match="seed"):
        loader(1, 0, seed=12).load_state_dict(state)
    with pytest.raises(ConfigError, match="dataset_len"):
        loader(1, 0, n=31).load_state_dict(state)


def test_a_per_rank_loader_refuses_a_state_from_another_world_size_with_a_clear_error() -> None:
    # The reproduction of the old failure: 1 rank (RandomSampler) checkpointed, then 2 ranks
    # (the DistributedSampler Lightning inserts): torchdata raised a bare AssertionError.
    ds = dataset(32)
    one = ResumableDataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    it = iter(one)
    for _ in range(3):
        next(it)
    state = one.state_dict()
    two = ResumableDataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True))
    with pytest.raises(ConfigError, match="world size 1 .* loaded at 2.*global_batch_size"):
        two.load_state_dict(state)
    with pytest.raises(ConfigError, match="global_batch_size"):
        loader(1, 0).load_state_dict(state)  # not an elastic state


def test_a_loader_built_for_another_world_size_than_the_process_group_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    dl = ResumableDataLoader(dataset(), global_batch_size=G)  # $WORLD_SIZE: 2 ranks of 2 samples
    assert dl.batch_size == 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="built for 2 rank.*process group of 1.*train_dataloader"):
            next(iter(dl))
        assert ResumableDataLoader(dataset(), global_batch_size=G).batch_size == G  # the group's size wins
    finally:
        dist.destroy_process_group()
