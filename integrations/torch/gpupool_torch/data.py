"""A DataLoader that resumes mid-epoch exactly: torchdata's ``StatefulDataLoader`` plus the sampler epoch.

Lightning resumes a mid-epoch checkpoint with the right batch index, but an ordinary
``DataLoader`` starts the epoch over (Lightning warns "your dataloader is not resumable").
torchdata's ``StatefulDataLoader`` (a maintained drop-in ``DataLoader``) keeps the sampler's
position and the shuffle generator's state in ``state_dict()``, which Lightning stores in its
checkpoints and restores: a shuffled run resumed mid-epoch replays exactly the batches of an
uninterrupted one, workers included, without fetching the skipped ones.

:class:`ResumableDataLoader` adds the one thing it does not cover: Lightning creates the iterator
(and prefetches) before it sets the sampler's epoch on a resume, so a shuffling
``DistributedSampler`` would replay epoch 0's order. The callback tells the loader which epoch
it is in (:meth:`mark_consumed`), the loader stores it beside torchdata's state and sets the
sampler's epoch before the resumed iteration.

**Elastic jobs** (a resume at another world size): pass ``global_batch_size=`` instead of
``batch_size``. The loader then uses an :class:`~gpupool_torch.elastic_sampler.ElasticDistributedSampler`
at every world size (one rank included): each rank takes ``global_batch_size / W`` samples of
every global batch of a world-size-independent order, and the state is the position in that
order, so a checkpoint taken at one world size resumes at another with the batches an
uninterrupted run sees. A loader without it refuses, with a :class:`ConfigError`, a state taken
at another world size (its sampler's position would not mean the same samples).

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> dl = ResumableDataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    >>> it = iter(dl); _ = next(it)
    >>> state = dl.state_dict()
    >>> again = ResumableDataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    >>> again.load_state_dict(state)
    >>> [b[0].tolist() for b in again]
    [[2.0, 3.0], [4.0, 5.0]]
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from gpupool_sdk.errors import ConfigError
from gpupool_torch.elastic_sampler import ElasticDistributedSampler

_EPOCH_KEY = "gpupool_epoch"
_WORLD_KEY = "gpupool_world_size"
_ELASTIC_KEY = "gpupool_elastic"
_POSITION_KEY = "gpupool_elastic_position"


class ResumableDataLoader(StatefulDataLoader):  # type: ignore[misc]
    """``torch.utils.data.DataLoader`` with exact mid-epoch resume (same arguments).

    Args:
        *args: ``DataLoader`` arguments.
        global_batch_size: elastic jobs (see the module): samples per optimizer step over all
            ranks; replaces ``batch_size``, ``sampler`` and ``generator``. ``shuffle``,
            ``drop_last`` and ``seed`` (default 0) then apply to the global order.
        seed: the shuffle seed with ``global_batch_size``.
        num_replicas: with ``global_batch_size``: the world size (default: the process group's,
            else ``$WORLD_SIZE``, else 1).
        rank: with ``global_batch_size``: this rank (default: the process group's).
        **kwargs: ``DataLoader`` arguments.

    Raises:
        ConfigError: ``global_batch_size`` with ``batch_size``, ``sampler``, ``batch_sampler`` or
            ``generator``, or a global batch that does not split evenly over the ranks.
    """

    def __init__(self, *args: Any, global_batch_size: int | None = None, seed: int = 0,
                 num_replicas: int | None = None, rank: int | None = None, **kwargs: Any) -> None:
        if global_batch_size is not None:
            args, kwargs = _elastic_arguments(args, kwargs, global_batch_size, seed, num_replicas, rank)
        elif num_replicas is not None or rank is not None:
            raise ConfigError("num_replicas", "applies only with global_batch_size= (an elastic loader)")
        super().__init__(*args, **kwargs)
        self.__dict__["gpupool_epoch"] = 0
        self.__dict__["_gpupool_resume_epoch"] = None
        self.__dict__["_gpupool_base"] = None

    def mark_consumed(self, batches: int, epoch: int = 0) -> None:
        """Record the epoch training is in (the batch count is torchdata's to keep)."""
        # Called every step: write the instance dict directly, past DataLoader.__setattr__.
        self.__dict__["gpupool_epoch"] = epoch

    def state_dict(self) -> dict[str, Any]:
        """torchdata's loader state plus the epoch."""
        state = dict(super().state_dict())
        state[_EPOCH_KEY] = int(self.gpupool_epoch)
        state[_WORLD_KEY] = self._world_size()
        sampler = self.sampler
        state[_ELASTIC_KEY] = isinstance(sampler, ElasticDistributedSampler)
        if isinstance(sampler, ElasticDistributedSampler):
            # The position in batches handed to training (workers prefetch ahead of it): it does
            # not depend on the world size nor on the number of workers.
            position = sampler.state_dict()
            it, base = self._iterator, self.__dict__.get("_gpupool_base")
            if sampler.pending is None and it is not None and base is not None:
                position["consumed"] = (base + int(it._num_yielded)) * sampler.global_batch_size
            state[_POSITION_KEY] = position
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken, in its epoch."""
        state = dict(state)
        epoch = state.pop(_EPOCH_KEY, None)
        saved_world = state.pop(_WORLD_KEY, None)
        saved_elastic = bool(state.pop(_ELASTIC_KEY, False))
        elastic = isinstance(self.sampler, ElasticDistributedSampler)
        if state and saved_elastic != elastic:
            raise ConfigError(
                "global_batch_size",
                f"the checkpoint's loader was {'' if saved_elastic else 'not '}built with global_batch_size= and "
                f"this one is{'' if elastic else ' not'}: build the loader the same way as the run that saved it",
            )
        if state and not elastic and saved_world is not None and saved_world != self._world_size():
            raise ConfigError(
                "global_batch_size",
                f"this loader's state was saved at world size {saved_world} and is loaded at {self._world_size()}: "
                "a per-rank sampler position does not carry over to another world size; build the loader with "
                "ResumableDataLoader(dataset, global_batch_size=..., shuffle=..., seed=...) (an elastic job)",
            )
        position = state.pop(_POSITION_KEY, None)
        if elastic and position is not None:
            self.sampler.check_state(position)  # now, not at the first batch: names what differs
        self.__dict__["_gpupool_resume_epoch"] = int(epoch) if epoch is not None else None
        if elastic and position is not None and _multiprocess_state(state) != (self.num_workers > 0):
            # Saved with workers and loaded without (or the reverse): torchdata's layouts differ;
            # the sampler's position is all an elastic loader needs.
            self.sampler.load_state_dict(position)
            super().load_state_dict({})
            # torchdata counts the batches of the next iteration from 0: they follow these.
            pending = self.sampler.pending
            self.__dict__["_gpupool_next_base"] = pending[1] // self.sampler.global_batch_size if pending else 0
            return
        self.__dict__["_gpupool_next_base"] = None
        super().load_state_dict(state)

    def _world_size(self) -> int:
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            world = getattr(sampler, "num_replicas", None)
            if isinstance(world, int):
                return world
        return 1

    def __iter__(self) -> Any:
        epoch = self.__dict__.get("_gpupool_resume_epoch")
        if epoch is not None:
            self.__dict__["_gpupool_resume_epoch"] = None
            for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
        it = super().__iter__()
        # Batches of this iteration's epoch consumed before the count torchdata keeps (which a
        # torchdata state restores, so it is 0 but after a state loaded without torchdata's layout).
        self.__dict__["_gpupool_base"] = self.__dict__.pop("_gpupool_next_base", None) or 0
        return it


def _multiprocess_state(state: dict[str, Any]) -> bool:
    return "_snapshot" in state


def _elastic_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], global_batch_size: int, seed: int,
                       num_replicas: int | None, rank: int | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``DataLoader`` arguments of an elastic loader: its sampler and this rank's batch size."""
    kwargs = dict(kwargs)
    if len(args) > 1:
        raise ConfigError("global_batch_size", "pass the other DataLoader arguments by keyword (batch_size is set for you)")
    dataset = args[0] if args else kwargs.pop("dataset", None)
    if dataset is None:
        raise ConfigError("dataset", "an elastic loader (global_batch_size=) needs a map-style dataset")
    for bad in ("batch_size", "sampler", "batch_sampler", "generator"):
        if kwargs.get(bad) is not None:
            raise ConfigError(bad, "cannot be combined with global_batch_size= (the elastic sampler sets the "
                                   "per-rank batch and the order; pass shuffle=, seed= and drop_last= instead)")
        kwargs.pop(bad, None)
    sampler = ElasticDistributedSampler(dataset, global_batch_size, shuffle=bool(kwargs.pop("shuffle", False)),
                                        seed=seed, drop_last=bool(kwargs.pop("drop_last", False)),
                                        num_replicas=num_replicas, rank=rank)
    kwargs["sampler"] = sampler
    kwargs["batch_size"] = sampler.per_rank_batch
    return (dataset,), kwargs
