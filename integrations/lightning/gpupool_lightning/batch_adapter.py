"""``BatchAdapter``: vertical resize for a Lightning job (opt in by adding the callback).

Example::

    from gpupool_lightning import BatchAdapter, GpuPoolCallback
    from gpupool_torch import elastic_dataloader

    class Model(pl.LightningModule):
        def train_dataloader(self):
            # 64 samples per optimizer step, 16 per forward/backward at the leased quota
            return elastic_dataloader(self.dataset, global_batch_size=64, micro_batch_size=16, shuffle=True)

    pool = GpuPoolCallback(memory="20GiB")
    trainer = pl.Trainer(accelerator=pool.accelerator, devices=pool.devices, callbacks=[pool, BatchAdapter()])

When the pool balloons the job to half its quota, the next global batches are cut into
micro-batches of 8 and Lightning accumulates 8 of them per step; on a deflate it goes back to
16 and 4. The global batch, and so the optimizer's math, does not change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_lightning._compat import CALLBACK_BASES
from gpupool_sdk.errors import ConfigError
from gpupool_torch.batching import ElasticBatchSampler, MicroBatchRule, find_elastic_sampler, plan_micro_batch

log = logging.getLogger("gpupool_lightning")


__all__ = ["BatchAdapter", "BatchChange"]


def _set_epoch_length(trainer: Any, batches: int) -> None:
    """Tell Lightning the epoch now has ``batches`` micro-batches.

    Lightning counts them once when it sets the dataloader up (``fit_loop.max_batches``, the
    combined loader's limit, the data fetcher's length: pinned by ``test_batch_adapter.py``).
    """
    fit_loop = trainer.fit_loop
    fit_loop.max_batches = batches
    combined = getattr(fit_loop, "_combined_loader", None)
    if combined is not None and combined.limits is not None and len(combined.limits) == 1:
        combined.limits = [batches]
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if fetcher is not None and isinstance(getattr(fetcher, "length", None), int):
        with contextlib.suppress(AttributeError):  # a fetcher whose length is derived, not stored
            fetcher.length = batches


@dataclass(frozen=True)
class BatchChange:
    """One resize the adapter applied.

    Attributes:
        global_step: optimizer steps done when the new size took effect.
        batch_index: the epoch's micro-batch index where it took effect.
        micro_batch_size: samples per forward/backward from then on.
        accumulation: micro-batches per optimizer step from then on.
        limit_bytes: the memory limit that asked for it (None: no limit).
    """

    global_step: int
    batch_index: int
    micro_batch_size: int
    accumulation: int
    limit_bytes: int | None


class BatchAdapter(*CALLBACK_BASES):  # type: ignore[misc]
    """Changes the micro-batch size and gradient accumulation when the job's memory limit changes.

    Needs a :class:`~gpupool_lightning.GpuPoolCallback` in the same Trainer (its balloon tells the
    limit) and a train dataloader built with :func:`gpupool_torch.elastic_dataloader` (or any
    ``DataLoader`` over an :class:`~gpupool_torch.batching.ElasticBatchSampler`). The adapter owns
    ``trainer.accumulate_grad_batches``: leave it at its default.

    The rule (:func:`~gpupool_torch.batching.plan_micro_batch`): the micro-batch scales with the
    memory left above ``fixed_bytes``, relative to the quota the job started with, never above the
    starting micro-batch, rounded down to a divisor of the per-rank global batch. A new size takes
    effect where a global batch starts and the epoch's batch count is a multiple of the new
    accumulation (for a halving, at most one more optimizer step at the old size, which has
    usually been fetched already).

    The optimizer's math is unchanged when the loss is a mean over samples and no layer couples
    the samples of a micro-batch (BatchNorm does; its statistics follow the micro-batch), and
    the dataset is a multiple of the global batch (or ``drop_last=True``).

    Args:
        fixed_bytes: memory that does not scale with the micro-batch (weights, gradients,
            optimizer state), when known; 0 scales the whole limit.
        rule: ``(limit_bytes, base_limit_bytes, base_micro, global_batch) -> micro`` instead of
            the default rule (must return a divisor of ``global_batch``).
        pool: the pool callback (default: found among the Trainer's callbacks).

    Raises:
        ConfigError: ``fixed_bytes`` or ``rule`` is invalid; at ``fit``: no pool callback, no
            elastic dataloader, or ``accumulate_grad_batches`` set by hand.
    """

    def __init__(self, fixed_bytes: int = 0, rule: MicroBatchRule | None = None, pool: Any = None) -> None:
        super().__init__()
        if isinstance(fixed_bytes, bool) or not isinstance(fixed_bytes, int) or fixed_bytes < 0:
            raise ConfigError("fixed_bytes", f"must be a whole number of bytes >= 0, got {fixed_bytes!r}")
        if rule is not None and not callable(rule):
            raise ConfigError("rule", f"must be a callable (limit, base_limit, base_micro, global_batch) -> micro, "
                              f"got {rule!r}")
        self.fixed_bytes = fixed_bytes
        self.rule = rule
        self.pool = pool
        self.changes: list[BatchChange] = []
        self._sampler: ElasticBatchSampler | None = None
        self._balloon: Any = None
        self._trainer: Any = None
        self._base_micro: int | None = None
        self._base_limit: int | None = None
        self._global_batch: int | None = None
        self._limit: int | None = None
        self._pending = False

    # -- what the user reads ------------------------------------------------------------------
    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward now (None before ``fit``)."""
        return None if self._sampler is None else self._sampler.micro_batch_size

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per optimizer step now (None before ``fit``)."""
        return None if self._sampler is None else self._sampler.accumulation

    # -- hooks ---------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        sampler = find_elastic_sampler(trainer.train_dataloader)
        if sampler is None:
            raise ConfigError(
                "train_dataloader",
                "BatchAdapter needs a train dataloader built with gpupool_torch.elastic_dataloader(dataset, "
                "global_batch_size=..., micro_batch_size=...) (or a DataLoader over an ElasticBatchSampler)",
            )
        if self._global_batch is not None and self._global_batch != sampler.global_batch_size:
            raise ConfigError(
                "global_batch_size",
                f"the checkpoint was trained with a global batch of {self._global_batch} per rank, the dataloader "
                f"now has {sampler.global_batch_size}; keep it equal to resume with the same optimizer math",
            )
        limit = trainer.limit_train_batches
        if limit not in (None, 1.0) and not (isinstance(limit, int) and limit >= len(sampler)):
            raise ConfigError(
                "limit_train_batches",
                f"is {limit!r}; BatchAdapter changes the number of batches per epoch and needs whole epochs "
                "(limit_train_batches=1.0, the default)",
            )
        accum = int(trainer.accumulate_grad_batches)
        if accum not in (1, sampler.accumulation):
            raise ConfigError(
                "accumulate_grad_batches",
                f"is {accum} but the elastic dataloader's global batch {sampler.global_batch_size} / micro-batch "
                f"{sampler.micro_batch_size} makes {sampler.accumulation}; leave accumulate_grad_batches at its "
                "default: BatchAdapter sets it",
            )
        self._sampler, self._trainer = sampler, trainer
        self._global_batch = sampler.global_batch_size
        if self._base_micro is None:
            self._base_micro = sampler.micro_batch_size
        trainer.accumulate_grad_batches = sampler.accumulation
        pool = self.pool if self.pool is not None else self._find_pool(trainer)
        balloon = getattr(pool, "memory_balloon", None) if pool is not None else None
        if balloon is None:
            log.warning("gpupool: BatchAdapter has no memory balloon to follow (no GpuPoolCallback, or "
                        "allocator='none'); the micro-batch stays %d", sampler.micro_batch_size)
            return
        self._balloon = balloon
        if self._base_limit is None:
            self._base_limit = balloon.quota_bytes
        balloon.add_limit_listener(self._on_limit)
        # A job restarted under a smaller quota starts at the size that quota allows.
        self._on_limit(balloon.limit_bytes)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning counts an epoch's batches once, at setup; a resize changed that count.
        sampler = self._sampler
        if sampler is not None and self.changes and trainer.fit_loop.max_batches != len(sampler):
            _set_epoch_length(trainer, len(sampler))

    @staticmethod
    def _find_pool(trainer: Any) -> Any:
        for cb in getattr(trainer, "callbacks", []) or []:
            if hasattr(cb, "memory_balloon") and hasattr(cb, "runtime"):
                return cb
        return None

    def _on_limit(self, limit: int | None) -> None:
        sampler = self._sampler
        if sampler is None or self._base_micro is None:
            return
        rule = self.rule
        if rule is None:
            micro = plan_micro_batch(limit, self._base_limit, self._base_micro, sampler.global_batch_size,
                                     self.fixed_bytes)
        else:
            micro = rule(limit, self._base_limit, self._base_micro, sampler.global_batch_size)
        self._limit = limit
        sampler.request(micro)
        self._pending = sampler.pending is not None
        if self._pending:
            log.info("gpupool: memory limit %s: micro-batch %d -> %d at the next global batch", limit,
                     sampler.micro_batch_size, micro)

    # The per-batch cost is one attribute read unless a change is pending.
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._pending:
            return
        sampler = self._sampler
        if sampler is None or sampler.pending is not None or sampler.switch_at is None or batch_idx < sampler.switch_at:
            return
        # The sampler cut this batch at the new size: Lightning accumulates accordingly from here.
        self._pending = False
        trainer.accumulate_grad_batches = sampler.accumulation
        _set_epoch_length(trainer, sampler.epoch_length_after_switch())
        self.changes.append(BatchChange(global_step=int(trainer.global_step), batch_index=batch_idx,
                                        micro_batch_size=sampler.micro_batch_size,
                                        accumulation=sampler.accumulation, limit_bytes=self._limit))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._balloon is not None:
            self._balloon.remove_limit_listener(self._on_limit)
            self._balloon = None

    # -- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sizes the job started with (a resumed job adapts relative to them)."""
        return {"version": 1, "base_micro": self._base_micro, "base_limit": self._base_limit,
                "global_batch": self._global_batch}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != 1:
            raise ConfigError("state_dict", "not a BatchAdapter state (expected version 1)")
        self._base_micro = state_dict.get("base_micro")
        self._base_limit = state_dict.get("base_limit")
        self._global_batch = state_dict.get("global_batch")
