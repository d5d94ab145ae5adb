"""Predicting a shared job's memory peak from the history of its window peaks (pure).

A job publishes the peaks of its recent telemetry windows (``memory_peak_history``, oldest
first, at most 32). One window's peak says little: a window that missed the step's largest
phase (a validation pass, the longest sequences, an optimizer state that grows) reports a low
peak, and the next window then exceeds ``peak x (1 + margin)``; a window that caught a rare
spike reserves more than the job needs most of the time. A high percentile over the recent
windows is steadier: with ``peak_percentile=1.0`` it is the largest peak seen in the window of
history, plus a small margin for what the history has not seen yet.

:func:`history_peak` is the percentile; ``gpupool_sdk.scheduler.filter.predicted_peak`` uses it
when a job has at least ``peak_history_min`` windows (``SchedulerConfig``), and the single-peak
rule (``memory_peak_bytes x (1 + peak_margin)``) otherwise. ``gpupool_sdk.sim.overcommit``
measures both rules on peaks drawn from the shared traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[int | float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values`` with linear interpolation (numpy's default method).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 1].

    Example:
        >>> percentile([10, 20, 30, 40], 0.5)
        25.0
        >>> percentile([10, 20, 30, 40], 1.0)
        40.0
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def history_peak(history: Sequence[int], q: float, margin: float) -> int:
    """The predicted peak from a history of window peaks: the ``q`` percentile plus ``margin``.

    Example:
        >>> history_peak([8, 10, 9, 10], q=1.0, margin=0.05)
        10
        >>> history_peak([800, 1000, 900, 1000], q=1.0, margin=0.05)
        1050
    """
    return int(percentile(history, q) * (1.0 + margin))
