"""The discrete-event engine: arrivals, completions, preemption acks, failures, metrics.

State is kept incrementally (per-GPU sums, per-job progress), and the policy is asked for
decisions only at event times. A policy returns the same decision types as the pure scheduler
(:mod:`gpupool_sdk.scheduler.types`), and the engine applies them exactly like the coordinator
would, to its own model:

* ``Grant`` puts the job's slices on the GPUs (the engine checks the capacity invariant);
* ``Preempt`` stops the job's progress, and ``checkpoint_s`` later the job acks; a policy that
  speaks the coordinator's protocol (``uses_protocol``) then answers the ack with ``Release``,
  other policies have the engine release at the ack;
* ``Release`` frees the slices; SUSPENDED/PENDING jobs are queued again at once (``gpupool
  run`` re-queues a preempted job), and pay ``restart_s`` of extra work at their next grant;
* a policy that suspends jobs in place rather than checkpointing them (Gandiva's suspend-resume)
  declares ``suspend_s`` and ``resume_s``: its preempts then ack after ``suspend_s`` and the job
  pays ``resume_s`` at its next grant, instead of the checkpoint and restart costs (a failed or
  revoked job still pays the full restart);
* ``Revoke`` frees the slices and loses the work since the last periodic checkpoint;
* ``Balloon`` makes the job ack ``balloon_s`` later with the target reached; ``Shrink`` rewrites
  its quota; ``Deflate`` gives it back; ``Reject`` ends the job (counted);
* ``Resize`` (an elastic job to another slice count) is applied as the coordinator does: the job
  is told to checkpoint (no progress, like a preemption but not counted as one: ``resizes``),
  acks ``checkpoint_s`` later, the policy answers the ack with ``Release`` to PENDING and grants
  it again at the new count (the :class:`~gpupool_sdk.scheduler.policy.Scheduler` does both in
  the same cycle), and the job pays ``restart_s`` of extra work at that grant: a rescale costs
  what a preemption costs (10 s + 20 s = 30 s by default, Pollux's figure). A shrink that makes
  room for a pending job (``Resize.for_job``, ``Resize.keep``) is applied the same way: the
  directive names both, and the scheduler re-grants the job the GPUs it kept;
* ``Queue`` changes nothing.

Elastic jobs: a job may run on ``k`` slices with ``min <= k <= max``, where the bounds come from
the policy's optional ``gpu_bounds(job)`` (the ``gpupool`` adapter returns its spec's
``min_gpus``/``max_gpus``), else from the trace row (``min_gpu=`` / ``max_gpu=``, default
``num_gpu``); a grant outside them raises :class:`SimulationError`. Its speed scales with ``k``
relative to the ``n = num_gpu`` the trace's run time was measured on, by a serial-fraction
(Amdahl-like) model with ``sigma = SimConfig.elastic_sigma``::

    throughput(k) = k / (1 + sigma * (k - 1))
    scale(k)      = throughput(k) / throughput(n)        (1 exactly when k == n)

so a job asking ``n`` GPUs for ``d`` seconds finishes in exactly ``d`` on ``n`` slices alone, and
in ``d / scale(k)`` on ``k``. (``sigma = 0``: linear speed-up; ``sigma = 0.05``, the default: 2
GPUs give 1.90x one GPU, 8 give 5.93x.)

Progress model: a job has ``remaining`` seconds of work at speed 1 (alone on what it asked
for). While running, it advances at its *rate*: the colocation speed from the
:class:`~gpupool_sdk.sim.workload.WorkloadModel` (product of pairwise Lucid factors with the
other jobs on its GPU; a gang runs at its slowest GPU's speed), times ``balloon_speed`` while
it is ballooned below its demand, times ``scale(k)`` on ``k`` slices (elastic jobs). While
preempting or resizing (writing its checkpoint) it makes no progress. The GPU-used metric counts
the colocation and balloon speeds, not ``scale(k)``: a GPU of an elastic gang is as busy as the
profile says, whatever the gang's size.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.resources import GpuInfo, JobState
from gpupool_sdk.scheduler.migrate import MIGRATE_PREFIX
from gpupool_sdk.scheduler.types import (
    Balloon,
    Decision,
    Deflate,
    Grant,
    Preempt,
    Queue,
    Reject,
    Release,
    Resize,
    Revoke,
    Withdraw,
)
from gpupool_sdk.sim.trace import TraceJob
from gpupool_sdk.sim.workload import WorkloadModel

try:  # Shrink lands with the scheduler; older type modules lack it.
    from gpupool_sdk.scheduler.types import Shrink
except ImportError:  # pragma: no cover
    Shrink = None  # type: ignore[assignment,misc]


def elastic_throughput(k: int, sigma: float) -> float:
    """Relative throughput of a data-parallel job on ``k`` GPUs: ``k / (1 + sigma * (k - 1))``.

    Example:
        >>> elastic_throughput(2, 0.25)
        1.6
    """
    return k / (1.0 + sigma * (k - 1))


def elastic_scale(k: int, n: int, sigma: float) -> float:
    """Speed of a job on ``k`` slices relative to the ``n`` it asked for (exactly 1.0 when ``k == n``).

    Example:
        >>> elastic_scale(1, 2, 0.25)
        0.625
    """
    if k == n:
        return 1.0
    return elastic_throughput(k, sigma) / elastic_throughput(n, sigma)

EPS = 1e-9

#: at most this many extra cycles at one instant when a policy's ``follow_up`` asks for them.
MAX_FOLLOW_UPS = 3

# Job states inside the engine.
FUTURE = "future"
PENDING = "pending"
RUNNING = "running"
PREEMPTING = "preempting"
DONE = "done"
REJECTED = "rejected"

# Event kinds (the order breaks ties at equal times: completions free GPUs before arrivals queue).
_COMPLETE, _ACK, _BALLOON_ACK, _FAIL, _REPAIR, _ARRIVAL, _WAKE = range(7)


class SimulationError(GpupoolError):
    """A policy produced a decision the engine cannot apply (over capacity, unknown job or GPU)."""


@dataclass(frozen=True)
class SimConfig:
    """Engine settings, validated at construction.

    Attributes:
        checkpoint_s: time from a preempt directive to the job's ack (checkpoint write).
        restart_s: extra work a preempted or failed job does when it runs again (restart and
            reload); ``checkpoint_s + restart_s`` is the preemption cost (30 s as in Pollux).
            A trace row overrides both with ``checkpoint_s=`` / ``restart_s=`` in ``extra``.
        balloon_s: time from a balloon directive to its ack.
        balloon_speed: speed factor of a job while ballooned below its memory demand (offload).
        checkpoint_interval_s: periodic checkpoints; a failed or revoked job loses the work since the last one.
        failure_mtbf_h: mean time between failures of one GPU, hours (None: no failures).
        repair_s: how long a failed GPU stays out.
        tick_s: while jobs are pending the policy is also called every ``tick_s`` (aging,
            reservations, starvation); 0 = only at events.
        stranded_samples: how many times over the run the stranded-GPU fraction is sampled.
        seed: seeds failures.
        clip_memory: clip a job's memory demand to the largest GPU (else such jobs are rejected).
        view_refresh_s: the gpupool adapter rebuilds a running job's view (attained service) when
            it is older than this.
        max_cycles: stop with :class:`SimulationError` after this many scheduling cycles (a policy
            that thrashes, or failures faster than jobs can finish); None = 1000 per job + 100,000.
        elastic_sigma: serial fraction of the elastic speed-up model, in [0, 1]: a job on ``k``
            slices runs at ``throughput(k) / throughput(num_gpu)`` with ``throughput(k) = k / (1 +
            sigma * (k - 1))`` (0 = linear; 1 = no speed-up at all). Only jobs granted another
            slice count than they asked (elastic jobs) are affected.
    """

    checkpoint_s: float = 10.0
    restart_s: float = 20.0
    balloon_s: float = 5.0
    balloon_speed: float = 0.9
    checkpoint_interval_s: float = 1800.0
    failure_mtbf_h: float | None = None
    repair_s: float = 3600.0
    tick_s: float = 60.0
    stranded_samples: int = 2000
    seed: int = 0
    clip_memory: bool = True
    view_refresh_s: float = 60.0
    max_cycles: int | None = None
    elastic_sigma: float = 0.05

    def __post_init__(self) -> None:
        for name in ("checkpoint_s", "restart_s", "balloon_s", "repair_s", "tick_s", "view_refresh_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(name, f"must be a finite number of seconds >= 0, got {v}")
        if not 0 < self.balloon_speed <= 1:
            raise ConfigError("balloon_speed", f"must be in (0, 1], got {self.balloon_speed}")
        if not self.checkpoint_interval_s > 0:
            raise ConfigError("checkpoint_interval_s", f"must be > 0, got {self.checkpoint_interval_s}")
        if self.failure_mtbf_h is not None and not self.failure_mtbf_h > 0:
            raise ConfigError("failure_mtbf_h", f"must be > 0 hours (or None for no failures), got {self.failure_mtbf_h}")
        if not (0.0 <= self.elastic_sigma <= 1.0):  # NaN fails too
            raise ConfigError(
                "elastic_sigma", f"must be in [0, 1] (0 = linear speed-up, 0.05 = 5 % serial), got {self.elastic_sigma}"
            )
        if self.stranded_samples < 1:
            raise ConfigError("stranded_samples", f"must be >= 1, got {self.stranded_samples}")


class SimJob:
    """A job's mutable state inside one simulation run."""

    __slots__ = (
        "tj", "name", "index", "num_gpu", "fraction", "demand", "util", "label", "state", "remaining",
        "rate", "last", "gpus", "shares", "mems", "balloon_factor", "submit", "first_start", "end",
        "queued_since", "pending_s", "run_s", "last_run_s", "run_start", "attained_gpu_s", "preemptions",
        "failures", "restarts", "version", "granted_at", "directive_seq", "directive_kind", "directive_deadline",
        "directive_target", "directive_for", "directive_keep", "acked", "ack_reached", "peak_known", "policy_data", "reject_reason",
        "checkpoint_s", "restart_s", "restart_due", "scale", "resizes",
    )

    def __init__(self, tj: TraceJob, demand: int, util: float, label: int) -> None:
        self.tj = tj
        self.name = tj.name
        self.index = tj.index
        self.num_gpu = tj.num_gpu
        self.fraction = tj.gpu_fraction
        self.demand = demand
        self.util = util
        self.label = label
        self.state = FUTURE
        self.remaining = tj.duration_s
        self.rate = 0.0
        self.last = 0.0
        self.gpus: list[int] = []
        self.shares: list[float] = []
        self.mems: list[int] = []
        self.balloon_factor = 1.0
        self.submit = tj.submit_s
        self.first_start: float | None = None
        self.end: float | None = None
        self.queued_since = tj.submit_s
        self.pending_s = 0.0
        self.run_s = 0.0
        self.last_run_s = 0.0
        self.run_start = 0.0
        self.attained_gpu_s = 0.0
        self.preemptions = 0
        self.failures = 0
        self.restarts = 0
        self.version = 0
        self.granted_at = 0.0
        self.directive_seq = 0
        self.directive_kind: str | None = None
        self.directive_deadline = 0.0
        self.directive_target = 0
        self.directive_for: str | None = None
        #: GPU UUIDs a shrinking resize keeps (its ``Resize.keep``), written into its directive's target.
        self.directive_keep: tuple[str, ...] = ()
        self.acked = False
        self.ack_reached: int | None = None
        self.peak_known = False
        self.policy_data: object = None
        self.reject_reason = ""
        #: per-job preemption cost from the trace's ``extra`` (``checkpoint_s=``, ``restart_s=``), else None.
        self.checkpoint_s = _extra_seconds(tj, "checkpoint_s")
        self.restart_s = _extra_seconds(tj, "restart_s")
        #: extra work the job does at its next grant (set when it is stopped).
        self.restart_due = 0.0
        #: speed factor of its current slice count (elastic jobs; 1.0 on the count it asked).
        self.scale = 1.0
        #: resize directives applied to it.
        self.resizes = 0


