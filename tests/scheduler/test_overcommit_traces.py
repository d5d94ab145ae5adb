"""Overcommit of the shared class with memory peaks from real data (Lucid profiles, Alibaba v2023 pods).

Read from ``../shared/traces`` relative to the repository root; skipped when absent.

Modelling assumption (stated, not in the data): a user asks for about twice the memory the job
really peaks at, rounded up to 4 GiB and capped at the GPU; the observed peak is what the job
reports in its telemetry (``JobView.memory_peak_bytes``).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from sched_helpers import gpus

from gpupool_sdk.resources import GiB, JobSpec, MiB, QoS
from gpupool_sdk.scheduler import ClusterSnapshot, Grant, JobView, Scheduler, SchedulerConfig

TRACES = Path(__file__).parents[2].parent / "shared" / "traces"
LUCID = TRACES / "lucid_single_jobs.csv"
ALIBABA = TRACES / "alibaba_v2023_default.csv"
V100 = 32 * GiB


def lucid_peaks() -> list[tuple[str, int]]:
    if not LUCID.exists():
        pytest.skip(f"{LUCID} not present")
    with LUCID.open() as f:
        return [
            (f"{row['model']}-{row['batchsize']}-{row['amp']}".lower(), int(float(row["gmem"]) * MiB))
            for row in csv.DictReader(f)
        ]


def request_for_peak(peak: int, cap: int = V100) -> int:
    return min(cap, math.ceil(2 * peak / (4 * GiB)) * 4 * GiB)


def grants_per_gpu(decisions: list, jobs: dict[str, JobView]) -> dict[str, list[tuple[JobView, int]]]:
    out: dict[str, list[tuple[JobView, int]]] = {}
    for d in decisions:
        if isinstance(d, Grant):
            for s in d.slices:
                out.setdefault(s.gpu_uuid, []).append((jobs[d.job], s.memory_bytes))
    return out


def shared_jobs_from_lucid() -> dict[str, JobView]:
    jobs = {}
    for k, (name, peak) in enumerate(lucid_peaks()):
        n = f"l{k}-{name}"[:60].replace("_", "-")
        spec = JobSpec(name=n, memory=request_for_peak(peak), qos="shared", compute_share=0.5)
        jobs[n] = JobView(spec=spec, order=k, memory_peak_bytes=peak)
    return jobs


def test_lucid_overcommit_packs_more_and_peaks_fit() -> None:
    pool = gpus("n:4xV100-32GB:pcie")
    jobs = shared_jobs_from_lucid()
    snap = ClusterSnapshot(now=0.0, gpus=pool, jobs=jobs)
    plain = Scheduler(SchedulerConfig(overcommit_ratio=1.0, max_decisions=1000)).schedule(snap)
    over_cfg = SchedulerConfig(overcommit_ratio=2.0, peak_margin=0.1, max_decisions=1000)
    over = Scheduler(over_cfg).schedule(snap)
    n_plain = sum(isinstance(d, Grant) for d in plain)
    n_over = sum(isinstance(d, Grant) for d in over)
    assert n_over > n_plain >= 4
    for uuid, items in grants_per_gpu(over, jobs).items():
        phys = pool[uuid].memory_bytes
        observed = sum(v.memory_peak_bytes or 0 for v, _ in items)
        predicted = sum(min(q, int((v.memory_peak_bytes or q) * 1.1)) for v, q in items)
        quotas = sum(q for _, q in items)
        assert observed <= predicted <= phys, uuid
        assert quotas <= 2.0 * phys
    for uuid, items in grants_per_gpu(plain, jobs).items():
        assert sum(q for _, q in items) <= pool[uuid].memory_bytes


def test_lucid_unknown_peaks_give_no_overcommit() -> None:
    pool = gpus("n:2xV100-32GB:pcie")
    jobs = {n: JobView(spec=v.spec, order=v.order) for n, v in shared_jobs_from_lucid().items()}
    snap = ClusterSnapshot(now=0.0, gpus=pool, jobs=jobs)
    ds = Scheduler(SchedulerConfig(overcommit_ratio=3.0, max_decisions=1000)).schedule(snap)
    for uuid, items in grants_per_gpu(ds, jobs).items():
        assert sum(q for _, q in items) <= pool[uuid].memory_bytes


def alibaba_pods(limit: int) -> list[dict[str, str]]:
    if not ALIBABA.exists():
        pytest.skip(f"{ALIBABA} not present")
    out = []
    with ALIBABA.open() as f:
        for row in csv.DictReader(f):
            if row["num_gpu"] == "1" and 0 < float(row["gpu_fraction"]) < 1.0:
                out.append(row)
            if len(out) == limit:
                break
    return out


def test_alibaba_sharing_pods_with_lucid_peaks_guaranteed_never_overcommitted() -> None:
    """Alibaba's GPU-sharing pods: their fraction is the memory and compute they ask for; LS and
    Guaranteed pods are ``guaranteed``, BE and Burstable are ``shared`` with a peak taken from the
    Lucid profiles (peak / request ratio, cycled)."""
    peaks = lucid_peaks()
    ratios = [p / request_for_peak(p) for _, p in peaks]
    pods = alibaba_pods(120)
    jobs: dict[str, JobView] = {}
    for k, row in enumerate(pods):
        frac = float(row["gpu_fraction"])
        qos = "guaranteed" if row["priority"] in ("LS", "Guaranteed") else "shared"
        mem = int(frac * V100)
        spec = JobSpec(name=row["job_id"], memory=mem, compute_share=frac, qos=qos)
        peak = int(mem * ratios[k % len(ratios)]) if qos == "shared" else None
        jobs[spec.name] = JobView(spec=spec, order=k, memory_peak_bytes=peak)
    assert {v.spec.qos_class for v in jobs.values()} == {QoS.SHARED, QoS.GUARANTEED}
    pool = gpus("n:8xV100-32GB:pcie")
    snap = ClusterSnapshot(now=0.0, gpus=pool, jobs=jobs)
    cfg = SchedulerConfig(overcommit_ratio=1.5, peak_margin=0.1, max_decisions=1000)
    over = Scheduler(cfg).schedule(snap)
    plain = Scheduler(SchedulerConfig(max_decisions=1000)).schedule(snap)
    shared_over = sum(isinstance(d, Grant) and jobs[d.job].spec.qos_class is QoS.SHARED for d in over)
    shared_plain = sum(isinstance(d, Grant) and jobs[d.job].spec.qos_class is QoS.SHARED for d in plain)
    assert shared_over > shared_plain
    for uuid, items in grants_per_gpu(over, jobs).items():
        phys = pool[uuid].memory_bytes
        reserved = sum(q for v, q in items if v.spec.qos_class is QoS.GUARANTEED)
        quota = sum(q for v, q in items if v.spec.qos_class is QoS.SHARED)
        peaks_ = sum(min(q, int((v.memory_peak_bytes or q) * 1.1)) for v, q in items if v.spec.qos_class is QoS.SHARED)
        compute = sum(v.spec.compute_share for v, _ in items if v.spec.qos_class is QoS.GUARANTEED)
        assert reserved + peaks_ <= phys
        assert reserved + quota <= 1.5 * phys
        assert compute <= 1.0 + 1e-9
