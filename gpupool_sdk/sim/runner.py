"""Run several policies on one trace and cluster, and render the results (table, JSON, plot)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.simulated import parse_cluster_spec
from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER
from gpupool_sdk.scheduler.types import SchedulerConfig
from gpupool_sdk.sim.baselines import BestFitPolicy, FifoPolicy, GandivaPolicy, TiresiasPolicy
from gpupool_sdk.sim.engine import DONE, SimConfig, SimPolicy, SimResult, Simulator
from gpupool_sdk.sim.estimates import EstimateModel
from gpupool_sdk.sim.metrics import compute_metrics
from gpupool_sdk.sim.pool_policy import PoolMapping, PoolPolicy
from gpupool_sdk.sim.trace import Trace
from gpupool_sdk.sim.workload import WorkloadModel

POLICY_NAMES: tuple[str, ...] = ("fifo", "tiresias", "gpupool", "bestfit", "gandiva")

#: The scheduler settings the simulator runs ``gpupool`` with unless told otherwise: the pool's
#: default policy, the same one ``gpupool coordinator`` runs
#: (:data:`gpupool_sdk.scheduler.config.DEFAULT_SCHEDULER`).
DEFAULT_POOL_CONFIG = DEFAULT_SCHEDULER


@dataclass(frozen=True)
class GandivaSettings:
    """Knobs of the ``gandiva`` policy (see :class:`~gpupool_sdk.sim.baselines.GandivaPolicy`).

    Attributes:
        quantum_s: time slice, seconds (Gandiva: 60 s).
        suspend_s: from a suspend directive to the freed GPUs, seconds.
        resume_s: extra work at the next grant after a suspension, seconds.
    """

    quantum_s: float = 60.0
    suspend_s: float = 0.5
    resume_s: float = 0.5

    def __post_init__(self) -> None:
        GandivaPolicy(self.quantum_s, self.suspend_s, self.resume_s)  # validates, naming the field


def make_policy(
    name: str,
    pool_config: SchedulerConfig | None = None,
    mapping: PoolMapping | None = None,
    tiresias_thresholds: Sequence[float] = (3600.0,),
    max_pending_in_snapshot: int | None = None,
    gandiva: GandivaSettings | None = None,
    estimates: EstimateModel | None = None,
) -> SimPolicy:
    """A fresh policy by name (``fifo``, ``tiresias``, ``gpupool``, ``bestfit``, ``gandiva``).

    ``pool_config`` carries every scheduler knob of ``gpupool`` (LAS thresholds, LAS preemption
    and promotion, aging...); ``gandiva`` the time-slicing knobs (default :class:`GandivaSettings`).

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    if name == "fifo":
        return FifoPolicy()
    if name == "tiresias":
        return TiresiasPolicy(thresholds_gpu_s=tiresias_thresholds)
    if name == "gpupool":
        return PoolPolicy(pool_config or DEFAULT_POOL_CONFIG, mapping, max_pending_in_snapshot, estimates)
    if name == "bestfit":
        return BestFitPolicy()
    if name == "gandiva":
        g = gandiva or GandivaSettings()
        return GandivaPolicy(quantum_s=g.quantum_s, suspend_s=g.suspend_s, resume_s=g.resume_s)
    raise ConfigError("policy", f"unknown policy {name!r}; use one of {', '.join(POLICY_NAMES)}")


#: Below this average wait (a fraction of the average JCT) under every policy, a run is flagged as
#: not congested (:meth:`SimReport.notes`).
UNCONGESTED_WAIT_FRACTION = 0.02


