"""Per-step phase timing of a training loop: data, forward, backward, optimizer, checkpoint.

:class:`PhaseTimer` is a plain class (no Trainer needed) that the Lightning callback and the
plain-PyTorch adapter drive from their hooks. On the CPU every phase is timed with
``time.monotonic()``. On a GPU the device phases (forward, backward, optimizer) are also
bracketed by CUDA events recorded on the current stream; the events of a step are read one or
more steps later with ``Event.query()``, so timing never synchronises the device per step.

Example:
    >>> from gpupool_sdk.telemetry.phases import Phase, PhaseTimer
    >>> t = PhaseTimer(window=10)
    >>> t.start(Phase.FORWARD); _ = t.stop(Phase.FORWARD)
    >>> t.step_end()
    >>> t.summary()["steps"]
    1
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import ConfigError


class Phase(str, enum.Enum):
    """Where a training step spends its time."""

    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    OTHER = "other"


#: Phases whose work runs on the device and that get CUDA events on a GPU.
DEVICE_PHASES: frozenset[Phase] = frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER})


@dataclass
class _PendingStep:
    """A finished step whose CUDA events may not have completed yet."""

    cpu: dict[Phase, float]
    wall_s: float
    events: list[tuple[Phase, Any, Any]] = field(default_factory=list)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return sorted_values[int(k)]
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


class PhaseTimer:
    """Times the phases of each training step and keeps a rolling window plus lifetime totals.

    Args:
        window: number of most recent steps the rolling summary covers (>= 1).
        use_cuda_events: time device phases with CUDA events. ``None`` (default) enables them
            when CUDA is initialised in this process; ``False`` always uses the CPU clock.
        clock: monotonic clock in seconds (tests pass a fake one).
        max_pending: steps whose CUDA events are still in flight before the oldest falls back
            to CPU times (bounds memory if the device falls far behind).

    Raises:
        ConfigError: ``window`` or ``max_pending`` is not a positive integer.

    Example:
        >>> t = PhaseTimer()
        >>> with t.phase(Phase.DATA):
        ...     pass
        >>> t.step_end()
        >>> sorted(t.summary()["phase_fraction"])[:2]
        ['backward', 'checkpoint']
    """

    def __init__(
        self,
        window: int = 100,
        use_cuda_events: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = 8,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ConfigError("window", f"must be an integer >= 1 (steps in the rolling summary), got {window!r}")
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
            raise ConfigError("max_pending", f"must be an integer >= 1, got {max_pending!r}")
        self.window = window
        self.max_pending = max_pending
        self._clock = clock
        self._use_cuda = self._cuda_wanted(use_cuda_events)
        self._open: dict[Phase, float] = {}
        self._open_events: dict[Phase, Any] = {}
        self._cur: dict[Phase, float] = {}
        self._cur_events: list[tuple[Phase, Any, Any]] = []
        self._step_started: float | None = None
        self._pending: deque[_PendingStep] = deque()
        self._recent: deque[tuple[float, dict[Phase, float]]] = deque(maxlen=window)
        self.total_steps = 0
        self.total_s: dict[Phase, float] = {p: 0.0 for p in Phase}
        self.total_wall_s = 0.0

    @staticmethod
    def _cuda_wanted(flag: bool | None) -> bool:
        if flag is False:
            return False
        try:
            import torch

            available = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
        except Exception:  # noqa: BLE001 - torch missing or broken: no events
            available = False
        if flag is True and not available:
            return False
        return available

    @property
    def uses_cuda_events(self) -> bool:
        """True when device phases are timed with CUDA events."""
        return self._use_cuda

    def set_cuda_events(self, enabled: bool) -> bool:
        """Turn CUDA-event timing of device phases on or off (on only if CUDA is initialised).

        The timer is usually built before the framework initialises CUDA (the lease comes
        first); the adapter turns events on once the model is on a GPU. Returns the new setting.
        """
        self.discard_open()
        self._use_cuda = self._cuda_wanted(True) if enabled else False
        return self._use_cuda

    # -- recording -------------------------------------------------------------------------
    def start(self, phase: Phase) -> None:
        """Begin timing ``phase`` (a phase already open is restarted)."""
        now = self._clock()
        if self._step_started is None:
            self._step_started = now
        self._open[phase] = now
        if self._use_cuda and phase in DEVICE_PHASES:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open_events[phase] = ev

    def stop(self, phase: Phase) -> float:
        """End timing ``phase``; returns the CPU seconds it took (0.0 if it was not open)."""
        began = self._open.pop(phase, None)
        if began is None:
            return 0.0
        elapsed = self._clock() - began
        if elapsed < 0.0:
            elapsed = 0.0
        cur = self._cur
        cur[phase] = cur.get(phase, 0.0) + elapsed
        if not self._use_cuda:
            return elapsed
        start_ev = self._open_events.pop(phase, None)
        if start_ev is not None:
            import torch

            end_ev = torch.cuda.Event(enable_timing=True)
            end_ev.record()
            self._cur_events.append((phase, start_ev, end_ev))
        return elapsed

    def add(self, phase: Phase, seconds: float, standalone: bool = False) -> None:
        """Add ``seconds`` measured elsewhere to ``phase`` of the current step.

        With ``standalone`` the time goes straight into the lifetime totals, outside any step
        (a checkpoint written when training stops, after the last step).
        """
        if standalone:
            self.total_s[phase] += max(0.0, seconds)
            return
        if self._step_started is None:
            self._step_started = self._clock() - seconds
        self._cur[phase] = self._cur.get(phase, 0.0) + max(0.0, seconds)

    def phase(self, phase: Phase) -> _PhaseContext:
        """Context manager timing ``phase``: ``with timer.phase(Phase.FORWARD): ...``."""
        return _PhaseContext(self, phase)

    def step_end(self) -> None:
        """Close the current step: open phases are stopped, the step enters the window.

        The step's wall time runs from the end of the previous step (or the first ``start``)
        to now, so time that no phase claimed is reported as ``other``.
        """
        for p in list(self._open):
            self.stop(p)
        now = self._clock()
        started = self._step_started if self._step_started is not None else now
        wall = max(0.0, now - started)
        claimed = sum(self._cur.values())
        if wall > claimed:
            self._cur[Phase.OTHER] = self._cur.get(Phase.OTHER, 0.0) + (wall - claimed)
        else:
            wall = claimed
        step = _PendingStep(cpu=dict(self._cur), wall_s=wall, events=self._cur_events)
        self._cur = {}
        self._cur_events = []
        self._step_started = now
        if step.events:
            self._pending.append(step)
        else:
            self._commit(step.cpu, step.wall_s)
        self._drain_pending()

    def _drain_pending(self) -> None:
        while self._pending:
            head = self._pending[0]
            if all(end.query() for _, _, end in head.events):
                self._pending.popleft()
                times = dict(head.cpu)
                device: dict[Phase, float] = {}
                for p, s, e in head.events:
                    device[p] = device.get(p, 0.0) + s.elapsed_time(e) / 1000.0
                for p, secs in device.items():
                    # The CPU may run ahead of the device (async launch); the device time is the truth.
                    times[p] = max(times.get(p, 0.0), secs)
                self._commit(times, max(head.wall_s, sum(times.values())))
            elif len(self._pending) > self.max_pending:
                old = self._pending.popleft()
                self._commit(old.cpu, old.wall_s)
            else:
                break

    def _commit(self, times: dict[Phase, float], wall_s: float) -> None:
        self._recent.append((wall_s, times))
        self.total_steps += 1
        self.total_wall_s += wall_s
        for p, s in times.items():
            self.total_s[p] += s

    def discard_open(self) -> None:
        """Forget phases still open and the partial step (e.g. after a resume)."""
        self._open.clear()
        self._open_events.clear()
        self._cur = {}
        self._cur_events = []
        self._step_started = None

    # -- reading ---------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Rolling summary of the last ``window`` completed steps plus lifetime totals.

        Returns:
            ``steps`` (in the window), ``step_time_s`` (``mean``, ``p50``, ``p99``),
            ``steps_per_s``, ``phase_s`` (mean seconds per step by phase), ``phase_fraction``
            (0-1, sums to 1 when any time was recorded), ``pending_device_steps`` and
            ``lifetime`` (``steps``, ``wall_s``, ``phase_s``).
        """
        walls = [w for w, _ in self._recent]
        n = len(walls)
        per_phase = {p.value: 0.0 for p in Phase}
        for _, times in self._recent:
            for p, s in times.items():
                per_phase[p.value] += s
        total = sum(per_phase.values())
        mean_wall = sum(walls) / n if n else 0.0
        ordered = sorted(walls)
        return {
            "steps": n,
            "step_time_s": {
                "mean": mean_wall,
                "p50": _percentile(ordered, 0.5),
                "p99": _percentile(ordered, 0.99),
            },
            "steps_per_s": (1.0 / mean_wall) if mean_wall > 0 else 0.0,
            "phase_s": {k: (v / n if n else 0.0) for k, v in per_phase.items()},
            "phase_fraction": {k: (v / total if total > 0 else 0.0) for k, v in per_phase.items()},
            "pending_device_steps": len(self._pending),
            "lifetime": self.lifetime(),
        }

    def lifetime(self) -> dict[str, Any]:
        """Totals since the job first started (survive a resume through :meth:`state_dict`)."""
        return {
            "steps": self.total_steps,
            "wall_s": self.total_wall_s,
            "phase_s": {p.value: s for p, s in self.total_s.items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """Lifetime totals, to be saved in a checkpoint."""
        return {"version": 1, **self.lifetime()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore lifetime totals saved by :meth:`state_dict` (the rolling window starts empty).

        Raises:
            ConfigError: ``state`` is not a state dict of this class.
        """
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ConfigError("state", "not a PhaseTimer state_dict (expected a dict with version 1)")
        self.total_steps = int(state.get("steps", 0))
        self.total_wall_s = float(state.get("wall_s", 0.0))
        phases = state.get("phase_s", {})
        self.total_s = {p: float(phases.get(p.value, 0.0)) for p in Phase}


class _PhaseContext:
    def __init__(self, timer: PhaseTimer, phase: Phase) -> None:
        self._t = timer
        self._p = phase

    def __enter__(self) -> None:
        self._t.start(self._p)

    def __exit__(self, *exc: object) -> None:
        self._t.stop(self._p)
