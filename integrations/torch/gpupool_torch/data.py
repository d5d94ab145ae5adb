"""A DataLoader that resumes mid-epoch, so a preempted job sees exactly the batches it would have.

Lightning resumes a mid-epoch checkpoint with the right batch index, but an ordinary
``DataLoader`` starts the epoch over from its first batch (Lightning warns "your dataloader is
not resumable"). :class:`ResumableDataLoader` implements ``state_dict``/``load_state_dict``;
:class:`~gpupool_lightning.GpuPoolCallback` tells it at every batch how many
batches of the epoch training has consumed (Lightning prefetches one batch ahead, so the
loader's own count would be off by one), and on resume the first ``consumed`` batches of the
epoch are skipped.

The skipped batches are fetched and discarded (correct for any deterministic dataset and
sampler, including ``num_workers > 0`` and a seeded shuffle that depends only on the epoch).

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> dl = ResumableDataLoader(TensorDataset(torch.arange(6.0)), batch_size=2)
    >>> dl.load_state_dict({"consumed": 2})
    >>> [b[0].tolist() for b in dl]
    [[4.0, 5.0]]
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """``torch.utils.data.DataLoader`` plus mid-epoch resume (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gpupool_consumed = 0
        self.gpupool_epoch = 0
        self._gpupool_skip = 0
        self._gpupool_resume_epoch: int | None = None

    def mark_consumed(self, batches: int, epoch: int = 0) -> None:
        """Record that training has consumed ``batches`` batches of epoch ``epoch``."""
        # Called every step: write the instance dict directly, past DataLoader.__setattr__ (a
        # Python-level check that guards only the loader's own settings, not these counters).
        d = self.__dict__
        d["gpupool_consumed"] = batches
        d["gpupool_epoch"] = epoch

    def state_dict(self) -> dict[str, Any]:
        """How many batches of which epoch training consumed."""
        return {"consumed": int(self.gpupool_consumed), "epoch": int(self.gpupool_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Skip the first ``state["consumed"]`` batches on the next iteration (none at an epoch end)."""
        consumed = int(state.get("consumed", 0))
        try:
            total = len(self)
        except TypeError:
            total = None
        self._gpupool_skip = 0 if total is not None and consumed >= total else consumed
        self._gpupool_resume_epoch = int(state["epoch"]) if self._gpupool_skip and "epoch" in state else None

    def _set_epoch(self, epoch: int) -> None:
        # Lightning creates the iterator (and prefetches) before it sets the sampler's epoch on a
        # resume; a shuffling sampler (DistributedSampler) would replay epoch 0's order.
        for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def __iter__(self) -> Any:
        if self._gpupool_resume_epoch is not None:
            self._set_epoch(self._gpupool_resume_epoch)
            self._gpupool_resume_epoch = None
        it = super().__iter__()
        skip, self._gpupool_skip = self._gpupool_skip, 0
        self.gpupool_consumed = skip
        for _ in range(skip):
            try:
                next(it)
            except StopIteration:
                break
        return it
