"""The framework-agnostic engine behind :class:`GpuPoolCallback` and :class:`PoolSession`.

One :class:`PoolRuntime` per training process. It

* builds and validates the :class:`~gpupool_sdk.resources.JobSpec`;
* takes the lease before the framework touches CUDA, in one of three modes:

  - ``direct``: ``PoolClient.acquire`` (the process submits its own spec and waits in the queue);
  - ``attach``: under ``gpupool run`` (``$GPUPOOL_RUN_SOCKET`` is set) the launcher holds the
    lease and the process talks to it over a local Unix socket (:mod:`.run_channel`);
  - ``follower``: a non-zero rank of a multi-process job (``$RANK``/``$LOCAL_RANK`` > 0); it
    holds no lease and learns every decision from rank 0 through the framework's broadcast;

* sets ``CUDA_VISIBLE_DEVICES`` to the leased devices and exports ``GPUPOOL_*`` so the other ranks
  (started later by the framework) see the same grant;
* at step boundaries, turns directives into actions (:meth:`decide`, :meth:`preempt`,
  :meth:`balloon`) and hands telemetry to the lease (whose I/O runs in the client's helper
  process, never on the training thread).

Environment variables (the contract with ``gpupool run`` and with other ranks):

``GPUPOOL_JOB`` job name; ``GPUPOOL_ENDPOINTS``/``GPUPOOL_PREFIX`` where the pool is;
``GPUPOOL_RUN_SOCKET`` attach to a ``gpupool run`` launcher; ``GPUPOOL_LEASED=1``,
``GPUPOOL_DEVICES`` (slice count), ``GPUPOOL_RESUME_FROM`` (checkpoint path) exported for the
other ranks; ``GPUPOOL_CHECKPOINT_DIR`` default checkpoint directory.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import ConfigError, GpupoolError, LeaseLostError
from gpupool_sdk.resources import Directive, DirectiveKind, JobSpec
from gpupool_sdk.telemetry.phases import Phase, PhaseTimer
from gpupool_sdk.telemetry.summary import TelemetrySummary, from_phase_timer

log = logging.getLogger("gpupool_sdk.runtime")

#: Exit code of a training process that was preempted and wants to be run again (sysexits.h).
EX_TEMPFAIL = 75

JOB_ENV = "GPUPOOL_JOB"
RUN_SOCKET_ENV = "GPUPOOL_RUN_SOCKET"
LEASED_ENV = "GPUPOOL_LEASED"
DEVICES_ENV = "GPUPOOL_DEVICES"
RESUME_ENV = "GPUPOOL_RESUME_FROM"
CKPT_DIR_ENV = "GPUPOOL_CHECKPOINT_DIR"

_ALLOCATORS = ("torch", "gpupool", "none")


class PoolLeaseLostError(LeaseLostError):
    """The job's lease was lost (revoked, or etcd unreachable past the TTL) while training.

    Training stopped at once so that the job never computes on a slice it no longer holds.
    ``emergency_checkpoint`` is the path written on the way out, or None.
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


def derive_job_name(explicit: str | None = None, argv0: str | None = None) -> str:
    """The job name: ``explicit``, else ``$GPUPOOL_JOB``, else the script's file name.

    The script name is lowercased and reduced to the allowed characters
    (``train_BERT.py`` -> ``train_bert``).

    Example:
        >>> derive_job_name(argv0="/home/me/Train BERT.py")
        'train-bert'
    """
    if explicit:
        return explicit
    env = os.environ.get(JOB_ENV)
    if env:
        return env
    stem = Path(argv0 if argv0 is not None else (sys.argv[0] if sys.argv and sys.argv[0] else "job")).stem
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._")[:63].strip("-._")
    return name or "job"


