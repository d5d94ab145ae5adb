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
import operator
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

#: The phases in index order: ``PHASES[i]`` is the phase that the index-based hot-path methods
#: of :class:`PhaseTimer` (:meth:`~PhaseTimer.begin`, :meth:`~PhaseTimer.switch`,
#: :meth:`~PhaseTimer.finish_step`) call ``i``.
PHASES: tuple[Phase, ...] = tuple(Phase)
#: Index of each phase in :data:`PHASES`.
PHASE_INDEX: dict[Phase, int] = {p: i for i, p in enumerate(PHASES)}
_N = len(PHASES)
_OTHER = PHASE_INDEX[Phase.OTHER]
_DEVICE_INDEXES: frozenset[int] = frozenset(PHASE_INDEX[p] for p in DEVICE_PHASES)
_ZEROS: tuple[float, ...] = (0.0,) * _N


@dataclass
class _PendingStep:
    """A finished step whose CUDA events may not have completed yet."""

    cpu: list[float]
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

    The per-step path allocates nothing: phase times accumulate into preallocated float lists
    indexed by phase (see :data:`PHASES`), a finished step is swapped into a ring of ``window``
    rows, and the summary dictionaries are built only when :meth:`summary` is called (when a
    publish is due). Adapters that run every step use the index-based methods
    (:meth:`begin`, :meth:`switch`, :meth:`finish_step`: one clock reading per boundary);
    :meth:`start` / :meth:`stop` / :meth:`phase` take a :class:`Phase` and do the same.

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
        # Start time of each open phase (None: not open), seconds of the current step per phase.
        self._open: list[float | None] = [None] * _N
        self._open_events: dict[Phase, Any] = {}
        self._cur: list[float] = [0.0] * _N
        self._cur_events: list[tuple[Phase, Any, Any]] = []
        self._step_started: float | None = None
        self._pending: deque[_PendingStep] = deque()
        # The rolling window: a ring of per-phase rows and step wall times; _ring_len rows are valid.
        self._ring: list[list[float]] = [[0.0] * _N for _ in range(window)]
        self._ring_wall: list[float] = [0.0] * window
        self._ring_pos = 0
        self._ring_len = 0
        self._total: list[float] = [0.0] * _N
        self.total_steps = 0
        self.total_wall_s = 0.0

    @property
    def total_s(self) -> dict[Phase, float]:
        """Lifetime seconds by phase (a snapshot; assign a dict to replace the totals)."""
        return dict(zip(PHASES, self._lifetime_phase_s(), strict=True))

    @total_s.setter
    def total_s(self, value: dict[Phase, float]) -> None:
        self._set_totals([float(value.get(p, 0.0)) for p in PHASES])

    def _set_totals(self, totals: list[float]) -> None:
        # The unfolded ring rows stay in the window but no longer count towards the totals.
        unfolded = self._lifetime_phase_s()
        self._total = [want - (have - old) for want, have, old in zip(totals, unfolded, self._total, strict=True)]

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

    # -- recording: hot path (phase indexes, one clock reading per boundary) ---------------
    def begin(self, index: int, now: float | None = None) -> None:
        """Open phase ``PHASES[index]`` at ``now`` (default: a clock reading).

        A phase already open is restarted.
        """
        if self._use_cuda:
            self._start_cuda(index, self._clock() if now is None else now)
            return
        if now is None:
            now = self._clock()
        if self._step_started is None:
            self._step_started = now
        self._open[index] = now

    def switch(self, stop: int, start: int) -> float:
        """Close phase index ``stop`` and open phase index ``start`` at one clock reading.

        ``stop`` or ``start`` may be -1 (nothing to close or open). Returns the reading.
        """
        now = self._clock()
        if self._use_cuda:
            if stop >= 0:
                self._stop_at(stop, now)
            if start >= 0:
                self._start_cuda(start, now)
            return now
        if stop >= 0:
            began = self._open[stop]
            if began is not None:
                self._open[stop] = None
                if now > began:
                    self._cur[stop] += now - began
        if start >= 0:
            if self._step_started is None:
                self._step_started = now
            self._open[start] = now
        return now

    def finish_step(self, stop: int = -1) -> float:
        """Close phase index ``stop`` (-1: none), every other open phase and the step, at one reading.

        Same as ``stop(PHASES[stop]); step_end()``. Returns the clock reading (the end of the step).
        """
        now = self._clock()
        if self._use_cuda or self._cur_events or self._pending:
            if stop >= 0:
                self._stop_at(stop, now)
            self._step_end_at(now)
            return now
        # CPU clock only: _stop_at + _step_end_at + _commit_cur, inlined (this runs every step).
        open_ = self._open
        cur = self._cur
        if stop >= 0:
            began = open_[stop]
            if began is not None:
                open_[stop] = None
                if now > began:
                    cur[stop] += now - began
        if open_.count(None) != _N:
            for i in range(_N):
                if open_[i] is not None:
                    self._stop_at(i, now)
        started = self._step_started
        wall = now - started if started is not None and now > started else 0.0
        claimed = sum(cur)
        if wall > claimed:
            cur[_OTHER] += wall - claimed
        else:
            wall = claimed
        self._step_started = now
        # _commit_cur, inlined: this runs every step, between kernels that evict the caches,
        # where every extra frame and object touched costs microseconds.
        pos = self._ring_pos
        ring = self._ring
        self._cur = ring[pos]
        ring[pos] = cur
        self._cur[:] = _ZEROS
        self._ring_wall[pos] = wall
        self.total_steps += 1
        self.total_wall_s += wall
        if pos + 1 == self.window or self._ring_len < self.window:
            self._advance(pos)
        else:
            self._ring_pos = pos + 1
        return now

    # -- recording: by Phase ---------------------------------------------------------------
    def start(self, phase: Phase) -> None:
        """Begin timing ``phase`` (a phase already open is restarted)."""
        self.begin(PHASE_INDEX[phase])

    def stop(self, phase: Phase) -> float:
        """End timing ``phase``; returns the CPU seconds it took (0.0 if it was not open)."""
        index = PHASE_INDEX[phase]
        if self._open[index] is None:
            return 0.0
        return self._stop_at(index, self._clock())

    def _start_cuda(self, index: int, now: float) -> None:
        if self._step_started is None:
            self._step_started = now
        self._open[index] = now
        if index in _DEVICE_INDEXES:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open_events[PHASES[index]] = ev

    def _stop_at(self, index: int, now: float) -> float:
        began = self._open[index]
        if began is None:
            return 0.0
        self._open[index] = None
        elapsed = now - began
        if elapsed < 0.0:
            elapsed = 0.0
        self._cur[index] += elapsed
        if not self._use_cuda:
            return elapsed
        phase = PHASES[index]
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
        index = PHASE_INDEX[phase]
        if standalone:
            self._total[index] += max(0.0, seconds)
            return
        if self._step_started is None:
            self._step_started = self._clock() - seconds
        self._cur[index] += max(0.0, seconds)

    def phase(self, phase: Phase) -> _PhaseContext:
        """Context manager timing ``phase``: ``with timer.phase(Phase.FORWARD): ...``."""
        return _PhaseContext(self, phase)

    def step_end(self) -> None:
        """Close the current step: open phases are stopped, the step enters the window.

        The step's wall time runs from the end of the previous step (or the first ``start``)
        to now, so time that no phase claimed is reported as ``other``.
        """
        self._step_end_at(self._clock())

    def _step_end_at(self, now: float) -> None:
        open_ = self._open
        if open_.count(None) != _N:
            for i in range(_N):
                if open_[i] is not None:
                    self._stop_at(i, now)
        cur = self._cur
        started = self._step_started
        wall = now - started if started is not None and now > started else 0.0
        claimed = sum(cur)
        if wall > claimed:
            cur[_OTHER] += wall - claimed
        else:
            wall = claimed
        self._step_started = now
        if self._cur_events:
            self._pending.append(_PendingStep(cpu=cur[:], wall_s=wall, events=self._cur_events))
            self._cur_events = []
            cur[:] = _ZEROS
        else:
            self._commit_cur(wall)
        if self._pending:
            self._drain_pending()

    def _commit_cur(self, wall_s: float) -> None:
        # Swap the current row into the ring; a fresh zero row becomes the current one.
        pos = self._ring_pos
        self._ring[pos] = self._cur
        self._cur = [0.0] * _N
        self._ring_wall[pos] = wall_s
        self.total_steps += 1
        self.total_wall_s += wall_s
        self._advance(pos)

    def _commit(self, times: list[float], wall_s: float) -> None:
        pos = self._ring_pos
        self._ring[pos] = times[:]
        self._ring_wall[pos] = wall_s
        self.total_steps += 1
        self.total_wall_s += wall_s
        self._advance(pos)

    def _advance(self, pos: int) -> None:
        # Lifetime phase totals are _total plus the ring rows [0, _ring_pos) (written since the
        # last wrap): the rows are folded into _total once per lap, not per step.
        pos += 1
        if pos == self.window:
            self._total[:] = map(operator.add, self._total, map(math.fsum, zip(*self._ring, strict=True)))
            pos = 0
        self._ring_pos = pos
        if self._ring_len < self.window:
            self._ring_len += 1

    def _lifetime_phase_s(self) -> list[float]:
        pos = self._ring_pos
        if not pos:
            return self._total[:]
        return [t + math.fsum(col) for t, col in zip(self._total, zip(*self._ring[:pos], strict=True), strict=True)]

    def _drain_pending(self) -> None:
        while self._pending:
            head = self._pending[0]
            if all(end.query() for _, _, end in head.events):
                self._pending.popleft()
                times = head.cpu[:]
                device: dict[int, float] = {}
                for p, s, e in head.events:
                    i = PHASE_INDEX[p]
                    device[i] = device.get(i, 0.0) + s.elapsed_time(e) / 1000.0
                for i, secs in device.items():
                    # The CPU may run ahead of the device (async launch); the device time is the truth.
                    times[i] = max(times[i], secs)
                self._commit(times, max(head.wall_s, sum(times)))
            elif len(self._pending) > self.max_pending:
                old = self._pending.popleft()
                self._commit(old.cpu, old.wall_s)
            else:
                break

    def discard_open(self) -> None:
        """Forget phases still open and the partial step (e.g. after a resume)."""
        self._open[:] = [None] * _N
        self._open_events.clear()
        self._cur[:] = _ZEROS
        self._cur_events = []
        self._step_started = None

    # -- reading (off the hot path: called when a publish is due) --------------------------
    def _window_rows(self) -> tuple[list[float], list[list[float]]]:
        n = self._ring_len
        if n < self.window:
            return self._ring_wall[:n], self._ring[:n]
        return self._ring_wall[:], self._ring[:]

    def summary(self) -> dict[str, Any]:
        """Rolling summary of the last ``window`` completed steps plus lifetime totals.

        Returns:
            ``steps`` (in the window), ``step_time_s`` (``mean``, ``p50``, ``p99``),
            ``steps_per_s``, ``phase_s`` (mean seconds per step by phase), ``phase_fraction``
            (0-1, sums to 1 when any time was recorded), ``pending_device_steps`` and
            ``lifetime`` (``steps``, ``wall_s``, ``phase_s``).
        """
        walls, rows = self._window_rows()
        n = len(walls)
        sums = [0.0] * _N
        for row in rows:
            for i in range(_N):
                sums[i] += row[i]
        per_phase = {p.value: sums[i] for i, p in enumerate(PHASES)}
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
            "phase_s": dict(zip((p.value for p in PHASES), self._lifetime_phase_s(), strict=True)),
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
        self._set_totals([float(phases.get(p.value, 0.0)) for p in PHASES])


class _PhaseContext:
    def __init__(self, timer: PhaseTimer, phase: Phase) -> None:
        self._t = timer
        self._p = phase

    def __enter__(self) -> None:
        self._t.start(self._p)

    def __exit__(self, *exc: object) -> None:
        self._t.stop(self._p)
