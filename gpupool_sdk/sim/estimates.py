"""What the pool can know about a simulated job's length: the remaining-time estimate it publishes.

A training job that knows its length (Lightning's ``trainer.estimated_stepping_batches`` or
``max_steps``) publishes ``remaining_s`` in its telemetry: steps left times the measured step
time. The simulator must not hand the scheduler the trace's true duration, so each job's
estimate is modelled from what such a job can really say (all knobs in :class:`EstimateModel`,
documented in ``docs/simulation.md``):

* **nothing before it has run**: a job publishes an estimate only once it has run ``after_s``
  seconds in all (its step time must be measured first); a job that never started, or ran less,
  reports nothing and is ranked by least attained service;
* **a fraction declares nothing** (``undeclared``): no ``max_steps``, a loop until a metric is
  reached, a notebook: such a job never reports an estimate;
* **early stopping** (``early_stop``): a fraction of the declaring jobs stop before their
  declared length (early stopping, a target metric reached, a user cancelling), at a uniform
  draw in ``[early_stop_min, 1)`` of it: their estimate is too long by that factor;
* **step-time error** (``sigma``): the measured step time is off by a per-job lognormal factor
  ``exp(N(0, sigma))`` (data loading, colocation, warm-up);

so a job that declares ``L`` seconds and has done ``w`` seconds of work reports
``max(0, L - w) x error`` on the GPUs it asked for (``L`` = true duration / stop fraction). The
draws are seeded by the run's seed and the job's id: every policy of a run sees the same ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.sim.engine import RUNNING, SimJob


@dataclass(frozen=True)
class EstimateModel:
    """How simulated jobs report their remaining time (see the module docstring).

    Attributes:
        after_s: seconds a job must have run in all before it publishes an estimate.
        undeclared: fraction of jobs that never declare a length (0-1).
        early_stop: fraction of the declaring jobs that stop before their declared length (0-1).
        early_stop_min: those stop at a uniform fraction in ``[early_stop_min, 1)`` of it (0-1).
        sigma: per-job lognormal error of the measured step time (0 = exact).
        enabled: False: no job ever reports an estimate (the scheduler then sees none, as a pool
            whose jobs publish no ``remaining_s``).

    Example:
        >>> EstimateModel(undeclared=0.5).undeclared
        0.5
    """

    after_s: float = 300.0
    undeclared: float = 0.25
    early_stop: float = 0.2
    early_stop_min: float = 0.3
    sigma: float = 0.2
    enabled: bool = True

    def __post_init__(self) -> None:
        if not (self.after_s >= 0 and math.isfinite(self.after_s)):
            raise ConfigError("after_s", f"must be finite seconds >= 0, got {self.after_s}")
        for name in ("undeclared", "early_stop", "early_stop_min"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:  # NaN fails too
                raise ConfigError(name, f"must be a fraction in [0, 1], got {v}")
        if not (0.0 <= self.sigma <= 3.0):
            raise ConfigError("sigma", f"must be in [0, 3] (0 = exact step times, 0.2 = about 20 % off), got {self.sigma}")


class JobEstimates:
    """The per-job draws of an :class:`EstimateModel` in one run, and the estimate at an instant.

    Args:
        model: the estimate model.
        seed: the run's seed (the draws are keyed by it and the job's id).
    """

    def __init__(self, model: EstimateModel, seed: int = 0) -> None:
        self.model = model
        self.seed = seed
        #: job index -> (declared length in seconds of work, step-time error factor), or None (declares nothing).
        self._draws: dict[int, tuple[float, float] | None] = {}

    def declared(self, job: SimJob) -> tuple[float, float] | None:
        """(declared length, error factor) of ``job``, or None when it declares nothing."""
        if job.index in self._draws:
            return self._draws[job.index]
        m = self.model
        rng = random.Random(f"{self.seed}:estimate:{job.tj.source}:{job.tj.job_id}")
        draw: tuple[float, float] | None
        undeclared = rng.random() < m.undeclared
        stops = rng.random() < m.early_stop
        frac = m.early_stop_min + (1.0 - m.early_stop_min) * rng.random()
        error = math.exp(rng.gauss(0.0, m.sigma)) if m.sigma > 0 else 1.0
        if not m.enabled or undeclared:
            draw = None
        else:
            length = job.tj.duration_s / (frac if stops and frac > 0 else 1.0)
            draw = (length, error)
        self._draws[job.index] = draw
        return draw

    def remaining_s(self, job: SimJob, now: float) -> float | None:
        """The ``remaining_s`` ``job`` publishes at ``now``: None until it has run ``after_s`` in
        all, or when it declares nothing; else its declared length minus the work done, times
        its step-time error, in seconds on the GPUs it holds now."""
        draw = self.declared(job)
        if draw is None:
            return None
        running = job.state == RUNNING
        ran = job.run_s + (now - job.last if running else 0.0)
        if ran < self.model.after_s:
            return None
        left = job.remaining - ((now - job.last) * job.rate if running else 0.0)
        done = max(0.0, job.tj.duration_s - max(0.0, left))
        length, error = draw
        scale = job.scale if running and job.scale > 0 else 1.0
        return max(0.0, length - done) * error / scale
