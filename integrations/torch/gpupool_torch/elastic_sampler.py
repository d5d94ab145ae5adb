"""A distributed sampler whose position survives a change of world size (elastic jobs).

An elastic job (``gpupool run --min-gpus/--max-gpus``) is checkpointed at one world size and
resumed at another. A ``DistributedSampler`` cannot follow: each rank takes every ``W``-th index
of the epoch's permutation, so which samples form a step depends on ``W``, and its resume point
(per-rank samples yielded) means nothing at another ``W``. A ``RandomSampler`` (one rank) has yet
another order and state.

:class:`ElasticDistributedSampler` fixes the data order independently of the world size, under
the default batch rule of :mod:`gpupool_sdk.runtime.elastic` (``keep_global``):

* the epoch's **global order** is a permutation of the dataset seeded by ``seed + epoch`` (the
  identity without ``shuffle``), cut into global batches of ``global_batch_size`` samples;
* at world size ``W``, rank ``r`` takes the ``r``-th contiguous share of every global batch
  (:func:`~gpupool_sdk.runtime.elastic.rank_slice`), ``global_batch_size / W`` samples, so that
  the ranks' batches of step ``k`` together are global batch ``k`` whatever ``W`` is, and DDP's
  mean of the ranks' gradients is the gradient of that global batch;
* its state (``state_dict``) is world-size independent: the epoch and the number of samples
  of the epoch's global order consumed (whole global batches). Loaded at any world size, every
  rank continues with the next global batch.

So a run resized at steps ``k1, k2, ...`` sees exactly the batches of an uninterrupted run with
the same global batch. ``drop_last=True`` drops an incomplete last global batch; ``False`` (the
default) completes it with the epoch's first samples (as ``DistributedSampler`` pads), so that
every step is a whole global batch at every world size.

It derives from ``DistributedSampler`` so that Lightning, which puts a ``DistributedSampler`` in a
loader with several ranks unless it has one (``use_distributed_sampler=True``, the default),
keeps it, and calls its :meth:`set_epoch` at each epoch. Use it through
``ResumableDataLoader(dataset, global_batch_size=..., shuffle=True, seed=...)``, which sizes the
per-rank batch and keeps the sampler's state in the loader's (torchdata) state.

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> ds = TensorDataset(torch.arange(8.0))
    >>> [list(ElasticDistributedSampler(ds, 4, num_replicas=2, rank=r)) for r in (0, 1)]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.runtime.elastic import rank_slice

#: The version of :meth:`ElasticDistributedSampler.state_dict`'s layout.
STATE_VERSION = 1


def _dist_world() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def resolve_world_size(num_replicas: int | None = None) -> int:
    """The world size a loader built now runs at: ``num_replicas``, the process group's, ``$WORLD_SIZE``, else 1."""
    if num_replicas is not None:
        return int(num_replicas)
    got = _dist_world()
    if got is not None:
        return got[0]
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(raw))
    except ValueError:
        raise ConfigError("WORLD_SIZE", f"must be a whole number, got {raw!r}") from None


