"""The in-job runtime: one :class:`PoolRuntime` per training process, shared by every adapter.

It composes small parts, each testable without a framework:

* :class:`~gpupool_sdk.runtime.options.RuntimeOptions`: the options, validated once;
* :mod:`~gpupool_sdk.runtime.leases`: the lease (direct, attached to ``gpupool run``, or
  follower) behind one Protocol;
* :class:`DirectiveInbox`: directives, signals and lease loss, raised as one attention flag
  that the per-step fast path reads;
* :class:`~gpupool_sdk.runtime.checkpoints.CheckpointBook`: atomic checkpoints and the resume point;
* :class:`~gpupool_sdk.runtime.publisher.TelemetryPublisher` and ``MemoryPeakMeter``;
* :class:`~gpupool_sdk.runtime.signals.SignalWatch`: SIGTERM/SIGINT/SIGUSR1 as preemptions.

The adapters call :meth:`PoolRuntime.step_boundary` where an optimizer step ended (and
:meth:`PoolRuntime.loop_boundary` between batches of other loops); everything else is bookkeeping.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupool_sdk.errors import GpupoolError, LeaseLostError
from gpupool_sdk.resources import Directive
from gpupool_sdk.runtime.checkpoints import CheckpointBook
from gpupool_sdk.runtime.decision import CARRY_ON, Decision, DecisionKind
from gpupool_sdk.runtime.env import (
    DEVICES_ENV,
    EX_TEMPFAIL,
    JOB_ENV,
    LEASE_ID_ENV,
    LEASED_ENV,
    RESUME_ENV,
    derive_job_name,
    process_rank,
)
from gpupool_sdk.runtime.leases import JobLease, LeaseMode, take_lease
from gpupool_sdk.runtime.options import RuntimeOptions
from gpupool_sdk.runtime.publisher import MemoryPeakMeter, TelemetryPublisher
from gpupool_sdk.runtime.sharing import JobSharing
from gpupool_sdk.runtime.signals import SignalWatch
from gpupool_sdk.telemetry.phases import Phase, PhaseTimer

log = logging.getLogger("gpupool_sdk.runtime")

#: ``(kind, quota_bytes) -> balloon controller``: the framework's memory tier (gpupool_torch provides it).
MemoryTier = Callable[[str, "int | None"], Any]
#: ``obj -> obj``: sends rank 0's object to every rank (the framework's broadcast).
Broadcast = Callable[[Any], Any]


class PoolLeaseLostError(LeaseLostError):
    """The job's lease was lost (revoked, or etcd unreachable past the TTL) while training.

    Training stopped at once so that the job never computes on a slice it no longer holds.
    ``emergency_checkpoint`` is the path written on the way out, or None; a restart under the
    same name resumes from it.
    """

    def __init__(self, job: str, reason: str, emergency_checkpoint: str | None) -> None:
        self.job = job
        self.reason = reason
        self.emergency_checkpoint = emergency_checkpoint
        saved = f"; emergency checkpoint at {emergency_checkpoint}" if emergency_checkpoint else ""
        super().__init__(
            f"job {job!r} lost its GPU lease ({reason}); training stopped{saved}. "
            "Check that etcd is reachable and the coordinator did not revoke the job, then restart it "
            "under the same name to resume"
        )


@dataclass
class PreemptTiming:
    """How long one preemption took, split into its parts (seconds).

    Attributes:
        boundary_wait_s: from the leader issuing the directive (its ``issued_at``) to the step
            boundary where this job acted on it.
        checkpoint_s: writing the checkpoint.
        protocol_s: writing the ack (through the client's helper process into etcd).
        release_s: from the ack to the coordinator taking the slices back, plus the release.
        total_s: directive issued to release done.
    """

    boundary_wait_s: float = 0.0
    checkpoint_s: float = 0.0
    protocol_s: float = 0.0
    release_s: float = 0.0
    total_s: float = 0.0


class DirectiveInbox:
    """Directives, signals and lease loss, behind one ``attention`` flag.

    The lease's threads append and raise the flag (plain attribute stores, atomic under the
    GIL); the step boundary reads the flag and, only when it is up, takes what arrived.
    """

    def __init__(self) -> None:
        self.attention = False
        #: Another gated job shares the GPU (the sharing gate sets it): attention stays up meanwhile.
        self.contended = False
        self.lost = False
        self.lost_reason = ""
        self.signal: int | None = None
        self._queue: collections.deque[Directive] = collections.deque()
        self._handled: set[int] = set()
        self._seen_at: dict[int, float] = {}

    def put(self, d: Directive) -> None:
        self._queue.append(d)
        self.attention = True

    def mark_lost(self, reason: Any = "") -> None:
        self.lost_reason = str(reason or "lease revoked or expired")
        self.lost = True
        self.attention = True

    def mark_signal(self, signum: int) -> None:
        self.signal = signum
        self.attention = True

    def handled(self, seq: int) -> None:
        self._handled.add(seq)

    def seen_at(self, seq: int, default: float) -> float:
        return self._seen_at.get(seq, default)

    def take(self) -> Decision:
        """The decision for what arrived (rank 0); lowers the flag first so that nothing is missed."""
        self.attention = self.contended
        if self.lost:
            self.attention = True
            return Decision(kind=DecisionKind.LOST, reason=self.lost_reason)
        if self.signal is not None:
            self.attention = True  # stays up until acted on
            return Decision(kind=DecisionKind.PREEMPT, reason=f"{SignalWatch.name(self.signal)} received",
                            directive_kind="signal")
        while self._queue:
            d = self._queue.popleft()
            if d.seq in self._handled:
                continue
            if self._queue:
                self.attention = True
            self._seen_at.setdefault(d.seq, time.monotonic())
            return Decision.from_directive(d)
        return CARRY_ON


class PoolRuntime:
    """Lease holder and directive engine shared by the framework adapters.

    Args:
        options: the validated options.
        client: a ready ``PoolClient``-like object (tests); default builds one.
        memory_tier: ``(kind, quota_bytes) -> balloon controller`` of the framework
            (``gpupool_torch.memory.make_balloon_controller``); None: balloon directives are refused.

    Example:
        >>> # rt = PoolRuntime(RuntimeOptions(gpus=1, memory="8GiB")); rt.acquire()
    """

    def __init__(self, options: RuntimeOptions, *, client: Any = None, memory_tier: MemoryTier | None = None) -> None:
        self.options = options
        self.job = derive_job_name(options.name)
        self.spec = options.job_spec(self.job)
        self.rank = process_rank()
        from gpupool_sdk.client.launch import launch_info

        #: Where the launcher put this process (torchrun, Slurm, Kubernetes variables).
        self.launch = launch_info(os.environ)
        self.mode = LeaseMode.for_process(self.rank, self.launch.local_rank, gang=self.spec.is_gang)
        if self.mode is LeaseMode.DIRECT and self.launch.nnodes != self.spec.nodes:
            from gpupool_sdk.errors import ConfigError

            raise ConfigError(
                "nodes",
                f"the launcher ({self.launch.launcher}) started this job on {self.launch.nnodes} node(s) but the "
                f"spec asks for nodes={self.spec.nodes}; pass nodes={self.launch.nnodes} (gpus is the total)",
            )
        if self.mode is LeaseMode.DIRECT and self.spec.is_elastic:
            from gpupool_sdk.errors import ConfigError

            # A resize restarts the job's processes; a lease held by this process ends with it,
            # so the job would lose its grant (and queue again) at every resize. `gpupool run`
            # holds the lease across that restart.
            raise ConfigError(
                "min_gpus",
                f"an elastic job (min_gpus={self.spec.min_gpus}, max_gpus={self.spec.max_gpus}) must run under "
                f"`gpupool run --min-gpus {self.spec.min_gpus} --max-gpus {self.spec.max_gpus} -- python ...`, "
                "which keeps the job's lease while the script restarts on the resized grant; a process that "
                "leases directly would lose its grant at every resize. Start it under gpupool run, or drop "
                "min_gpus/max_gpus",
            )
        self.book = CheckpointBook(options.checkpoint_path(), self.job, options.keep_checkpoints, options.resume_paths)
        self.timer = PhaseTimer()
        self.inbox = DirectiveInbox()
        self.meter = MemoryPeakMeter(options.memory_peak_fn, lambda: self._balloon)
        self.publisher = TelemetryPublisher(self.job, self.timer, self.meter, float(options.telemetry_interval_s))
        self.signals = SignalWatch(self.inbox.mark_signal)
        self.lease: JobLease | None = None
        self.lease_hex = ""
        self.resume_from: str | None = None
        self.slices = 0
        self.devices_visible: list[str] = []
        self.preemptions = 0
        self.lease_generation = 0
        self.preempted = False
        self.preempt_reason = ""
        self.finished = False
        self.lost_error: PoolLeaseLostError | None = None
        self.last_preempt: PreemptTiming | None = None
        self.step = 0
        self._client = client
        self._memory_tier = memory_tier
        self._balloon: Any = None
        self._optimizers: list[Any] = []
        self._training = False
        self._pid = os.getpid()
        self._closed = False
        #: MPS environment or time-slicing gate of the grant (gpupool_sdk.runtime.sharing).
        self.sharing = JobSharing(self.job, self.inbox, mode=options.sharing, period_s=options.timeslice_period_s,
                                  offload=options.handover_offload, balloon=self.balloon_controller)

    # -- lease ---------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True on the process that holds the lease (rank 0)."""
        return self.mode is not LeaseMode.FOLLOWER

    def _client_factory(self) -> Any:
        if self._client is None:
            from gpupool_sdk.client import PoolClient

            self._client = PoolClient(endpoints=self.options.endpoints, prefix=self.options.prefix)
        return self._client

    def acquire(self) -> None:
        """Take the lease (or read rank 0's grant), set ``CUDA_VISIBLE_DEVICES``, find the resume point."""
        grant = take_lease(self.mode, self.spec, rank=self.rank, client_factory=self._client_factory,
                           timeout=self.options.acquire_timeout, on_status=self.options.on_status)
        if grant.launcher_spec:
            from gpupool_sdk.errors import ConfigError

            try:
                self._check_launcher_spec(grant.launcher_spec)
            except ConfigError as exc:
                # Running the script again cannot help: the launcher gives up instead of restarting it.
                refuse = getattr(grant.lease, "refuse", None)
                if refuse is not None:
                    refuse(exc.field, str(exc))
                raise
            from gpupool_sdk.resources import JobSpec

            with contextlib.suppress(Exception):  # the launcher's spec is the job's (its quota, its name)
                self.spec = JobSpec.from_dict(grant.launcher_spec)
        if grant.job != self.job:
            log.warning("gpupool run holds job %r; this process uses that name (not %r)", grant.job, self.job)
            self.job = grant.job
            self.book = CheckpointBook(self.book.directory, self.job, self.options.keep_checkpoints,
                                       self.options.resume_paths)
            self.publisher.job = self.job
        self.lease = grant.lease
        self.lease_hex = grant.lease_hex
        self.slices = grant.slices
        self.devices_visible = grant.devices
        self.lease_generation += 1
        # Rank 0 chooses the resume point (the newest readable checkpoint); followers take its choice.
        # (followers of a gang, started by the launcher rather than by rank 0, compute it too: the
        # checkpoint directory is shared and the rule is the same).
        self.resume_from = (self.book.resume_point(grant.resume_hint) if self.is_leader or grant.resume_hint is None
                            else grant.resume_hint)
        if self.lease is not None:
            self.lease.add_lost_callback(self.inbox.mark_lost)
            threading.Thread(target=self._watch_directives, args=(self.lease,), name="gpupool-directives",
                             daemon=True).start()
            log.info("gpupool: %s holds lease %s (etcdctl lease timetolive %s --keys)", self.job, self.lease_hex,
                     self.lease_hex)
        if grant.devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(grant.devices)
        self._plan_sharing()
        os.environ[LEASED_ENV] = "1"
        os.environ[DEVICES_ENV] = str(self.slices)
        os.environ[JOB_ENV] = self.job
        if self.lease_hex:
            os.environ[LEASE_ID_ENV] = self.lease_hex
        if self.resume_from:
            os.environ[RESUME_ENV] = self.resume_from
        else:
            os.environ.pop(RESUME_ENV, None)
        # The signal handlers wait for training (arm_signals): until then there is nothing to checkpoint.
        atexit.register(self.close)

    def _plan_sharing(self) -> None:
        """MPS environment (before CUDA initialises) or time-slicing plan of this grant (docs/sharing.md)."""
        self.sharing.job = self.job
        if self.mode is LeaseMode.ATTACHED:
            self.sharing.from_launcher()
        elif self.mode is LeaseMode.DIRECT and self.lease is not None:
            self.sharing.on_lease(self.lease, self._client)

    def _check_launcher_spec(self, launched: Mapping[str, Any]) -> None:
        """Under ``gpupool run`` the launcher's flags are the spec; a callback value that differs is an error.

        Only the values the script set away from their defaults are compared (a default means
        "whatever the launcher says").
        """
        from gpupool_sdk.errors import ConfigError
        from gpupool_sdk.resources import JobSpec
        from gpupool_sdk.resources.units import parse_size

        try:
            theirs = JobSpec.from_dict(launched)
        except Exception:  # noqa: BLE001 - an older launcher's spec: nothing to compare
            return
        o, d = self.options, RuntimeOptions(memory=0)
        mine: list[tuple[str, str, Any, Any, Any]] = [
            ("gpus", "--gpus", o.gpus, d.gpus, theirs.gpus),
            ("qos", "--qos", o.qos, d.qos, theirs.qos_class.value),
            ("priority", "--priority", o.priority, d.priority, theirs.priority),
            ("compute_share", "--compute-share", o.compute_share, d.compute_share, theirs.compute_share),
        ]
        if o.memory is not None:
            mine.append(("memory", "--memory", parse_size(o.memory), None, theirs.memory_bytes))
        for key, flag, own, default, leased in mine:
            if own in (default, leased):
                continue
            raise ConfigError(
                key,
                f"the script's callback asks {key}={own!r} but `gpupool run {flag}` leased {leased!r}; under "
                f"gpupool run the launcher's flags are the job's spec: drop {key}= from the callback or pass "
                f"{flag} {own} to gpupool run",
            )

    def _watch_directives(self, lease: JobLease) -> None:
        # Blocks on the lease's directive stream (no CPU while waiting); ends with the lease.
        for d in lease.directives():
            self.inbox.put(d)

    @property
    def accelerator(self) -> str:
        """``"gpu"`` when the lease holds real GPUs visible to CUDA, else ``"cpu"``."""
        try:
            import torch

            return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        except Exception:  # noqa: BLE001 - no torch: CPU
            return "cpu"

    @property
    def devices(self) -> int:
        """Number of devices (or CPU processes) the framework should use: one per leased slice."""
        if self.accelerator == "gpu":
            import torch

            return max(1, min(self.slices, torch.cuda.device_count()))
        return max(1, self.slices)

    def arm_signals(self, found: Mapping[int, Any] | None = None) -> bool:
        """Handle the preemption signals from here on: the adapter calls it where step boundaries begin.

        Not at :meth:`acquire`: a signal only ever acts at a step boundary, and before training
        (building the model, DDP's rendezvous, restoring a checkpoint) none may come for minutes,
        or ever, when the process is blocked in a collective whose peer died: a recording handler
        there kept the process alive until its launcher's SIGKILL (torchrun's 30 s). Until armed,
        the process's own dispositions stand: by default SIGTERM ends it at once, with nothing to
        save, and ``gpupool run`` reports it stopped before its checkpoint (exit 75). Idempotent;
        a no-op once the lease is given back, lost or closed. Returns whether the watch is active.

        Args:
            found: the handlers a framework found before it put its own in place (see
                :meth:`SignalWatch.install`).
        """
        if self._closed or self.preempted or self.lost_error is not None:
            return False
        self.signals.install(self.options.signal_numbers, found)
        return self.signals.active

    def lease_lost(self) -> bool:
        """True when the lease is gone (one attribute read)."""
        return self.inbox.lost

    def close(self) -> None:
        """Release the lease (job done or process exiting). Idempotent; a no-op in forked children."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self.stop_training()
        self.signals.uninstall()
        lease = self.lease
        if lease is not None:
            try:
                lease.release()
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the helper revokes anyway
                log.debug("release failed: %s", exc)
        close_client = getattr(self._client, "close", None)
        if close_client is not None:
            try:
                close_client()
            except Exception as exc:  # noqa: BLE001
                log.debug("client close failed: %s", exc)

    # -- training ------------------------------------------------------------------------------
    def start_training(self, optimizers: Any = ()) -> None:
        """Training starts: register ``optimizers``, build the balloon tier, start sampler and exporter.

        Idempotent; nothing here may stop training (failures are logged).
        """
        for opt in optimizers or ():
            self.add_optimizer(opt)
        if self._training:
            return
        self._training = True
        try:
            self.balloon_controller()
        except Exception as exc:  # noqa: BLE001 - a balloon directive retries and acks the error
            log.warning("gpupool: no memory balloon for %s yet (%s); a balloon directive will be refused", self.job, exc)
        if self.is_leader:
            self.sharing.start()
        if self.lease is None:
            return
        if self.accelerator == "gpu":
            allocs = getattr(self.lease, "allocations", ()) or ()
            self.publisher.start_sampler([str(a.gpu_uuid) for a in allocs if getattr(a, "gpu_uuid", None)])
        if self.options.metrics_port is not None:
            self.publisher.start_exporter(self.options.metrics_port, self.options.metrics_addr)

    def stop_training(self) -> None:
        """Training ended: stop the sampler and the exporter, leave the time-slicing rotation."""
        self._training = False
        self.publisher.stop()
        self.sharing.stop()

    def add_optimizer(self, optimizer: Any) -> None:
        """Register an optimizer whose state a balloon may offload to host memory."""
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
            if self._balloon is not None and hasattr(self._balloon, "add_optimizer"):
                self._balloon.add_optimizer(optimizer)

    def balloon_controller(self) -> Any:
        """The memory tier's balloon controller (built on first use), or None when ballooning is off."""
        if self._balloon is None and self.options.allocator != "none" and self._memory_tier is not None:
            kind = self.options.allocator
            if kind == "torch" and self.accelerator != "gpu":
                kind = "host"
            self._balloon = self._memory_tier(kind, self.spec.memory_bytes or None)
            for opt in self._optimizers:
                self._balloon.add_optimizer(opt)
        return self._balloon

    def report_memory_peak(self, peak_bytes: int) -> None:
        """Report the job's per-slice memory peak (bytes) for the next summary (one comparison)."""
        self.meter.report(peak_bytes)

    def set_total_steps(self, total_steps: int | float | None) -> None:
        """The job's declared length in optimizer steps; summaries then carry ``progress`` and ``remaining_s``."""
        self.publisher.set_total_steps(total_steps)

    # -- step boundary ---------------------------------------------------------------------------
    def decide(self) -> Decision:
        """Rank 0: what every rank does at this boundary (no I/O). Carry on unless attention is up."""
        if self.preempted or (self.lease is None and self.inbox.signal is None):
            return CARRY_ON
        if not self.inbox.attention:
            return CARRY_ON
        return self.inbox.take()

    def agree(self, broadcast: Broadcast | None) -> Decision:
        """The decision every rank acts on: rank 0's, broadcast when there are several ranks."""
        if broadcast is None:
            return self.decide()
        wire = self.decide().to_wire() if self.is_leader else None
        return Decision.from_wire(broadcast(wire))

    def step_boundary(self, step_of: Callable[[], int], save: Callable[[str], None] | None,
                      broadcast: Broadcast | None = None, now: float | None = None) -> Decision:
        """Act at an optimizer-step boundary; returns the decision (``kind.stops``: stop training).

        Single process, nothing pending, no summary due: two attribute reads and a comparison.

        Args:
            step_of: returns the global step (called only when a step number is needed).
            save: writes a checkpoint to the given path (every rank calls it).
            broadcast: the framework's rank-0 broadcast when there are several ranks (all ranks
                must call this method on the same steps).
            now: a ``time.monotonic()`` reading the caller already took.

        Raises:
            PoolLeaseLostError: the lease is gone (after an emergency checkpoint).
        """
        if broadcast is None and not self.inbox.attention:
            if self.lease is not None and (now is None or now >= self.publisher.next_due):
                self.step = step_of()
                self.publisher.maybe_publish(self.lease, self.step, now)
            return CARRY_ON
        if self.inbox.contended:
            self.sharing.turn()  # another job shares the GPU: wait for our turn (docs/sharing.md)
        dec = self.agree(broadcast)
        if dec.kind is not None:
            self.step = step_of()
            self.act(dec, self.step, save)
            if dec.kind.stops:
                if broadcast is not None:
                    # Every rank leaves together, once rank 0 has acked: a launcher that stops the
                    # other ranks when one exits (torchrun) would otherwise kill rank 0 mid-ack.
                    broadcast(None)
                return dec
        if self.lease is not None and (now is None or now >= self.publisher.next_due):
            self.step = step_of()
            self.publisher.maybe_publish(self.lease, self.step, now)
        return dec

    def act(self, dec: Decision, step: int, save: Callable[[str], None] | None) -> None:
        """Carry out ``dec`` on this rank (checkpoint, balloon, ack, fence).

        Raises:
            PoolLeaseLostError: ``dec`` is ``LOST``.
        """
        kind = dec.kind
        if kind is DecisionKind.LOST:
            raise self.fence(dec, step, save)
        if kind in (DecisionKind.PREEMPT, DecisionKind.RESIZE):
            if save is None:
                raise GpupoolError("a preemption needs a way to save a checkpoint (save=None)")
            self.preempt(dec, step, save)
        elif kind in (DecisionKind.BALLOON, DecisionKind.DEFLATE):
            self.balloon(dec, step)
        elif kind is DecisionKind.REFUSE:
            self.refuse(dec, step)

    def preempt(self, dec: Decision, step: int, save: Callable[[str], None]) -> str:
        """Every rank: checkpoint through ``save(path)``; rank 0 acks, waits for the release, releases.

        Returns:
            The checkpoint path.
        """
        boundary, boundary_wall = time.monotonic(), time.time()
        by_signal = dec.directive_kind == "signal"
        self.preemptions += 1  # counted before the save so that the checkpoint carries it
        path = self.book.write(step, "signal" if by_signal else "preempt", save, writer=self.rank == 0)
        saved = time.monotonic()
        self.timer.add(Phase.CHECKPOINT, saved - boundary, standalone=True)
        self.preempted = True
        self.preempt_reason = dec.reason
        self.resume_from = path
        self.inbox.handled(dec.seq)
        log.info("gpupool: %s stopped at step %d (%s); checkpoint %s", self.job, step, dec.reason, path)
        # A resize under `gpupool run` keeps the lease: the launcher waits for the re-grant and
        # runs the script again on the new slices (no release, no second queueing).
        keep_lease = dec.kind is DecisionKind.RESIZE and self.mode is LeaseMode.ATTACHED
        if dec.kind is DecisionKind.RESIZE and self.mode is LeaseMode.DIRECT:
            # Never sent by this SDK's coordinator (a direct lease is never elastic, see __init__):
            # the lease ends with this process, so the resize can only be a preemption.
            log.warning("gpupool: %s got a resize directive on a direct lease; handled as a preemption (run "
                        "elastic jobs under `gpupool run --min-gpus --max-gpus` to keep the grant)", self.job)
        if self.is_leader and self.lease is not None:
            acked = saved
            if not by_signal:
                # Every node of a gang acks (its node's ranks stopped), naming the shared checkpoint.
                self.lease.ack(dec.directive(), step=step, checkpoint=path, ok=True,
                               message="checkpointed; restarting on the resized grant" if keep_lease else "checkpointed")
                acked = time.monotonic()
                if not keep_lease and not self.lease.wait_released(timeout=self.options.release_timeout):
                    log.warning("slices of %s not taken back within %.0fs; releasing the lease", self.job,
                                self.options.release_timeout)
            if by_signal:
                # Under `gpupool run` the launcher learns that the script checkpointed: a launcher in
                # between (torchrun exits 1 when it is signalled) hides the script's exit 75.
                stopped = getattr(self.lease, "stopped", None)
                if stopped is not None:
                    stopped(path, dec.reason)
            if keep_lease:
                self._closed = True  # the launcher keeps the lease through the resize
                self.stop_training()
                self.signals.uninstall()
            else:
                self.close()
            done = time.monotonic()
            waited = (max(0.0, boundary_wall - dec.issued_at) if dec.issued_at > 0
                      else boundary - self.inbox.seen_at(dec.seq, boundary))
            self.last_preempt = PreemptTiming(boundary_wait_s=waited, checkpoint_s=saved - boundary,
                                              protocol_s=acked - saved, release_s=done - acked,
                                              total_s=waited + (done - boundary))
        return path

    def balloon(self, dec: Decision, step: int) -> None:
        """Every rank: inflate or deflate the memory balloon; rank 0 acks the bytes reached."""
        self.inbox.handled(dec.seq)
        ok, message, reached = True, "", None
        try:
            ctl = self.balloon_controller()
            if ctl is None:
                ok, message = False, ("ballooning disabled (allocator='none')" if self.options.allocator == "none"
                                      else "no memory tier: this adapter does not balloon")
            else:
                if ctl.kind == "host":
                    self.meter.note_boundary(int(ctl.usage_bytes()))
                if dec.kind is DecisionKind.BALLOON:
                    res = ctl.inflate(int(dec.target.get("memory_bytes", 0)))
                    ok, message, reached = bool(res.reached_target), res.message, int(res.reached_bytes)
                else:
                    res = ctl.deflate()
                    message, reached = res.message, int(res.reached_bytes)
        except GpupoolError as exc:
            ok, message = False, str(exc)
        if self.is_leader and self.lease is not None:
            self.lease.ack(dec.directive(), step=step, reached_bytes=reached, ok=ok, message=message)

    def refuse(self, dec: Decision, step: int) -> None:
        """Rank 0: ack a directive of a kind this SDK does not know as refused, with the reason."""
        self.inbox.handled(dec.seq)
        msg = (f"unknown directive kind {dec.directive_kind!r}: this gpupool-sdk knows preempt, resize, balloon "
               "and deflate; upgrade the SDK in the training image to match the coordinator")
        log.warning("gpupool: %s", msg)
        if self.is_leader and self.lease is not None:
            d = Directive(kind=dec.directive_kind, seq=dec.seq, deadline=0.0, target=dict(dec.target), reason=dec.reason)
            self.lease.ack(d, step=step, ok=False, message=msg)

    def fence(self, dec: Decision, step: int, save: Callable[[str], None] | None) -> PoolLeaseLostError:
        """Lease lost: write an emergency checkpoint if possible; return the error to raise."""
        path: str | None = None
        if save is not None:
            try:
                path = self.book.write(step, "emergency", save, writer=self.rank == 0)
            except Exception as exc:  # noqa: BLE001 - the error we raise matters more
                log.warning("emergency checkpoint failed: %s", exc)
        self.lost_error = PoolLeaseLostError(self.job, dec.reason or self.inbox.lost_reason, path)
        self._closed = True  # nothing left to release
        self.signals.uninstall()
        self.sharing.stop()  # no more turns on a GPU the job no longer holds
        return self.lost_error

    def finish(self, step: int, release: bool = True) -> None:
        """Training finished normally: the job's checkpoints stop being resume points; release unless told not to."""
        if self.preempted or self.lost_error is not None:
            return
        if not self.finished and self.rank == 0:
            self.book.mark_finished(step)
        self.finished = True
        if release:
            self.close()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Phase totals, preemption count, lease generation and lease id, for the checkpoint."""
        return {
            "version": 1,
            "phases": self.timer.state_dict(),
            "preemptions": self.preemptions,
            "lease_generation": self.lease_generation,
            "lease": self.lease_hex,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        from gpupool_sdk.errors import ConfigError

        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ConfigError("state_dict", "not a gpupool callback state (expected version 1)")
        self.timer.load_state_dict(dict(state["phases"]))
        self.preemptions = max(self.preemptions, int(state.get("preemptions", 0)))
        saved = int(state.get("lease_generation", 0))
        same_lease = bool(self.lease_hex) and state.get("lease") == self.lease_hex
        # A checkpoint written under the lease held now (a ModelCheckpoint file resumed in the same
        # run) does not start a new generation; one from an earlier lease does.
        self.lease_generation = saved if same_lease else saved + max(1, self.lease_generation)


class PoolAdapter:
    """What every framework adapter exposes of its :class:`PoolRuntime` (``self.runtime``)."""

    runtime: PoolRuntime

    @property
    def job(self) -> str:
        """The job name."""
        return self.runtime.job

    @property
    def devices(self) -> int:
        """Devices for the framework: one per leased slice (CPU processes on a machine without GPUs)."""
        return self.runtime.devices

    @property
    def resume_from(self) -> str | None:
        """The newest readable checkpoint of this job (pass it as ``ckpt_path``), or None."""
        return self.runtime.resume_from

    @property
    def preempted(self) -> bool:
        """True once this process checkpointed and gave its slices back."""
        return self.runtime.preempted

    @property
    def lease_id(self) -> str:
        """The job's etcd lease in hex: ``etcdctl lease timetolive <lease_id> --keys``."""
        return self.runtime.lease_hex

    @property
    def preemptions(self) -> int:
        """Preemptions over the job's life (restored from checkpoints)."""
        return self.runtime.preemptions

    @property
    def lease_generation(self) -> int:
        """How many leases the job has held, this one included (restored from checkpoints)."""
        return self.runtime.lease_generation

    @property
    def phase_timer(self) -> PhaseTimer:
        """The :class:`~gpupool_sdk.telemetry.phases.PhaseTimer` of this process."""
        return self.runtime.timer

    @property
    def preempt_timing(self) -> PreemptTiming | None:
        """Timing of the last preemption (rank 0), or None."""
        return self.runtime.last_preempt

    def report_memory_peak(self, peak_bytes: int) -> None:
        """Report the job's per-slice memory peak (bytes) for the next published summary.

        Cheap (one comparison, no I/O): it may be called every step.

        Example:
            >>> # pool.report_memory_peak(torch.cuda.max_memory_allocated())

        Raises:
            ConfigError: ``peak_bytes`` is not a whole number of bytes >= 0.
        """
        self.runtime.report_memory_peak(peak_bytes)

    def exit_if_preempted(self) -> None:
        """Exit with code 75 (``EX_TEMPFAIL``: "run me again") if preempted; release the lease either way."""
        self.runtime.close()
        if self.runtime.preempted:
            raise SystemExit(EX_TEMPFAIL)

    def close(self) -> None:
        """Release the lease now (idempotent; also runs at process exit)."""
        self.runtime.close()

    def state_dict(self) -> dict[str, Any]:
        """Phase totals, preemption count and lease generation, to store in the checkpoint."""
        return self.runtime.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from the checkpoint being resumed)."""
        self.runtime.load_state_dict(state_dict)