def process_rank() -> int:
    """Global rank of this process as the launchers set it (0 when not distributed)."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return 0


def _check_positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
    return value


def _check_peak_bytes(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"must be a whole number of bytes >= 0, got {value!r}")
    return value


def _check_opt_positive(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(name, f"must be a number of seconds > 0 (or None), got {value!r}")
    return float(value)


@dataclass
class PreemptTiming:
    """How long one preemption took, split into its parts (seconds).

    Directive to ack = ``boundary_wait_s + checkpoint_s + protocol_s``.

    Attributes:
        boundary_wait_s: from the leader issuing the directive (its ``issued_at``, wall clock) to
            the step boundary where this job acted on it: etcd propagation plus the rest of the
            current step.
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


@dataclass
class Decision:
    """What every rank does at one step boundary (broadcast from rank 0).

    ``kind`` is ``None`` (carry on), ``"preempt"`` (also used for ``resize``), ``"balloon"``,
    ``"deflate"`` or ``"lost"``.
    """

    kind: str | None = None
    seq: int = 0
    target: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    issued_at: float = 0.0

    def to_wire(self) -> dict[str, Any] | None:
        if self.kind is None:
            return None
        return {"kind": self.kind, "seq": self.seq, "target": dict(self.target), "reason": self.reason,
                "issued_at": self.issued_at}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any] | None) -> Decision:
        if not obj:
            return cls()
        return cls(kind=obj["kind"], seq=int(obj["seq"]), target=dict(obj.get("target", {})),
                   reason=obj.get("reason", ""), issued_at=float(obj.get("issued_at", 0.0)))


_CARRY_ON = Decision()


