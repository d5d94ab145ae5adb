"""A live pool in miniature: does a real coordinator order jobs the way the simulator does?

One small trace (``tests/data/live_miniature.csv`` by default: 30 whole-GPU jobs, arrivals over
about five hours, run times from 15 minutes to 6 hours, on one node of 8 GPUs) is run twice:

* **live**: its arrival and run times compressed (``--hour-s 5``: one trace hour lasts 5 real
  seconds, a factor of 720), a real etcd, a real ``gpupool coordinator`` with the pool's policy
  whose durations are divided by the same factor (written to a TOML policy file), a real
  ``gpupool agent --simulate`` publishing the GPUs, and **one real process per job**
  (``live_miniature.py job``: a :class:`~gpupool_sdk.client.pool.PoolClient`) that submits the
  job's spec at its compressed arrival time, waits for the grant, "trains" for its compressed run
  time in small sleeps, publishes telemetry with ``progress`` and ``remaining_s`` as the callback
  does, and honours preemption directives (checkpoint, ack, wait for the release, give the lease
  back, submit again under the same name and resume with the work done so far, paying the restart);
* **simulated**: the same compressed trace through the simulator's API
  (:func:`gpupool_sdk.sim.run_simulation`, policy ``gpupool``) with **the same policy file**, the
  same cluster string, the same job specs and remaining-time estimates, and the engine's own
  durations (checkpoint, restart, tick, view refresh, estimate delay) divided by the factor. As a
  check of the compression itself, the uncompressed trace with the unscaled policy is simulated
  too: the compressed simulation must order jobs identically.

Then it compares the orders in which jobs start and finish (Kendall's tau, Spearman's rho, the
fraction of job pairs in the same order), the average JCT (live / simulated) and the number of
preemptions; and, as a calibration, how alike the live finish order is to the orders other
simulated policies give on the same trace (FIFO, Tiresias, Gandiva, best-fit, ``gpupool`` without
estimates or with other estimate draws): an order that is the simulated ``gpupool``'s is closer to
it than to any of those. What it can and cannot show is in ``docs/simulation.md``, section 8.

A job process's remaining-time estimate is the simulator's own model
(:class:`~gpupool_sdk.sim.estimates.JobEstimates`, same seed): a job that declares no length
never publishes ``remaining_s``; the others publish ``(declared length - work done) x step-time
error`` once they have run ``after_s`` in all, so both sides see the same information.

Run::

    python benchmarks/live_miniature.py [--trace FILE.csv] [--cluster SPEC] [--hour-s 5] [-o json]

``--endpoints`` uses a running etcd (a fresh key prefix); without it an embedded etcd is started.
Every process it starts is stopped before it returns (SIGTERM to its process group, then SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "tests" / "data" / "live_miniature.csv"
#: One node of 8 GPUs: the agent's ``--simulate`` grammar, which the simulator's ``--cluster`` reads too.
DEFAULT_CLUSTER = "mini:8xV100-32GB:nvlink"
#: Real seconds per trace hour (a compression factor of 720).
DEFAULT_HOUR_S = 5.0

#: ``SchedulerConfig`` fields measured on the trace's clock: divided by the compression factor.
SCALED_FIELDS: tuple[str, ...] = (
    "min_runtime_s",
    "aging_s_per_priority",
    "max_wait_s",
    "reserve_after_s",
    "las_threshold_gpu_s",
)
#: Fields left as they are: ``preempt_grace_s`` and ``balloon_grace_s`` are deadlines a real process
#: must meet (a checkpoint through etcd does not get 720x faster), and the others are not durations.

#: Real seconds between a job process's progress steps (it also looks for directives at each).
STEP_S = 0.02
#: Real seconds between a job's telemetry publications.
PUBLISH_S = 0.1


# ---------------------------------------------------------------------------------------------
# the workload, the compression and the policy file


def synth_workload(path: Path, jobs: int = 30, seed: int = 14) -> None:
    """Write the default miniature trace (unified schema) to ``path``: ``jobs`` whole-GPU jobs.

    Arrivals: exponential gaps of 10 minutes on average; run times: lognormal around 50 minutes
    (sigma 0.9) clipped to 15 min - 6 h, whole minutes; GPUs: 1 (60 %), 2 (25 %), 4 (15 %).
    Deterministic for a seed. ``tests/data/live_miniature.csv`` is ``synth_workload(path)``.
    """
    rng = random.Random(seed)
    t = 0.0
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "source", "submit_s", "duration_s", "num_gpu", "gpu_fraction", "priority", "extra"])
        for i in range(jobs):
            dur = min(6 * 3600.0, max(900.0, math.exp(rng.gauss(math.log(3000.0), 0.9))))
            gpus = rng.choices((1, 2, 4), weights=(60, 25, 15))[0]
            w.writerow([i, "live_miniature", int(t), 60 * round(dur / 60), gpus, "1.0", "", ""])
            t += rng.expovariate(1 / 600.0)


def check_workload(trace: Any) -> None:
    """Refuse rows the job processes cannot run like the simulator does.

    Raises:
        ConfigError: a row asks a fraction of a GPU (a live job does not slow down when it shares a
            GPU, so the simulator's colocation model would not be compared like for like) or is
            elastic (the job processes do not resize); the message names the row and the column.
    """
    from gpupool_sdk.errors import ConfigError

    for j in trace.jobs:
        if j.gpu_fraction < 1.0:
            raise ConfigError("trace", f"{trace.path} row {j.row}, column 'gpu_fraction': the miniature runs whole-GPU "
                              f"jobs only (a live job does not model colocation slowdown), got {j.gpu_fraction:g}; "
                              "use a trace with gpu_fraction 1.0")
        if j.is_elastic:
            raise ConfigError("trace", f"{trace.path} row {j.row}, column 'extra': min_gpu=/max_gpu= (elastic) is not "
                              "supported by the miniature's job processes; remove them")


def compress_trace(src: Path, dst: Path, factor: float) -> None:
    """Write ``src`` to ``dst`` with every ``submit_s`` and run time divided by ``factor``.

    Rows are loaded (and validated) by :func:`gpupool_sdk.sim.load_trace` first, so run times
    drawn or derived by the loader are fixed before the compression.
    """
    from gpupool_sdk.sim import load_trace

    trace = load_trace(src)
    check_workload(trace)
    with dst.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "source", "submit_s", "duration_s", "num_gpu", "gpu_fraction", "priority", "extra"])
        for j in trace.jobs:
            extra = ";".join(f"{k}={v}" for k, v in j.extra.items())
            w.writerow([j.job_id, j.source, repr(j.submit_s / factor), repr(j.duration_s / factor), j.num_gpu,
                        repr(j.gpu_fraction), j.priority, extra])


def scale_policy(config: Any, factor: float) -> Any:
    """``config`` (a :class:`~gpupool_sdk.scheduler.types.SchedulerConfig`) with its durations divided by ``factor``."""
    values: dict[str, Any] = {}
    for name in SCALED_FIELDS:
        v = getattr(config, name)
        values[name] = tuple(x / factor for x in v) if isinstance(v, tuple) else v / factor
    return replace(config, **values)


def write_policy_file(config: Any, path: Path, comment: str = "") -> None:
    """Write every field of ``config`` as a ``[scheduler]`` table that ``--config`` reads back exactly."""
    from gpupool_sdk.scheduler.types import SchedulerConfig

    def toml(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, tuple):
            return "[" + ", ".join(repr(float(x)) for x in v) + "]"
        if isinstance(v, float):
            return "inf" if v == math.inf else repr(v)
        return str(v)

    lines = [f"# {line}" for line in comment.splitlines()] + ["[scheduler]"]
    lines += [f"{f.name} = {toml(getattr(config, f.name))}" for f in fields(SchedulerConfig)]
    path.write_text("\n".join(lines) + "\n")


@dataclass(frozen=True)
class EngineTimes:
    """The simulator's own durations (trace seconds) that the compression divides."""

    checkpoint_s: float = 10.0
    restart_s: float = 20.0
    tick_s: float = 60.0
    view_refresh_s: float = 60.0
    checkpoint_interval_s: float = 1800.0
    estimate_after_s: float = 300.0

    def scaled(self, factor: float) -> EngineTimes:
        return EngineTimes(**{k: v / factor for k, v in asdict(self).items()})

    def sim_config(self, seed: int) -> Any:
        from gpupool_sdk.sim import SimConfig

        return SimConfig(checkpoint_s=self.checkpoint_s, restart_s=self.restart_s, tick_s=self.tick_s,
                         view_refresh_s=self.view_refresh_s, checkpoint_interval_s=self.checkpoint_interval_s,
                         seed=seed)

    def estimates(self) -> Any:
        from gpupool_sdk.sim.estimates import EstimateModel

        return EstimateModel(after_s=self.estimate_after_s)


# ---------------------------------------------------------------------------------------------
# what each job does: its plan, shared by the simulation and the job process


@dataclass(frozen=True)
class JobPlan:
    """One job of the compressed trace, as its process runs it (times in real = compressed seconds).

    Attributes:
        name: the job's name (the simulator's ``j<index>``).
        spec: the :class:`JobSpec` the simulator's ``gpupool`` adapter builds for it, as a dict.
        submit_s: arrival, seconds after the run's start.
        duration_s: work at full speed.
        checkpoint_s: from a preempt directive to the ack.
        restart_s: extra work at each grant after a preemption.
        checkpoint_interval_s: a job that loses its lease loses the work since its last periodic checkpoint.
        declared_s: the length it declares (the simulator's estimate model), None when it declares none.
        error: its step-time error factor (the estimate is ``max(0, declared - done) x error``).
        after_s: it publishes an estimate once it has run this long in all.
        memory_peak_bytes: the memory peak it reports once running (the simulator's demand).
    """

    name: str
    spec: dict[str, Any]
    submit_s: float
    duration_s: float
    checkpoint_s: float
    restart_s: float
    checkpoint_interval_s: float
    declared_s: float | None
    error: float
    after_s: float
    memory_peak_bytes: int

    def remaining_s(self, ran_s: float, left_s: float) -> float | None:
        """The ``remaining_s`` the job publishes after running ``ran_s`` in all with ``left_s`` of work
        left (restart work included): the simulator's :meth:`JobEstimates.remaining_s`, term by term."""
        if self.declared_s is None or ran_s < self.after_s:
            return None
        done = max(0.0, self.duration_s - max(0.0, left_s))
        return max(0.0, self.declared_s - done) * self.error


def plan_jobs(trace: Any, cluster: str, config: Any, times: EngineTimes, seed: int) -> list[JobPlan]:
    """Each job's plan: specs and estimates from the simulator's own ``gpupool`` adapter and model."""
    from gpupool_sdk.inventory.simulated import parse_cluster_spec
    from gpupool_sdk.sim import PoolPolicy, Simulator, WorkloadModel
    from gpupool_sdk.sim.estimates import JobEstimates
    from gpupool_sdk.store.codec import decode_dict, encode

    estimates = times.estimates()
    sim_cfg = times.sim_config(seed)
    policy = PoolPolicy(config, estimates=estimates)
    sim = Simulator(trace.jobs, parse_cluster_spec(cluster), policy, WorkloadModel(seed=seed), sim_cfg)
    policy.bind(sim)
    draws = JobEstimates(estimates, seed)
    plans = []
    for job in sim.jobs:
        spec = policy.spec_for(job)
        declared = draws.declared(job)
        plans.append(JobPlan(
            name=job.name,
            spec=decode_dict("spec", encode(spec)),
            submit_s=job.submit,
            duration_s=job.tj.duration_s,
            checkpoint_s=sim_cfg.checkpoint_s if job.checkpoint_s is None else job.checkpoint_s,
            restart_s=sim_cfg.restart_s if job.restart_s is None else job.restart_s,
            checkpoint_interval_s=sim_cfg.checkpoint_interval_s,
            declared_s=None if declared is None else declared[0],
            error=1.0 if declared is None else declared[1],
            after_s=estimates.after_s,
            memory_peak_bytes=job.demand,
        ))
    return plans


# ---------------------------------------------------------------------------------------------
# outcomes and their comparison


@dataclass
class JobOutcome:
    """When a job arrived, first started and finished (seconds after the run's start), and how often it was preempted."""

    name: str
    submit: float
    start: float | None = None
    end: float | None = None
    preemptions: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def jct(self) -> float | None:
        return None if self.end is None else self.end - self.submit


def sim_outcomes(result: Any) -> dict[str, JobOutcome]:
    """The outcomes of a :class:`~gpupool_sdk.sim.SimResult` (finished jobs have an ``end``)."""
    from gpupool_sdk.sim.engine import DONE

    return {
        j.name: JobOutcome(j.name, j.submit, j.first_start, j.end if j.state == DONE else None, j.preemptions)
        for j in result.jobs
    }


def rank_agreement(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """How alike two orders of the same jobs are (keys present in both).

    Returns:
        ``kendall_tau`` (tau-b: 1 = same order, 0 = unrelated, -1 = reversed), ``spearman_rho``
        (Pearson correlation of the ranks, ties averaged), ``pairs_same`` (of the pairs strictly
        ordered in both, the fraction ordered the same way) and ``pairs`` (how many that is).

    Example:
        >>> r = rank_agreement({"a": 1, "b": 2, "c": 3}, {"a": 10, "b": 30, "c": 20})
        >>> round(r["kendall_tau"], 3), r["pairs_same"]
        (0.333, 0.6666666666666666)
    """
    names = sorted(set(a) & set(b))
    concordant = discordant = ties_a = ties_b = 0
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            da = a[x] - a[y]
            db = b[x] - b[y]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    n0 = concordant + discordant
    denom = math.sqrt((n0 + ties_a) * (n0 + ties_b))
    tau = (concordant - discordant) / denom if denom else 1.0
    ra, rb = _ranks([a[n] for n in names]), _ranks([b[n] for n in names])
    return {
        "kendall_tau": tau,
        "spearman_rho": _pearson(ra, rb),
        "pairs_same": concordant / n0 if n0 else 1.0,
        "pairs": float(n0),
    }


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    n = len(x)
    if n < 2:
        return 1.0
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else 1.0


def compare(live: Mapping[str, JobOutcome], sim: Mapping[str, JobOutcome], separated_s: float) -> dict[str, Any]:
    """Live against simulated: start and finish orders, average JCT, preemptions.

    Args:
        live, sim: outcomes by job name (the same time unit).
        separated_s: also count agreement on the finish-order pairs the simulator separates by
            more than this (the pairs a few cycles of latency cannot flip).
    """
    both = [n for n in sim if sim[n].end is not None and live.get(n) is not None and live[n].end is not None]
    started = [n for n in sim if sim[n].start is not None and live.get(n) is not None and live[n].start is not None]
    finish = rank_agreement({n: live[n].end for n in both}, {n: sim[n].end for n in both})  # type: ignore[misc]
    start = rank_agreement({n: live[n].start for n in started}, {n: sim[n].start for n in started})  # type: ignore[misc]
    same = total = 0
    for i, x in enumerate(both):
        for y in both[i + 1:]:
            ds = sim[x].end - sim[y].end  # type: ignore[operator]
            if abs(ds) <= separated_s:
                continue
            dl = live[x].end - live[y].end  # type: ignore[operator]
            total += 1
            same += (dl > 0) == (ds > 0)
    jct_live = [live[n].jct for n in both]
    jct_sim = [sim[n].jct for n in both]
    avg_live = sum(jct_live) / len(both) if both else 0.0  # type: ignore[arg-type]
    avg_sim = sum(jct_sim) / len(both) if both else 0.0  # type: ignore[arg-type]
    ratios = sorted(lv / sv for lv, sv in zip(jct_live, jct_sim, strict=True) if sv)  # type: ignore[operator]
    return {
        "jobs": len(sim),
        "finished_both": len(both),
        "finish_order": finish,
        "start_order": start,
        "finish_pairs_separated": {"separated_s": separated_s, "pairs": total, "same": same / total if total else 1.0},
        "avg_jct_live": avg_live,
        "avg_jct_sim": avg_sim,
        "avg_jct_ratio": avg_live / avg_sim if avg_sim else math.nan,
        "jct_ratio_p50": ratios[len(ratios) // 2] if ratios else math.nan,
        "preemptions_live": sum(o.preemptions for o in live.values()),
        "preemptions_sim": sum(o.preemptions for o in sim.values()),
        "makespan_live": max((o.end for o in live.values() if o.end is not None), default=0.0),
        "makespan_sim": max((o.end for o in sim.values() if o.end is not None), default=0.0),
    }


def latencies(live: Mapping[str, JobOutcome], sim: Mapping[str, JobOutcome]) -> dict[str, Any]:
    """Real seconds the live pool adds (times as the job processes saw them).

    ``grant``: from the submission to the grant, for jobs the simulator started on arrival (free
    GPUs: what is left is the pool's latency, spec to watch to grant to watch). ``preempt``: from
    the directive seen to the lease given back (checkpoint, ack, the leader's release).
    """
    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        if not xs:
            return {"n": 0, "p50": math.nan, "max": math.nan, "mean": math.nan}
        return {"n": len(xs), "p50": xs[len(xs) // 2], "max": xs[-1], "mean": sum(xs) / len(xs)}

    grant: list[float] = []
    preempt: list[float] = []
    for name, o in live.items():
        s = sim.get(name)
        submitted: float | None = None
        seen: float | None = None
        for e in o.events:
            if e["event"] == "submit":
                submitted = e["t"]
            elif e["event"] == "grant" and submitted is not None:
                first = submitted == o.events[0]["t"]
                if first and s is not None and s.start == s.submit:
                    grant.append(e["t"] - submitted)
                submitted = None
            elif e["event"] == "preempt":
                seen = e["t"]
            elif e["event"] == "released" and seen is not None:
                preempt.append(e["t"] - seen)
                seen = None
    return {"grant_s": stats(grant), "preempt_to_release_s": stats(preempt)}


# ---------------------------------------------------------------------------------------------
# the simulation


def simulate(trace_path: Path, cluster: str, policy_file: Path, times: EngineTimes, seed: int) -> tuple[Any, Any]:
    """Run ``gpupool`` on the trace with the policy file; returns (trace, SimResult)."""
    from gpupool_sdk.scheduler.config import load_policy_config
    from gpupool_sdk.sim import load_trace, run_simulation

    trace = load_trace(trace_path, seed=seed)
    config = load_policy_config(policy_file).scheduler
    report = run_simulation(trace, cluster, ["gpupool"], sim_config=times.sim_config(seed), pool_config=config,
                            estimates=times.estimates(), seed=seed)
    return trace, report.results["gpupool"]


# ---------------------------------------------------------------------------------------------
# the live pool


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupool_sdk.cli.main", *args]


class _Procs:
    """Processes started in their own process groups, stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], stdin: int | None = None, stdout: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        p = subprocess.Popen(
            argv, stdin=stdin if stdin is not None else subprocess.DEVNULL, stdout=stdout if stdout is not None else log,
            stderr=log, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )
        self.procs.append(p)
        return p

    def stop(self, grace_s: float = 10.0) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            for s in (p.stdin, p.stdout):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
        for log in self._logs:
            log.close()


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def _etcd(endpoint: str | None, workdir: Path) -> Iterator[str]:
    if endpoint is not None:
        yield endpoint
        return
    from gpupool_sdk.store import EtcdServer

    server = EtcdServer(data_dir=workdir / "etcd", name="miniature").start(timeout=60)
    try:
        yield server.endpoint
    finally:
        server.stop()


def run_live(
    plans: Sequence[JobPlan],
    cluster: str,
    policy_file: Path,
    workdir: Path,
    endpoint: str | None = None,
    prefix: str | None = None,
    loop_wait_s: float = 0.1,
    timeout_s: float = 900.0,
) -> dict[str, JobOutcome]:
    """Run the jobs against a real coordinator, agent and etcd; their outcomes by name.

    Args:
        plans: from :func:`plan_jobs` (times already compressed).
        cluster: the agent's ``--simulate`` spec.
        policy_file: the coordinator's ``--config``.
        workdir: logs (``*.log``) and the jobs' event files go here.
        endpoint: a running etcd (``host:port``); None starts an embedded one.
        prefix: the pool's key prefix (default a fresh ``/gpupool-miniature/<uuid>``); deleted afterwards.
        loop_wait_s: the coordinator's ``--loop-wait`` (time-driven cycles: LAS queue crossings).
        timeout_s: give up (TimeoutError) when the jobs have not all finished by then.
    """
    from gpupool_sdk.inventory.simulated import parse_cluster_spec
    from gpupool_sdk.store import EtcdStore
    from gpupool_sdk.store.keyspace import Keyspace

    prefix = prefix or f"/gpupool-miniature/{uuid.uuid4().hex}"
    keys = Keyspace(prefix)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "jobs").mkdir(exist_ok=True)
    with _etcd(endpoint, workdir) as ep:
        store = EtcdStore(ep, keyspace=keys)
        procs = _Procs(workdir)
        try:
            base = ["--endpoints", ep, "--prefix", prefix]
            procs.start("agent", _cli("agent", *base, "--simulate", cluster, "--ttl", "10", "--refresh", "1"))
            want = {g.uuid for g in parse_cluster_spec(cluster)}
            _wait(lambda: want <= {kv.key.rsplit("/", 1)[-1] for kv in store.get_prefix(keys.gpus_prefix())[0]},
                  60, f"the agent to publish {cluster}")
            procs.start("coordinator", _cli("coordinator", *base, "--id", "mini", "--config", str(policy_file),
                                            "--loop-wait", str(loop_wait_s), "--ttl", "10", "--log-level", "info"))
            _wait(lambda: store.get(keys.leader()) is not None, 60, "the coordinator to lead")
            jobs = []
            for plan in plans:
                plan_path = workdir / "jobs" / f"{plan.name}.json"
                plan_path.write_text(json.dumps(asdict(plan)))
                events = workdir / "jobs" / f"{plan.name}.events"
                argv = [sys.executable, str(Path(__file__).resolve()), "job", str(plan_path), str(events),
                        "--endpoints", ep, "--prefix", prefix]
                jobs.append(procs.start(f"job-{plan.name}", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            ready_by = time.monotonic() + 60.0 + 5.0 * len(plans)  # 30 interpreters starting on 2 busy cores
            for p, plan in zip(jobs, plans, strict=True):
                assert p.stdout is not None
                if not select.select([p.stdout], [], [], max(0.0, ready_by - time.monotonic()))[0]:
                    raise TimeoutError(f"job process {plan.name} not ready in time (see {workdir}/job-{plan.name}.log)")
                line = p.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"job process {plan.name} did not start (see {workdir}/job-{plan.name}.log)")
            t0 = time.time() + 0.5
            for p in jobs:
                assert p.stdin is not None
                p.stdin.write(f"{t0!r}\n".encode())
                p.stdin.flush()
            deadline = time.monotonic() + timeout_s
            for p, plan in zip(jobs, plans, strict=True):
                left = deadline - time.monotonic()
                try:
                    code = p.wait(max(0.1, left))
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"job {plan.name} still running after {timeout_s:g}s (logs in {workdir})") from None
                if code != 0:
                    raise RuntimeError(f"job process {plan.name} exited {code} (see {workdir}/job-{plan.name}.log)")
        finally:
            procs.stop()
            with contextlib.suppress(Exception):
                store.delete_prefix(keys.root())
            store.close()
    return {plan.name: read_events(workdir / "jobs" / f"{plan.name}.events", plan) for plan in plans}


def read_events(path: Path, plan: JobPlan) -> JobOutcome:
    """A job process's event file as a :class:`JobOutcome`."""
    out = JobOutcome(plan.name, plan.submit_s)
    for line in path.read_text().splitlines():
        e = json.loads(line)
        out.events.append(e)
        if e["event"] == "grant" and out.start is None:
            out.start = e["t"]
        elif e["event"] == "preempt":
            out.preemptions += 1
        elif e["event"] == "finish":
            out.end = e["t"]
    return out


# ---------------------------------------------------------------------------------------------
# one job's process


def job_main(plan_path: str, events_path: str, endpoints: str, prefix: str) -> int:
    """The process of one job (see the module docstring); returns its exit code."""
    from gpupool_sdk.client.node import ANY_NODE
    from gpupool_sdk.client.pool import PoolClient
    from gpupool_sdk.errors import JobRejectedError
    from gpupool_sdk.resources import DirectiveKind, JobSpec
    from gpupool_sdk.store.codec import decode, encode
    from gpupool_sdk.telemetry.summary import TelemetrySummary

    parent = os.getppid()

    def orphaned() -> None:  # the runner died without stopping us: leave (the lease expires)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=orphaned, name="orphan-watch", daemon=True).start()
    raw = json.loads(Path(plan_path).read_text())
    plan = JobPlan(**raw)
    spec = decode("spec", encode(plan.spec, kind="JobSpec"), JobSpec)
    # The I/O side in threads of this process: one interpreter per job instead of two (30 jobs
    # and their helpers on a small machine); the same Helper code runs either way.
    client = PoolClient(endpoints=endpoints, prefix=prefix, node=ANY_NODE, in_process=True,
                        telemetry_interval_s=PUBLISH_S / 2)
    client.resume_info(plan.name)  # connect to etcd before the clock starts
    print("ready", flush=True)
    t0 = float(sys.stdin.readline())
    log = open(events_path, "w")  # noqa: SIM115 - closed below

    def event(kind: str, at: float | None = None, **kw: Any) -> None:
        log.write(json.dumps({"event": kind, "t": (time.time() if at is None else at) - t0, **kw}) + "\n")
        log.flush()

    time.sleep(max(0.0, t0 + plan.submit_s - time.time()))
    left = plan.duration_s  # work still to do, seconds at full speed (restart work added at grants)
    ran = 0.0  # seconds run in all (the estimate's "after_s" clock)
    restart_due = 0.0
    try:
        while True:
            event("submit")
            try:
                lease = client.acquire(spec, timeout=None)
            except JobRejectedError as exc:
                event("rejected", reason=str(exc))
                return 0
            event("grant", gpus=[a.gpu_uuid for a in lease.allocations])
            left += restart_due
            restart_due = 0.0
            granted = last = time.monotonic()
            next_publish = 0.0
            while True:
                time.sleep(max(0.0, min(STEP_S, left)))
                now = time.monotonic()
                dt, last = now - last, now
                left -= dt
                ran += dt
                if left <= 0:
                    # It finished `-left` seconds ago (inside its last sleep).
                    event("finish", at=time.time() + left)
                    lease.release()
                    return 0
                if lease.lost:
                    event("lost", reason=str(lease.lost_reason))
                    left += (now - granted) % plan.checkpoint_interval_s  # back to the last periodic checkpoint
                    restart_due = plan.restart_s
                    break
                directive = lease.poll_directive()
                if directive is not None:
                    if directive.kind in (DirectiveKind.PREEMPT, DirectiveKind.RESIZE):
                        event("preempt", seq=directive.seq, for_job=directive.target.get("for_job"))
                        time.sleep(plan.checkpoint_s)  # writing the checkpoint: no progress
                        lease.ack(directive, step=int(plan.duration_s - left), checkpoint=f"mem://{plan.name}")
                        event("ack", seq=directive.seq)
                        lease.wait_released(timeout=60)
                        lease.release()
                        event("released")
                        restart_due = plan.restart_s
                        break
                    # Balloon or deflate (whole-GPU guaranteed jobs get none): refuse, never misread.
                    kind = getattr(directive.kind, "value", directive.kind)
                    lease.ack(directive, ok=False, message=f"{kind} not supported by this job")
                if now >= next_publish:
                    next_publish = now + PUBLISH_S
                    remaining = plan.remaining_s(ran, left)
                    summary = TelemetrySummary(
                        job=plan.name, step=int(plan.duration_s - left), steps_per_s=1.0, published_at=time.time(),
                        memory_peak_bytes=plan.memory_peak_bytes, remaining_s=remaining,
                        progress=None if plan.declared_s is None else min(1.0, max(0.0, 1 - left / plan.duration_s)),
                    )
                    lease.publish_telemetry(summary.to_dict())
    finally:
        log.close()
        client.close()


# ---------------------------------------------------------------------------------------------
# the whole comparison


def run(
    trace: Path = DEFAULT_TRACE,
    cluster: str = DEFAULT_CLUSTER,
    hour_s: float = DEFAULT_HOUR_S,
    policy: Path | None = None,
    seed: int = 0,
    endpoint: str | None = None,
    prefix: str | None = None,
    workdir: Path | None = None,
    loop_wait_s: float = 0.1,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Simulate and run live; the comparison (times in trace seconds) and the settings.

    Args:
        trace: the uncompressed trace (unified schema).
        cluster: the cluster, in the agent's ``--simulate`` grammar.
        hour_s: real seconds per trace hour (compression factor ``3600 / hour_s``).
        policy: a policy file (``[scheduler]``) to start from; None = the pool's defaults.
        seed: the simulator's seed (profiles, estimates).
        endpoint, prefix: a running etcd and a key prefix (None: embedded etcd, fresh prefix).
        workdir: where the scaled policy file, the compressed trace and the logs go (default a temporary folder).
        loop_wait_s: the coordinator's ``--loop-wait``.
        timeout_s: bound on the live run.
    """
    from gpupool_sdk.errors import ConfigError
    from gpupool_sdk.scheduler.config import load_policy_config

    if not (hour_s > 0 and math.isfinite(hour_s)):
        raise ConfigError("--hour-s", f"must be real seconds > 0 per trace hour (5 = a factor of 720), got {hour_s}")
    factor = 3600.0 / hour_s
    workdir = workdir or Path(tempfile.mkdtemp(prefix="gpupool-miniature-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base_cfg = load_policy_config(policy).scheduler
    unscaled_file = workdir / "policy.toml"
    write_policy_file(base_cfg, unscaled_file, f"policy of the miniature run (from {policy or 'the defaults'})")
    policy_file = workdir / "policy-scaled.toml"
    write_policy_file(scale_policy(base_cfg, factor), policy_file,
                      f"durations divided by {factor:g} (1 trace hour = {hour_s:g} s); "
                      "the same file: gpupool coordinator --config and the simulation")
    compressed = workdir / "trace-compressed.csv"
    compress_trace(trace, compressed, factor)
    times = EngineTimes()
    # The simulator, uncompressed (the reference) and compressed (what the live pool runs).
    _, ref = simulate(trace, cluster, unscaled_file, times, seed)
    ctrace, small = simulate(compressed, cluster, policy_file, times.scaled(factor), seed)
    plans = plan_jobs(ctrace, cluster, load_policy_config(policy_file).scheduler, times.scaled(factor), seed)
    t_start = time.monotonic()
    live = run_live(plans, cluster, policy_file, workdir, endpoint, prefix, loop_wait_s, timeout_s)
    wall = time.monotonic() - t_start
    sim_small = sim_outcomes(small)
    in_trace_s = {n: _scaled(o, factor) for n, o in live.items()}
    sim_ref = sim_outcomes(ref)
    separated = 3600.0  # pairs the simulator finishes more than one trace hour apart
    others = baselines(trace, cluster, times, seed)
    return {
        "trace": str(trace),
        "cluster": cluster,
        "jobs": len(plans),
        "hour_s": hour_s,
        "factor": factor,
        "loop_wait_s": loop_wait_s,
        "live_wall_s": wall,
        "policy_file": str(policy_file),
        "workdir": str(workdir),
        "live_vs_sim": compare(in_trace_s, sim_ref, separated),
        "compressed_sim_vs_sim": compare({n: _scaled(o, factor) for n, o in sim_small.items()}, sim_ref, separated),
        "latency_real_s": latencies(live, sim_small),
        # Calibration: how alike the live order is to other simulated policies' (and gpupool's
        # with other information), and how alike those are to the simulated gpupool's.
        "live_vs_others_tau": {k: compare(in_trace_s, o, separated)["finish_order"]["kendall_tau"] for k, o in others.items()},
        "sim_vs_others_tau": {k: compare(o, sim_ref, separated)["finish_order"]["kendall_tau"] for k, o in others.items()},
        "live_events": {n: o.events for n, o in live.items()},
        "outcomes": {
            n: {"submit": sim_ref[n].submit, "start_sim": sim_ref[n].start, "end_sim": sim_ref[n].end,
                "start_live": in_trace_s[n].start, "end_live": in_trace_s[n].end,
                "preempt_sim": sim_ref[n].preemptions, "preempt_live": in_trace_s[n].preemptions}
            for n in sim_ref
        },
    }


#: The simulated policies the live order is also compared with (``baselines``).
BASELINES: tuple[str, ...] = ("fifo", "tiresias", "gandiva", "bestfit")


def baselines(trace: Path, cluster: str, times: EngineTimes, seed: int) -> dict[str, dict[str, JobOutcome]]:
    """Outcomes of the same (uncompressed) trace under :data:`BASELINES` and under ``gpupool`` with
    what a job reports changed: no estimates at all (``gpupool-no-estimates``) and other estimate
    and profile draws (``gpupool-seed<N>``). An order that is the simulated ``gpupool``'s should
    be closer to it than to any of these."""
    from gpupool_sdk.sim import load_trace, run_simulation
    from gpupool_sdk.sim.estimates import EstimateModel

    tr = load_trace(trace, seed=seed)
    rep = run_simulation(tr, cluster, list(BASELINES), sim_config=times.sim_config(seed), seed=seed)
    out = {k: sim_outcomes(r) for k, r in rep.results.items()}
    none = run_simulation(tr, cluster, ["gpupool"], sim_config=times.sim_config(seed), seed=seed,
                          estimates=EstimateModel(after_s=times.estimate_after_s, enabled=False))
    out["gpupool-no-estimates"] = sim_outcomes(none.results["gpupool"])
    for other in (seed + 1, seed + 2):
        r = run_simulation(load_trace(trace, seed=other), cluster, ["gpupool"], sim_config=times.sim_config(other),
                           seed=other, estimates=times.estimates())
        out[f"gpupool-seed{other}"] = sim_outcomes(r.results["gpupool"])
    return out


def _scaled(o: JobOutcome, factor: float) -> JobOutcome:
    return JobOutcome(o.name, o.submit * factor, None if o.start is None else o.start * factor,
                      None if o.end is None else o.end * factor, o.preemptions)


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """A few human-readable lines of :func:`run`'s report."""
    out = [f"{report['jobs']} jobs on {report['cluster']}, 1 trace hour = {report['hour_s']:g} s "
           f"(x{report['factor']:g}), live run {report['live_wall_s']:.0f} s"]
    for key, label in (("live_vs_sim", "live vs simulated"), ("compressed_sim_vs_sim", "compressed sim vs sim")):
        c = report[key]
        f, s, sep = c["finish_order"], c["start_order"], c["finish_pairs_separated"]
        out.append(
            f"{label}: finish order tau {f['kendall_tau']:.3f} rho {f['spearman_rho']:.3f} pairs {f['pairs_same']:.3f}; "
            f"start order tau {s['kendall_tau']:.3f} pairs {s['pairs_same']:.3f}; pairs > 1 h apart "
            f"{sep['same']:.3f} of {sep['pairs']}; avg JCT {c['avg_jct_live']:.0f} / {c['avg_jct_sim']:.0f} s "
            f"= {c['avg_jct_ratio']:.3f}x (p50 per job {c['jct_ratio_p50']:.3f}x); preemptions "
            f"{c['preemptions_live']} / {c['preemptions_sim']}; finished {c['finished_both']}/{c['jobs']}"
        )
    out.append("finish-order tau against other simulated orders, live / simulated gpupool: " + ", ".join(
        f"{k} {report['live_vs_others_tau'][k]:.3f} / {report['sim_vs_others_tau'][k]:.3f}" for k in report["live_vs_others_tau"]))
    lat = report["latency_real_s"]
    g, p = lat["grant_s"], lat["preempt_to_release_s"]
    out.append(f"live latency (real s): grant p50 {g['p50']:.3f} max {g['max']:.3f} (n={g['n']}); "
               f"preempt to release p50 {p['p50']:.3f} max {p['max']:.3f} (n={p['n']})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "job":
        p = argparse.ArgumentParser(prog="live_miniature.py job")
        p.add_argument("plan")
        p.add_argument("events")
        p.add_argument("--endpoints", required=True)
        p.add_argument("--prefix", required=True)
        a = p.parse_args(args[1:])
        return job_main(a.plan, a.events, a.endpoints, a.prefix)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="uncompressed trace (unified schema)")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, help="agent --simulate spec (default %(default)s)")
    p.add_argument("--hour-s", type=float, default=DEFAULT_HOUR_S, help="real seconds per trace hour (default %(default)s)")
    p.add_argument("--config", type=Path, default=None, help="policy file to start from (default: the pool's defaults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoints", default=None, help="a running etcd (default: start an embedded one)")
    p.add_argument("--loop-wait", type=float, default=0.1, help="the coordinator's --loop-wait (default %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and files here (default a temporary folder)")
    p.add_argument("--repeat", type=int, default=1, help="live runs (the simulations are deterministic)")
    p.add_argument("--write-workload", type=Path, default=None, help="write the default synthetic trace here and exit")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    a = p.parse_args(args)
    if a.write_workload is not None:
        synth_workload(a.write_workload)
        return 0
    reports = []
    for i in range(a.repeat):
        wd = None if a.workdir is None else a.workdir / f"run{i}"
        report = run(a.trace, a.cluster, a.hour_s, a.config, a.seed, a.endpoints, None, wd, a.loop_wait)
        reports.append(report)
        if a.output == "text":
            print("\n".join(summary_lines(report)), flush=True)
    if a.output == "json":
        for r in reports:
            r.pop("live_events", None)
        print(json.dumps(reports if a.repeat > 1 else reports[0], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
