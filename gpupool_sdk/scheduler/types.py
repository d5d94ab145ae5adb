"""The scheduler's input (a frozen :class:`ClusterSnapshot`) and output (a list of decisions).

The scheduler is pure: no etcd, no clock, no randomness. ``now`` comes in the snapshot. The
coordinator builds snapshots from etcd and applies decisions with fenced transactions; the
simulator builds them from a trace and applies decisions to its own model; both run the same
:class:`~gpupool_sdk.scheduler.policy.Scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Ack, Allocation, Directive, GangMember, GpuInfo, JobSpec, JobState

#: Smallest etcd ``--max-txn-ops`` the coordinator works with (a one-slice job's release needs 5).
MIN_ETCD_MAX_TXN_OPS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """Operator policy knobs, validated at construction.

    Attributes:
        overcommit_ratio: for ``shared`` slices only, the sum of granted memory on a GPU may reach
            this multiple of physical memory as long as predicted peaks fit (1.0 = no overcommit).
        peak_margin: safety margin added to a job's observed memory peak when predicting it (0.1 = +10 %).
        peak_history_min: a shared job that published at least this many window peaks
            (``memory_peak_history``) is predicted from them (:mod:`~gpupool_sdk.scheduler.peak_history`);
            0 = always the single-peak rule (``memory_peak_bytes x (1 + peak_margin)``).
        peak_percentile: the percentile (0-1) of the window peaks that predicts the peak (1.0 = the largest).
        peak_history_margin: margin added to that percentile (0.02 = +2 %).
        min_runtime_s: default minimum run time after a grant before a job may be preempted
            (a spec's own ``min_runtime_s`` wins when larger).
        aging_s_per_priority: a pending job gains one effective priority point per this many seconds
            waited, so no job starves (0 disables aging).
        max_wait_s: a job that has waited this long is treated as top priority among pending jobs.
        preempt_grace_s: default time to checkpoint and ack a preempt directive.
        balloon_grace_s: time to ack a balloon directive before the coordinator preempts instead.
        balloon_floor_fraction: a balloon never shrinks a shared job's per-slice quota below this
            fraction of the memory it declared (``spec.memory``), whatever its reported peak: a
            peak can be wrong (on the CPU a job reports a few hundred bytes), and a job shrunk
            below what it can train in is not running, only holding a slot. When the floor does
            not free enough the pending job preempts instead (if it may). 0.5: a balloon takes
            at most half (trimmed caches and offloaded optimizer state are about that much).
        balloon_floor_bytes: nor below this many bytes per slice (256 MiB); a job that declared
            less is never ballooned.
        allow_preemption: False turns preemption off (jobs only queue).
        max_decisions: bound on grants + preemptions per cycle, to keep cycles short.
        las_threshold_gpu_s: optional least-attained-service queues (Tiresias-like): ascending
            thresholds on ``JobView.attained_gpu_s``; within one priority level, jobs in a lower queue
            (less service received) go first. Empty (the default) turns it off.
        las_preempt: with ``las_threshold_gpu_s`` set, a pending job may also preempt running
            jobs of its own priority level (or lower) that sit at least one LAS queue higher, as
            Tiresias does; shared and guaranteed jobs only, never exclusive ones, never inside
            their minimum run time. False keeps LAS to ordering the pending jobs.
        las_promote_after_factor: with LAS on, a job whose wait (time since ``queued_at`` not spent
            running) reached this multiple of its run so far counts as queue 0 again (Tiresias'
            starvation promotion; while it runs, until its run catches up). 0 turns it off.
        use_remaining: with LAS on, a job that reports its remaining time (``JobView.remaining_s``,
            from its telemetry) is ranked by its remaining service instead of its attained
            service, and inside a queue jobs that know they are short go first
            (shortest-remaining-first; jobs that report nothing keep LAS). False: attained only.
        reserve_after_s: a pending job that cannot be placed and has waited this long gets GPUs
            reserved for it: lower jobs may only backfill on other GPUs.
        max_reservations: at most this many blocked jobs hold reservations in one cycle.
        resize_up: grow granted elastic jobs toward ``max_gpus`` when nothing is pending.
        max_preemption_attempts: at most this many pending jobs per cycle search for balloon or
            preemption victims (the costly part of a cycle; the highest in queue order go first,
            the others try again next cycle, as in the Kubernetes scheduler).
        keep_reservations: a blocked job that held a reservation in the last cycle keeps the
            same GPUs while each carries the same load and is held for nobody else, instead of a
            new search over every job holding capacity (the Kubernetes scheduler's nominated
            node); False searches again each cycle.
        max_considered: at most this many pending jobs, the first in queue order, are considered
            per cycle (placed, or a wait, balloon, shrink, preemption or reservation planned for
            them); the others are only placed where they fit now (backfill), else queued, and
            nothing is planned for them until they move up, as Slurm's backfill considers at
            most ``bf_max_job_test`` jobs. A bound on a cycle's work with a long queue
            (``docs/scheduler.md`` *Performance*); while it cuts, nothing grows elastically (a
            job not looked at might have used the room). 0 = no bound.
        spread_idle_above: a one-slice job goes to an idle GPU rather than a partly used one while
            more than this fraction of the GPUs it may use are idle. Jobs sharing a GPU slow each
            other down, so packing pays only when GPUs get scarce; below the threshold the
            scheduler packs (best fit), which keeps the remaining idle GPUs whole for whole-GPU
            and gang jobs. 1.0 = always pack; 0.0 = spread whenever an idle GPU is free.
        colocation_aware: when a one-slice ``shared`` job packs onto a partly used GPU, GPUs whose
            fit is within ``COLOCATION_TIE_BYTES`` of the best fit count as tied, and among them
            the one whose holders' measured utilisation (``JobView.gpu_util``) sums lowest wins
            (Lucid: partners whose summed utilisation stays under the GPU's capacity slow each
            other little). A tie-breaker after best fit; see ``docs/scheduler.md`` *Placement*.
        shrink_elastic: a pending job that needs room resizes elastic victims down to their
            ``min_gpus`` (a ``Resize`` naming it) instead of preempting them whole, when that alone
            makes room and those victims are no more protected than the ones a preemption would
            take. False: elastic victims are preempted whole, like rigid ones.
        etcd_max_txn_ops: the most operations one etcd transaction may hold (etcd's
            ``--max-txn-ops``); a job whose grant or release would need more is rejected (see
            :func:`~gpupool_sdk.scheduler.reject.job_txn_ops`). 0 = no limit (the simulator has no
            etcd); the coordinator sets it from ``--etcd-max-txn-ops`` (default 128, etcd's default).
        resize_retry_s: after a job refuses a resize (an ``ok=False`` ack), no resize is proposed to
            it for this long, doubled for each refusal in a row up to 16x (``JobView.resize_retry_at``);
            meanwhile a pending job that needs its GPUs may still preempt it whole.
        migrate_for_fragmentation: a pending one-slice job that fits on no GPU, and gets no room
            by waiting, ballooning, shrinking or preempting, gets it by moving up to three running
            ``shared`` jobs off one GPU when each of them fits right now on another GPU: they are
            preempted with a ``migrate:`` reason naming it (a checkpoint and a restart each) and
            queue again at their old place in line (:mod:`~gpupool_sdk.scheduler.migrate`).
        migrate_min_run_s: a job is moved only after running this long since its grant (a
            migration re-grants it, so no job is moved more than once per this many seconds).
        migrate_max_per_cycle: the most jobs moved in one cycle (0 = none).
        migrate_hold_s: a moved job's landing room (the GPU it was checked to fit on) is held
            for it from its move until it is granted again, at most this long: others are not
            placed in that room meanwhile, and the job is placed there first (0 = held only in
            the cycle that moves it). Kept by the leader's scheduler only: a failover drops it.
    """

    overcommit_ratio: float = 1.0
    peak_margin: float = 0.1
    peak_history_min: int = 8
    peak_percentile: float = 1.0
    peak_history_margin: float = 0.0
    min_runtime_s: float = 0.0
    aging_s_per_priority: float = 60.0
    max_wait_s: float = 3600.0
    preempt_grace_s: float = 60.0
    balloon_grace_s: float = 30.0
    balloon_floor_fraction: float = 0.5
    balloon_floor_bytes: int = 256 << 20  # 256 MiB
    allow_preemption: bool = True
    max_decisions: int = 256
    las_threshold_gpu_s: tuple[float, ...] = ()
    las_preempt: bool = True
    las_promote_after_factor: float = 0.0
    use_remaining: bool = True
    reserve_after_s: float = 600.0
    max_reservations: int = 2
    resize_up: bool = True
    max_preemption_attempts: int = 32
    max_considered: int = 0
    keep_reservations: bool = False
    spread_idle_above: float = 0.25
    colocation_aware: bool = False
    shrink_elastic: bool = True
    etcd_max_txn_ops: int = 0
    resize_retry_s: float = 300.0
    migrate_for_fragmentation: bool = False
    migrate_min_run_s: float = 3600.0
    migrate_max_per_cycle: int = 2
    migrate_hold_s: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "overcommit_ratio",
            "peak_margin",
            "min_runtime_s",
            "aging_s_per_priority",
            "max_wait_s",
            "preempt_grace_s",
            "balloon_grace_s",
            "reserve_after_s",
            "las_promote_after_factor",
            "resize_retry_s",
            "migrate_min_run_s",
            "migrate_hold_s",
        ):
            # NaN slips through every `x < bound` check below, and infinity makes no sense for these.
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(name, f"must be a finite number, got {getattr(self, name)}")
        if self.overcommit_ratio < 1.0:
            raise ConfigError("overcommit_ratio", f"must be >= 1.0 (1.0 = no overcommit), got {self.overcommit_ratio}")
        if not 0.0 <= self.peak_margin <= 10.0:
            raise ConfigError("peak_margin", f"must be in [0, 10], got {self.peak_margin}")
        hmin = self.peak_history_min
        if isinstance(hmin, bool) or not isinstance(hmin, int) or not 0 <= hmin <= 32:
            raise ConfigError("peak_history_min", f"must be a whole number of windows 0-32 (0 = no history), got {hmin!r}")
        if not 0.0 <= self.peak_percentile <= 1.0:  # NaN fails too
            raise ConfigError("peak_percentile", f"must be a quantile in [0, 1] (1.0 = the largest peak), "
                              f"got {self.peak_percentile}")
        if not 0.0 <= self.peak_history_margin <= 10.0:  # NaN fails too
            raise ConfigError("peak_history_margin", f"must be in [0, 10], got {self.peak_history_margin}")
        if not 0.0 <= self.balloon_floor_fraction <= 1.0:  # NaN fails too
            raise ConfigError(
                "balloon_floor_fraction",
                f"must be a fraction in [0, 1] of a job's declared memory (1 = never balloon), "
                f"got {self.balloon_floor_fraction}",
            )
        floor_bytes = self.balloon_floor_bytes
        if isinstance(floor_bytes, bool) or not isinstance(floor_bytes, int) or floor_bytes < 0:
            raise ConfigError(
                "balloon_floor_bytes", f"must be a whole number of bytes >= 0 (268435456 = 256 MiB), got {floor_bytes!r}"
            )
        for name in ("min_runtime_s", "aging_s_per_priority", "max_wait_s", "preempt_grace_s", "balloon_grace_s",
                     "resize_retry_s", "migrate_min_run_s", "migrate_hold_s"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0 seconds, got {getattr(self, name)}")
        if self.max_decisions < 1:
            raise ConfigError("max_decisions", f"must be >= 1, got {self.max_decisions}")
        if self.reserve_after_s < 0:
            raise ConfigError("reserve_after_s", f"must be >= 0 seconds, got {self.reserve_after_s}")
        if self.max_preemption_attempts < 0:
            raise ConfigError("max_preemption_attempts", f"must be >= 0, got {self.max_preemption_attempts}")
        mc = self.max_considered
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 0:
            raise ConfigError(
                "max_considered", f"must be a whole number of pending jobs >= 0 (0 = consider every one), got {mc!r}"
            )
        if self.las_promote_after_factor < 0:
            raise ConfigError(
                "las_promote_after_factor", f"must be >= 0 (0 = no promotion), got {self.las_promote_after_factor}"
            )
        if not 0.0 <= self.spread_idle_above <= 1.0:  # NaN fails too
            raise ConfigError(
                "spread_idle_above", f"must be a fraction in [0, 1] (1 = always pack), got {self.spread_idle_above}"
            )
        if self.etcd_max_txn_ops != 0 and self.etcd_max_txn_ops < MIN_ETCD_MAX_TXN_OPS:
            raise ConfigError(
                "etcd_max_txn_ops",
                f"must be 0 (no limit) or >= {MIN_ETCD_MAX_TXN_OPS} (etcd's --max-txn-ops; its default is 128), "
                f"got {self.etcd_max_txn_ops}",
            )
        moves = self.migrate_max_per_cycle
        if isinstance(moves, bool) or not isinstance(moves, int) or moves < 0:
            raise ConfigError(
                "migrate_max_per_cycle", f"must be a whole number of jobs moved per cycle >= 0, got {moves!r}"
            )
        if self.max_reservations < 0:
            raise ConfigError("max_reservations", f"must be >= 0, got {self.max_reservations}")
        thresholds = tuple(float(t) for t in self.las_threshold_gpu_s)
        if any(t <= 0 for t in thresholds) or list(thresholds) != sorted(set(thresholds)):
            raise ConfigError(
                "las_threshold_gpu_s", f"must be strictly ascending positive GPU-seconds, got {self.las_threshold_gpu_s}"
            )
        object.__setattr__(self, "las_threshold_gpu_s", thresholds)


@dataclass(frozen=True)
class JobView:
    """Everything the scheduler knows about one job.

    Attributes:
        spec: what the job asks for.
        state: its state machine position (PENDING jobs are candidates for grants).
        allocations: slices it holds now (empty when pending).
        queued_at: when it started waiting (for aging and queueing-delay metrics).
        granted_at: when its current grant was made.
        last_checkpoint_at: wall time of its last acknowledged checkpoint (work lost on preemption
            is measured from here, or from ``granted_at`` when it never checkpointed).
        attained_gpu_s: GPU-seconds it has received so far, compute share x seconds summed over
            its slices (a half-GPU slice attains 0.5 GPU-s per second), the current grant's service
            included for a granted job (least-attained-service queues and ``waited`` use it).
        directive: the directive outstanding for it, if any.
        ack: the last ack it wrote, if any.
        memory_peak_bytes: the recent per-slice memory peak it reported in telemetry (for overcommit).
        memory_peak_history: the peaks of its recent telemetry windows, oldest first (for overcommit:
            :func:`~gpupool_sdk.scheduler.filter.predicted_peak`).
        order: a tie breaker (submission order); lower goes first.
        remaining_s: the job's own estimate of the seconds of training it has left on the GPUs it
            holds (or asks for), from ``telemetry/{job}`` (``TelemetrySummary.remaining_s``); None
            when it declared no length. Progress-aware ordering and victim choice use it
            (:func:`~gpupool_sdk.scheduler.ordering.service_gpu_s`).
        members: for a multi-node gang (``spec.nodes`` > 1), the members that joined
            (``jobs/{job}/members/{node}`` on live leases), by node rank; empty otherwise.
        resize_refusals: resize directives it refused in a row (from its status).
        resize_retry_at: after a refused resize, no resize is proposed to it before this instant
            (from its status; None: no backoff).
        gpu_util: the GPU utilisation (0-1, idle and input phases included) the job measured on
            its GPUs, from ``telemetry/{job}`` (``TelemetrySummary.gpu_util``); None when it has
            not run or has no NVML. Colocation-aware placement (``SchedulerConfig.colocation_aware``) uses it.
    """

    spec: JobSpec
    state: JobState = JobState.PENDING
    allocations: tuple[Allocation, ...] = ()
    queued_at: float = 0.0
    granted_at: float | None = None
    last_checkpoint_at: float | None = None
    attained_gpu_s: float = 0.0
    directive: Directive | None = None
    ack: Ack | None = None
    memory_peak_bytes: int | None = None
    order: int = 0
    remaining_s: float | None = None
    members: tuple[GangMember, ...] = ()
    memory_peak_history: tuple[int, ...] = ()
    resize_refusals: int = 0
    resize_retry_at: float | None = None
    gpu_util: float | None = None

    @property
    def name(self) -> str:
        """The job name (``spec.name``)."""
        return self.spec.name


@dataclass(frozen=True)
class ClusterSnapshot:
    """A frozen view of the pool at one instant.

    Attributes:
        now: wall-clock time of the snapshot (seconds since the epoch, or simulated seconds).
        gpus: every GPU published by an agent, by UUID.
        jobs: every job with a spec, by name.
        cordoned: UUIDs of GPUs an operator cordoned (no new grants; running jobs stay).
        draining: nodes being drained (no new grants; running jobs are preempted).
        term: the leader term the decisions will be written under.
        orphans: allocations present in etcd that belong to no live job (no lease, no spec, or
            an earlier incarnation's lease). Their memory and compute count as used until the
            leader deletes them; they are never granted, preempted or released by the scheduler.
    """

    now: float
    gpus: Mapping[str, GpuInfo]
    jobs: Mapping[str, JobView]
    cordoned: frozenset[str] = frozenset()
    draining: frozenset[str] = frozenset()
    term: int = 0
    orphans: tuple[Allocation, ...] = ()


@dataclass(frozen=True)
class SliceGrant:
    """One slice of a grant: a share of one GPU."""

    node: str
    gpu_uuid: str
    gpu_index: int
    memory_bytes: int
    compute_share: float


@dataclass(frozen=True)
class Grant:
    """Give ``job`` these slices (all or nothing) and move it to GRANTED."""

    job: str
    slices: tuple[SliceGrant, ...]
    reason: str = ""


@dataclass(frozen=True)
class Queue:
    """Leave ``job`` PENDING; ``reason`` says what it waits for (shown in its status)."""

    job: str
    reason: str


@dataclass(frozen=True)
class Reject:
    """``job`` can never run on this pool (more memory than any GPU has, unknown feature...)."""

    job: str
    reason: str


@dataclass(frozen=True)
class Preempt:
    """Ask ``job`` to checkpoint and release by ``deadline``; ``for_job`` is who needs its slices."""

    job: str
    reason: str
    deadline: float
    for_job: str | None = None


@dataclass(frozen=True)
class Resize:
    """Ask an elastic ``job`` to restart with ``gpus`` slices (checkpoint first).

    A resize that shrinks a job to make room for a pending one (instead of preempting it whole)
    names that job in ``for_job`` and the UUIDs of the GPUs the shrunk job keeps in ``keep``: at
    the ack, the kept GPUs are held for it and it is re-granted exactly those; the others are held
    for ``for_job``. A growing resize has neither.
    """

    job: str
    gpus: int
    reason: str
    deadline: float
    for_job: str | None = None
    keep: tuple[str, ...] = ()


@dataclass(frozen=True)
class Balloon:
    """Ask ``job`` to shrink to ``target_bytes`` per slice by ``deadline`` (``for_job`` needs the memory)."""

    job: str
    target_bytes: int
    reason: str
    deadline: float
    for_job: str | None = None


@dataclass(frozen=True)
class Deflate:
    """Give ``job`` its full quota back (the memory pressure is over)."""

    job: str
    reason: str = ""


@dataclass(frozen=True)
class Release:
    """``job`` acknowledged its preemption (or finished): free its slices; ``state`` is where it goes."""

    job: str
    state: JobState
    reason: str


@dataclass(frozen=True)
class Withdraw:
    """``job`` refused its resize directive (an ``ok=False`` ack): withdraw the directive and leave
    its grant as it is; no resize is proposed to it before ``retry_at``."""

    job: str
    reason: str
    retry_at: float


@dataclass(frozen=True)
class Revoke:
    """``job`` missed its directive deadline: revoke its etcd lease (forced preemption)."""

    job: str
    reason: str


@dataclass(frozen=True)
class Shrink:
    """``job`` acknowledged a balloon: its per-slice quota is now ``memory_bytes`` (rewrite its allocations)."""

    job: str
    memory_bytes: int
    reason: str = ""


Decision = Grant | Queue | Reject | Preempt | Resize | Balloon | Deflate | Release | Revoke | Shrink | Withdraw


@dataclass(frozen=True)
class ScheduleResult:
    """Decisions of one cycle plus counters for metrics.

    Attributes:
        decisions: the cycle's decisions, in the order to apply them.
        considered: pending jobs considered in full.
        valid_until: with the snapshot unchanged but for ``now``, a cycle before this instant
            decides the same (:mod:`gpupool_sdk.scheduler.horizon`); ``now`` when the order moves
            with time (aging, ``max_wait_s``, promotion), ``math.inf`` when nothing is timed.
    """

    decisions: tuple[Decision, ...] = field(default_factory=tuple)
    considered: int = 0
    valid_until: float = math.inf