def _resolve_rank(rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    got = _dist_world()
    if got is not None:
        return got[1]
    for var in ("RANK", "LOCAL_RANK"):
        raw = os.environ.get(var)
        if raw is not None and raw.strip().isdigit():
            return int(raw)
    return 0


class ElasticDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """This rank's share of every global batch of a world-size-independent order (see the module).

    Args:
        dataset: a sized (map-style) dataset.
        global_batch_size: samples per optimizer step over all ranks; a multiple of every world
            size the job may run at (its ``--max-gpus``).
        shuffle: a new permutation each epoch, seeded by ``seed + epoch``.
        seed: the shuffle seed (the same on every rank and every restart).
        drop_last: drop an incomplete last global batch (else complete it, see the module).
        num_replicas: the world size (default: the process group's, else ``$WORLD_SIZE``, else 1).
        rank: this rank (default: the process group's, read when iteration starts).

    Raises:
        ConfigError: ``global_batch_size`` is not a whole number or does not split evenly over
            the world size; the dataset is empty or smaller than one global batch with ``drop_last``.
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ConfigError("global_batch_size", f"must be a whole number >= 1, got {global_batch_size!r}")
        world = resolve_world_size(num_replicas)
        me = _resolve_rank(rank)
        rank_slice(global_batch_size, world, min(me, world - 1))  # validates the split (names global_batch)
        super().__init__(dataset, num_replicas=world, rank=min(me, world - 1), shuffle=shuffle, seed=seed,  # type: ignore[arg-type]
                         drop_last=drop_last)
        self.global_batch_size = global_batch_size
        self._fixed_world = num_replicas is not None
        self._fixed_rank = rank is not None
        n = len(dataset)
        self.dataset_len = n
        steps = n // global_batch_size if drop_last else math.ceil(n / global_batch_size)
        if steps < 1:
            raise ConfigError(
                "global_batch_size",
                f"{global_batch_size} is larger than the dataset ({n} samples) with drop_last=True: no step "
                "would run; use a smaller global batch or drop_last=False",
            )
        #: Optimizer steps (global batches) per epoch, the same at every world size.
        self.steps_per_epoch = steps
        self.num_samples = steps * self.per_rank_batch
        self.total_size = steps * global_batch_size
        # (epoch, consumed) to start the next iteration at, set by load_state_dict.
        self._pending: tuple[int, int] | None = None
        # The running iteration: its epoch, where it started, samples this rank yielded.
        self._run_epoch = 0
        self._run_start = 0
        self._run_yielded = 0

    @property
    def per_rank_batch(self) -> int:
        """Samples per step on each rank: ``global_batch_size / num_replicas``."""
        return self.global_batch_size // self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's samples in global order, ``steps_per_epoch * global_batch_size`` indices."""
        n = self.dataset_len
        if self.shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            perm = torch.arange(n)
        if self.total_size > n:
            perm = perm.repeat(math.ceil(self.total_size / n))
        return perm[: self.total_size].tolist()  # type: ignore[no-any-return]

    def _check_world(self) -> None:
        got = _dist_world()
        if got is None:
            return
        world, rank = got
        if not self._fixed_world and world != self.num_replicas:
            raise ConfigError(
                "num_replicas",
                f"this loader was built for {self.num_replicas} rank(s) but runs in a process group of {world}: "
                "build it where the world size is known (in train_dataloader() or a LightningDataModule, or "
                "under torchrun), or pass num_replicas",
            )
        if not self._fixed_rank:
            self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        # A generator: nothing below runs until the first index is asked for, so the iterators
        # torchdata creates and drops while it restores a state do not consume the resume point.
        self._check_world()
        pending, self._pending = self._pending, None
        epoch, start = pending if pending is not None else (self.epoch, 0)
        self.epoch = epoch
        self._run_epoch, self._run_start, self._run_yielded = epoch, start, 0
        order = self.global_order(epoch)
        lo, hi = rank_slice(self.global_batch_size, self.num_replicas, self.rank)
        g = self.global_batch_size
        for base in range(start, self.total_size, g):
            for idx in order[base + lo : base + hi]:
                self._run_yielded += 1
                yield idx

    @property
    def pending(self) -> tuple[int, int] | None:
        """``(epoch, consumed)`` loaded and not yet started, or None."""
        return self._pending

    def consumed(self) -> int:
        """Samples of the current epoch's global order consumed (whole global batches)."""
        if self._pending is not None:
            return self._pending[1]
        return self._run_start + (self._run_yielded // self.per_rank_batch) * self.global_batch_size

    def state_dict(self) -> dict[str, Any]:
        """The position, independent of the world size: epoch and samples consumed in its global order."""
        epoch = self._pending[0] if self._pending is not None else self._run_epoch
        return {
            "version": STATE_VERSION,
            "epoch": int(epoch),
            "consumed": int(self.consumed()),
            "global_batch_size": self.global_batch_size,
            "dataset_len": self.dataset_len,
            "shuffle": bool(self.shuffle),
            "seed": int(self.seed),
            "drop_last": bool(self.drop_last),
            "world_size": self.num_replicas,  # informational: the state does not depend on it
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (taken at any world size) at the next iteration.

        A state taken at the end of its epoch starts the next epoch.

        Raises:
            ConfigError: the state was taken with another global batch, dataset length, shuffle,
                seed or ``drop_last`` (the order would not be the same), or is not this sampler's.
        """
        epoch, consumed = self.check_state(state)
        if consumed >= self.total_size:
            epoch, consumed = epoch + 1, 0
        self._pending = (epoch, consumed)
        self.epoch = epoch

    def check_state(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, consumed)`` of ``state`` if this sampler can continue from it (see :meth:`load_state_dict`).

        Raises:
            ConfigError: as :meth:`load_state_dict`.
        """
        if not isinstance(state, dict) or "consumed" not in state or "epoch" not in state:
            raise ConfigError("state", "not an ElasticDistributedSampler state (no 'epoch'/'consumed')")
        for key, mine in (("global_batch_size", self.global_batch_size), ("dataset_len", self.dataset_len),
                          ("shuffle", bool(self.shuffle)), ("seed", int(self.seed)),
                          ("drop_last", bool(self.drop_last))):
            if key in state and state[key] != mine:
                raise ConfigError(
                    key,
                    f"the checkpoint's loader had {key}={state[key]!r}, this one has {mine!r}: the data order "
                    f"would not continue; build the loader with {key}={state[key]!r}",
                )
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed < 0 or consumed % self.global_batch_size:
            raise ConfigError("state", f"consumed={consumed} is not a whole number of global batches")
        return epoch, consumed
