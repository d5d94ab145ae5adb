"""Pure scheduler throughput: decisions per second of one schedule() cycle, 1,000 pending jobs.

Usage::

    python benchmarks/bench_scheduler.py [--json] [--sizes 256 1024 4096] [--pending 1000] [--las 3600,36000]
    python benchmarks/bench_scheduler.py --congested [--json]   # only the coordinator figure below

Pools of 8-GPU nodes (H100-80GB in two NVLink islands of four, every fourth node A100-40GB
on PCIe), half of them already busy with running jobs of low priority, and 1,000 pending jobs
of mixed shapes (shared and guaranteed fractions, exclusive, 2/4/8-GPU pack gangs, spread,
anti-affinity, elastic, some with a higher priority that preempts). ``max_decisions`` is raised
to 10,000 so the whole queue is considered in one cycle.

Figures: ``first_cycle`` is one cold cycle over the full queue; ``repeated`` applies the
decisions (grants; preempt and balloon directives acked one cycle later, then released and
re-queued) and runs further cycles with new arrivals (steady state on a full pool).
The goal is above 1,000 decisions/s at 4,096 GPUs on one core. Times are CPU seconds of this
process (``time.process_time``): on a shared machine they do not count the time other work held
the core (wall-clock figures before issue 14 varied 2-3x with the machine's load). ``--las`` measures the
least-attained-service mode: the running jobs then carry 0 to 49,000 GPU-s of attained service
(so fresh jobs may preempt those in higher queues) and the config gets those thresholds.

``coordinator``: the cycle a deployed coordinator runs with a long queue: the default policy
(:data:`gpupool_sdk.scheduler.config.DEFAULT_SCHEDULER`, ``etcd_max_txn_ops`` 128 as the
coordinator sets it), 1,024 GPUs, 5,000 pending jobs kept waiting by new arrivals, running jobs
with attained service; CPU seconds per cycle (``time.process_time``, one core) over 15 steady
cycles after the first. Goal: under 0.1 s per cycle. ``--congested`` also runs it right after
with the bounds on a cycle's work off (``max_considered`` 0, ``keep_reservations`` off), in the
same process, and reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from typing import Any

from gpupool_sdk.resources import Ack, Allocation, Directive, DirectiveKind, GiB, GpuInfo, JobSpec, JobState
from gpupool_sdk.scheduler import (
    Balloon,
    ClusterSnapshot,
    Grant,
    JobView,
    Preempt,
    Reject,
    Release,
    Scheduler,
    SchedulerConfig,
    Shrink,
)

FEATURES_H100 = ("bf16", "fp16", "fp8", "nvlink", "tensor_cores")
FEATURES_A100 = ("bf16", "fp16", "tensor_cores")


def make_pool(n_gpus: int) -> dict[str, GpuInfo]:
    """``n_gpus`` GPUs on 8-GPU nodes; every fourth node is A100-40GB on PCIe."""
    out: dict[str, GpuInfo] = {}
    for n in range(n_gpus // 8):
        node = f"node-{n:04d}"
        a100 = n % 4 == 3
        for i in range(8):
            uuid = f"GPU-{node}-{i}"
            out[uuid] = GpuInfo(
                uuid=uuid,
                node=node,
                index=i,
                model="A100-40GB" if a100 else "H100-80GB",
                memory_bytes=(40 if a100 else 80) * GiB,
                features=FEATURES_A100 if a100 else FEATURES_H100,
                nvlink_island=None if a100 else i // 4,
            )
    return out


def random_spec(rng: random.Random, name: str, priority_hi: int = 0) -> JobSpec:
    """One job of a mixed workload."""
    r = rng.random()
    prio = rng.choice((0, 0, 1, 2)) + priority_hi
    if r < 0.35:
        return JobSpec(name=name, memory=f"{rng.choice((4, 8, 12, 16, 24, 32))}GiB", qos="shared", priority=prio)
    if r < 0.60:
        return JobSpec(
            name=name,
            memory=f"{rng.choice((8, 16, 20, 30, 40))}GiB",
            compute_share=rng.choice((0.25, 0.5)),
            qos="guaranteed",
            priority=prio,
        )
    if r < 0.75:
        return JobSpec(
            name=name,
            gpus=rng.choice((2, 4, 4, 8)),
            memory="70GiB",
            qos="guaranteed",
            priority=prio,
            features=("nvlink",),
            topology="pack",
        )
    if r < 0.85:
        return JobSpec(name=name, gpus=rng.choice((1, 2)), qos="exclusive", priority=prio)
    if r < 0.92:
        return JobSpec(name=name, gpus=rng.choice((2, 3, 4)), memory="20GiB", compute_share=0.5, topology="spread", priority=prio)
    if r < 0.96:
        return JobSpec(
            name=name, gpus=2, memory="16GiB", compute_share=0.5, anti_affinity=f"grp{rng.randrange(8)}", priority=prio
        )
    return JobSpec(name=name, gpus=4, min_gpus=2, max_gpus=8, memory="40GiB", compute_share=1.0, topology="pack", priority=prio)


def make_snapshot(n_gpus: int, pending: int, seed: int = 1, attained: bool = False) -> ClusterSnapshot:
    """A pool half busy with low-priority running jobs, and ``pending`` jobs waiting (``attained``:
    running jobs carry 0 to 49,000 GPU-s of service, for the LAS mode)."""
    rng = random.Random(seed)
    pool = make_pool(n_gpus)
    gpu_list = list(pool.values())
    jobs: dict[str, JobView] = {}
    # Half the GPUs run low-priority shared/guaranteed fractional jobs (two per GPU).
    for k, g in enumerate(gpu_list[: n_gpus // 2]):
        for half in range(2):
            name = f"run-{k}-{half}"
            qos = "shared" if half == 0 else "guaranteed"
            spec = JobSpec(name=name, memory=f"{g.memory_bytes // GiB // 4}GiB", compute_share=0.5, qos=qos, priority=0)
            alloc = Allocation(name, g.node, g.uuid, g.index, spec.memory_bytes, 0.5, spec.qos_class, granted_at=0.0)
            jobs[name] = JobView(
                spec=spec,
                state=JobState.GRANTED,
                allocations=(alloc,),
                granted_at=0.0,
                order=len(jobs),
                memory_peak_bytes=int(spec.memory_bytes * 0.6),
                attained_gpu_s=1000.0 * (k % 50) if attained else 0.0,
            )
    for k in range(pending):
        name = f"pend-{k}"
        jobs[name] = JobView(
            spec=random_spec(rng, name, priority_hi=3 if k % 50 == 0 else 0),
            queued_at=float(rng.randrange(0, 600)),
            order=len(jobs),
        )
    return ClusterSnapshot(now=1000.0, gpus=pool, jobs=jobs)


def apply_decisions(snapshot: ClusterSnapshot, decisions: list[Any], now: float) -> dict[str, JobView]:
    """Jobs after the cycle (enough of a coordinator for repeated cycles): grants allocate; preempt and
    balloon directives are written and acked one cycle later; releases re-queue the job; shrinks
    rewrite its quota."""
    jobs = dict(snapshot.jobs)
    for d in decisions:
        v = jobs.get(d.job)
        if v is None:
            continue
        if isinstance(d, Grant):
            allocs = tuple(
                Allocation(d.job, s.node, s.gpu_uuid, s.gpu_index, s.memory_bytes, s.compute_share, v.spec.qos_class)
                for s in d.slices
            )
            jobs[d.job] = replace(v, state=JobState.GRANTED, allocations=allocs, granted_at=now)
        elif isinstance(d, Preempt):
            directive = Directive(DirectiveKind.PREEMPT, seq=1, deadline=d.deadline, target={"for_job": d.for_job})
            jobs[d.job] = replace(v, state=JobState.PREEMPTING, directive=directive, ack=None)
        elif isinstance(d, Balloon):
            target = {"memory_bytes": d.target_bytes, "for_job": d.for_job}
            jobs[d.job] = replace(v, directive=Directive(DirectiveKind.BALLOON, 1, d.deadline, target), ack=None)
        elif isinstance(d, Release):
            jobs[d.job] = replace(
                v, state=JobState.PENDING, allocations=(), granted_at=None, directive=None, ack=None, queued_at=now
            )
        elif isinstance(d, Shrink):
            allocs = tuple(replace(a, memory_bytes=d.memory_bytes) for a in v.allocations)
            jobs[d.job] = replace(v, allocations=allocs, directive=None, ack=None)
        elif isinstance(d, Reject):
            del jobs[d.job]
    return jobs


def ack_directives(jobs: dict[str, JobView], now: float) -> None:
    """Every directive written last cycle is acknowledged now (the job reached a step boundary)."""
    for name, v in jobs.items():
        if v.directive is not None and v.ack is None:
            target = v.directive.target.get("memory_bytes")
            jobs[name] = replace(v, ack=Ack(seq=v.directive.seq, step=100, checkpoint="/ck", reached_bytes=target, at=now))


def bench_size(n_gpus: int, pending: int, cycles: int = 5, las: tuple[float, ...] = ()) -> dict[str, Any]:
    """Figures for one pool size (``las``: least-attained-service thresholds, empty = off)."""
    config = SchedulerConfig(max_decisions=10_000, overcommit_ratio=1.5, min_runtime_s=120.0, las_threshold_gpu_s=las)
    sched = Scheduler(config)
    snap = make_snapshot(n_gpus, pending, attained=bool(las))
    t0 = time.process_time()
    decisions = sched.schedule(snap)
    first_s = time.process_time() - t0
    kinds: dict[str, int] = {}
    for d in decisions:
        kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1

    rng = random.Random(7)
    total_decisions = 0
    rep_kinds: dict[str, int] = {}
    total_s = 0.0
    now = snap.now
    jobs = apply_decisions(snap, decisions, now)
    for c in range(cycles):
        now += 10.0
        ack_directives(jobs, now)
        # New arrivals keep about ``pending`` jobs waiting.
        waiting = sum(1 for v in jobs.values() if v.state is JobState.PENDING)
        for k in range(max(0, pending - waiting)):
            name = f"new-{c}-{k}"
            jobs[name] = JobView(spec=random_spec(rng, name), queued_at=now, order=len(jobs) + k)
        cur = ClusterSnapshot(now=now, gpus=snap.gpus, jobs=jobs)
        t0 = time.process_time()
        ds = sched.schedule(cur)
        total_s += time.process_time() - t0
        total_decisions += len(ds)
        for d in ds:
            rep_kinds[type(d).__name__] = rep_kinds.get(type(d).__name__, 0) + 1
        jobs = apply_decisions(cur, ds, now)
    return {
        "gpus": n_gpus,
        "pending": pending,
        "first_cycle": {
            "decisions": len(decisions),
            "seconds": round(first_s, 4),
            "decisions_per_s": round(len(decisions) / first_s, 1),
            "grants_and_preemptions_per_s": round((kinds.get("Grant", 0) + kinds.get("Preempt", 0)) / first_s, 1),
            "kinds": kinds,
        },
        "repeated": {
            "cycles": cycles,
            "decisions": total_decisions,
            "seconds": round(total_s, 4),
            "decisions_per_s": round(total_decisions / total_s, 1) if total_s else 0.0,
            "grants_and_preemptions_per_s": round(
                (rep_kinds.get("Grant", 0) + rep_kinds.get("Preempt", 0)) / total_s, 1
            )
            if total_s
            else 0.0,
            "kinds": rep_kinds,
        },
    }


def bench_coordinator(
    n_gpus: int = 1024, pending: int = 5000, cycles: int = 15, config: SchedulerConfig | None = None
) -> dict[str, Any]:
    """CPU seconds per cycle of the default policy (or ``config``) with ``pending`` jobs waiting
    (see the module docstring)."""
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER

    config = replace(config or DEFAULT_SCHEDULER, etcd_max_txn_ops=128)
    sched = Scheduler(config)
    snap = make_snapshot(n_gpus, pending, attained=True)
    t0 = time.process_time()
    decisions = sched.schedule(snap)
    first_s = time.process_time() - t0
    rng = random.Random(7)
    now = snap.now
    jobs = apply_decisions(snap, decisions, now)
    times: list[float] = []
    kinds: dict[str, int] = {}
    for c in range(cycles):
        now += 10.0
        ack_directives(jobs, now)
        waiting = sum(1 for v in jobs.values() if v.state is JobState.PENDING)
        for k in range(max(0, pending - waiting)):
            name = f"new-{c}-{k}"
            jobs[name] = JobView(spec=random_spec(rng, name), queued_at=now, order=len(jobs) + k)
        cur = ClusterSnapshot(now=now, gpus=snap.gpus, jobs=jobs)
        t0 = time.process_time()
        ds = sched.schedule(cur)
        times.append(time.process_time() - t0)
        for d in ds:
            kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
        jobs = apply_decisions(cur, ds, now)
    times.sort()
    return {
        "gpus": n_gpus,
        "pending": pending,
        "first_cycle_s": round(first_s, 4),
        "cycle_s_mean": round(sum(times) / len(times), 4),
        "cycle_s_p50": round(times[len(times) // 2], 4),
        "cycle_s_p90": round(times[min(len(times) - 1, int(0.9 * len(times)))], 4),
        "cycle_s_max": round(times[-1], 4),
        "kinds": kinds,
        "goal": "< 0.1 s per cycle, one core",
        "goal_met": times[len(times) // 2] < 0.1,
        "load_avg_1m": round(os.getloadavg()[0], 1),  # other work on the machine while measuring
    }


def bench_congested() -> dict[str, Any]:
    """:func:`bench_coordinator` with the default policy and, right after it in the same process,
    with the bounds on a cycle's work off (``max_considered`` 0, ``keep_reservations`` off: every
    pending job considered in full, every reservation searched again)."""
    from gpupool_sdk.scheduler.config import DEFAULT_SCHEDULER

    on = bench_coordinator()
    off = bench_coordinator(config=replace(DEFAULT_SCHEDULER, max_considered=0, keep_reservations=False))
    return {
        **on,
        "bounds_off": {k: off[k] for k in ("cycle_s_p50", "cycle_s_p90", "cycle_s_mean", "kinds", "load_avg_1m")},
        "p50_over_bounds_off": round(on["cycle_s_p50"] / max(off["cycle_s_p50"], 1e-9), 2),
    }


def run(sizes: tuple[int, ...] = (256, 1024, 4096), pending: int = 1000, las: tuple[float, ...] = ()) -> dict[str, Any]:
    """Run the benchmark at every size; returns a JSON-able dict (used by ``benchmarks/run_all.py``)."""
    results = {f"gpus_{n}": bench_size(n, pending, las=las) for n in sizes}
    at_4096 = results.get("gpus_4096", {}).get("first_cycle", {}).get("decisions_per_s")
    return {
        "goal": ">1000 decisions/s at 4096 GPUs, 1000 pending",
        "goal_met": bool(at_4096 and at_4096 > 1000),
        **results,
        "coordinator": bench_congested(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--sizes", type=int, nargs="*", default=[256, 1024, 4096])
    ap.add_argument("--pending", type=int, default=1000)
    ap.add_argument("--las", default="", metavar="GPU_S[,GPU_S...]", help="least-attained-service thresholds (empty = off)")
    ap.add_argument("--congested", action="store_true",
                    help="only the coordinator figure: default policy, 1,024 GPUs, 5,000 pending")
    args = ap.parse_args(argv)
    if args.congested:
        res_c = bench_congested()
        off = res_c["bounds_off"]
        print(json.dumps(res_c, indent=1) if args.json else
              f"coordinator, default policy, {res_c['gpus']} GPUs, {res_c['pending']} pending: cycle "
              f"p50 {res_c['cycle_s_p50']} s, p90 {res_c['cycle_s_p90']} s, mean {res_c['cycle_s_mean']} s, max {res_c['cycle_s_max']} s "
              f"(first {res_c['first_cycle_s']} s); goal met: {res_c['goal_met']}; bounds off (same run): "
              f"p50 {off['cycle_s_p50']} s, p90 {off['cycle_s_p90']} s (ratio {res_c['p50_over_bounds_off']})")
        return 0
    las = tuple(float(x) for x in args.las.split(",") if x.strip())
    res = run(tuple(args.sizes), args.pending, las)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{'gpus':>6} {'cycle decisions':>16} {'cycle s':>8} {'dec/s':>9} {'grant+preempt/s':>16} {'repeat dec/s':>13}  kinds")
    for key, r in res.items():
        if not key.startswith("gpus_"):
            continue
        f, rep = r["first_cycle"], r["repeated"]
        print(
            f"{r['gpus']:>6} {f['decisions']:>16} {f['seconds']:>8.3f} {f['decisions_per_s']:>9.0f} "
            f"{f['grants_and_preemptions_per_s']:>16.0f} "
            f"{rep['decisions_per_s']:>13.0f}  {f['kinds']}"
        )
        print(
            f"{'':>6} repeated {rep['cycles']} cycles: {rep['decisions']} decisions in {rep['seconds']:.3f} s "
            f"({rep['grants_and_preemptions_per_s']:.0f} grants+preemptions/s)  {rep['kinds']}"
        )
    print(f"goal ({res['goal']}): {'met' if res['goal_met'] else 'NOT met'}", file=sys.stderr)
    c = res["coordinator"]
    print(f"coordinator, default policy, {c['gpus']} GPUs, {c['pending']} pending: cycle p50 {c['cycle_s_p50']} s, p90 {c['cycle_s_p90']} s, "
          f"mean {c['cycle_s_mean']} s, max {c['cycle_s_max']} s; goal ({c['goal']}): "
          f"{'met' if c['goal_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
