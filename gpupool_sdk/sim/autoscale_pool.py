"""A simulated node pool that follows the autoscale signal (cost in GPU-hours against JCT).

:class:`AutoscaledPolicy` wraps any simulator policy. The cluster is declared at its largest
size; nodes not provisioned are held out of service (to the policy they look like GPUs that are
down, so nothing is placed there). At every scheduling cycle (and every ``tick_s`` while jobs
wait or nodes idle) it runs the coordinator's own autoscale rule
(:func:`gpupool_sdk.scheduler.autoscale.autoscale`) on the provisioned nodes and the queue:

* nodes asked for are provisioned after ``boot_s`` (a cloud VM's boot and agent start; the
  pool pays for them from the request on, as a cloud bills);
* nodes the signal names for scale-down (idle for ``scale_down_idle_s``, nothing pending) are
  released at once.

The provisioned GPU-seconds are integrated over the run: :meth:`AutoscaledPolicy.finish` gives
GPU-hours, the peak and the time-weighted mean node count, which size the fixed clusters the
autoscaled run is compared with (``benchmarks/bench_autoscale.py``, ``docs/simulation.md``).

Example:
    >>> from gpupool_sdk.sim.baselines import FifoPolicy
    >>> p = AutoscaledPolicy(FifoPolicy(), initial_nodes=1)
    >>> p.name
    'fifo+autoscale'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.scheduler.autoscale import (
    AutoscaleSettings,
    AutoscaleSignal,
    NodeState,
    PendingDemand,
    autoscale,
)

if TYPE_CHECKING:
    from gpupool_sdk.sim.engine import Simulator


@dataclass(frozen=True)
class PoolUsage:
    """What the node pool cost over a run.

    Attributes:
        gpu_hours: provisioned GPU-hours (booting nodes included) up to the end of the run.
        node_hours: provisioned node-hours.
        peak_nodes: most nodes provisioned at once.
        mean_nodes: time-weighted mean of the nodes provisioned.
        scale_ups: nodes requested over the run.
        scale_downs: nodes released over the run.
    """

    gpu_hours: float
    node_hours: float
    peak_nodes: int
    mean_nodes: float
    scale_ups: int
    scale_downs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_hours": self.gpu_hours,
            "node_hours": self.node_hours,
            "peak_nodes": self.peak_nodes,
            "mean_nodes": self.mean_nodes,
            "scale_ups": self.scale_ups,
            "scale_downs": self.scale_downs,
        }


class AutoscaledPolicy:
    """Wraps a simulator policy with a node pool that follows the autoscale signal.

    Args:
        inner: the policy that schedules (``gpupool``, ``fifo``...).
        settings: the autoscale thresholds (the coordinator's).
        initial_nodes: nodes provisioned at time 0 (in the cluster's node order).
        boot_s: from a scale-up request to the node in service.
        tick_s: how often the signal is re-evaluated while jobs wait or nodes idle.

    Raises:
        ConfigError: a negative count or time.
    """

    def __init__(
        self,
        inner: Any,
        settings: AutoscaleSettings | None = None,
        initial_nodes: int = 1,
        boot_s: float = 300.0,
        tick_s: float = 60.0,
    ) -> None:
        if initial_nodes < 0:
            raise ConfigError("initial_nodes", f"must be >= 0, got {initial_nodes}")
        for name, v in (("boot_s", boot_s), ("tick_s", tick_s)):
            if not 0 <= v < math.inf or (name == "tick_s" and v == 0):
                raise ConfigError(name, f"must be a finite number of seconds ({'> 0' if name == 'tick_s' else '>= 0'}), got {v}")
        self.inner = inner
        self.settings = settings or AutoscaleSettings()
        self.initial_nodes = initial_nodes
        self.boot_s = float(boot_s)
        self.tick_s = float(tick_s)
        self.sim: Simulator | None = None
        self._order: list[str] = []
        self._gpus_of: dict[str, list[int]] = {}
        self._model_of: dict[str, str] = {}
        self._live: set[str] = set()
        self._booting: dict[str, float] = {}
        self._idle_since: dict[str, float] = {}
        self._last: AutoscaleSignal | None = None
        self._last_t = 0.0
        self._gpu_s = 0.0
        self._node_s = 0.0
        self._peak = 0
        self.scale_ups = 0
        self.scale_downs = 0
        self.signals: list[tuple[float, int]] = []  # (time, nodes provisioned) at each change

    def __getattr__(self, name: str) -> Any:
        # Everything the engine asks of a policy that this wrapper does not change.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return f"{self.inner.name}+autoscale"

    # ------------------------------------------------------------------ the engine's calls

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        for g, node in enumerate(sim.node_of):
            if node not in self._gpus_of:
                self._order.append(node)
                self._model_of[node] = sim.gpus[g].model
            self._gpus_of.setdefault(node, []).append(g)
        if self.initial_nodes > len(self._order):
            raise ConfigError("initial_nodes", f"{self.initial_nodes} nodes asked, the cluster declares {len(self._order)}")
        self._live = set(self._order[: self.initial_nodes])
        self.inner.bind(sim)
        sim.listeners.append(self._on_job_change)
        for node in self._order[self.initial_nodes :]:
            self._set_service(node, False)
        self._peak = len(self._live)
        self.signals.append((0.0, len(self._live)))

    def _on_job_change(self, job: Any) -> None:
        # A node that holds a job is not idle, even if no evaluation saw it busy (the idle clock restarts).
        sim = self.sim
        if sim is not None:
            for g in job.gpus or ():
                self._idle_since.pop(sim.node_of[g], None)

    def schedule(self, sim: Simulator) -> Any:
        self._account(sim.now)
        self._follow_signal(sim)
        return self.inner.schedule(sim)

    def next_wakeup(self, sim: Simulator) -> float | None:
        wake = self.inner.next_wakeup(sim)
        candidates = [t for t in (wake, min(self._booting.values(), default=None)) if t is not None]
        idle_live = any(not any(sim.on_gpu[g] for g in self._gpus_of[n]) for n in self._live)
        if sim.pending or self._booting or (idle_live and len(self._live) > self.settings.min_nodes):
            candidates.append(sim.now + self.tick_s)
        return min(candidates) if candidates else None

    # ------------------------------------------------------------------ the pool

    def _provisioned(self) -> int:
        return len(self._live) + len(self._booting)

    def _account(self, now: float) -> None:
        dt = now - self._last_t
        if dt > 0:
            nodes = self._provisioned()
            self._node_s += nodes * dt
            self._gpu_s += dt * sum(len(self._gpus_of[n]) for n in (*self._live, *self._booting))
            self._last_t = now

    def _set_service(self, node: str, up: bool) -> None:
        sim = self.sim
        assert sim is not None
        for g in self._gpus_of[node]:
            sim.healthy[g] = up
            sim._set_idle(g, up and not sim.on_gpu[g])
            sim._health_changed(g)

    def _follow_signal(self, sim: Simulator) -> None:
        now = sim.now
        for node, ready in sorted(self._booting.items(), key=lambda kv: (kv[1], kv[0])):
            if ready <= now:
                del self._booting[node]
                self._live.add(node)
                self._set_service(node, True)
        states = []
        for node in self._order:
            if node in self._live:
                busy = sum(1 for g in self._gpus_of[node] if sim.on_gpu[g])
                if busy:
                    self._idle_since.pop(node, None)
                else:
                    self._idle_since.setdefault(node, now)
                states.append(NodeState(node, self._model_of[node], len(self._gpus_of[node]), busy, self._idle_since.get(node)))
            elif node in self._booting:
                states.append(NodeState(node, self._model_of[node], len(self._gpus_of[node]), 0, None))
        pending = [
            PendingDemand(j.name, None, max(1, math.ceil(sim.gpu_bounds(j)[0] * j.fraction - 1e-9)), j.queued_since)
            for j in sim.pending.values()
        ]
        signal = autoscale(states, pending, now, self.settings, self._last)
        self._last = signal
        changed = False
        for names in signal.scale_down.values():
            for node in names:
                if node in self._live and not any(sim.on_gpu[g] for g in self._gpus_of[node]):
                    self._live.discard(node)
                    self._idle_since.pop(node, None)
                    self._set_service(node, False)
                    self.scale_downs += 1
                    changed = True
        for t, want in signal.desired.items():
            have = sum(1 for n in (*self._live, *self._booting) if self._model_of[n] == t)
            spare = [n for n in self._order if self._model_of[n] == t and n not in self._live and n not in self._booting]
            for node in spare[: max(0, want - have)]:
                self.scale_ups += 1
                changed = True
                if self.boot_s == 0:
                    self._live.add(node)
                    self._set_service(node, True)
                else:
                    self._booting[node] = now + self.boot_s
        if changed:
            self._peak = max(self._peak, self._provisioned())
            self.signals.append((now, self._provisioned()))

    def finish(self, end_s: float) -> PoolUsage:
        """The pool's cost from time 0 to ``end_s`` (the run's makespan)."""
        self._account(end_s)
        span = max(end_s, 1e-9)
        return PoolUsage(
            gpu_hours=self._gpu_s / 3600.0,
            node_hours=self._node_s / 3600.0,
            peak_nodes=self._peak,
            mean_nodes=self._node_s / span,
            scale_ups=self.scale_ups,
            scale_downs=self.scale_downs,
        )
