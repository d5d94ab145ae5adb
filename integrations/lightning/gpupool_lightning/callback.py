"""Lightning integration: :class:`GpuPoolCallback` leases GPU slices for a Trainer.

Works with ``pytorch_lightning`` and with ``lightning.pytorch`` (the class derives from the
``Callback`` of each one installed, so either Trainer accepts it).

Example (the whole integration)::

    import pytorch_lightning as pl          # or: import lightning.pytorch as pl
    from gpupool_lightning import GpuPoolCallback

    pool = GpuPoolCallback(gpus=1, memory="20GiB", qos="shared", priority=5, checkpoint_dir="ckpt/")
    trainer = pl.Trainer(accelerator=pool.accelerator, devices=pool.devices, callbacks=[pool], max_epochs=10)
    trainer.fit(model, datamodule=dm, ckpt_path=pool.resume_from)
    pool.exit_if_preempted()                # exit code 75 when preempted: "run me again"

What the callback relies on in Lightning's hook order (pinned by
``tests/integrations/test_hook_order.py``): per optimizer step ``on_train_batch_start`` ->
``on_before_backward`` -> ``on_after_backward`` -> ``on_before_optimizer_step`` ->
``on_train_batch_end``; the batch is fetched and moved to the device before
``on_train_batch_start`` (counted as the data phase).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from gpupool_sdk.runtime.runtime import (
    _CARRY_ON,
    EX_TEMPFAIL,
    Decision,
    PoolAdapter,
    PoolLeaseLostError,
    PoolRuntime,
)
from gpupool_sdk.telemetry.phases import PHASE_INDEX, Phase
from gpupool_torch.data import ResumableDataLoader

log = logging.getLogger("gpupool_lightning")

_bases: list[type] = []
try:
    from pytorch_lightning import Callback as _PLCallback

    _bases.append(_PLCallback)
except ImportError:  # pragma: no cover - depends on the environment
    pass
try:
    from lightning.pytorch import Callback as _LCallback

    _bases.append(_LCallback)
except ImportError:
    pass
if not _bases:  # pragma: no cover
    raise ImportError(
        "GpuPoolCallback needs Lightning: pip install pytorch-lightning (or lightning), "
        "or use gpupool_torch.PoolSession for a plain PyTorch loop"
    )

__all__ = ["EX_TEMPFAIL", "GpuPoolCallback", "PoolLeaseLostError", "ResumableDataLoader"]

# Phase indexes for the timer's hot-path methods (no enum hashing in the per-step hooks).
_DATA = PHASE_INDEX[Phase.DATA]
_FORWARD = PHASE_INDEX[Phase.FORWARD]
_BACKWARD = PHASE_INDEX[Phase.BACKWARD]
_OPTIMIZER = PHASE_INDEX[Phase.OPTIMIZER]


def _loaders(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _loaders(o)]
    if isinstance(obj, dict):
        return [x for o in obj.values() for x in _loaders(o)]
    return [obj]


class GpuPoolCallback(PoolAdapter, *_bases):  # type: ignore[misc]
    """Leases GPU slices from the pool for a Lightning Trainer and obeys the pool's directives.

    The constructor takes the lease *before* the Trainer touches CUDA: it submits the job spec,
    waits in the queue, sets ``CUDA_VISIBLE_DEVICES`` to the leased GPUs, and looks up the
    job's last acknowledged checkpoint. Pass :attr:`accelerator`, :attr:`devices` and
    :attr:`resume_from` to the Trainer. Under ``gpupool run`` it attaches to the launcher's
    lease instead of submitting a second spec; on ranks other than 0 it holds no lease and
    follows rank 0.

    At step boundaries (every ``check_every_n_steps`` optimizer steps) rank 0 looks at the
    lease's latest directive (no I/O: the client's helper process keeps it current) and the
    decision is broadcast through ``trainer.strategy`` so that every rank acts at the same step:

    * ``preempt`` / ``resize``: every rank saves ``trainer.save_checkpoint`` into
      ``checkpoint_dir`` (validation is not run first), rank 0 acks with the step and path,
      waits for the coordinator to take the slices back, releases the lease, and the Trainer
      stops (validation is disabled for the rest of this ``fit``). Then
      :meth:`exit_if_preempted` exits with code 75 (``EX_TEMPFAIL``), which ``gpupool run``
      reads as "queue me again".
    * ``balloon`` / ``deflate``: the memory balloon is inflated or deflated at the boundary
      (before the next optimizer step) and rank 0 acks the bytes reached.
    * lease lost: an emergency checkpoint is written if possible and
      :class:`PoolLeaseLostError` is raised out of ``trainer.fit``.

    Args:
        gpus: slices wanted.
        memory: memory per slice (``"20GiB"``); required unless ``qos="exclusive"``.
        qos: ``"shared"`` (default), ``"guaranteed"`` or ``"exclusive"``.
        priority: higher runs first and may preempt lower.
        name: job name; default ``$GPUPOOL_JOB`` or the script's file name. A job restarted
            under the same name resumes from its last acknowledged checkpoint.
        checkpoint_dir: where preemption checkpoints go (shared by all ranks).
        endpoints: etcd endpoints (default ``$GPUPOOL_ENDPOINTS``).
        compute_share: share of each GPU's compute, in (0, 1].
        allocator: memory tier for balloons: ``"torch"``, ``"gpupool"`` or ``"none"``.
        check_every_n_steps: directive check interval, in optimizer steps.
        telemetry_interval_s: how often a phase summary is published.
        acquire_timeout: seconds to wait in the queue (None: forever).
        memory_peak_fn: called only when a summary is due (never per step); returns the job's
            per-slice memory peak in bytes since its previous call, or None. A number replaces
            the measured ``memory_peak_bytes`` (see :meth:`report_memory_peak`).
        metrics_port: serve this job's summary as Prometheus metrics (``gpupool_job_*``) on
            this port from rank 0 (0: any free port); None (default) for none.
        **spec_fields: other :class:`~gpupool_sdk.resources.JobSpec` fields (``features``,
            ``gpu_model``, ``min_runtime_s``, ``preempt_grace_s``, ``owner``, ``prefix``...).

    Raises:
        ConfigError: an argument is invalid (the message names it and the fix).
        AcquireTimeoutError: not granted within ``acquire_timeout``.
    """

    def __init__(
        self,
        gpus: int = 1,
        memory: int | str | None = None,
        qos: str = "shared",
        priority: int = 0,
        name: str | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        endpoints: str | None = None,
        compute_share: float = 1.0,
        allocator: str = "torch",
        check_every_n_steps: int = 1,
        telemetry_interval_s: float = 5.0,
        acquire_timeout: float | None = None,
        memory_peak_fn: Callable[[], int | None] | None = None,
        metrics_port: int | None = None,
        **spec_fields: Any,
    ) -> None:
        super().__init__()
        self.runtime = PoolRuntime(
            gpus=gpus,
            memory=memory,
            qos=qos,
            priority=priority,
            name=name,
            checkpoint_dir=checkpoint_dir,
            endpoints=endpoints,
            compute_share=compute_share,
            allocator=allocator,
            check_every_n_steps=check_every_n_steps,
            telemetry_interval_s=telemetry_interval_s,
            acquire_timeout=acquire_timeout,
            memory_peak_fn=memory_peak_fn,
            metrics_port=metrics_port,
            **spec_fields,
        )
        self.runtime.acquire()
        # The per-step hooks reach the timer through one attribute (it is never replaced).
        self._timer = self.runtime.timer
        self._opt_stepped = False
        self._world_size = 1
        self._resumable: list[ResumableDataLoader] = []
        self._last_checkpoint: str | None = None

    # -- what the Trainer needs ------------------------------------------------------------
    @property
    def accelerator(self) -> str:
        """``"gpu"`` when the leased GPUs are visible to CUDA, else ``"cpu"``."""
        return self.runtime.accelerator

    @property
    def preemptions(self) -> int:
        """Preemptions over the job's life (restored from checkpoints)."""
        return self.runtime.preemptions

    @property
    def lease_generation(self) -> int:
        """How many leases the job has held, this one included (restored from checkpoints)."""
        return self.runtime.lease_generation

    @property
    def phase_timer(self) -> Any:
        """The :class:`~gpupool_sdk.telemetry.phases.PhaseTimer` of this process."""
        return self.runtime.timer

    @property
    def preempt_timing(self) -> Any:
        """:class:`~gpupool_sdk.runtime.runtime.PreemptTiming` of the last preemption (rank 0), or None."""
        return self.runtime.last_preempt

    @property
    def last_checkpoint(self) -> str | None:
        """Path of the last checkpoint this callback wrote (preemption or emergency)."""
        return self._last_checkpoint

    def exit_if_preempted(self) -> None:
        """Call after ``trainer.fit``: exit with code 75 if preempted, else release the lease.

        Example:
            >>> # trainer.fit(model, ckpt_path=pool.resume_from); pool.exit_if_preempted()
        """
        super().exit_if_preempted()
        self.runtime.close()

    def close(self) -> None:
        """Release the lease now (idempotent; also runs at process exit)."""
        self.runtime.close()

    def __enter__(self) -> GpuPoolCallback:
        return self

    # -- hooks -----------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # The optimizers exist now: the balloon controller measures the footprint from here on.
        self.runtime.start_training(getattr(trainer, "optimizers", []) or [])
        self._world_size = int(trainer.world_size)
        device = getattr(pl_module, "device", None)
        # The timer was built before CUDA existed in this process (the lease comes first).
        self.runtime.timer.set_cuda_events(getattr(device, "type", "cpu") == "cuda")
        # A mid-epoch restart skips on_train_epoch_start: collect the loaders here too.
        self._collect_loaders(trainer)

    def _collect_loaders(self, trainer: Any) -> None:
        self._resumable = [dl for dl in _loaders(trainer.train_dataloader) if isinstance(dl, ResumableDataLoader)]
        self.runtime.timer.discard_open()
        self.runtime.timer.start(Phase.DATA)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._collect_loaders(trainer)

    # The per-step hooks below are the hot path: one clock reading per phase boundary, no
    # allocation, no I/O; the directive check is an attribute read between directives.
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._timer.switch(_DATA, _FORWARD)
        rt = self.runtime
        # lease_lost(), inlined: a lease that reports its loss through a callback is not asked.
        if self._world_size == 1 and (rt._lost_seen or (rt._poll_lost and rt.lease_lost())):
            self._fence(trainer, Decision(kind="lost", reason=rt.lost_reason()))
        if self._resumable:
            consumed, epoch = batch_idx + 1, trainer.current_epoch
            for dl in self._resumable:
                dl.mark_consumed(consumed, epoch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._timer.switch(_FORWARD, _BACKWARD)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._timer.switch(_BACKWARD, -1)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._opt_stepped = True
        self._timer.begin(_OPTIMIZER)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rt = self.runtime
        # The step's end is also the next data phase's start, unless something took time below.
        now: float | None = self._timer.finish_step(_OPTIMIZER)
        stepped, self._opt_stepped = self._opt_stepped, False
        # trainer.global_step is a chain of Lightning properties (microseconds once training has
        # evicted the caches): read only where a step number is used. The runtime's step is
        # brought up to date on those steps.
        step: int | None = None
        check = stepped
        if check and rt.check_every_n_steps != 1:
            step = rt.step = int(trainer.global_step)
            check = step % rt.check_every_n_steps == 0
        # Act only where an optimizer step just finished (not mid gradient-accumulation), and
        # on the same steps on every rank, so the broadcast below pairs up.
        if check:
            if self._world_size > 1:
                wire = rt.decide().to_wire() if rt.is_leader else None
                dec = Decision.from_wire(trainer.strategy.broadcast(wire, src=0))
            elif rt._watching and not rt._attention:
                # decide()'s own first test, inlined: no directive and no loss since the last look.
                dec = _CARRY_ON
            else:
                dec = rt.decide()
            if dec.kind is not None:
                if step is None:
                    step = rt.step = int(trainer.global_step)
                if dec.kind == "lost":
                    self._fence(trainer, dec)
                elif dec.kind == "preempt":
                    self._preempt(trainer, dec, step)
                    return
                elif dec.kind in ("balloon", "deflate"):
                    rt.balloon(dec, step)
                    now = None
        # maybe_publish's interval test, inlined; the summary is built only when one is due.
        if rt.lease is not None and (now is None or now >= rt._next_publish):
            if step is None:
                step = rt.step = int(trainer.global_step)
            if rt.maybe_publish(step, now):
                now = None
        self._timer.begin(_DATA, now)

    def _save(self, trainer: Any) -> Any:
        def save(path: str) -> None:
            trainer.save_checkpoint(path)
            self._last_checkpoint = path

        return save

    def _preempt(self, trainer: Any, dec: Decision, step: int) -> None:
        log.info("gpupool: %s preempted at step %d (%s); checkpointing", self.job, step, dec.reason)
        self.runtime.preempt(dec, step, self._save(trainer))
        trainer.should_stop = True
        # Stopping early would otherwise run validation on slices we no longer hold.
        trainer.limit_val_batches = 0

    def _fence(self, trainer: Any, dec: Decision) -> None:
        raise self.runtime.fence(dec, int(trainer.global_step), self._save(trainer))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.runtime.stop_training()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, PoolLeaseLostError):
            log.error("gpupool: %s", exception)
