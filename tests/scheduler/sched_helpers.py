"""Builders for scheduler tests: GPUs with the real resource model, job views, snapshots.

``gpus("node-a:8xH100-80GB:nvlink=2x4")`` uses the inventory's simulated parser when it is
present, and a small local builder with the same shape otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from gpupool_sdk.resources import Allocation, GiB, GpuHealth, GpuInfo, JobSpec, JobState, QoS
from gpupool_sdk.scheduler import (
    ClusterSnapshot,
    Decision,
    Grant,
    JobView,
    Scheduler,
    SchedulerConfig,
)

_MEM = {"H100-80GB": 80 * GiB, "A100-40GB": 40 * GiB, "A100-80GB": 80 * GiB, "V100-32GB": 32 * GiB, "T4": 16 * GiB}
_FEATURES = ("bf16", "fp16", "nvlink", "tensor_cores")


def _fallback(spec: str) -> list[GpuInfo]:
    out: list[GpuInfo] = []
    for piece in spec.split(","):
        parts = piece.strip().split(":")
        node, group = parts[0], parts[1]
        topo = parts[2] if len(parts) > 2 else "nvlink"
        m = re.match(r"(\d+)x(\S+)", group)
        assert m, piece
        count, model = int(m.group(1)), m.group(2)
        sizes: list[int] = []
        if topo == "nvlink":
            sizes = [count]
        elif topo.startswith("nvlink="):
            a, b = topo.split("=")[1].split("x")
            sizes = [int(b)] * int(a)
        island_of: list[int | None] = [None] * count
        start = 0
        for k, size in enumerate(sizes):
            for i in range(start, start + size):
                island_of[i] = k
            start += size
        for i in range(count):
            out.append(
                GpuInfo(
                    uuid=f"GPU-sim-{node}-{i}",
                    node=node,
                    index=i,
                    model=model,
                    memory_bytes=_MEM.get(model, 80 * GiB),
                    features=_FEATURES,
                    nvlink_island=island_of[i],
                    simulated=True,
                )
            )
    return out


def gpus(spec: str) -> dict[str, GpuInfo]:
    """GPUs by UUID from a ``--simulate`` style spec (``node-a:8xH100-80GB:nvlink=2x4,...``)."""
    try:
        from gpupool_sdk.inventory.simulated import parse_cluster_spec
    except ImportError:  # the inventory package is not there yet
        found = _fallback(spec)
    else:
        found = parse_cluster_spec(spec)
    return {g.uuid: g for g in found}


def unhealthy(gpu: GpuInfo, why: str = "xid 79") -> GpuInfo:
    """The same GPU with a failed health verdict."""
    return replace(gpu, health=GpuHealth(healthy=False, reasons=(why,)))


def job(name: str, *, order: int = 0, queued_at: float = 0.0, peak: int | None = None, **spec: Any) -> JobView:
    """A pending job view."""
    return JobView(spec=JobSpec(name=name, **spec), queued_at=queued_at, order=order, memory_peak_bytes=peak)


def running(
    view: JobView,
    gpu_list: Iterable[GpuInfo],
    *,
    granted_at: float = 0.0,
    memory: int | None = None,
    state: JobState = JobState.GRANTED,
    **fields: Any,
) -> JobView:
    """``view`` holding one slice on each GPU of ``gpu_list`` (exclusive slices take the whole GPU)."""
    spec = view.spec
    allocs = []
    for g in gpu_list:
        exclusive = spec.qos_class is QoS.EXCLUSIVE
        allocs.append(
            Allocation(
                job=spec.name,
                node=g.node,
                gpu_uuid=g.uuid,
                gpu_index=g.index,
                memory_bytes=g.memory_bytes if exclusive else (memory if memory is not None else spec.memory_bytes),
                compute_share=1.0 if exclusive else spec.compute_share,
                mode=spec.qos_class,
                granted_at=granted_at,
            )
        )
    return replace(view, state=state, allocations=tuple(allocs), granted_at=granted_at, **fields)


def snap(
    gpu_map: Mapping[str, GpuInfo], jobs: Iterable[JobView], now: float = 0.0, **kw: Any
) -> ClusterSnapshot:
    """A snapshot of ``gpu_map`` and ``jobs``."""
    return ClusterSnapshot(now=now, gpus=dict(gpu_map), jobs={j.name: j for j in jobs}, **kw)


def run(snapshot: ClusterSnapshot, config: SchedulerConfig | None = None) -> list[Decision]:
    """One cycle with ``config`` (defaults)."""
    return Scheduler(config or SchedulerConfig()).schedule(snapshot)


def by_job(decisions: Iterable[Decision]) -> dict[str, list[Decision]]:
    """Decisions grouped by job name."""
    out: dict[str, list[Decision]] = {}
    for d in decisions:
        out.setdefault(d.job, []).append(d)
    return out


def only(decisions: Iterable[Decision], job_name: str) -> Decision:
    """The single decision about ``job_name`` (fails when there is not exactly one)."""
    found = [d for d in decisions if d.job == job_name]
    assert len(found) == 1, f"expected one decision for {job_name}, got {found}"
    return found[0]


def apply(snapshot: ClusterSnapshot, decisions: Iterable[Decision]) -> ClusterSnapshot:
    """Apply grants to ``snapshot`` (a tiny model of the coordinator, for multi-cycle tests)."""
    jobs = dict(snapshot.jobs)
    for d in decisions:
        if isinstance(d, Grant):
            view = jobs[d.job]
            allocs = tuple(
                Allocation(
                    job=d.job,
                    node=s.node,
                    gpu_uuid=s.gpu_uuid,
                    gpu_index=s.gpu_index,
                    memory_bytes=s.memory_bytes,
                    compute_share=s.compute_share,
                    mode=view.spec.qos_class,
                    granted_at=snapshot.now,
                )
                for s in d.slices
            )
            jobs[d.job] = replace(view, state=JobState.GRANTED, allocations=allocs, granted_at=snapshot.now)
    return replace(snapshot, jobs=jobs)
