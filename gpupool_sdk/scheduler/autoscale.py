"""Autoscale signals: from pending demand and idle capacity to a desired node count per GPU type.

Pure policy (snapshot in, signal out; no I/O, no clock: ``now`` comes from the snapshot). The
coordinator's leader runs it after every cycle, publishes the result at ``{prefix}/autoscale``
(JSON :class:`AutoscaleSignal`) and as the metric ``gpupool_autoscale_desired_nodes{gpu_type}``;
the simulator runs the same code to grow and shrink its node pool (``--autoscale``).

The rule, per GPU type (the catalog model of a node's GPUs):

* **demand**: GPUs wanted by jobs that have been pending at least ``scale_up_after_s`` (their
  ``min_gpus``; a job with ``gpu_model`` counts for that type, one without for the type with the
  most nodes, or ``default_type``);
* **scale up** by ``ceil((demand - free GPUs of the type) / GPUs per node)`` nodes;
* **scale down**: nodes with no slice granted for at least ``scale_down_idle_s``, while no job of
  the type is pending at all, are named in ``scale_down`` (oldest idle first) and subtracted;
* **hysteresis**: the two delays keep short bursts and short lulls from moving the pool, and
  while jobs of a type are still pending the desired count never drops below the last one
  published (nodes that were asked for are still booting);
* clamped to ``[min_nodes, max_nodes]`` per type.

Example:
    >>> s = autoscale([NodeState("n0", "H100-80GB", 8, 8, None)], [PendingDemand("j", "H100-80GB", 12, 0.0)],
    ...               now=600.0, settings=AutoscaleSettings(scale_up_after_s=60))
    >>> s.desired["H100-80GB"], s.current["H100-80GB"]
    (3, 1)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import JobState
from gpupool_sdk.resources._fields import opt, req
from gpupool_sdk.scheduler.types import ClusterSnapshot, SliceGrant


@dataclass(frozen=True)
class AutoscaleSettings:
    """Thresholds of the autoscale signal.

    Args:
        scale_up_after_s: a pending job counts as demand once it has waited this long.
        scale_down_idle_s: a node is named for scale-down once it has held no slice this long.
        min_nodes: lower bound per GPU type.
        max_nodes: upper bound per GPU type.
        gpus_per_node: GPUs a new node of each type brings (default: the largest node of that
            type in the pool, else 8).
        default_type: the type demand without ``gpu_model`` is counted for (default: the type
            with the most nodes).

    Raises:
        ConfigError: a negative delay, or ``min_nodes > max_nodes``.
    """

    scale_up_after_s: float = 60.0
    scale_down_idle_s: float = 600.0
    min_nodes: int = 0
    max_nodes: int = 10_000
    gpus_per_node: Mapping[str, int] = field(default_factory=dict)
    default_type: str | None = None

    def __post_init__(self) -> None:
        for name in ("scale_up_after_s", "scale_down_idle_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(name, f"must be a finite number of seconds >= 0, got {v!r}")
        if not 0 <= self.min_nodes <= self.max_nodes:
            raise ConfigError("min_nodes", f"need 0 <= min_nodes <= max_nodes, got {self.min_nodes} > {self.max_nodes}")
        for t, n in self.gpus_per_node.items():
            if not isinstance(n, int) or n < 1:
                raise ConfigError("gpus_per_node", f"{t}: must be a whole number >= 1, got {n!r}")


@dataclass(frozen=True)
class NodeState:
    """One node as the autoscaler sees it: type, GPUs, GPUs holding a slice, and since when it is idle."""

    name: str
    gpu_type: str
    gpus: int
    busy_gpus: int
    idle_since: float | None  # None while any GPU holds a slice


@dataclass(frozen=True)
class PendingDemand:
    """One pending job: the type it needs (None: any), the GPUs it needs at least, and since when it waits."""

    job: str
    gpu_type: str | None
    gpus: int
    since: float


@dataclass(frozen=True)
class AutoscaleSignal:
    """The value of ``{prefix}/autoscale``: what a cloud autoscaler should converge to.

    Attributes:
        at: snapshot time (wall clock).
        desired: nodes wanted per GPU type.
        current: nodes present per GPU type.
        scale_down: per type, the idle nodes to remove (oldest idle first); exactly
            ``current - desired`` of them when the signal asks for fewer nodes.
        pending_gpus: GPUs wanted by pending jobs per type (all of them, waited long enough or not).
        free_gpus: GPUs holding no slice per type.
        reasons: one line per type saying why.
    """

    at: float
    desired: Mapping[str, int]
    current: Mapping[str, int]
    scale_down: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    pending_gpus: Mapping[str, int] = field(default_factory=dict)
    free_gpus: Mapping[str, int] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)

    def same_advice(self, other: AutoscaleSignal | None) -> bool:
        """True when ``other`` asks for the same thing (time and counters aside): no need to republish."""
        return other is not None and dict(self.desired) == dict(other.desired) and {
            k: tuple(v) for k, v in self.scale_down.items()
        } == {k: tuple(v) for k, v in other.scale_down.items()} and dict(self.current) == dict(other.current)

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "desired": dict(self.desired),
            "current": dict(self.current),
            "scale_down": {k: list(v) for k, v in self.scale_down.items()},
            "pending_gpus": dict(self.pending_gpus),
            "free_gpus": dict(self.free_gpus),
            "reasons": dict(self.reasons),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "autoscale") -> AutoscaleSignal:
        return cls(
            at=req(d, "at", float, where),
            desired={str(k): int(v) for k, v in req(d, "desired", dict, where).items()},
            current={str(k): int(v) for k, v in opt(d, "current", dict, where, {}).items()},
            scale_down={str(k): tuple(str(n) for n in v) for k, v in opt(d, "scale_down", dict, where, {}).items()},
            pending_gpus={str(k): int(v) for k, v in opt(d, "pending_gpus", dict, where, {}).items()},
            free_gpus={str(k): int(v) for k, v in opt(d, "free_gpus", dict, where, {}).items()},
            reasons={str(k): str(v) for k, v in opt(d, "reasons", dict, where, {}).items()},
        )


def autoscale(
    nodes: Sequence[NodeState],
    pending: Sequence[PendingDemand],
    now: float,
    settings: AutoscaleSettings,
    previous: AutoscaleSignal | None = None,
) -> AutoscaleSignal:
    """The desired node count per GPU type (see the module docstring for the rule)."""
    by_type: dict[str, list[NodeState]] = {}
    for n in nodes:
        by_type.setdefault(n.gpu_type, []).append(n)
    default = settings.default_type or (
        max(by_type, key=lambda t: (len(by_type[t]), t)) if by_type else None
    )
    types = set(by_type) | {p.gpu_type for p in pending if p.gpu_type is not None}
    if default is not None:
        types.add(default)
    desired: dict[str, int] = {}
    current: dict[str, int] = {}
    down: dict[str, tuple[str, ...]] = {}
    pending_gpus: dict[str, int] = {}
    free_gpus: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for t in sorted(types):
        members = by_type.get(t, [])
        per_node = settings.gpus_per_node.get(t) or max((n.gpus for n in members), default=8)
        mine = [p for p in pending if (p.gpu_type or default) == t]
        ripe = sum(p.gpus for p in mine if now - p.since >= settings.scale_up_after_s)
        free = sum(n.gpus - n.busy_gpus for n in members)
        short = max(0, ripe - free)
        up = math.ceil(short / per_node)
        idle = sorted(
            (n for n in members if n.busy_gpus == 0 and n.idle_since is not None and now - n.idle_since >= settings.scale_down_idle_s),
            key=lambda n: (n.idle_since, n.name),
        )
        removable = idle if not mine else []
        want = len(members) + up - len(removable)
        if mine and previous is not None:
            want = max(want, previous.desired.get(t, 0))  # nodes asked for are still on their way
        want = min(max(want, settings.min_nodes), settings.max_nodes)
        current[t] = len(members)
        desired[t] = want
        pending_gpus[t] = sum(p.gpus for p in mine)
        free_gpus[t] = free
        if want < len(members):
            down[t] = tuple(n.name for n in removable[: len(members) - want])
        if up:
            reasons[t] = f"{ripe} GPU(s) pending over {settings.scale_up_after_s:g}s, {free} free: +{up} node(s) of {per_node}"
        elif t in down:
            reasons[t] = f"{len(down[t])} node(s) idle over {settings.scale_down_idle_s:g}s and nothing pending"
        elif mine:
            reasons[t] = f"{pending_gpus[t]} GPU(s) pending ({ripe} waited long enough), {free} free"
        else:
            reasons[t] = "steady"
    return AutoscaleSignal(now, desired, current, down, pending_gpus, free_gpus, reasons)


def node_states(
    snapshot: ClusterSnapshot,
    idle_since: Mapping[str, float],
    granted: Mapping[str, Sequence[SliceGrant]] | None = None,
) -> list[NodeState]:
    """The snapshot's nodes: type (the most common model), GPUs, busy GPUs; ``idle_since`` from the caller's memory.

    MIG instances count as their parent GPU (one physical GPU). ``granted``: slices granted after
    the snapshot was read (the cycle's own grants), busy as well.
    """
    physical: dict[str, dict[str, str]] = {}
    for g in snapshot.gpus.values():
        physical.setdefault(g.node, {})[g.mig_parent or g.uuid] = g.model
    busy: dict[str, set[str]] = {}
    for view in snapshot.jobs.values():
        for a in view.allocations:
            held = snapshot.gpus.get(a.gpu_uuid)
            busy.setdefault(a.node, set()).add((held.mig_parent or held.uuid) if held is not None else a.gpu_uuid)
    for slices in (granted or {}).values():
        for sl in slices:
            held = snapshot.gpus.get(sl.gpu_uuid)
            busy.setdefault(sl.node, set()).add((held.mig_parent or held.uuid) if held is not None else sl.gpu_uuid)
    out = []
    for node, gpus in sorted(physical.items()):
        model = Counter(gpus.values()).most_common(1)[0][0]
        nbusy = len(busy.get(node, set()) & set(gpus))
        out.append(NodeState(node, model, len(gpus), nbusy, None if nbusy else idle_since.get(node, snapshot.now)))
    return out


def pending_demand(snapshot: ClusterSnapshot, granted: Collection[str] = ()) -> list[PendingDemand]:
    """Pending jobs of the snapshot as demand (``min_gpus`` each; REJECTED jobs and ``granted`` ones are not demand)."""
    return [
        PendingDemand(v.name, v.spec.gpu_model, v.spec.min_gpus or v.spec.gpus, v.queued_at or snapshot.now)
        for v in snapshot.jobs.values()
        if v.state is JobState.PENDING and v.name not in granted
    ]


class Autoscaler:
    """Runs :func:`autoscale` cycle after cycle, remembering when each node became idle and the last signal.

    Deterministic: time comes from each snapshot. Used by the coordinator's leader and the simulator.

    Args:
        settings: thresholds.
    """

    def __init__(self, settings: AutoscaleSettings | None = None) -> None:
        self.settings = settings or AutoscaleSettings()
        self._idle_since: dict[str, float] = {}
        self.last: AutoscaleSignal | None = None

    def update(self, snapshot: ClusterSnapshot, granted: Mapping[str, Sequence[SliceGrant]] | None = None) -> AutoscaleSignal:
        """The signal for ``snapshot`` after ``granted`` (job -> slices granted since the snapshot was read).

        The coordinator reads its snapshot before the cycle's grants; without ``granted`` the jobs it
        just placed would count as demand and their GPUs as free.
        """
        granted = granted or {}
        nodes = node_states(snapshot, self._idle_since, granted)
        self._idle_since = {n.name: n.idle_since for n in nodes if n.idle_since is not None}
        signal = autoscale(nodes, pending_demand(snapshot, granted), snapshot.now, self.settings, self.last)
        self.last = signal
        return signal

    def forget(self) -> None:
        """Drop the memory (a new leader term starts it afresh)."""
        self._idle_since.clear()
        self.last = None


def nodes_to_add(signal: AutoscaleSignal) -> dict[str, int]:
    """Per type, how many nodes the signal asks to add (0 when none)."""
    return {t: max(0, n - signal.current.get(t, 0)) for t, n in signal.desired.items()}


def flatten(signals: Iterable[AutoscaleSignal]) -> list[dict[str, Any]]:
    """The signals as rows (for logs and the simulator's report)."""
    return [{"at": s.at, **{f"desired_{t}": n for t, n in s.desired.items()}} for s in signals]
