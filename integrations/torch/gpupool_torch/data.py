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

_EPOCH_KEY = "gpupool_epoch"


class ResumableDataLoader(StatefulDataLoader):  # type: ignore[misc]
    """``torch.utils.data.DataLoader`` with exact mid-epoch resume (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["gpupool_epoch"] = 0
        self.__dict__["_gpupool_resume_epoch"] = None

    def mark_consumed(self, batches: int, epoch: int = 0) -> None:
        """Record the epoch training is in (the batch count is torchdata's to keep)."""
        # Called every step: write the instance dict directly, past DataLoader.__setattr__.
        self.__dict__["gpupool_epoch"] = epoch

    def state_dict(self) -> dict[str, Any]:
        """torchdata's loader state plus the epoch."""
        state = dict(super().state_dict())
        state[_EPOCH_KEY] = int(self.gpupool_epoch)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken, in its epoch."""
        state = dict(state)
        epoch = state.pop(_EPOCH_KEY, None)
        self.__dict__["_gpupool_resume_epoch"] = int(epoch) if epoch is not None else None
        super().load_state_dict(state)

    def __iter__(self) -> Any:
        epoch = self.__dict__.get("_gpupool_resume_epoch")
        if epoch is not None:
            self.__dict__["_gpupool_resume_epoch"] = None
            for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
                set_epoch = getattr(sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
        return super().__iter__()