class PoolRuntime:
    """Lease holder and directive engine shared by the framework adapters.

    Args:
        gpus, memory, qos, priority, compute_share: the slice request (see
            :class:`~gpupool_sdk.resources.JobSpec`); further ``JobSpec`` fields go in ``spec_fields``.
        name: job name (default: :func:`derive_job_name`).
        checkpoint_dir: where preemption checkpoints go (default ``$GPUPOOL_CHECKPOINT_DIR`` or
            ``./gpupool-checkpoints``); must be shared by every rank.
        endpoints: etcd endpoints (default ``$GPUPOOL_ENDPOINTS``).
        prefix: key prefix (default ``$GPUPOOL_PREFIX``).
        allocator: memory tier for balloon directives: ``"torch"`` (default; the host tier on a
            machine without CUDA), ``"gpupool"`` (the SDK's allocator) or ``"none"``.
        check_every_n_steps: how often rank 0 looks for a directive (and the ranks agree on it).
        telemetry_interval_s: how often a rolling summary is handed to the lease.
        acquire_timeout: seconds to wait in the queue (None: forever).
        release_timeout: seconds to wait for the coordinator to take the slices back after a
            preempt ack before releasing anyway.
        on_status: called with each status change while queued.
        client: a ready ``PoolClient``-like object (tests); default builds one.
        memory_peak_fn: called (on the training thread) only when a summary is due; returns the
            job's per-slice memory peak in bytes since the previous call, or None when it does not
            know. A number replaces the measured figure in the published ``memory_peak_bytes``.
        metrics_port: serve the job's own summary as Prometheus metrics on this port (rank 0;
            0 picks a free one); None for no exporter.
        spec_fields: extra :class:`JobSpec` fields (``features``, ``gpu_model``, ``min_runtime_s``...).

    Raises:
        ConfigError: an argument is invalid; the message names it.
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
        prefix: str | None = None,
        compute_share: float = 1.0,
        allocator: str = "torch",
        check_every_n_steps: int = 1,
        telemetry_interval_s: float = 5.0,
        acquire_timeout: float | None = None,
        release_timeout: float = 30.0,
        on_status: Callable[[Any], None] | None = None,
        client: Any = None,
        memory_peak_fn: Callable[[], int | None] | None = None,
        metrics_port: int | None = None,
        **spec_fields: Any,
    ) -> None:
        if memory_peak_fn is not None and not callable(memory_peak_fn):
            raise ConfigError(
                "memory_peak_fn", f"must be a callable returning bytes or None, got {memory_peak_fn!r}"
            )
        if metrics_port is not None and (
            isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535
        ):
            raise ConfigError("metrics_port", f"must be a TCP port 0-65535 (0: any free port) or None, got {metrics_port!r}")
        if allocator not in _ALLOCATORS:
            raise ConfigError("allocator", f"got {allocator!r}; use one of {', '.join(map(repr, _ALLOCATORS))}")
        self.check_every_n_steps = _check_positive_int(check_every_n_steps, "check_every_n_steps")
        self.telemetry_interval_s = _check_opt_positive(telemetry_interval_s, "telemetry_interval_s") or 5.0
        self.acquire_timeout = _check_opt_positive(acquire_timeout, "acquire_timeout")
        self.release_timeout = _check_opt_positive(release_timeout, "release_timeout") or 30.0
        if memory is None:
            memory = 0
            if qos != "exclusive":
                raise ConfigError(
                    "memory", f"{qos} jobs must say how much GPU memory per slice they need, e.g. memory='20GiB'"
                )
        job = derive_job_name(name)
        self.spec = JobSpec(
            name=job, gpus=gpus, memory=memory, qos=qos, priority=priority, compute_share=compute_share, **spec_fields
        )
        self.job = job
        ckdir = checkpoint_dir if checkpoint_dir is not None else os.environ.get(CKPT_DIR_ENV, "gpupool-checkpoints")
        if not isinstance(ckdir, (str, os.PathLike)) or not str(ckdir):
            raise ConfigError("checkpoint_dir", f"must be a directory path, got {checkpoint_dir!r}")
        self.checkpoint_dir = Path(ckdir)
        self.endpoints = endpoints
        self.prefix = prefix
        self.allocator = allocator
        self.on_status = on_status
        self._client = client
        self.rank = process_rank()
        self.mode = "follower" if self.rank != 0 else ("attach" if os.environ.get(RUN_SOCKET_ENV) else "direct")
        self.lease: Any = None
        self.resume_from: str | None = None
        self.slices = 0
        self.timer = PhaseTimer()
        self.preemptions = 0
        self.lease_generation = 0
        self.preempted = False
        self.lost_error: PoolLeaseLostError | None = None
        self.last_preempt: PreemptTiming | None = None
        self._handled_seqs: set[int] = set()
        self._directive_seen_at: dict[int, float] = {}
        self._balloon: Any = None
        self._optimizers: list[Any] = []
        self._next_publish = 0.0
        self.memory_peak_fn = memory_peak_fn
        self.metrics_port = metrics_port
        # Memory peak bookkeeping, all touched only at step boundaries where something happens
        # (a publish, a balloon), never per step: the user's reports since the last publish, the
        # footprint seen at balloon boundaries since the last publish, and torch's lifetime peak
        # at the last publish (to tell whether it rose within the window).
        self._reported_peak: int | None = None
        self._boundary_peak = 0
        self._torch_peak_seen = 0
        self._training = False
        self._sampler: Any = None
        self._job_metrics: Any = None
        self._metrics_server: Any = None
        self._lost_flag = threading.Event()
        self._inbox: collections.deque[Directive] = collections.deque()
        self._inbox_flag = threading.Event()
        # Plain attributes that the lease's threads set (a store is atomic under the GIL), so
        # that the per-step checks read one attribute instead of calling Event.is_set():
        # _lost_seen mirrors _lost_flag; _attention is raised with every directive or loss.
        self._lost_seen = False
        self._attention = False
        # True when the lease can only be asked (it takes no lost callback): the per-step check
        # then reads the lease too; otherwise _lost_seen alone tells (the callback raises it).
        self._poll_lost = False
        self._watching = False
        self._pid = os.getpid()
        self._closed = False
        self.step = 0

    # -- lease -----------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True on the process that holds the lease (rank 0)."""
        return self.mode != "follower"

    def acquire(self) -> None:
        """Take the lease (or read rank 0's grant), set ``CUDA_VISIBLE_DEVICES``, find the resume checkpoint."""
        if self.mode == "follower":
            if os.environ.get(LEASED_ENV) != "1":
                raise ConfigError(
                    "RANK",
                    f"this process is rank {self.rank} but rank 0 exported no grant ({LEASED_ENV} unset); "
                    "start multi-process jobs from one script (Lightning's ddp launcher) or under `gpupool run`",
                )
            self.slices = int(os.environ.get(DEVICES_ENV, str(self.spec.gpus)))
            self.resume_from = os.environ.get(RESUME_ENV) or None
            return
        if self.mode == "attach":
            from gpupool_sdk.runtime.run_channel import ChannelLease

            self.lease = ChannelLease.connect(os.environ[RUN_SOCKET_ENV])
            if self.lease.job != self.job:
                log.warning("gpupool run holds job %r; this process uses that name (not %r)", self.lease.job, self.job)
                self.job = self.lease.job
            self.resume_from = self.lease.resume_from
        else:
            client = self._client
            if client is None:
                from gpupool_sdk.client import PoolClient

                client = self._client = PoolClient(endpoints=self.endpoints, prefix=self.prefix)
            self.lease = client.acquire(self.spec, timeout=self.acquire_timeout, on_status=self.on_status)
            ck = client.resume_info(self.job)
            self.resume_from = ck.path if ck is not None and ck.path and Path(ck.path).exists() else None
        self.lease_generation += 1
        add_cb = getattr(self.lease, "add_lost_callback", None)
        self._poll_lost = add_cb is None
        if add_cb is not None:
            add_cb(self._on_lease_lost)
            if callable(getattr(self.lease, "directives", None)):
                self._watching = True
                threading.Thread(
                    target=self._watch_directives, args=(self.lease,), name="gpupool-directives", daemon=True
                ).start()
        devices = _visible_devices(self.lease)
        self.slices = max(1, len(devices)) if devices else self.spec.gpus
        if devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        os.environ[LEASED_ENV] = "1"
        os.environ[DEVICES_ENV] = str(self.slices)
        os.environ[JOB_ENV] = self.job
        if self.resume_from:
            os.environ[RESUME_ENV] = self.resume_from
        else:
            os.environ.pop(RESUME_ENV, None)
        atexit.register(self.close)

    @property
    def accelerator(self) -> str:
        """``"gpu"`` when the lease holds real GPUs visible to CUDA, else ``"cpu"``."""
        try:
            import torch

            return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        except Exception:  # noqa: BLE001
            return "cpu"

    @property
    def devices(self) -> int:
        """Number of devices (or CPU processes) the framework should use: one per leased slice."""
        if self.accelerator == "gpu":
            import torch

            return max(1, min(self.slices, torch.cuda.device_count()))
        return max(1, self.slices)

    def _on_lease_lost(self, *_: Any) -> None:
        # Called from the lease's thread.
        self._lost_flag.set()
        self._lost_seen = True
        self._attention = True

    def lease_lost(self) -> bool:
        """True when the lease is gone (cheap: two attribute reads)."""
        lease = self.lease
        if lease is None:
            return False
        return self._lost_seen or bool(getattr(lease, "lost", False))

    def lost_reason(self) -> str:
        return str(getattr(self.lease, "lost_reason", "") or "lease revoked or expired")

    def close(self) -> None:
        """Release the lease (job done or process exiting). Idempotent; a no-op in forked children."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self.stop_training()
        lease = self.lease
        if lease is not None:
            try:
                lease.release()
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the helper revokes anyway
                log.debug("release failed: %s", exc)
        close_client = getattr(self._client, "close", None)
        if close_client is not None:
            with contextlib.suppress(Exception):
                close_client()

    # -- step boundary -----------------------------------------------------------------------
    def _watch_directives(self, lease: Any) -> None:
        # Blocks on the lease's directive queue (no CPU, no GIL while waiting) so that the step
        # boundary only reads an Event; the thread ends when the lease ends.
        for d in lease.directives():
            self._inbox.append(d)
            self._inbox_flag.set()
            self._attention = True

    def decide(self) -> Decision:
        """Rank 0: what all ranks must do at this step boundary (no I/O: the lease's cached view)."""
        if self.lease is None:
            return _CARRY_ON
        if self._watching:
            # Between directives this is the whole check: one attribute read, no queue call.
            if not self._attention:
                return _CARRY_ON
            # Lowered before looking, so that a directive or a loss arriving meanwhile raises it again.
            self._attention = False
        if self.lease_lost():
            self._attention = True
            return Decision(kind="lost", reason=self.lost_reason())
        d: Directive | None
        if self._watching:
            self._inbox_flag.clear()
            d = self._inbox.popleft() if self._inbox else None
            if self._inbox:
                self._inbox_flag.set()
                self._attention = True
        else:
            d = self.lease.poll_directive()
        if d is None or d.seq in self._handled_seqs:
            return _CARRY_ON
        self._directive_seen_at.setdefault(d.seq, time.monotonic())
        kind = d.kind
        name = {DirectiveKind.PREEMPT: "preempt", DirectiveKind.RESIZE: "preempt", DirectiveKind.BALLOON: "balloon"}
        return Decision(kind=name.get(kind, "deflate"), seq=d.seq, target=dict(d.target), reason=d.reason,
                        issued_at=float(d.issued_at or 0.0))

    def checkpoint_path(self, step: int, tag: str) -> Path:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        return self.checkpoint_dir / f"{self.job}-{tag}-step{step}.ckpt"

    def _directive(self, dec: Decision) -> Directive:
        kind = DirectiveKind.PREEMPT if dec.kind == "preempt" else DirectiveKind(dec.kind)
        return Directive(kind=kind, seq=dec.seq, deadline=0.0, target=dec.target, reason=dec.reason)

    def preempt(self, dec: Decision, step: int, save: Callable[[str], None]) -> str:
        """Every rank: checkpoint through ``save(path)``; rank 0 also acks, waits for release, releases.

        Returns:
            The checkpoint path.
        """
        boundary = time.monotonic()
        boundary_wall = time.time()
        path = str(self.checkpoint_path(step, "preempt"))
        # Counted before the save so that the checkpoint carries it.
        self.preemptions += 1
        save(path)
        saved = time.monotonic()
        # Written between steps (the last step is closed): lifetime totals only.
        self.timer.add(Phase.CHECKPOINT, saved - boundary, standalone=True)
        self.preempted = True
        self._handled_seqs.add(dec.seq)
        if self.is_leader and self.lease is not None:
            self.lease.ack(self._directive(dec), step=step, checkpoint=path, ok=True, message="checkpointed")
            acked = time.monotonic()
            released = self.lease.wait_released(timeout=self.release_timeout)
            if not released:
                log.warning("slices of %s not taken back within %.0fs; releasing the lease", self.job, self.release_timeout)
            self.close()
            done = time.monotonic()
            if dec.issued_at > 0:
                waited = max(0.0, boundary_wall - dec.issued_at)
            else:
                waited = boundary - self._directive_seen_at.get(dec.seq, boundary)
            self.last_preempt = PreemptTiming(
                boundary_wait_s=waited,
                checkpoint_s=saved - boundary,
                protocol_s=acked - saved,
                release_s=done - acked,
                total_s=waited + (done - boundary),
            )
        return path

    def add_optimizer(self, optimizer: Any) -> None:
        """Register an optimizer whose state a balloon may offload to host memory."""
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
            if self._balloon is not None and hasattr(self._balloon, "add_optimizer"):
                self._balloon.add_optimizer(optimizer)

    def start_training(self, optimizers: Any = ()) -> None:
        """Training starts: register ``optimizers``, build the balloon controller, start the samplers.

        Called by the adapters once the optimizers exist (Lightning's ``on_train_start``,
        :class:`~gpupool_torch.PoolSession` on entry and in ``add_optimizer``).
        The controller measures the footprint that ``memory_peak_bytes`` reports from the first
        publish on, before any balloon. On rank 0 with real GPUs and NVML, an
        :class:`~gpupool_sdk.telemetry.nvml_sampler.NvmlSampler` samples the leased GPUs on its
        own thread; with ``metrics_port`` a job-side Prometheus exporter starts. Idempotent;
        nothing here may stop training (failures are logged).
        """
        for opt in optimizers or ():
            self.add_optimizer(opt)
        if self._training:
            return
        self._training = True
        try:
            self._balloon_controller()
        except Exception as exc:  # noqa: BLE001 - a balloon directive retries and acks the error
            log.warning("gpupool: no memory balloon for %s yet (%s); a balloon directive will be refused", self.job, exc)
        if not self.is_leader or self.lease is None:
            return
        if self._sampler is None and self.accelerator == "gpu":
            self._sampler = self._start_sampler()
        if self.metrics_port is not None and self._metrics_server is None:
            try:
                from gpupool_sdk.telemetry.prometheus import JobMetrics

                self._job_metrics = JobMetrics()
                self._metrics_server = self._job_metrics.serve(self.metrics_port)
            except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
                self._job_metrics = None
                log.warning("gpupool: job metrics exporter on port %s not started: %s", self.metrics_port, exc)

    def _start_sampler(self) -> Any:
        uuids = [str(a.gpu_uuid) for a in (getattr(self.lease, "allocations", None) or ()) if getattr(a, "gpu_uuid", None)]
        if not uuids:
            # Under `gpupool run` the process does not see the allocations; sampling every GPU
            # would report other jobs' devices as this job's.
            log.debug("gpupool: leased GPU UUIDs unknown; no NVML sampling")
            return None
        try:
            from gpupool_sdk.telemetry.nvml_sampler import NvmlSampler

            sampler = NvmlSampler(gpu_uuids=uuids).start()
        except Exception as exc:  # noqa: BLE001 - NVML is optional
            log.debug("gpupool: NVML sampler not started: %s", exc)
            return None
        return sampler if sampler.available else None

    def stop_training(self) -> None:
        """Training ended (Lightning's ``teardown``, or :meth:`close`): stop the sampler and the exporter."""
        self._training = False
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.stop()
        server, self._metrics_server = self._metrics_server, None
        self._job_metrics = None
        if server is not None:
            with contextlib.suppress(Exception):
                server.close()

    def _balloon_controller(self) -> Any:
        if self._balloon is None and self.allocator != "none":
            from gpupool_torch.memory import make_balloon_controller

            kind = self.allocator
            if kind == "torch" and self.accelerator != "gpu":
                kind = "host"
            self._balloon = make_balloon_controller(kind=kind,  # type: ignore[arg-type]
                quota_bytes=self.spec.memory_bytes or None)
            for opt in self._optimizers:
                self._balloon.add_optimizer(opt)
        return self._balloon

    def balloon(self, dec: Decision, step: int) -> None:
        """Every rank: inflate (``balloon``) or deflate the memory balloon; rank 0 acks the bytes reached."""
        self._handled_seqs.add(dec.seq)
        ok, message, reached = True, "", None
        try:
            ctl = self._balloon_controller()
            if ctl is not None and ctl.kind == "host":
                # The footprint just before it changes belongs to this publish window's peak.
                self._boundary_peak = max(self._boundary_peak, int(ctl.usage_bytes()))
            if ctl is None:
                ok, message = False, "ballooning disabled (allocator='none')"
            elif dec.kind == "balloon":
                res = ctl.inflate(int(dec.target.get("memory_bytes", 0)))
                ok, message, reached = bool(res.reached_target), res.message, int(res.reached_bytes)
            else:
                res = ctl.deflate()
                message, reached = res.message, int(res.reached_bytes)
        except GpupoolError as exc:
            ok, message = False, str(exc)
        if self.is_leader and self.lease is not None:
            self.lease.ack(self._directive(dec), step=step, reached_bytes=reached, ok=ok, message=message)

    def fence(self, dec: Decision, step: int, save: Callable[[str], None] | None) -> PoolLeaseLostError:
        """Lease lost: write an emergency checkpoint if possible; return the error to raise."""
        path: str | None = None
        if save is not None:
            try:
                p = str(self.checkpoint_path(step, "emergency"))
                save(p)
                path = p
            except Exception as exc:  # noqa: BLE001 - the error we raise matters more
                log.warning("emergency checkpoint failed: %s", exc)
        self.lost_error = PoolLeaseLostError(self.job, dec.reason or self.lost_reason(), path)
        self._closed = True  # nothing left to release
        return self.lost_error

    def report_memory_peak(self, peak_bytes: int) -> None:
        """Report the job's per-slice memory peak (bytes) for the next published summary.

        The largest value reported since the previous publish replaces the measured figure in
        ``memory_peak_bytes`` (the coordinator predicts the job's peak from it, for overcommit
        and ballooning). Cheap: one comparison, no I/O.

        Raises:
            ConfigError: ``peak_bytes`` is not a whole number of bytes >= 0.
        """
        peak = _check_peak_bytes(peak_bytes, "peak_bytes")
        if self._reported_peak is None or peak > self._reported_peak:
            self._reported_peak = peak

    def maybe_publish(self, step: int, now: float | None = None) -> bool:
        """Hand a telemetry summary to the lease when the interval is up (non-blocking).

        Between publishes this is one comparison: the summary (phase timing, memory peak, NVML
        figures when sampled) is built only when one is due.

        Args:
            step: the global step, recorded in the summary.
            now: a ``time.monotonic()`` reading the caller already took (default: read the clock).

        Returns:
            True when a summary was built and handed over.
        """
        if self.lease is None:
            return False
        if now is None:
            now = time.monotonic()
        if now < self._next_publish:
            return False
        self._next_publish = now + self.telemetry_interval_s
        try:
            summary = self.build_summary(step)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
            log.warning("gpupool: telemetry summary not built: %s", exc)
            return False
        try:
            self.lease.publish_telemetry(summary.to_dict())
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
            log.debug("publish_telemetry failed: %s", exc)
        metrics = self._job_metrics
        if metrics is not None:
            with contextlib.suppress(Exception):
                metrics.update(summary)
        return True

    def build_summary(self, step: int) -> TelemetrySummary:
        """The summary to publish now; starts the next memory-peak window."""
        return from_phase_timer(
            self.job,
            step,
            self.timer.summary(),
            published_at=time.time(),
            sampler=self._sampler,
            memory_peak_bytes=self._memory_peak(),
        )

    def _memory_peak(self) -> int | None:
        """Per-slice memory peak since the previous publish, or None when nothing was measured (never 0).

        The user's figure (:meth:`report_memory_peak`, ``memory_peak_fn``) wins; else the
        balloon tier's measure; else None (the summary then falls back to NVML's figure).
        """
        reported, self._reported_peak = self._reported_peak, None
        fn = self.memory_peak_fn
        if fn is not None:
            try:
                value = fn()
                if value is not None:
                    value = _check_peak_bytes(value, "memory_peak_fn()")
                    reported = value if reported is None else max(reported, value)
            except Exception as exc:  # noqa: BLE001 - a faulty hook must not stop training
                log.warning("gpupool: memory_peak_fn failed, its figure is left out: %s", exc)
        measured = self._measured_peak()  # read anyway: it also starts the next window
        peak = reported if reported is not None else measured
        return peak if peak else None

    def _measured_peak(self) -> int:
        """Peak of the balloon tier's footprint since the previous call (0: nothing measured).

        * ``host`` tier (CPU jobs): ``usage_bytes()``: the SDK allocator's reserved bytes plus the
          resident optimizer state, read now and at each balloon boundary in the window (the
          footprint only changes at those boundaries: no per-step sampling is needed).
        * ``gpupool`` tier: the SDK allocator's reserved peak, then reset (the pool's own stats).
        * ``torch`` tier (or no controller, on a GPU): ``torch.cuda.max_memory_reserved()``,
          never reset: :func:`torch.cuda.reset_peak_memory_stats` would change the figures
          the user (or Lightning's ``DeviceStatsMonitor``) reads. When the lifetime peak rose in
          the window it is the window's peak; otherwise the reserved bytes now (PyTorch caches
          what a step reserved, so between steps this is the step's peak unless the cache was
          emptied).
        """
        boundary, self._boundary_peak = self._boundary_peak, 0
        ctl = self._balloon
        kind = getattr(ctl, "kind", None)
        try:
            if kind == "host":
                return max(boundary, int(ctl.usage_bytes()))
            if kind == "gpupool":
                st = ctl.allocator.stats()
                ctl.allocator.reset_peak_stats()
                return max(boundary, int(st["reserved_bytes.all.peak"]))
        except Exception as exc:  # noqa: BLE001 - measuring must never stop training
            log.debug("memory footprint not measured: %s", exc)
            return boundary
        return max(boundary, self._torch_window_peak())

    def _torch_window_peak(self) -> int:
        torch = sys.modules.get("torch")  # never import torch just to learn it has no stats
        if torch is None:
            return 0
        try:
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return 0
            lifetime = int(torch.cuda.max_memory_reserved())
            current = int(torch.cuda.memory_reserved())
        except Exception:  # noqa: BLE001 - replace-mode allocators have no torch stats
            return 0
        rose = lifetime > self._torch_peak_seen
        self._torch_peak_seen = max(self._torch_peak_seen, lifetime)
        return lifetime if rose else current

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "phases": self.timer.state_dict(),
            "preemptions": self.preemptions,
            "lease_generation": self.lease_generation,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ConfigError("state_dict", "not a gpupool callback state (expected version 1)")
        self.timer.load_state_dict(dict(state["phases"]))
        self.preemptions = int(state.get("preemptions", 0))
        # This incarnation's lease comes on top of the ones before it.
        self.lease_generation = int(state.get("lease_generation", 0)) + max(1, self.lease_generation)


class PoolAdapter:
    """What both framework adapters expose of their :class:`PoolRuntime` (``self.runtime``).

    :class:`~gpupool_lightning.GpuPoolCallback` and
    :class:`~gpupool_torch.PoolSession` derive from it; each builds the
    runtime in its own constructor and adds what its framework needs.
    """

    runtime: PoolRuntime
    #: Leaving the ``with`` block after a preemption raises ``SystemExit(75)``.
    exit_on_preempt = True

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
        """The job's last acknowledged checkpoint (Lightning: pass it as ``ckpt_path``), or None."""
        return self.runtime.resume_from

    @property
    def preempted(self) -> bool:
        """True once this process checkpointed and gave its slices back."""
        return self.runtime.preempted

    def report_memory_peak(self, peak_bytes: int) -> None:
        """Report the job's per-slice memory peak (bytes) for the next published summary.

        The largest value reported since the previous publish replaces the measured
        ``memory_peak_bytes`` (the pool predicts the job's peak from it, for overcommit and
        ballooning). Cheap (one comparison, no I/O): it may be called every step.

        Example:
            >>> # pool.report_memory_peak(torch.cuda.max_memory_allocated())

        Raises:
            ConfigError: ``peak_bytes`` is not a whole number of bytes >= 0.
        """
        self.runtime.report_memory_peak(peak_bytes)

    def exit_if_preempted(self) -> None:
        """Exit with code 75 (``EX_TEMPFAIL``: "run me again") if preempted, releasing the lease first."""
        if self.runtime.preempted:
            self.runtime.close()
            sys.exit(EX_TEMPFAIL)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.runtime.close()
        if exc_type is None and self.runtime.preempted and self.exit_on_preempt:
            raise SystemExit(EX_TEMPFAIL)

    def state_dict(self) -> dict[str, Any]:
        """Phase totals, preemption count and lease generation, to store in the checkpoint."""
        return self.runtime.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from the checkpoint being resumed)."""
        self.runtime.load_state_dict(state_dict)


def _visible_devices(lease: Any) -> list[str]:
    vd = getattr(lease, "visible_devices", None)
    if vd is None:
        allocs = getattr(lease, "allocations", None) or []
        vd = sorted({int(a.gpu_index) for a in allocs})
    if isinstance(vd, str):
        return [x.strip() for x in vd.split(",") if x.strip()]
    return [str(x) for x in vd]
