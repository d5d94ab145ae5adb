"""Vertical resize in the job: the micro-batch follows the memory limit, the global batch stays.

When the pool shrinks a job's memory (a balloon) or gives it back (deflate, a larger quota),
the job can keep training with a smaller (or larger) micro-batch and more (or fewer) gradient
accumulation steps, so that every optimizer step still sees the same samples: the global batch,
and with it the optimizer's math, does not change.

* :func:`plan_micro_batch`: the default rule (pure): the micro-batch scales with the memory
  that is left for activations, rounded down to a divisor of the per-rank global batch.
* :class:`ElasticBatchSampler`: a batch sampler that cuts each global batch into micro-batches of
  the current size, and changes the size only where an accumulation window starts.
* :func:`elastic_dataloader`: a ``DataLoader`` over such a sampler.

The Lightning side is ``gpupool_lightning.BatchAdapter``; a plain loop reads
:attr:`ElasticBatchSampler.accumulation` at each optimizer step. See ``docs/memory.md``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sized
from typing import Any

from gpupool_sdk.errors import ConfigError

#: ``(limit_bytes, base_limit_bytes, base_micro, global_batch) -> micro``: a resize rule.
MicroBatchRule = Callable[[int | None, int | None, int, int], int]


def _whole(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be a whole number >= {minimum}, got {value!r}")
    return value


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def plan_micro_batch(
    limit_bytes: int | None,
    base_limit_bytes: int | None,
    base_micro: int,
    global_batch: int,
    fixed_bytes: int = 0,
) -> int:
    """The micro-batch for a memory limit (the default rule of the batch adapter).

    The user chose ``base_micro`` for ``base_limit_bytes``. Memory is modelled as a fixed part
    (weights, gradients, optimizer state: ``fixed_bytes``) plus a part proportional to the
    micro-batch (activations). Under ``limit_bytes`` the micro-batch may be
    ``base_micro * (limit - fixed) / (base_limit - fixed)``, never more than ``base_micro``,
    rounded down to a divisor of ``global_batch`` (every micro-batch of a step has the same
    size, which keeps the mean of the micro-batch losses equal to the global batch's), at least 1.

    With ``fixed_bytes=0`` (the default) halving the limit halves the micro-batch; that is
    optimistic when the fixed part is large, so pass it when it is known.

    Args:
        limit_bytes: the memory limit now (None: none).
        base_limit_bytes: the limit ``base_micro`` was chosen for (None: unknown, keep ``base_micro``).
        base_micro: the user's micro-batch size.
        global_batch: samples per optimizer step on this rank (``base_micro * accumulation``).
        fixed_bytes: memory that does not scale with the micro-batch.

    Returns:
        The micro-batch size, a divisor of ``global_batch``.

    Example:
        >>> plan_micro_batch(512, 1024, base_micro=8, global_batch=8)
        4
        >>> plan_micro_batch(2048, 1024, base_micro=8, global_batch=32)
        8
        >>> plan_micro_batch(300, 1000, base_micro=12, global_batch=24, fixed_bytes=100)
        2
    """
    _whole(base_micro, "base_micro")
    _whole(global_batch, "global_batch")
    if global_batch % base_micro:
        raise ConfigError("global_batch", f"{global_batch} is not a multiple of the micro-batch {base_micro}")
    if limit_bytes is None or base_limit_bytes is None or limit_bytes >= base_limit_bytes:
        return base_micro
    room = base_limit_bytes - fixed_bytes
    if room <= 0:
        raise ConfigError("fixed_bytes", f"{fixed_bytes} is not below the base limit {base_limit_bytes}")
    allowed = math.floor(base_micro * max(0, limit_bytes - fixed_bytes) / room)
    fitting = [d for d in divisors(global_batch) if d <= max(1, allowed)]
    return fitting[-1]


class ElasticBatchSampler:
    """Yields micro-batches of a fixed sequence of global batches; the micro-batch size can change.

    The indices of ``sampler`` are grouped into global batches of ``global_batch_size`` (the last
    one may be short unless ``drop_last``), each cut into micro-batches of the current size. A new
    size asked for with :meth:`request` is applied when a global batch starts and the number of
    micro-batches yielded in this epoch is a multiple of the new accumulation, so the framework's
    accumulation windows (counted from the start of the epoch) stay aligned with global batches.
    :attr:`switch_at` is then the epoch's micro-batch index where the new size starts.

    Args:
        sampler: the index sampler (a ``Sampler``, a ``range``, any sized iterable of indices).
        global_batch_size: samples per optimizer step on this rank.
        micro_batch_size: samples per forward/backward (a divisor of ``global_batch_size``).
        drop_last: drop a last global batch shorter than ``global_batch_size``.

    Raises:
        ConfigError: a size is not a whole number >= 1, or the micro-batch does not divide the global batch.
    """

    def __init__(self, sampler: Any, global_batch_size: int, micro_batch_size: int, drop_last: bool = False) -> None:
        self.sampler = sampler
        self.global_batch_size = _whole(global_batch_size, "global_batch_size")
        self.micro_batch_size = self._check_micro(micro_batch_size)
        self.drop_last = bool(drop_last)
        #: The micro-batch index (in the current epoch) where the last size change took effect.
        self.switch_at: int | None = None
        self._pending: int | None = None
        self._lock = threading.Lock()
        self._yielded = 0
        self._globals_done = 0
        self._globals_at_switch = 0

    def _check_micro(self, micro: int) -> int:
        _whole(micro, "micro_batch_size")
        if self.global_batch_size % micro:
            raise ConfigError(
                "micro_batch_size",
                f"{micro} does not divide the global batch {self.global_batch_size}; use one of "
                f"{divisors(self.global_batch_size)}",
            )
        return micro

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step at the current size."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def pending(self) -> int | None:
        """The size asked for and not applied yet, or None."""
        return self._pending

    def request(self, micro_batch_size: int) -> None:
        """Ask for a new micro-batch size (applied at the next aligned global batch; see the class)."""
        micro = self._check_micro(micro_batch_size)
        with self._lock:
            self._pending = None if micro == self.micro_batch_size else micro

    def _n_samples(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError("the index sampler has no length")
        return len(self.sampler)

    def length_with(self, micro: int) -> int:
        """Micro-batches in a whole epoch at micro-batch size ``micro``."""
        n = self._n_samples()
        full, rest = divmod(n, self.global_batch_size)
        tail = math.ceil(rest / micro) if rest and not self.drop_last else 0
        return full * (self.global_batch_size // micro) + tail

    def __len__(self) -> int:
        return self.length_with(self.micro_batch_size)

    def epoch_length_after_switch(self) -> int:
        """Micro-batches in the current epoch, given that the size changed at :attr:`switch_at`."""
        at = self.switch_at or 0
        return at + self.length_with(self.micro_batch_size) - self._globals_at_switch * self.accumulation

    def _maybe_switch(self) -> None:
        with self._lock:
            new = self._pending
            if new is None or self._yielded % (self.global_batch_size // new):
                return
            self.micro_batch_size = new
            self._pending = None
            self.switch_at = self._yielded
            self._globals_at_switch = self._globals_done

    def __iter__(self) -> Iterator[list[int]]:
        self._yielded = 0
        self._globals_done = 0
        self.switch_at = None
        batch: list[int] = []
        for idx in self.sampler:
            batch.append(int(idx))
            if len(batch) == self.global_batch_size:
                yield from self._split(batch)
                batch = []
        if batch and not self.drop_last:
            yield from self._split(batch)

    def _split(self, batch: list[int]) -> Iterator[list[int]]:
        self._maybe_switch()
        micro = self.micro_batch_size
        for start in range(0, len(batch), micro):
            self._yielded += 1
            yield batch[start : start + micro]
        self._globals_done += 1


def elastic_dataloader(
    dataset: Any,
    global_batch_size: int,
    micro_batch_size: int,
    shuffle: bool = False,
    generator: Any = None,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> Any:
    """A ``torch.utils.data.DataLoader`` whose batches are micro-batches of an :class:`ElasticBatchSampler`.

    Args:
        dataset: a map-style dataset.
        global_batch_size: samples per optimizer step on this rank.
        micro_batch_size: the starting micro-batch size (the largest the job will use).
        shuffle: shuffle the indices each epoch (``RandomSampler`` with ``generator``).
        generator: the ``torch.Generator`` of the shuffle (for reproducible runs).
        drop_last: drop a short last global batch.
        **loader_kwargs: other ``DataLoader`` arguments (``num_workers``, ``collate_fn``...);
            not ``batch_size``, ``sampler``, ``shuffle`` or ``batch_sampler``.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> dl = elastic_dataloader(TensorDataset(torch.arange(8.0)), global_batch_size=4, micro_batch_size=2)
        >>> [b[0].tolist() for b in dl]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    """
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

    for bad in ("batch_size", "sampler", "shuffle", "batch_sampler"):
        if bad in loader_kwargs:
            raise ConfigError(bad, "is set by elastic_dataloader; pass global_batch_size / micro_batch_size instead")
    index_sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    batch_sampler = ElasticBatchSampler(index_sampler, global_batch_size, micro_batch_size, drop_last=drop_last)
    return DataLoader(dataset, batch_sampler=batch_sampler, **loader_kwargs)


def find_elastic_sampler(loader: Any) -> ElasticBatchSampler | None:
    """The :class:`ElasticBatchSampler` behind ``loader`` (a DataLoader, or Lightning's wrappers), or None."""
    seen = 0
    stack = [loader]
    while stack and seen < 64:
        obj = stack.pop()
        seen += 1
        if isinstance(obj, ElasticBatchSampler):
            return obj
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        for attr in ("batch_sampler", "flattened", "iterables", "loader"):
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj:
                stack.append(inner)
    return None