def _extra_seconds(tj: TraceJob, key: str) -> float | None:
    raw = tj.extra.get(key)
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError("trace", f"row {tj.row}, column 'extra': {key}={raw!r} is not a number of seconds") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ConfigError("trace", f"row {tj.row}, column 'extra': {key} must be >= 0 seconds, got {raw!r}")
    return v


def _policy_seconds(policy: object, name: str) -> float | None:
    v = getattr(policy, name, None)
    if v is None:
        return None
    if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
        raise ConfigError(name, f"policy {getattr(policy, 'name', policy)!r} declares {name}={v!r}; must be seconds >= 0")
    return float(v)


class SimPolicy(Protocol):
    """A scheduling policy the engine can run.

    Attributes:
        name: shown in reports.
        uses_protocol: True when the policy answers preempt acks with ``Release`` itself (the
            coordinator's protocol); False to have the engine release at the ack.

    Optional attributes, read once when the engine is built:

    * ``overcommit_ratio`` (float, default 1.0): memory a GPU may grant over its size;
    * ``suspend_s`` and ``resume_s`` (float or None, default None): the policy's preemptions are
      in-place suspensions that ack after ``suspend_s`` and cost ``resume_s`` of extra work at the
      next grant, overriding the checkpoint and restart costs of the config and the trace;
    * ``gpu_bounds(job) -> (min, max)``: the slice counts the policy may grant ``job`` (default:
      the trace row's ``min_gpu=`` / ``max_gpu=``, else exactly ``num_gpu``);
    * ``follow_up(sim) -> bool``: called after a cycle's decisions are applied; True asks for
      another cycle at the same instant (at most :data:`MAX_FOLLOW_UPS`), as the coordinator's
      next cycle sees its own writes at once (the ``gpupool`` adapter uses it to grow an elastic
      job granted below its maximum in the same instant, not at the next event).
    """

    name: str
    uses_protocol: bool

    def bind(self, sim: Simulator) -> None:
        """Called once before the run, with the engine whose state the policy reads."""

    def schedule(self, sim: Simulator) -> Sequence[Decision]:
        """Decisions for the current instant ``sim.now``."""

    def slice_demand(self, job: SimJob) -> tuple[float, int]:
        """(compute share, memory bytes) one slice of ``job`` would take under this policy (for stranding)."""

    def next_wakeup(self, sim: Simulator) -> float | None:
        """An extra time at which the policy wants to be called (None: only at events and ticks)."""


