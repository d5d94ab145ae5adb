"""Lightning integration: :class:`GpuPoolCallback` leases GPU slices for a Trainer.

Works with ``pytorch_lightning`` and with ``lightning.pytorch`` (the class derives from the
``Callback`` of each one installed, so either Trainer accepts it).

Example (the whole integration)::

    import pytorch_lightning as pl          # or: import lightning.pytorch as pl
    from gpupool_lightning import GpuPoolCallback

    pool = GpuPoolCallback(gpus=1, memory="20GiB", qos="shared", priority=5, checkpoint_dir="ckpt/")
    trainer = pl.Trainer(accelerator=pool.accelerator, devices=pool.devices, callbacks=[pool], max_epochs=10)
    trainer.fit(model, datamodule=dm, ckpt_path=pool.resume_from)
    # A preempted (or SIGTERM'd) fit never returns: the process exits with code 75 ("run me
    # again") right after the checkpoint, so the code below only ever sees a finished model.

What the callback relies on in Lightning's hook order (pinned by
``integrations/lightning/tests/test_hook_order.py``): per optimizer step ``on_train_batch_start`` ->
``on_before_backward`` -> ``on_after_backward`` -> ``on_before_optimizer_step`` ->
``on_train_batch_end``; the batch is fetched and moved to the device before
``on_train_batch_start`` (counted as the data phase).
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from gpupool_lightning._compat import CALLBACK_BASES
from gpupool_sdk.runtime import EX_TEMPFAIL, PoolAdapter, PoolLeaseLostError, PoolRuntime, RuntimeOptions
from gpupool_sdk.runtime.decision import CARRY_ON, Decision, DecisionKind
from gpupool_sdk.telemetry.phases import PHASE_INDEX, Phase
from gpupool_torch.data import ResumableDataLoader
from gpupool_torch.memory import prepare_job_memory
from gpupool_torch.session import memory_tier

log = logging.getLogger("gpupool_lightning")


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


def _fit_validating(trainer: Any) -> bool:
    """Inside a validation loop of ``fit`` (not the sanity check), on a Lightning that can resume into one."""
    try:
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        return bool(str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "fit" and trainer.validating
                    and not trainer.sanity_checking and hasattr(val_loop, "restarted_mid_evaluation"))
    except Exception:  # noqa: BLE001 - a Trainer without these: nothing to rewind
        return False


def _rewind_validation(checkpoint: dict[str, Any]) -> None:
    """Make a checkpoint taken inside ``fit``'s validation resume into that validation, from its start.

    Lightning resumes a checkpoint taken after a validation batch as if that validation had ended
    (it fast-forwards the loop's counters to its end): the epoch end then runs without the
    validation's metrics, and the default ``EarlyStopping`` (it checks at the train epoch's end)
    raises for the missing one at every restart. Lightning (2.6 tested) runs a validation again
    when its counters say a batch was started and not processed ("restarted mid evaluation"), so the
    validation loop's progress is written as "first batch of this run started": the resumed run
    validates from its first batch, and what the interrupted run logged is not mixed in.
    """
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.val_loop.batch_progress")
    if not isinstance(state, dict) or not {"total", "current"} <= state.keys():
        return
    # `total` counts the epoch's validation runs (val_check_interval < 1), `current` this run's batches.
    before = int(state["total"]["completed"]) - int(state["current"]["completed"])
    state["total"].update(ready=before + 1, started=before + 1, processed=before, completed=before)
    state["current"].update(ready=1, started=1, processed=0, completed=0)
    state["is_last_batch"] = False


class GpuPoolCallback(PoolAdapter, *CALLBACK_BASES):  # type: ignore[misc]
    """Leases GPU slices from the pool for a Lightning Trainer and obeys the pool's directives.

    The constructor takes the lease *before* the Trainer touches CUDA: it submits the job spec,
    waits in the queue, sets ``CUDA_VISIBLE_DEVICES`` to the leased GPUs, and finds the job's
    newest readable checkpoint. Pass :attr:`accelerator`, :attr:`devices` and :attr:`resume_from`
    to the Trainer. Under ``gpupool run`` it attaches to the launcher's lease instead of
    submitting a second spec; on ranks other than 0 it holds no lease and follows rank 0.

    At step boundaries (every ``check_every_n_steps`` optimizer steps, and after every batch of
    a validation, test or predict loop) rank 0 looks at what arrived (no I/O) and the decision
    is broadcast through ``trainer.strategy`` so that every rank acts at the same step:

    * ``preempt`` / ``resize`` directive, or SIGTERM / SIGINT / SIGUSR1: every rank saves
      ``trainer.save_checkpoint`` into ``checkpoint_dir`` (atomically), rank 0 acks a directive,
      waits for the coordinator to take the slices back and releases the lease; then the process
      exits with code 75 (``EX_TEMPFAIL``, "run me again"; ``exit_on_preempt=False``: ``fit``
      returns instead and :attr:`preempted` tells). No other callback runs after the checkpoint,
      so ``EarlyStopping(strict=True)`` or a monitored ``ModelCheckpoint`` never see a half epoch.
    * ``balloon`` / ``deflate``: the memory balloon is inflated or deflated and rank 0 acks the bytes reached.
    * a directive kind this SDK does not know: acked as refused, with the reason.
    * lease lost: an emergency checkpoint is written if possible and
      :class:`PoolLeaseLostError` is raised out of ``trainer.fit``.

    Args:
        client: a ready ``PoolClient``-like object (tests).
        **options: the pool options, :class:`~gpupool_sdk.runtime.RuntimeOptions`: ``gpus``,
            ``memory``, ``qos``, ``priority``, ``name``, ``checkpoint_dir``, ``endpoints``,
            ``compute_share``, ``allocator``, ``check_every_n_steps``, ``telemetry_interval_s``,
            ``acquire_timeout``, ``on_status`` (called with each status while queued),
            ``memory_peak_fn``, ``metrics_port``, ``exit_on_preempt``, ``preempt_signals``,
            ``keep_checkpoints``, ``resume_paths``; and :class:`~gpupool_sdk.resources.JobSpec`
            fields (``features``, ``gpu_model``, ``min_runtime_s``, ``preempt_grace_s``...).

    Raises:
        ConfigError: an option is invalid or unknown (the message names it and the closest valid one).
        AcquireTimeoutError: not granted within ``acquire_timeout``.
    """

    def __init__(self, client: Any = None, **options: Any) -> None:
        super().__init__()
        self.options = RuntimeOptions.from_kwargs(**options)
        self.runtime = PoolRuntime(self.options, client=client, memory_tier=memory_tier)
        self.runtime.acquire()
        # allocator="gpupool": the SDK allocator goes in now, before the Trainer touches CUDA.
        prepare_job_memory(self.options.allocator, self.runtime.spec.memory_bytes or None)
        # The per-step hooks reach the timer through one attribute (it is never replaced).
        self._timer = self.runtime.timer
        # Per-phase memory peaks: read at the phase boundaries of one sampled step per window.
        self._probe = self.runtime.publisher.phase_probe
        self._opt_stepped = False
        self._broadcast: Any = None
        self._resumable: list[ResumableDataLoader] = []
        self._last_checkpoint: str | None = None
        #: A directive seen at an epoch's last batch waits for the first validation batch (else the next step).
        self._at_epoch_end = False
        #: The checkpoint being written is taken inside a validation loop of ``fit``.
        self._rewind_validation = False
        self._trainer: Any = None

    # -- what the Trainer needs ------------------------------------------------------------
    @property
    def accelerator(self) -> str:
        """``"gpu"`` when the leased GPUs are visible to CUDA, else ``"cpu"``."""
        return self.runtime.accelerator

    @property
    def last_checkpoint(self) -> str | None:
        """Path of the last checkpoint this callback wrote (preemption, signal or emergency)."""
        return self._last_checkpoint

    @property
    def memory_balloon(self) -> Any:
        """The job's balloon controller on this rank (None with ``allocator="none"`` or before one could be built).

        Built on first use; :class:`~gpupool_lightning.BatchAdapter` subscribes to its limit changes.
        """
        try:
            return self.runtime.balloon_controller()
        except Exception as exc:  # noqa: BLE001 - a balloon directive reports the error in its ack
            log.debug("gpupool: no balloon controller: %s", exc)
            return None

    def __enter__(self) -> GpuPoolCallback:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.runtime.close()

    # -- hooks -----------------------------------------------------------------------------
    def _arm_signals(self, trainer: Any) -> None:
        """A loop starts (sanity check, training, or a ``validate``/``test``/``predict`` run): the
        preemption signals are handled from here on, at its batch boundaries.

        Not earlier: before a loop no boundary comes (DDP's rendezvous, model wrapping and
        checkpoint restore can block in a collective for good when a peer died), so a signal keeps
        the process's own disposition there (by default SIGTERM ends the process at once, with
        nothing to save). Lightning has put its SIGTERM handler in place by now (at ``fit``, before
        the loops): it would set ``trainer.received_sigterm``, and its loops then raise
        ``SIGTERMException`` at the end of the step, the epoch or inside validation, a ``SystemExit``
        with code 0 and no checkpoint (``gpupool run`` then reported a finished job). So the handler
        chained is the one Lightning found (its connector's saved handlers), not Lightning's, and a
        SIGTERM Lightning recorded before this point is handed to the watch: the checkpoint and
        exit 75 at the next boundary decide alone. Idempotent; nothing once the lease is given back.
        """
        connector = getattr(trainer, "_signal_connector", None)
        found = getattr(connector, "_original_handlers", None)
        if not self.runtime.arm_signals(found if isinstance(found, dict) and found else None):
            return
        watch = self.runtime.signals
        if connector is not None and getattr(connector, "received_sigterm", False) \
                and watch.owns(signal.getsignal(signal.SIGTERM)):
            connector.received_sigterm = False
            watch.record(signal.SIGTERM)  # arrived between Lightning's registration and this loop

    def _hand_back_signals(self, trainer: Any) -> None:
        """The Trainer's run ends: the process's own signal handlers go back in place.

        Lightning's signal connector restores, at the end of every ``fit`` (``validate``...), the
        handlers it found at its start, this callback's among them; in a process that lives on
        after ``fit`` (``exit_on_preempt=False``, a notebook, a sweep of fits) that handler then
        recorded a later SIGTERM and swallowed it. Here the watch is uninstalled (the handlers
        found before it go back where its own is in place) and Lightning's saved copies of its
        handler are replaced by those handlers: whichever runs last, the process's own handler is
        the one in place. Called from ``on_exception`` (before Lightning's restore) and from
        ``teardown`` (after it). A later stage of a Trainer with this callback (``trainer.test``)
        installs the watch again when its loop starts while the runtime holds its lease.
        """
        watch = self.runtime.signals
        saved = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
        if isinstance(saved, dict):
            for signum, handler in list(saved.items()):
                if watch.owns(handler):
                    saved[signum] = watch.previous(signum)
        watch.uninstall()

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._arm_signals(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._arm_signals(trainer)  # a `validate` run (inside `fit`: already armed)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._arm_signals(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._arm_signals(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._arm_signals(trainer)
        rt = self.runtime
        # The optimizers exist now: the balloon tier measures the footprint from here on.
        rt.start_training(getattr(trainer, "optimizers", []) or [])
        self._trainer = trainer
        strategy = trainer.strategy
        self._broadcast = (lambda obj: strategy.broadcast(obj, src=0)) if int(trainer.world_size) > 1 else None
        device = getattr(pl_module, "device", None)
        # The timer was built before CUDA existed in this process (the lease comes first).
        rt.timer.set_cuda_events(getattr(device, "type", "cpu") == "cuda")
        # The job's declared length feeds the pool's remaining-time ordering.
        total = getattr(trainer, "estimated_stepping_batches", None)
        if not total or total == float("inf"):
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        rt.set_total_steps(total)
        # A mid-epoch restart skips on_train_epoch_start: collect the loaders here too.
        self._collect_loaders(trainer)

    def _collect_loaders(self, trainer: Any) -> None:
        self._resumable = [dl for dl in _loaders(trainer.train_dataloader) if isinstance(dl, ResumableDataLoader)]
        # The loader keeps its own position (torchdata); it only needs the epoch, once per epoch.
        for dl in self._resumable:
            dl.mark_consumed(0, trainer.current_epoch)
        self.runtime.timer.discard_open()
        self.runtime.timer.start(Phase.DATA)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._collect_loaders(trainer)

    # The per-step hooks below are the hot path: one clock reading per phase boundary, no
    # allocation, no I/O; between directives the check is an attribute read.
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._timer.switch(_DATA, _FORWARD)
        if self._probe.armed:
            self._probe.phase_end("data")
        rt = self.runtime
        if rt.inbox.lost and self._broadcast is None:
            self._fence(trainer, Decision(kind=DecisionKind.LOST, reason=rt.inbox.lost_reason))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._timer.switch(_FORWARD, _BACKWARD)
        if self._probe.armed:
            self._probe.phase_end("forward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._timer.switch(_BACKWARD, -1)
        if self._probe.armed:
            self._probe.phase_end("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._opt_stepped = True
        self._timer.begin(_OPTIMIZER)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped, self._opt_stepped = self._opt_stepped, False
        if not stepped:
            # Gradient accumulation: the batch belongs to the optimizer step still open (the
            # timer counts optimizer steps, not batches); nothing is decided mid-accumulation.
            self._timer.switch(-1, _DATA)
            return
        rt = self.runtime
        now: float | None = self._timer.finish_step(_OPTIMIZER)
        if self._probe.armed:
            self._probe.step_end()
        if self._broadcast is None and not rt.inbox.attention:
            # The per-step fast path (one process, nothing arrived): only a summary may be due.
            # No closure, no property chain, no allocation.
            if now is not None and now >= rt.publisher.next_due and rt.lease is not None:
                rt.publisher.maybe_publish(rt.lease, int(trainer.global_step), now)
                now = None
            self._timer.begin(_DATA, now)
            return
        check = True
        every = self.options.check_every_n_steps
        if every != 1:
            check = int(trainer.global_step) % every == 0
        self._at_epoch_end = False
        if check and not rt.inbox.lost and self._validation_follows(trainer, batch_idx):
            # The epoch's last batch, with its validation next: a checkpoint here resumes into an
            # epoch end whose validation never ran, and EarlyStopping(strict=True) raises for the
            # missing metric. The first validation batch acts instead (its checkpoint resumes into
            # that validation: _rewind_validation); on a Lightning that cannot resume a validation,
            # the next training step (every rank alike): a plain mid-epoch checkpoint.
            self._at_epoch_end = True
            check = False
        if check:
            # trainer.global_step is a chain of properties: read only when a step number is used.
            dec = rt.step_boundary(lambda: int(trainer.global_step), self._save(trainer), self._broadcast, now)
            if dec is not CARRY_ON:
                now = None
                if dec.kind is not None and dec.kind.stops:
                    self._stop(trainer)
                    return
        elif rt.lease is not None and now is not None and now >= rt.publisher.next_due:
            rt.publisher.maybe_publish(rt.lease, int(trainer.global_step), now)
            now = None
        self._timer.begin(_DATA, now)

    @staticmethod
    def _validation_follows(trainer: Any, batch_idx: int) -> bool:
        try:
            last = batch_idx + 1 >= trainer.num_training_batches
            every = trainer.check_val_every_n_epoch
            return bool(last and trainer.enable_validation
                        and (every is None or (trainer.current_epoch + 1) % every == 0))
        except Exception:  # noqa: BLE001 - a Trainer without these: act at once
            return False

    # Directives that arrive while another loop runs are honoured within one batch of it.
    def _loop_batch_end(self, trainer: Any) -> None:
        rt = self.runtime
        if self._at_epoch_end and not rt.inbox.lost and not _fit_validating(trainer):
            return  # the next training step acts (see on_train_batch_end)
        if self._broadcast is None and not rt.inbox.attention:
            return
        dec = rt.step_boundary(lambda: int(trainer.global_step), self._save(trainer), self._broadcast)
        if dec.kind is not None and dec.kind.stops:
            self._stop(trainer)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._loop_batch_end(trainer)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._loop_batch_end(trainer)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._loop_batch_end(trainer)

    def _save(self, trainer: Any) -> Any:
        def save(path: str) -> None:
            self._rewind_validation = _fit_validating(trainer)
            try:
                trainer.save_checkpoint(path)
            finally:
                self._rewind_validation = False
            self._last_checkpoint = path

        return save

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._rewind_validation:
            _rewind_validation(checkpoint)

    def _stop(self, trainer: Any) -> None:
        rt = self.runtime
        self._last_checkpoint = rt.resume_from if rt.preempted else self._last_checkpoint
        trainer.should_stop = True
        # Stopping early would otherwise run validation on slices we no longer hold.
        trainer.limit_val_batches = 0
        if self.options.exit_on_preempt:
            log.warning("gpupool: %s %s; exiting with code %d to be run again (resume from %s)", self.job,
                        rt.preempt_reason or "preempted", EX_TEMPFAIL, rt.resume_from)
            raise SystemExit(EX_TEMPFAIL)

    def _fence(self, trainer: Any, dec: Decision) -> None:
        raise self.runtime.fence(dec, int(trainer.global_step), self._save(trainer))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        # A fit that ends without a preemption finished the job: its checkpoints stop being
        # resume points (the lease is kept for what the script does next: test, export).
        if not self.runtime.preempted and not trainer.interrupted:
            self.runtime.finish(int(trainer.global_step), release=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.runtime.stop_training()
        self._hand_back_signals(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._hand_back_signals(trainer)
        if isinstance(exception, PoolLeaseLostError):
            log.error("gpupool: %s", exception)
