"""The in-job runtime's options: one frozen dataclass, validated once, shared by every adapter.

The Lightning callback and the plain-PyTorch session take the same keyword arguments; they are
declared here and nowhere else (:meth:`RuntimeOptions.from_kwargs` splits them from the
:class:`~gpupool_sdk.resources.JobSpec` fields that pass through to the spec).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import JobSpec

#: Memory tiers a balloon directive can use.
ALLOCATORS = ("torch", "gpupool", "none")

#: Signals that mean "preempt now" by default: Kubernetes eviction and ``scancel`` (SIGTERM),
#: Ctrl-C (SIGINT), and Slurm's ``--signal`` default (SIGUSR1).
DEFAULT_PREEMPT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1")

#: Default checkpoint directory (relative to the working directory).
DEFAULT_CHECKPOINT_DIR = "gpupool-checkpoints"


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
    return value


def _opt_seconds(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ConfigError(name, f"must be a number of seconds > 0 (or None), got {value!r}")
    return float(value)


def _signal_numbers(names: Any) -> tuple[int, ...]:
    if names is None:
        return ()
    if isinstance(names, (str, int)):
        names = (names,)
    out: list[int] = []
    for n in names:
        if isinstance(n, int) and not isinstance(n, bool):
            out.append(int(n))
            continue
        sig = getattr(signal, str(n).upper(), None) if isinstance(n, str) else None
        if not isinstance(sig, signal.Signals):
            raise ConfigError(
                "preempt_signals",
                f"{n!r} is not a signal name; use names like 'SIGTERM', 'SIGUSR1', or () for none",
            )
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError("preempt_signals", f"{sig.name} cannot be handled; remove it")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


def _spec_comes_from_elsewhere() -> bool:
    """Under ``gpupool run`` (the launcher's flags are the spec) or on a follower rank (rank 0's grant)."""
    from gpupool_sdk.runtime.env import RUN_SOCKET_ENV, process_rank

    return bool(os.environ.get(RUN_SOCKET_ENV)) or process_rank() != 0


@dataclass(frozen=True)
class RuntimeOptions:
    """How a training process uses the pool (every adapter's keyword arguments).

    Attributes:
        gpus: slices wanted.
        memory: memory per slice (``"20GiB"``, ``"20Gi"`` or bytes); required unless ``qos="exclusive"``,
            under ``gpupool run`` (whose ``--memory`` is the spec) or on a rank other than 0.
        qos: ``"shared"`` (default), ``"guaranteed"`` or ``"exclusive"``.
        priority: higher runs first and may preempt lower.
        name: job name; default ``$GPUPOOL_JOB`` or the script's file name. A job restarted
            under the same name resumes from its newest valid checkpoint.
        checkpoint_dir: where the pool's checkpoints go (default ``$GPUPOOL_CHECKPOINT_DIR`` or
            ``./gpupool-checkpoints``); shared by every rank.
        endpoints: etcd endpoints (default ``$GPUPOOL_ENDPOINTS``).
        prefix: key prefix (default ``$GPUPOOL_PREFIX``).
        compute_share: share of each GPU's compute, in (0, 1].
        allocator: memory tier for balloon directives: ``"torch"`` (default; host tier on a
            machine without CUDA), ``"gpupool"`` (the SDK's allocator) or ``"none"``.
        check_every_n_steps: directive check interval, in optimizer steps.
        telemetry_interval_s: how often a phase summary is published.
        acquire_timeout: seconds to wait in the queue (None: forever).
        release_timeout: seconds to wait for the coordinator to take the slices back after a
            preempt ack before releasing anyway.
        on_status: called with each :class:`~gpupool_sdk.resources.JobStatus` while queued.
        memory_peak_fn: called only when a summary is due (never per step); returns the job's
            per-slice memory peak in bytes since its previous call, or None.
        metrics_port: serve this job's summary as Prometheus metrics on this port from rank 0
            (0: any free port); None (default) for none.
        metrics_addr: address of that exporter (default ``127.0.0.1``: job-side exporters are
            local unless asked otherwise).
        exit_on_preempt: after a preemption's checkpoint the process exits with code 75 at once
            (default), so no code after ``fit`` mistakes a partial model for a finished one.
            False: ``fit`` returns and :attr:`preempted` tells.
        preempt_signals: signals that mean "preempt now": checkpoint at the next step boundary,
            release, exit 75. Default SIGTERM, SIGINT, SIGUSR1; ``()`` for none. Handlers that
            were installed before are chained.
        keep_checkpoints: how many of the job's pool checkpoints to keep (newest first).
        resume_paths: more checkpoint files (glob patterns) that count as resume candidates,
            e.g. a ``ModelCheckpoint``'s ``last.ckpt`` in another directory. ``last*.ckpt`` in
            ``checkpoint_dir`` always counts.
        sharing: ``"auto"`` (default): under CUDA MPS (the agent runs it) the grant's MPS limits
            go into the environment before CUDA initialises; on a shared slice of a GPU without
            MPS the job takes turns at step boundaries with the other jobs on it (time-slicing,
            ``docs/sharing.md``). ``"off"``: neither.
        timeslice_period_s: one round of time-slicing turns; each job holds the GPU for
            ``period * share / sum of shares``.
        handover_offload: when handing the GPU over at a turn, park memory (release the cache,
            move optimizer state to host memory) and restore it on the next turn: ``"auto"``
            (default: only when the memory quotas of the GPU's jobs do not fit it together),
            ``"always"`` or ``"never"``.
        spec_fields: other :class:`~gpupool_sdk.resources.JobSpec` fields (``features``,
            ``gpu_model``, ``min_runtime_s``, ``preempt_grace_s``...).

    Raises:
        ConfigError: an option is invalid; the message names it and the fix.
    """

    gpus: int = 1
    memory: int | str | None = None
    qos: str = "shared"
    priority: int = 0
    name: str | None = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    endpoints: str | None = None
    prefix: str | None = None
    compute_share: float = 1.0
    allocator: str = "torch"
    check_every_n_steps: int = 1
    telemetry_interval_s: float = 5.0
    acquire_timeout: float | None = None
    release_timeout: float = 30.0
    on_status: Callable[[Any], None] | None = None
    memory_peak_fn: Callable[[], int | None] | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    exit_on_preempt: bool = True
    preempt_signals: tuple[str | int, ...] | None = DEFAULT_PREEMPT_SIGNALS
    keep_checkpoints: int = 2
    resume_paths: tuple[str, ...] = ()
    sharing: str = "auto"
    timeslice_period_s: float = 2.0
    handover_offload: str = "auto"
    spec_fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ConfigError("allocator", f"got {self.allocator!r}; use one of {', '.join(map(repr, ALLOCATORS))}")
        _positive_int(self.check_every_n_steps, "check_every_n_steps")
        _positive_int(self.keep_checkpoints, "keep_checkpoints")
        object.__setattr__(self, "telemetry_interval_s",
                           _opt_seconds(self.telemetry_interval_s, "telemetry_interval_s") or 5.0)
        object.__setattr__(self, "acquire_timeout", _opt_seconds(self.acquire_timeout, "acquire_timeout"))
        object.__setattr__(self, "release_timeout", _opt_seconds(self.release_timeout, "release_timeout") or 30.0)
        if self.memory_peak_fn is not None and not callable(self.memory_peak_fn):
            raise ConfigError("memory_peak_fn", f"must be a callable returning bytes or None, got {self.memory_peak_fn!r}")
        if self.on_status is not None and not callable(self.on_status):
            raise ConfigError("on_status", f"must be a callable taking a JobStatus, got {self.on_status!r}")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ConfigError("metrics_port", f"must be a TCP port 0-65535 (0: any free port) or None, got {port!r}")
        if not isinstance(self.exit_on_preempt, bool):
            raise ConfigError("exit_on_preempt", f"must be True or False, got {self.exit_on_preempt!r}")
        _signal_numbers(self.preempt_signals)  # validated here, resolved where installed
        from gpupool_sdk.runtime.sharing import OFFLOAD_MODES, SHARING_MODES

        if self.sharing not in SHARING_MODES:
            raise ConfigError("sharing", f"got {self.sharing!r}; use one of {', '.join(map(repr, SHARING_MODES))}")
        if self.handover_offload not in OFFLOAD_MODES:
            raise ConfigError("handover_offload",
                              f"got {self.handover_offload!r}; use one of {', '.join(map(repr, OFFLOAD_MODES))}")
        object.__setattr__(self, "timeslice_period_s", _opt_seconds(self.timeslice_period_s, "timeslice_period_s") or 2.0)
        if isinstance(self.resume_paths, str):
            object.__setattr__(self, "resume_paths", (self.resume_paths,))
        ckdir = self.checkpoint_dir
        if ckdir is not None and (not isinstance(ckdir, (str, os.PathLike)) or not str(ckdir)):
            raise ConfigError("checkpoint_dir", f"must be a directory path, got {ckdir!r}")
        if self.memory is None and self.qos != "exclusive" and not _spec_comes_from_elsewhere():
            raise ConfigError(
                "memory", f"{self.qos} jobs must say how much GPU memory per slice they need, e.g. memory='20GiB'"
            )

    @property
    def signal_numbers(self) -> tuple[int, ...]:
        """:attr:`preempt_signals` as signal numbers."""
        return _signal_numbers(self.preempt_signals)

    def checkpoint_path(self) -> Path:
        """The checkpoint directory: the option, else ``$GPUPOOL_CHECKPOINT_DIR``, else the default."""
        from gpupool_sdk.runtime.env import CKPT_DIR_ENV

        ckdir = self.checkpoint_dir if self.checkpoint_dir is not None else os.environ.get(CKPT_DIR_ENV)
        return Path(ckdir or DEFAULT_CHECKPOINT_DIR)

    def job_spec(self, job: str) -> JobSpec:
        """The :class:`JobSpec` these options ask for, under the job name ``job``.

        Without ``memory`` (allowed only where the spec comes from elsewhere: under ``gpupool run``
        or on a follower rank) this is a local stand-in: the launcher's or rank 0's grant decides.
        """
        if self.memory is None and self.qos != "exclusive":
            return JobSpec(name=job, gpus=self.gpus, qos="exclusive", priority=self.priority)
        return JobSpec(
            name=job, gpus=self.gpus, memory=self.memory or 0, qos=self.qos, priority=self.priority,
            compute_share=self.compute_share, **dict(self.spec_fields),
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RuntimeOptions:
        """Build options from an adapter's keyword arguments; the rest must be JobSpec fields.

        Raises:
            ConfigError: a keyword is neither an option nor a JobSpec field (names the closest one).
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"spec_fields"}
        spec_names = {f.name for f in dataclasses.fields(JobSpec)} - {"name", "gpus", "memory", "qos", "priority",
                                                                       "compute_share"}
        options = {k: v for k, v in kwargs.items() if k in own}
        extra = {k: v for k, v in kwargs.items() if k not in own}
        for key in extra:
            if key not in spec_names:
                close = difflib.get_close_matches(key, sorted(own | spec_names), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(key, f"is not an option of the pool callback/session nor a JobSpec field{hint}")
        return cls(**options, spec_fields=extra)
