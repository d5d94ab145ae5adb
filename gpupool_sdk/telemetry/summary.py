"""The telemetry summary a training process publishes under ``telemetry/{job}``.

The training process (the Lightning callback or the plain-loop adapter, through the client)
builds one :class:`TelemetrySummary` every few seconds from its phase timers and NVML sampler
and writes it on the job's lease. The coordinator reads ``memory_peak_history`` and
``memory_peak_bytes`` (to predict peaks for overcommit and ballooning); ``gpupool top``, the Prometheus exporter and the advice rules
read the rest.

Value layout (JSON, with the codec's ``schema``/``kind`` envelope)::

    {
      "job": "bert-ft", "step": 1200, "steps_per_s": 3.1, "window_s": 30.0,
      "phase_seconds":  {"data": 0.05, "forward": 0.09, "backward": 0.15,
                         "optimizer": 0.02, "checkpoint": 0.0, "other": 0.01},
      "phase_fraction": {"data": 0.15, "forward": 0.28, ...},      # sums to 1 (or all 0)
      "memory_peak_bytes": 12884901888,                              # max over slices, recent window
      "memory_peak_by_phase": {"forward": 9663676416, "backward": 12884901888},
      "memory_peak_history": [12079595520, 12884901888],               # recent windows, oldest first
      "gpu_util": 0.62,                                              # 0-1, null without NVML
      "slices": [{"gpu_uuid": "GPU-...", "memory_used_bytes": 1.2e10, "util": 0.6,
                  "memory_peak_bytes": 12884901888}],
      "last_step_at": 1764668400.2, "published_at": 1764668401.0,
      "remaining_s": 5400.0, "progress": 0.25                        # optional: see below
    }

``remaining_s`` (seconds of training left at the current step time, on the GPUs the job holds
now) and ``progress`` (fraction of the declared length done, 0-1) are published by a job that
knows its length (``trainer.estimated_stepping_batches`` or ``max_steps``, ``global_step`` and
the measured step time); both are absent (null) for a job that does not. The coordinator reads
``remaining_s`` into ``JobView.remaining_s`` (progress-aware ordering, ``docs/scheduler.md``).

``phase_seconds`` are per-step averages over the last ``window_s`` seconds. Every field but
``job`` is optional when reading: an older or partial writer still parses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources._fields import check, opt, req

#: The phase names, in display order; they match ``Phase.value`` of ``telemetry/phases.py``.
PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "checkpoint", "other")


def phase_name(phase: Any) -> str:
    """Normalise a phase key (a ``Phase`` enum member or a string) to one of :data:`PHASES`.

    Unknown names map to ``"other"`` so a newer writer with more phases still parses.
    """
    raw = getattr(phase, "value", phase)
    name = str(raw).strip().lower()
    return name if name in PHASES else "other"


def _non_negative(value: float, fieldname: str) -> float:
    if math.isnan(value) or value < 0:
        raise SpecError(fieldname, f"must be a number >= 0, got {value!r}")
    return value


def _ratio_or_none(value: float | None, fieldname: str) -> float | None:
    if value is None:
        return None
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise SpecError(fieldname, f"must be a ratio in [0, 1] (divide percentages by 100), got {value!r}")
    return value


def _phase_map(
    raw: Mapping[Any, Any] | None, fieldname: str, as_int: bool = False
) -> dict[str, Any]:
    """Fold a phase-keyed mapping onto :data:`PHASES` (unknown phases add into ``other``)."""
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        name = phase_name(key)
        num: float = check(value, (int, float), f"{fieldname}.{name}")
        v = _non_negative(float(num), f"{fieldname}.{name}")
        if as_int:
            # Peaks are maxima, not sums: folding keeps the largest.
            out[name] = max(int(v), out.get(name, 0))
        else:
            out[name] = out.get(name, 0.0) + v
    return out


def fractions(phase_seconds: Mapping[str, float]) -> dict[str, float]:
    """Each phase's share of the total (all zeros when nothing was timed).

    Example:
        >>> fractions({"data": 1.0, "forward": 3.0})["data"]
        0.25
    """
    total = sum(phase_seconds.values())
    if total <= 0:
        return dict.fromkeys(PHASES, 0.0)
    return {p: phase_seconds.get(p, 0.0) / total for p in PHASES}


@dataclass(frozen=True)
class SliceTelemetry:
    """What one slice (one GPU of the job) looked like in the window.

    Attributes:
        gpu_uuid: the GPU of the slice.
        memory_used_bytes: device memory the job's process uses on it now (NVML), or the
            allocator's reserved bytes when NVML cannot see per-process memory; None if unknown.
        util: the job's (or the whole GPU's, when per-process samples are unavailable) SM
            utilisation 0-1, None without NVML.
        memory_peak_bytes: the peak of the job's memory on this slice in the window, if known.
    """

    gpu_uuid: str
    memory_used_bytes: int | None = None
    util: float | None = None
    memory_peak_bytes: int | None = None

    def __post_init__(self) -> None:
        _ratio_or_none(self.util, "slices[].util")

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_uuid": self.gpu_uuid,
            "memory_used_bytes": self.memory_used_bytes,
            "util": self.util,
            "memory_peak_bytes": self.memory_peak_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "slice") -> SliceTelemetry:
        used = opt(d, "memory_used_bytes", (int, float), where, None)
        peak = opt(d, "memory_peak_bytes", (int, float), where, None)
        util = opt(d, "util", float, where, None)
        return cls(
            gpu_uuid=req(d, "gpu_uuid", str, where),
            memory_used_bytes=None if used is None else int(_non_negative(float(used), f"{where}.memory_used_bytes")),
            util=_ratio_or_none(util, f"{where}.util"),
            memory_peak_bytes=None if peak is None else int(_non_negative(float(peak), f"{where}.memory_peak_bytes")),
        )


#: How many recent window peaks a summary carries (``memory_peak_history``).
PEAK_HISTORY_LEN = 32


@dataclass(frozen=True)
class TelemetrySummary:
    """A job's phase-aware utilisation summary (``telemetry/{job}``).

    Attributes:
        job: the job name.
        step: the global step at publication.
        steps_per_s: training steps per second over the window.
        window_s: length of the window the averages cover, in seconds.
        phase_seconds: per-step average seconds of each phase in :data:`PHASES` over the window.
        phase_fraction: each phase's share of the step time (0-1, sums to 1 or all 0).
        memory_peak_bytes: the largest per-slice memory peak in the window (None if unknown).
        memory_peak_by_phase: per-slice memory peak reached during each phase.
        gpu_util: mean SM utilisation 0-1 over the job's GPUs, from NVML; None on the CPU.
        slices: per-slice detail.
        last_step_at: wall-clock time the last training step finished (idle detection), or None.
        published_at: wall-clock time of publication.
        remaining_s: estimated seconds of training left (declared length minus ``step``, times the
            measured step time, on the GPUs held now); None when the job does not know its length.
        progress: fraction of the declared length done, 0-1 (``step / total_steps``); None when unknown.
        memory_peak_history: the job's per-slice peaks of its recent windows, oldest first, this
            window's included (at most :data:`PEAK_HISTORY_LEN`); the coordinator predicts the
            job's peak from it (a high percentile) instead of from one window.

    Example:
        >>> s = TelemetrySummary.build("bert", step=10, steps_per_s=2.0, window_s=30,
        ...                            phase_seconds={"data": 0.1, "forward": 0.3}, published_at=0.0)
        >>> round(s.phase_fraction["data"], 2)
        0.25
    """

    job: str
    step: int = 0
    steps_per_s: float = 0.0
    window_s: float = 0.0
    phase_seconds: Mapping[str, float] = field(default_factory=dict)
    phase_fraction: Mapping[str, float] = field(default_factory=dict)
    memory_peak_bytes: int | None = None
    memory_peak_by_phase: Mapping[str, int] = field(default_factory=dict)
    gpu_util: float | None = None
    slices: tuple[SliceTelemetry, ...] = ()
    last_step_at: float | None = None
    published_at: float = 0.0
    remaining_s: float | None = None
    progress: float | None = None
    memory_peak_history: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        hist = self.memory_peak_history
        if isinstance(hist, (str, bytes)) or not isinstance(hist, (list, tuple)):
            raise SpecError("memory_peak_history", f"must be a list of byte counts, got {hist!r}")
        if len(hist) > PEAK_HISTORY_LEN:
            hist = tuple(hist)[-PEAK_HISTORY_LEN:]
        for v in hist:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise SpecError("memory_peak_history", f"must hold byte counts >= 0, got {v!r}")
        set_(self, "memory_peak_history", tuple(int(v) for v in hist))
        if not isinstance(self.job, str) or not self.job:
            raise SpecError("job", f"must be the job name, got {self.job!r}")
        if not isinstance(self.step, int) or self.step < 0:
            raise SpecError("step", f"must be an integer >= 0, got {self.step!r}")
        set_(self, "steps_per_s", _non_negative(float(self.steps_per_s), "steps_per_s"))
        set_(self, "window_s", _non_negative(float(self.window_s), "window_s"))
        secs = _phase_map(self.phase_seconds, "phase_seconds")
        set_(self, "phase_seconds", {p: secs.get(p, 0.0) for p in PHASES})
        frac = _phase_map(self.phase_fraction, "phase_fraction") if self.phase_fraction else fractions(secs)
        set_(self, "phase_fraction", {p: min(1.0, frac.get(p, 0.0)) for p in PHASES})
        set_(self, "memory_peak_by_phase", _phase_map(self.memory_peak_by_phase, "memory_peak_by_phase", as_int=True))
        if self.memory_peak_bytes is not None:
            set_(self, "memory_peak_bytes", int(_non_negative(float(self.memory_peak_bytes), "memory_peak_bytes")))
        set_(self, "gpu_util", _ratio_or_none(self.gpu_util, "gpu_util"))
        set_(self, "slices", tuple(self.slices))
        if self.remaining_s is not None:
            if isinstance(self.remaining_s, bool) or not isinstance(self.remaining_s, (int, float)):
                raise SpecError("remaining_s", f"must be seconds (a number >= 0) or null, got {self.remaining_s!r}")
            rem = float(self.remaining_s)
            if not math.isfinite(rem) or rem < 0:
                raise SpecError(
                    "remaining_s", f"must be finite seconds >= 0 (omit it when the length is unknown), got {rem!r}"
                )
            set_(self, "remaining_s", rem)
        if self.progress is not None:
            if isinstance(self.progress, bool) or not isinstance(self.progress, (int, float)):
                raise SpecError("progress", f"must be a fraction 0-1 or null, got {self.progress!r}")
            set_(self, "progress", _ratio_or_none(float(self.progress), "progress"))

    @classmethod
    def build(
        cls,
        job: str,
        *,
        step: int,
        steps_per_s: float,
        window_s: float,
        phase_seconds: Mapping[Any, float],
        published_at: float,
        memory_peak_by_phase: Mapping[Any, int] | None = None,
        slices: Iterable[SliceTelemetry] = (),
        gpu_util: float | None = None,
        memory_peak_bytes: int | None = None,
        last_step_at: float | None = None,
        remaining_s: float | None = None,
        progress: float | None = None,
    ) -> TelemetrySummary:
        """Build a summary from phase timings (keys may be ``Phase`` members or strings).

        ``phase_fraction`` is derived from ``phase_seconds``. ``memory_peak_bytes`` defaults to
        the largest of the per-phase and per-slice peaks; ``gpu_util`` defaults to the mean of
        the slices' utilisation when they report one.
        """
        slices = tuple(slices)
        by_phase = _phase_map(memory_peak_by_phase, "memory_peak_by_phase", as_int=True)
        if memory_peak_bytes is None:
            candidates = list(by_phase.values()) + [
                s.memory_peak_bytes or s.memory_used_bytes or 0 for s in slices
            ]
            memory_peak_bytes = max(candidates) if any(candidates) else None
        if gpu_util is None:
            utils = [s.util for s in slices if s.util is not None]
            gpu_util = sum(utils) / len(utils) if utils else None
        return cls(
            job=job,
            step=step,
            steps_per_s=steps_per_s,
            window_s=window_s,
            phase_seconds=_phase_map(phase_seconds, "phase_seconds"),
            memory_peak_bytes=memory_peak_bytes,
            memory_peak_by_phase=by_phase,
            gpu_util=gpu_util,
            slices=slices,
            last_step_at=last_step_at,
            published_at=published_at,
            remaining_s=remaining_s,
            progress=progress,
        )

    @property
    def step_seconds(self) -> float:
        """Average seconds per step (sum of the phases)."""
        return sum(self.phase_seconds.values())

    def dominant_phase(self) -> str | None:
        """The phase taking the largest share of step time, or None when nothing was timed."""
        if self.step_seconds <= 0:
            return None
        return max(PHASES, key=lambda p: self.phase_fraction.get(p, 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "step": self.step,
            "steps_per_s": self.steps_per_s,
            "window_s": self.window_s,
            "phase_seconds": dict(self.phase_seconds),
            "phase_fraction": dict(self.phase_fraction),
            "memory_peak_bytes": self.memory_peak_bytes,
            "memory_peak_by_phase": dict(self.memory_peak_by_phase),
            "gpu_util": self.gpu_util,
            "slices": [s.to_dict() for s in self.slices],
            "last_step_at": self.last_step_at,
            "published_at": self.published_at,
            "remaining_s": self.remaining_s,
            "progress": self.progress,
            "memory_peak_history": list(self.memory_peak_history),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "telemetry") -> TelemetrySummary:
        """Parse a summary; every field but ``job`` may be missing, unknown fields are ignored.

        Also accepts the store's envelope :class:`gpupool_sdk.store.records.TelemetryRecord`
        (``{"job", "at", "summary": {...}}``) whose ``summary`` holds this record's fields.
        """
        inner = d.get("summary")
        if isinstance(inner, Mapping) and "phase_seconds" not in d:
            merged = {**inner, "job": d.get("job", inner.get("job"))}
            if merged.get("published_at") is None and d.get("at") is not None:
                merged["published_at"] = d["at"]
            d = merged
        raw_slices = opt(d, "slices", list, where, [])
        slices = []
        for i, s in enumerate(raw_slices):
            check(s, dict, f"{where}.slices[{i}]")
            slices.append(SliceTelemetry.from_dict(s, f"{where}.slices[{i}]"))
        peak = opt(d, "memory_peak_bytes", (int, float), where, None)
        return cls(
            job=req(d, "job", str, where),
            step=int(opt(d, "step", (int, float), where, 0)),
            steps_per_s=opt(d, "steps_per_s", float, where, 0.0),
            window_s=opt(d, "window_s", float, where, 0.0),
            phase_seconds=opt(d, "phase_seconds", dict, where, {}),
            phase_fraction=opt(d, "phase_fraction", dict, where, {}),
            memory_peak_bytes=None if peak is None else int(peak),
            memory_peak_by_phase=opt(d, "memory_peak_by_phase", dict, where, {}),
            gpu_util=opt(d, "gpu_util", float, where, None),
            slices=tuple(slices),
            last_step_at=opt(d, "last_step_at", float, where, None),
            published_at=opt(d, "published_at", float, where, 0.0),
            remaining_s=opt(d, "remaining_s", (int, float), where, None),
            progress=opt(d, "progress", (int, float), where, None),
            memory_peak_history=tuple(opt(d, "memory_peak_history", list, where, [])),
        )


class SliceSource(Protocol):
    """What :func:`from_phase_timer` needs of a sampler (:class:`~gpupool_sdk.telemetry.nvml_sampler.NvmlSampler`)."""

    def slices(self) -> list[SliceTelemetry]: ...


def from_phase_timer(
    job: str,
    step: int,
    timer_summary: Mapping[str, Any],
    *,
    published_at: float,
    last_step_at: float | None = None,
    sampler: SliceSource | None = None,
    memory_peak_bytes: int | None = None,
    memory_peak_by_phase: Mapping[Any, int] | None = None,
) -> TelemetrySummary:
    """Build the summary from ``PhaseTimer.summary()`` plus optional NVML and allocator figures.

    Args:
        job: the job name.
        step: the global step.
        timer_summary: the dict ``PhaseTimer.summary()`` returns (``phase_s``, ``steps_per_s``,
            ``steps``, ``step_time_s``).
        published_at: wall-clock time now.
        last_step_at: wall-clock end of the last step (defaults to ``published_at``).
        sampler: an :class:`~gpupool_sdk.telemetry.nvml_sampler.NvmlSampler` (started), for
            per-slice memory and utilisation; None on the CPU.
        memory_peak_bytes: the allocator's per-slice peak in the window (e.g.
            ``torch.cuda.max_memory_reserved()`` since the last publication), if known; wins over NVML's.
        memory_peak_by_phase: per-phase peaks, if the caller tracks them.

    Example:
        >>> s = from_phase_timer("bert", 10, {"phase_s": {"data": 0.1, "forward": 0.3}, "steps_per_s": 2.5,
        ...                      "steps": 50, "step_time_s": {"mean": 0.4}}, published_at=0.0)
        >>> (s.window_s, round(s.phase_fraction["forward"], 2))
        (20.0, 0.75)
    """
    steps = int(timer_summary.get("steps", 0) or 0)
    mean = float((timer_summary.get("step_time_s") or {}).get("mean", 0.0) or 0.0)
    return TelemetrySummary.build(
        job,
        step=step,
        steps_per_s=float(timer_summary.get("steps_per_s", 0.0) or 0.0),
        window_s=mean * steps,
        phase_seconds=timer_summary.get("phase_s") or {},
        published_at=published_at,
        memory_peak_by_phase=memory_peak_by_phase,
        slices=sampler.slices() if sampler is not None else (),
        memory_peak_bytes=memory_peak_bytes,
        last_step_at=published_at if last_step_at is None else last_step_at,
    )