@dataclass
class SimReport:
    """Results of one invocation: per policy, the metrics and the raw result."""

    trace: str
    cluster: str
    jobs: int
    trace_stats: dict[str, int]
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: dict[str, SimResult] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """What a reader should know before comparing the policies (empty when nothing).

        Today one: the cluster was not congested. Policies differ in whom they make wait; when
        jobs waited under 2 % of their completion time under every policy, every policy ties
        (the issue that asked for congested runs saw a trace at its real rate on 160 GPUs do so).
        """
        waits = [
            m["avg_queue_s"] / m["avg_jct_s"]
            for m in self.metrics.values()
            if m.get("avg_jct_s") and m.get("avg_queue_s") is not None
        ]
        if waits and max(waits) < UNCONGESTED_WAIT_FRACTION:
            return [
                f"not congested: under every policy jobs waited at most {max(waits):.1%} of their completion "
                "time, so the policies can hardly differ; compare them under load: compress arrivals "
                "(--time-scale 0.5, 0.2, ...) or simulate fewer GPUs (--cluster)"
            ]
        return []

    def to_json(self) -> dict[str, Any]:
        """``{"trace", "cluster", "jobs", "gpus", "trace_stats", "policies": {NAME: {metrics}}, "notes"}``."""
        return {
            "trace": self.trace,
            "cluster": self.cluster,
            "jobs": self.jobs,
            "gpus": next(iter(self.results.values())).num_gpus if self.results else 0,
            "trace_stats": self.trace_stats,
            "policies": self.metrics,
            "notes": self.notes(),
        }


def run_simulation(
    trace: Trace,
    cluster: str,
    policies: Sequence[str],
    *,
    sim_config: SimConfig | None = None,
    pool_config: SchedulerConfig | None = None,
    mapping: PoolMapping | None = None,
    workload: WorkloadModel | None = None,
    seed: int = 0,
    max_pending_in_snapshot: int | None = None,
    gandiva: GandivaSettings | None = None,
    estimates: EstimateModel | None = None,
    on_policy: Callable[[str, int, int], None] | None = None,
) -> SimReport:
    """Simulate ``trace`` on ``cluster`` once per policy (same jobs, same workload draws).

    Args:
        trace: from :func:`gpupool_sdk.sim.trace.load_trace`.
        cluster: the agent's ``--simulate`` spec with an optional ``N*`` repeat (``"16*8xV100-32GB"``).
        policies: policy names, run in this order.
        sim_config: engine settings (its ``seed`` is replaced by ``seed``).
        pool_config: the scheduler's knobs for ``gpupool`` (default :data:`DEFAULT_POOL_CONFIG`).
        mapping: trace-to-spec mapping for ``gpupool``.
        workload: the workload model (default: Lucid profiles and pairs, seeded with ``seed``).
        seed: seeds profile draws and failures.
        max_pending_in_snapshot: ``gpupool`` speed knob (see :class:`~gpupool_sdk.sim.pool_policy.PoolPolicy`).
        gandiva: the ``gandiva`` policy's knobs (default :class:`GandivaSettings`).
        estimates: how ``gpupool``'s jobs report their remaining time (default :class:`EstimateModel`).
        on_policy: called with ``(policy, index, count)`` before each policy runs (progress display).

    Example:
        >>> report = run_simulation(load_trace("tiresias_60job.csv"), "2*8xV100-32GB", ["fifo", "gpupool"])  # doctest: +SKIP
        >>> report.metrics["gpupool"]["avg_jct_s"] <= report.metrics["fifo"]["avg_jct_s"]  # doctest: +SKIP
        True
    """
    if not policies:
        raise ConfigError("policy", "give at least one policy")
    for name in policies:
        make_policy(name)  # validate names before spending time
    gpus = parse_cluster_spec(cluster)
    wl = workload or WorkloadModel(seed=seed)
    base = sim_config or SimConfig()
    cfg = SimConfig(**{**base.__dict__, "seed": seed})
    report = SimReport(trace=trace.path, cluster=cluster, jobs=len(trace), trace_stats=trace.stats.to_dict())
    for i, name in enumerate(policies):
        if name in report.results:
            continue
        if on_policy is not None:
            on_policy(name, i, len(policies))
        policy = make_policy(
            name, pool_config, mapping, max_pending_in_snapshot=max_pending_in_snapshot, gandiva=gandiva,
            estimates=estimates,
        )
        t0 = time.process_time()
        result = Simulator(trace.jobs, gpus, policy, wl, cfg).run()
        result.wall_s = time.process_time() - t0
        report.results[name] = result
        report.metrics[name] = compute_metrics(result)
        # Elastic jobs (gpupool with min_gpu=/max_gpu= rows or --elastic): resize directives applied.
        report.metrics[name]["resizes"] = result.resizes
        # Preemptions that moved a job for fragmentation (migrate_for_fragmentation): counted in preemptions too.
        report.metrics[name]["migrations"] = result.migrations
    return report


TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("avg_jct_s", "avg JCT", "s"),
    ("p50_jct_s", "p50 JCT", "s"),
    ("p99_jct_s", "p99 JCT", "s"),
    ("avg_queue_s", "avg queueing", "s"),
    ("makespan_s", "makespan", "s"),
    ("gpu_alloc_util", "GPU allocated", "%"),
    ("gpu_used_util", "GPU used", "%"),
    ("mem_util", "memory used", "%"),
    ("mem_granted_util", "memory granted", "%"),
    ("preemptions", "preemptions", "n"),
    ("migrations", "of them migrations", "n"),
    ("resizes", "resizes", "n"),
    ("stranded_gpu_fraction", "stranded GPUs", "%"),
    ("finished", "finished jobs", "n"),
    ("unfinished", "unfinished jobs", "n"),
    ("rejected", "rejected jobs", "n"),
    ("wall_s", "CPU time", "s"),
)


def _fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "n":
        return f"{int(value)}"
    if abs(value) >= 10000:
        return f"{value:,.0f}"
    return f"{value:.1f}"


def render_table(report: SimReport) -> Any:
    """A :class:`rich.table.Table`: one row per metric, one column per policy, ratios against ``fifo``."""
    from rich.table import Table

    names = list(report.metrics)
    table = Table(title=f"{report.jobs} jobs from {report.trace} on {report.cluster}")
    table.add_column("metric")
    for n in names:
        table.add_column(n, justify="right")
    base = report.metrics.get("fifo")
    for key, label, unit in TABLE_ROWS:
        cells = []
        for n in names:
            v = float(report.metrics[n][key])
            cell = _fmt(v, unit)
            if base is not None and n != "fifo" and key not in ("finished", "unfinished", "rejected", "wall_s"):
                b = float(base[key])
                if b > 0:
                    cell += f" ({v / b:.2f}x)"
            cells.append(cell)
        table.add_row(label, *cells)
    return table


def write_plot(report: SimReport, path: str, points: int = 400) -> None:
    """PNG with the JCT CDF per policy (left) and allocated/used GPU utilization over time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    for name, res in report.results.items():
        jct = sorted(j.end - j.submit for j in res.jobs if j.state == DONE and j.end is not None)
        if jct:
            ys = [(i + 1) / len(jct) for i in range(len(jct))]
            ax1.plot(jct, ys, label=name)
        tl = res.timeline
        if tl.t:
            step = max(1, len(tl.t) // points)
            ts = [t / 3600.0 for t in tl.t[::step]]
            line = ax2.plot(ts, [a / res.num_gpus for a in tl.alloc[::step]], label=f"{name} allocated")
            ax2.plot(
                ts, [u / res.num_gpus for u in tl.used[::step]], linestyle="--", color=line[0].get_color(),
                label=f"{name} used",
            )
    ax1.set_xscale("log")
    ax1.set_xlabel("job completion time (s)")
    ax1.set_ylabel("fraction of jobs")
    ax1.set_title("JCT CDF")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_xlabel("time (h)")
    ax2.set_ylabel("GPU utilization")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("GPU utilization over time")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