@dataclass
class Timeline:
    """Cluster state after each event time (for plots): times and utilization fractions."""

    t: list[float] = field(default_factory=list)
    alloc: list[float] = field(default_factory=list)
    used: list[float] = field(default_factory=list)
    mem: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


@dataclass
class SimResult:
    """Raw outcome of one run (metrics are computed from it in :mod:`gpupool_sdk.sim.metrics`)."""

    policy: str
    jobs: list[SimJob]
    num_gpus: int
    total_memory: int
    makespan_s: float
    alloc_gpu_s: float
    used_gpu_s: float
    used_mem_byte_s: float
    granted_mem_byte_s: float
    stranded_gpu_s: float
    free_while_pending_gpu_s: float
    preemptions: int
    failures: int
    revokes: int
    balloons: int
    cycles: int
    timeline: Timeline
    wall_s: float = 0.0
    resizes: int = 0
    migrations: int = 0


class Simulator:
    """One run of one policy over one trace on one cluster.

    Args:
        jobs: the trace's jobs (sorted by arrival).
        gpus: the cluster (from :func:`gpupool_sdk.inventory.simulated.parse_cluster_spec`).
        policy: what decides.
        workload: memory demand, utilization profile and colocation speed of each job.
        config: engine settings.

    Example:
        >>> from gpupool_sdk.sim.policies import FifoPolicy  # doctest: +SKIP
        >>> result = Simulator(trace.jobs, gpus, FifoPolicy(), WorkloadModel()).run()  # doctest: +SKIP
    """

    def __init__(
        self,
        jobs: Sequence[TraceJob],
        gpus: Sequence[GpuInfo],
        policy: SimPolicy,
        workload: WorkloadModel,
        config: SimConfig | None = None,
    ) -> None:
        if not gpus:
            raise ConfigError("cluster", "has no GPUs; give a spec such as '16*8xV100-32GB'")
        self.config = config or SimConfig()
        self.policy = policy
        self.workload = workload
        self.gpus: list[GpuInfo] = list(gpus)
        self.uuid_index: dict[str, int] = {g.uuid: i for i, g in enumerate(self.gpus)}
        if len(self.uuid_index) != len(self.gpus):
            raise ConfigError("cluster", "GPU UUIDs must be unique")
        n = len(self.gpus)
        self.mem_total: list[int] = [g.memory_bytes for g in self.gpus]
        self.node_of: list[str] = [g.node for g in self.gpus]
        self.healthy: list[bool] = [g.healthy for g in self.gpus]
        self.alloc_share: list[float] = [0.0] * n
        self.alloc_mem: list[int] = [0] * n
        self.on_gpu: list[list[SimJob]] = [[] for _ in range(n)]
        #: idle healthy GPUs, all and by node (kept up to date for whole-GPU placement).
        self.idle: set[int] = {g for g in range(n) if self.healthy[g]}
        self.idle_by_node: dict[str, set[int]] = {}
        for g in range(n):
            self.idle_by_node.setdefault(self.node_of[g], set())
            if self.healthy[g]:
                self.idle_by_node[self.node_of[g]].add(g)
        # Cached per-GPU metric contributions and their sums.
        self._c_alloc = [0.0] * n
        self._c_used = [0.0] * n
        self._c_mem = [0.0] * n
        self._c_gmem = [0.0] * n
        self._s_alloc = self._s_used = self._s_mem = self._s_gmem = 0.0
        self.total_memory = sum(self.mem_total)
        self.max_gpu_memory = max(self.mem_total)
        self.jobs: list[SimJob] = []
        for tj in jobs:
            prof = workload.profile_for(tj)
            demand = workload.memory_demand(tj, prof)
            if self.config.clip_memory:
                demand = min(demand, self.max_gpu_memory)
            self.jobs.append(SimJob(tj, demand, prof.gpu_util, prof.label))
        self.by_name: dict[str, SimJob] = {j.name: j for j in self.jobs}
        self.pending: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}  # RUNNING and PREEMPTING
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._rng = random.Random(f"failures:{self.config.seed}")
        self.preemptions = self.failures = self.revokes = self.balloons = self.cycles = self.resizes = 0
        #: preemptions that move a job for fragmentation (their reason starts with ``migrate:``).
        self.migrations = 0
        self.wake_at: float | None = None
        #: called with a job whenever its state, slices or directive change (policies keep indexes with it).
        self.listeners: list[Callable[[SimJob], None]] = []
        self._suspend_s = _policy_seconds(policy, "suspend_s")
        self._resume_s = _policy_seconds(policy, "resume_s")
        self._policy_bounds: Callable[[SimJob], tuple[int, int]] | None = getattr(policy, "gpu_bounds", None)
        self._follow_up: Callable[[Simulator], bool] | None = getattr(policy, "follow_up", None)

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, job: int = -1, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, job, version))

    # ------------------------------------------------------------------ progress and rates

    def _advance(self, job: SimJob) -> None:
        dt = self.now - job.last
        if dt > 0 and job.state == RUNNING:
            job.remaining -= dt * job.rate
            job.run_s += dt
            job.attained_gpu_s += dt * sum(job.shares)
        job.last = self.now

    def _speed(self, job: SimJob) -> float:
        if job.state != RUNNING:
            return 0.0
        speed = 1.0
        coloc = self.workload.colocated_speed
        for g in job.gpus:
            others = [o.label for o in self.on_gpu[g] if o is not job]
            if others:
                s = coloc(job.label, others)
                if s < speed:
                    speed = s
        return speed * job.balloon_factor * job.scale

    def _refresh(self, gpus: set[int], extra_jobs: Sequence[SimJob] = ()) -> None:
        """Recompute rates of jobs touching ``gpus`` and metric contributions of the GPUs they touch."""
        affected: dict[int, SimJob] = {}
        for g in gpus:
            for j in self.on_gpu[g]:
                affected[j.index] = j
        for j in extra_jobs:
            affected[j.index] = j
        touched = set(gpus)
        for j in affected.values():
            self._advance(j)
            new = self._speed(j)
            if new != j.rate:
                j.rate = new
                j.version += 1
                if j.state == RUNNING and new > 0:
                    self._push(self.now + max(0.0, j.remaining) / new, _COMPLETE, j.index, j.version)
            touched.update(j.gpus)
        for g in touched:
            self._contrib(g)

    def _contrib(self, g: int) -> None:
        total = self.mem_total[g]
        alloc = min(1.0, self.alloc_share[g])
        used = 0.0
        mem_used = 0
        for j in self.on_gpu[g]:
            k = j.gpus.index(g)
            used += j.shares[k] * j.util * (j.rate / j.scale)
            mem_used += min(j.demand, j.mems[k])
        used = min(1.0, used)
        mem = float(min(total, mem_used))
        gmem = float(min(total, self.alloc_mem[g]))
        self._s_alloc += alloc - self._c_alloc[g]
        self._s_used += used - self._c_used[g]
        self._s_mem += mem - self._c_mem[g]
        self._s_gmem += gmem - self._c_gmem[g]
        self._c_alloc[g], self._c_used[g], self._c_mem[g], self._c_gmem[g] = alloc, used, mem, gmem

    # ------------------------------------------------------------------ state changes

    def _place(self, job: SimJob, gpus: list[int], shares: list[float], mems: list[int]) -> None:
        job.gpus, job.shares, job.mems = gpus, shares, mems
        job.scale = elastic_scale(len(gpus), job.num_gpu, self.config.elastic_sigma)
        for g, s, m in zip(gpus, shares, mems, strict=True):
            if not self.on_gpu[g]:
                self._set_idle(g, False)
            self.on_gpu[g].append(job)
            self.alloc_share[g] += s
            self.alloc_mem[g] += m

    def _set_idle(self, g: int, idle: bool) -> None:
        if idle:
            self.idle.add(g)
            self.idle_by_node[self.node_of[g]].add(g)
        else:
            self.idle.discard(g)
            self.idle_by_node[self.node_of[g]].discard(g)

    def _unplace(self, job: SimJob) -> set[int]:
        gpus = set(job.gpus)
        for g, s, m in zip(job.gpus, job.shares, job.mems, strict=True):
            self.on_gpu[g].remove(job)
            self.alloc_share[g] -= s
            self.alloc_mem[g] -= m
            if not self.on_gpu[g]:
                self.alloc_share[g] = 0.0
                self.alloc_mem[g] = 0
                self._set_idle(g, self.healthy[g])
        job.gpus, job.shares, job.mems = [], [], []
        return gpus

    def _enqueue(self, job: SimJob) -> None:
        job.state = PENDING
        job.queued_since = self.now
        job.directive_kind = None
        job.acked = False
        job.balloon_factor = 1.0
        self.pending[job.name] = job
        self.running.pop(job.name, None)
        self._changed(job)

    def _changed(self, job: SimJob) -> None:
        for listener in self.listeners:
            listener(job)

    def _stop(self, job: SimJob, lost_work: bool) -> None:
        """Take ``job`` off its GPUs and queue it again."""
        self._advance(job)
        if lost_work:
            since = self.now - job.granted_at
            lost_wall = since % self.config.checkpoint_interval_s
            job.remaining += lost_wall * job.rate
        job.last_run_s = self.now - job.run_start
        job.restarts += 1
        if not lost_work and self._resume_s is not None:
            job.restart_due = self._resume_s
        else:
            job.restart_due = self.config.restart_s if job.restart_s is None else job.restart_s
        job.rate = 0.0
        job.version += 1
        freed = self._unplace(job)
        self._enqueue(job)
        self._refresh(freed)

    def _finish(self, job: SimJob) -> None:
        self._advance(job)
        job.state = DONE
        job.end = self.now
        job.last_run_s = self.now - job.run_start
        job.version += 1
        self.running.pop(job.name, None)
        freed = self._unplace(job)
        self._changed(job)
        self._refresh(freed)

    def reject(self, job: SimJob, reason: str) -> None:
        """End a job that can never run (counted in the report, excluded from JCT)."""
        if job.state == PENDING:
            self.pending.pop(job.name, None)
            job.pending_s += self.now - job.queued_since
        elif job.state in (RUNNING, PREEMPTING):
            self._advance(job)
            self.running.pop(job.name, None)
            self._refresh(self._unplace(job))
        job.state = REJECTED
        job.reject_reason = reason
        job.end = self.now
        self._changed(job)

    # ------------------------------------------------------------------ decisions

    def apply(self, decisions: Sequence[Decision]) -> None:
        """Apply a policy's decisions to the model, in order (see the module docstring)."""
        for d in decisions:
            if d.__class__ is Queue:
                continue  # most decisions of a congested cycle: nothing to apply
            if isinstance(d, Grant):
                self._grant(d)
            elif isinstance(d, Preempt):
                if d.reason.startswith(MIGRATE_PREFIX) and self._job(d.job, d).state == RUNNING:
                    self.migrations += 1
                self._preempt(d.job, d.deadline, d.for_job)
            elif isinstance(d, Release):
                job = self._job(d.job, d)
                if job.state in (RUNNING, PREEMPTING):
                    if d.state in (JobState.DONE, JobState.FAILED):
                        self._finish(job)
                    else:
                        self._stop(job, lost_work=False)
            elif isinstance(d, Revoke):
                job = self._job(d.job, d)
                if job.state in (RUNNING, PREEMPTING):
                    self.revokes += 1
                    self._stop(job, lost_work=True)
            elif isinstance(d, Balloon):
                self._balloon(d)
            elif Shrink is not None and isinstance(d, Shrink):
                self._shrink(d.job, d.memory_bytes)
            elif isinstance(d, Deflate):
                self._deflate(d.job)
            elif isinstance(d, Reject):
                job = self._job(d.job, d)
                if job.state != REJECTED:
                    self.reject(job, d.reason)
            elif isinstance(d, Resize):
                self._resize(d)
            elif isinstance(d, (Queue, Withdraw)):
                # Withdraw answers a refused resize; simulated jobs never refuse one (their acks are ok).
                continue
            else:  # pragma: no cover - a new decision type
                raise SimulationError(f"unknown decision {d!r}; teach gpupool_sdk.sim.engine to apply it")

    def _job(self, name: str, d: object) -> SimJob:
        job = self.by_name.get(name)
        if job is None:
            raise SimulationError(f"decision {d!r} names unknown job {name!r}")
        return job

    def gpu_bounds(self, job: SimJob) -> tuple[int, int]:
        """(fewest, most) slices ``job`` may be granted: the policy's ``gpu_bounds``, else the trace row's."""
        if self._policy_bounds is not None:
            return self._policy_bounds(job)
        tj = job.tj
        return (tj.min_gpu or job.num_gpu, tj.max_gpu or job.num_gpu)

    def _check_count(self, what: str, job: SimJob, count: int) -> None:
        lo, hi = self.gpu_bounds(job)
        if not lo <= count <= hi:
            accepts = f"asks {job.num_gpu}" if lo == hi else f"accepts {lo}-{hi} (elastic)"
            raise SimulationError(f"{what} for {job.name} has {count} slices; the job {accepts}")

    def _grant(self, d: Grant) -> None:
        job = self._job(d.job, d)
        if job.state != PENDING:
            raise SimulationError(f"Grant for {d.job} in state {job.state}; only pending jobs can be granted")
        self._check_count("Grant", job, len(d.slices))
        gpus: list[int] = []
        shares: list[float] = []
        mems: list[int] = []
        for s in d.slices:
            g = self.uuid_index.get(s.gpu_uuid)
            if g is None:
                raise SimulationError(f"Grant for {d.job} names unknown GPU {s.gpu_uuid!r}")
            if g in gpus:
                raise SimulationError(f"Grant for {d.job} puts two slices on GPU {s.gpu_uuid}")
            if not self.healthy[g]:
                raise SimulationError(f"Grant for {d.job} uses failed GPU {s.gpu_uuid}")
            gpus.append(g)
            shares.append(float(s.compute_share))
            mems.append(int(s.memory_bytes))
        self._check_capacity(d.job, gpus, mems)
        self.pending.pop(job.name, None)
        job.pending_s += self.now - job.queued_since
        job.state = RUNNING
        job.last = self.now
        job.run_start = self.now
        job.granted_at = self.now
        if job.first_start is None:
            job.first_start = self.now
        if job.restarts > 0:
            job.remaining += job.restart_due
        job.peak_known = True
        self.running[job.name] = job
        self._place(job, gpus, shares, mems)
        self._changed(job)
        self._refresh(set(gpus), (job,))

    def _check_capacity(self, name: str, gpus: list[int], mems: list[int]) -> None:
        ratio = getattr(self.policy, "overcommit_ratio", 1.0)
        for g, m in zip(gpus, mems, strict=True):
            if self.alloc_mem[g] + m > ratio * self.mem_total[g] + 1:
                raise SimulationError(
                    f"Grant for {name} over-commits GPU {self.gpus[g].uuid}: "
                    f"{self.alloc_mem[g] + m} bytes granted > {ratio:g} x {self.mem_total[g]}"
                )

    def _preempt(self, name: str, deadline: float, for_job: str | None) -> None:
        job = self._job(name, name)
        if job.state != RUNNING:
            return
        self.preemptions += 1
        job.preemptions += 1
        self._stop_at_checkpoint(job, "preempt", deadline, for_job, (), self._suspend_s)

    def _resize(self, d: Resize) -> None:
        """Start a resize: the job checkpoints (no progress) and acks; it is re-granted at the ack."""
        job = self._job(d.job, d)
        if job.state != RUNNING:
            return
        self._check_count("Resize", job, d.gpus)
        self.resizes += 1
        job.resizes += 1
        job.directive_target = d.gpus
        # A shrink for a pending job: the scheduler holds the freed GPUs for it and re-grants the kept ones.
        self._stop_at_checkpoint(job, "resize", d.deadline, d.for_job, d.keep, None)

    def _stop_at_checkpoint(
        self, job: SimJob, kind: str, deadline: float, for_job: str | None, keep: tuple[str, ...], cost_s: float | None
    ) -> None:
        """A preempt or resize directive: no progress until the ack, ``cost_s`` later (default: the checkpoint)."""
        self._advance(job)
        job.state = PREEMPTING
        job.directive_seq += 1
        job.directive_kind = kind
        job.directive_deadline = deadline
        job.directive_for = for_job
        job.directive_keep = keep
        job.acked = False
        job.version += 1
        self._changed(job)
        self._refresh(set(job.gpus), (job,))
        if cost_s is None:
            cost_s = self.config.checkpoint_s if job.checkpoint_s is None else job.checkpoint_s
        self._push(self.now + cost_s, _ACK, job.index, job.directive_seq)

    def _balloon(self, d: Balloon) -> None:
        job = self._job(d.job, d)
        if job.state != RUNNING:
            return
        self.balloons += 1
        job.directive_seq += 1
        job.directive_kind = "balloon"
        job.directive_deadline = d.deadline
        job.directive_target = d.target_bytes
        job.directive_for = d.for_job
        job.acked = False
        self._changed(job)
        self._push(self.now + self.config.balloon_s, _BALLOON_ACK, job.index, job.directive_seq)

    def _shrink(self, name: str, memory: int) -> None:
        job = self._job(name, name)
        job.directive_kind = None
        job.acked = False
        if job.state not in (RUNNING, PREEMPTING):
            return
        for k, g in enumerate(job.gpus):
            delta = min(memory, job.mems[k]) - job.mems[k]
            job.mems[k] += delta
            self.alloc_mem[g] += delta
        if memory < job.demand:
            job.balloon_factor = self.config.balloon_speed
        self._changed(job)
        self._refresh(set(job.gpus), (job,))

    def _deflate(self, name: str) -> None:
        job = self._job(name, name)
        if job.state not in (RUNNING, PREEMPTING):
            return
        spec_mem = self.policy.slice_demand(job)[1]
        for k, g in enumerate(job.gpus):
            delta = spec_mem - job.mems[k]
            if delta > 0:
                job.mems[k] += delta
                self.alloc_mem[g] += delta
        job.balloon_factor = 1.0
        self._changed(job)
        self._refresh(set(job.gpus), (job,))

    # ------------------------------------------------------------------ failures

    def _next_failure(self) -> None:
        if self.config.failure_mtbf_h is None:
            return
        rate = len(self.gpus) / (self.config.failure_mtbf_h * 3600.0)
        self._push(self.now + self._rng.expovariate(rate), _FAIL)

    def _fail_gpu(self) -> None:
        up = [g for g in range(len(self.gpus)) if self.healthy[g]]
        self._next_failure()
        if not up:
            return
        g = self._rng.choice(up)
        self.healthy[g] = False
        self._set_idle(g, False)
        self.failures += 1
        for job in list(self.on_gpu[g]):
            job.failures += 1
            self._stop(job, lost_work=True)
        self._push(self.now + self.config.repair_s, _REPAIR, g)
        self._health_changed(g)

    def _health_changed(self, g: int) -> None:
        hook = getattr(self.policy, "on_health_change", None)
        if hook is not None:
            hook(self, g)

    # ------------------------------------------------------------------ stranding

    def _stranded(self) -> tuple[float, float]:
        """(stranded, free) GPU capacity now, in GPUs, with respect to the next pending job."""
        if not self.pending:
            return 0.0, 0.0
        head = min(self.pending.values(), key=lambda j: (j.queued_since, j.index))
        share, mem = self.policy.slice_demand(head)
        stranded = free = 0.0
        for g in range(len(self.gpus)):
            if not self.healthy[g]:
                continue
            f = 1.0 - self.alloc_share[g] if self.on_gpu[g] else 1.0
            if f <= EPS:
                continue
            free += f
            if f + EPS < share or self.mem_total[g] - self.alloc_mem[g] < mem:
                stranded += f
        return stranded, free

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        """Simulate until every job finished or nothing can happen any more."""
        cfg = self.config
        for job in self.jobs:
            self._push(job.submit, _ARRIVAL, job.index)
        self._next_failure()
        self.policy.bind(self)
        last_arrival = self.jobs[-1].submit if self.jobs else 0.0
        work = sum(j.remaining * j.num_gpu * j.fraction for j in self.jobs)
        horizon = max(last_arrival, work / max(1, len(self.gpus))) * 1.5 + 1.0
        sample_every = horizon / cfg.stranded_samples
        next_sample = 0.0
        stranded_gpu_s = free_pending_gpu_s = 0.0
        cur_stranded = cur_free = 0.0
        area_alloc = area_used = area_mem = area_gmem = 0.0
        tl = Timeline()
        last_t = 0.0
        active = 0
        # Arrivals still in the heap: the run is over only when none is left (an idle cluster
        # between two arrivals is not the end of the trace).
        arrivals_left = len(self.jobs)
        heap = self._heap
        max_cycles = cfg.max_cycles if cfg.max_cycles is not None else 1000 * len(self.jobs) + 100_000
        while heap:
            t = heap[0][0]
            dt = t - last_t
            if dt > 0:
                area_alloc += self._s_alloc * dt
                area_used += self._s_used * dt
                area_mem += self._s_mem * dt
                area_gmem += self._s_gmem * dt
                stranded_gpu_s += cur_stranded * dt
                free_pending_gpu_s += cur_free * dt
            self.now = last_t = t
            acted = False
            while heap and heap[0][0] <= t:
                _, kind, _, idx, version = heapq.heappop(heap)
                if kind == _ARRIVAL:
                    job = self.jobs[idx]
                    active += 1
                    arrivals_left -= 1
                    job.last = t
                    fewest = self.gpu_bounds(job)[0]
                    if fewest > len(self.gpus):
                        self._enqueue(job)
                        self.reject(job, f"asks {fewest} GPUs; the cluster has {len(self.gpus)}")
                        active -= 1
                        continue
                    if job.demand > self.max_gpu_memory:
                        self._enqueue(job)
                        self.reject(job, "memory demand exceeds every GPU")
                        active -= 1
                        continue
                    self._enqueue(job)
                    acted = True
                elif kind == _COMPLETE:
                    job = self.jobs[idx]
                    if job.version == version and job.state == RUNNING:
                        self._finish(job)
                        active -= 1
                        acted = True
                elif kind == _ACK:
                    job = self.jobs[idx]
                    if job.state == PREEMPTING and job.directive_seq == version:
                        acted = True
                        if self.policy.uses_protocol:
                            job.acked = True
                            self._changed(job)
                        else:
                            self._stop(job, lost_work=False)
                elif kind == _BALLOON_ACK:
                    job = self.jobs[idx]
                    if job.state == RUNNING and job.directive_seq == version and job.directive_kind == "balloon":
                        acted = True
                        job.acked = True
                        job.ack_reached = job.directive_target
                        self._changed(job)
                elif kind == _FAIL:
                    self._fail_gpu()
                    acted = True
                elif kind == _REPAIR:
                    self.healthy[idx] = True
                    if not self.on_gpu[idx]:
                        self._set_idle(idx, True)
                    self._health_changed(idx)
                    acted = True
                elif kind == _WAKE:
                    if self.wake_at is not None and self.wake_at <= t:
                        self.wake_at = None
                    acted = True
            if arrivals_left == 0 and active <= 0 and not self.pending and not self.running:
                tl.t.append(t)
                tl.alloc.append(self._s_alloc)
                tl.used.append(self._s_used)
                tl.mem.append(self._s_mem)
                tl.pending.append(0)
                break
            if acted:
                self.cycles += 1
                if self.cycles > max_cycles:
                    raise SimulationError(
                        f"{self.policy.name}: no end after {self.cycles} scheduling cycles at t={t:.0f}s with "
                        f"{len(self.pending)} pending and {len(self.running)} running jobs; the policy thrashes "
                        "(give preempted jobs a minimum run time) or failures outpace progress (raise failure_mtbf_h)"
                    )
                self.apply(self.policy.schedule(self))
                follow_ups = 0
                while self._follow_up is not None and follow_ups < MAX_FOLLOW_UPS and self._follow_up(self):
                    follow_ups += 1
                    self.cycles += 1
                    self.apply(self.policy.schedule(self))
            if t >= next_sample:
                cur_stranded, cur_free = self._stranded()
                next_sample = t + sample_every
            tl.t.append(t)
            tl.alloc.append(self._s_alloc)
            tl.used.append(self._s_used)
            tl.mem.append(self._s_mem)
            tl.pending.append(len(self.pending))
            wake = self.policy.next_wakeup(self)
            if self.pending and cfg.tick_s > 0:
                tick = t + cfg.tick_s
                wake = tick if wake is None else min(wake, tick)
            if wake is not None and wake > t and (self.wake_at is None or wake < self.wake_at or self.wake_at <= t):
                self.wake_at = wake
                self._push(wake, _WAKE)
            if not heap and (self.pending or self.running):
                # Nothing left that could change the state: the rest can never run.
                break
        makespan = max((j.end for j in self.jobs if j.end is not None and j.state == DONE), default=self.now)
        makespan = max(makespan, EPS)
        return SimResult(
            policy=self.policy.name,
            jobs=self.jobs,
            num_gpus=len(self.gpus),
            total_memory=self.total_memory,
            makespan_s=makespan,
            alloc_gpu_s=area_alloc,
            used_gpu_s=area_used,
            used_mem_byte_s=area_mem,
            granted_mem_byte_s=area_gmem,
            stranded_gpu_s=stranded_gpu_s,
            free_while_pending_gpu_s=free_pending_gpu_s,
            preemptions=self.preemptions,
            failures=self.failures,
            revokes=self.revokes,
            balloons=self.balloons,
            cycles=self.cycles,
            timeline=tl,
            resizes=self.resizes,
            migrations=self.migrations,
        )
