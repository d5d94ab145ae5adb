"""Pure report building for ``gpupool top`` and ``gpupool metrics report``.

Everything here turns a :class:`~gpupool_sdk.telemetry.view.PoolView` into plain JSON-ready
dicts (the ``-o json`` output, stable keys) that the CLI renders as tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpupool_sdk.resources import QoS
from gpupool_sdk.resources.gpu import device_readings
from gpupool_sdk.telemetry.advice import AdviceSettings, advise
from gpupool_sdk.telemetry.pricing import ModelOffer, PriceTable
from gpupool_sdk.telemetry.summary import PHASES
from gpupool_sdk.telemetry.usage import UsageLedger, hourly_cost
from gpupool_sdk.telemetry.view import PoolView

#: One letter per phase in the proportion bar of ``gpupool top``.
PHASE_LETTERS: Mapping[str, str] = {
    "data": "D",
    "forward": "F",
    "backward": "B",
    "optimizer": "O",
    "checkpoint": "C",
    "other": ".",
}


def phase_bar(fractions: Mapping[str, float], width: int = 20) -> str:
    """A fixed-width bar with one letter per phase, proportional to its share of step time.

    Largest-remainder rounding keeps the bar exactly ``width`` wide; an empty timing gives blanks.

    Example:
        >>> phase_bar({"data": 0.5, "forward": 0.25, "backward": 0.25}, width=8)
        'DDDDFFBB'
    """
    total = sum(max(0.0, fractions.get(p, 0.0)) for p in PHASES)
    if total <= 0 or width <= 0:
        return " " * max(width, 0)
    exact = {p: max(0.0, fractions.get(p, 0.0)) / total * width for p in PHASES}
    cells = {p: int(v) for p, v in exact.items()}
    left = width - sum(cells.values())
    for p in sorted(PHASES, key=lambda p: (-(exact[p] - cells[p]), PHASES.index(p)))[:left]:
        cells[p] += 1
    return "".join(PHASE_LETTERS[p] * cells[p] for p in PHASES)


def _quota(view: PoolView, job: str) -> int | None:
    spec = view.specs.get(job)
    if spec is not None and spec.memory_bytes > 0:
        return spec.memory_bytes
    allocs = view.allocations_of(job)
    return max((a.memory_bytes for a in allocs), default=None) or None


def job_rows(view: PoolView, prices: PriceTable) -> list[dict[str, Any]]:
    """One row per job (live or with usage), for ``gpupool top``."""
    rows = []
    for job in view.job_names():
        spec = view.specs.get(job)
        status = view.statuses.get(job)
        tel = view.telemetry.get(job)
        usage = view.usage.get(job)
        allocs = view.allocations_of(job)
        qos = spec.qos_class.value if spec else (allocs[0].mode.value if allocs else (usage.qos.value if usage else ""))
        if status is not None:
            state = status.state.value
        elif spec is not None:
            state = "UNKNOWN"
        else:
            state = "GONE"  # only a usage record (or stray keys) remain
        rows.append(
            {
                "job": job,
                "state": state,
                "qos": qos,
                "owner": spec.owner if spec else (usage.owner if usage else ""),
                "priority": spec.priority if spec else None,
                "slices": len(allocs),
                "gpus": sorted({a.gpu_uuid for a in allocs}),
                "step": tel.step if tel else None,
                "steps_per_s": tel.steps_per_s if tel else None,
                "phase_fraction": dict(tel.phase_fraction) if tel else None,
                "phase_seconds": dict(tel.phase_seconds) if tel else None,
                "dominant_phase": tel.dominant_phase() if tel else None,
                "memory_peak_bytes": tel.memory_peak_bytes if tel else None,
                "memory_quota_bytes": _quota(view, job),
                "gpu_util": tel.gpu_util if tel else None,
                "telemetry_age_s": round(view.now - tel.published_at, 1) if tel and tel.published_at else None,
                "gpu_seconds": usage.gpu_seconds if usage else 0.0,
                "cost_usd": usage.cost_usd if usage else 0.0,
                "cost_usd_per_hour": hourly_cost(allocs, view.gpus, prices),
            }
        )
    return rows


def gpu_rows(view: PoolView) -> list[dict[str, Any]]:
    """One row per GPU: capacity, what is granted on it, to whom, and the jobs' measured use."""
    util_by_slice: dict[tuple[str, str], float] = {}
    mem_by_slice: dict[tuple[str, str], int] = {}
    for job, tel in view.telemetry.items():
        for s in tel.slices:
            if s.util is not None:
                util_by_slice[(job, s.gpu_uuid)] = s.util
            if s.memory_used_bytes is not None:
                mem_by_slice[(job, s.gpu_uuid)] = s.memory_used_bytes
    rows = []
    for uuid, g in sorted(view.gpus.items(), key=lambda kv: (kv[1].node, kv[1].index)):
        allocs = view.allocations_on(uuid)
        utils = [util_by_slice[(a.job, uuid)] for a in allocs if (a.job, uuid) in util_by_slice]
        used = [mem_by_slice[(a.job, uuid)] for a in allocs if (a.job, uuid) in mem_by_slice]
        rows.append(
            {
                "gpu": uuid,
                "node": g.node,
                "index": g.index,
                "model": g.model,
                "healthy": g.healthy,
                "health_reasons": list(g.health.reasons),
                "cordoned": uuid in view.cordoned,
                "memory_bytes": g.memory_bytes,
                "memory_allocated_bytes": sum(a.memory_bytes for a in allocs),
                "memory_used_bytes": sum(used) if used else None,
                "compute_allocated": min(
                    1.0, sum(1.0 if a.mode is QoS.EXCLUSIVE else a.compute_share for a in allocs)
                ),
                # max, not sum: without per-process NVML samples each job reports the whole device's
                "util": max(utils) if utils else None,
                "jobs": sorted(a.job for a in allocs),
                # the agent's reading of the whole device (any process): temperature and power from
                # the GPU record, usage from readings/{node}/{gpu} (up to its --usage-interval old)
                "readings": device_readings(g.health, view.readings.get(uuid)),
            }
        )
    return rows


def top_report(view: PoolView, prices: PriceTable) -> dict[str, Any]:
    """The whole ``gpupool top -o json`` document."""
    return {
        "at": view.now,
        "revision": view.revision,
        "leader": view.leader.to_dict() if view.leader else None,
        "jobs": job_rows(view, prices),
        "gpus": gpu_rows(view),
        "errors": list(view.errors),
    }


def cost_report(
    view: PoolView,
    prices: PriceTable,
    offers: Iterable[ModelOffer] = (),
    settings: AdviceSettings | None = None,
) -> dict[str, Any]:
    """The ``gpupool metrics report -o json`` document: cost by job and owner, plus advice.

    Keys: ``jobs`` (one row per usage record, most expensive first), ``owners`` (totals),
    ``total_cost_usd``, ``cost_usd_per_hour`` (current rate of every slice), ``advice`` (every
    live job's items, largest saving first), ``saving_usd_per_hour`` (sum of the largest item per
    job, so one job's alternatives are not double counted), ``errors``.
    """
    offers = tuple(offers)
    ledger = UsageLedger.from_records(view.usage.values())
    jobs = []
    for u in sorted(view.usage.values(), key=lambda u: (-u.cost_usd, u.job)):
        jobs.append(
            {
                "job": u.job,
                "owner": u.owner,
                "qos": u.qos.value,
                "gpu_hours": u.gpu_seconds / 3600.0,
                "gpu_seconds_by_model": dict(u.gpu_seconds_by_model),
                "memory_gib_hours": u.memory_gib_seconds / 3600.0,
                "cost_usd": u.cost_usd,
                "unpriced_gpu_hours": u.unpriced_gpu_seconds / 3600.0,
                "cost_usd_per_hour": hourly_cost(view.allocations_of(u.job), view.gpus, prices),
                "first_seen": u.first_seen,
                "last_seen": u.last_seen,
                "live": u.job in view.specs,
            }
        )
    owners = [
        {"owner": t.owner, "jobs": t.jobs, "gpu_hours": t.gpu_seconds / 3600.0, "cost_usd": t.cost_usd}
        for t in ledger.by_owner()
    ]
    advice: list[dict[str, Any]] = []
    best_saving = 0.0
    for job, spec in sorted(view.specs.items()):
        status = view.statuses.get(job)
        items = advise(
            spec,
            telemetry=view.telemetry.get(job),
            allocations=view.allocations_of(job),
            gpus_by_uuid=view.gpus,
            prices=prices,
            now=view.now,
            offers=offers,
            last_checkpoint_at=status.last_checkpoint.at if status and status.last_checkpoint else None,
            settings=settings,
        )
        advice.extend(a.to_dict() for a in items)
        best_saving += max((a.saving_usd_per_hour for a in items), default=0.0)
    advice.sort(key=lambda a: (-a["saving_usd_per_hour"], a["job"], a["kind"]))
    return {
        "at": view.now,
        "jobs": jobs,
        "owners": owners,
        "total_cost_usd": ledger.total_cost_usd(),
        "cost_usd_per_hour": hourly_cost(view.allocations, view.gpus, prices),
        "advice": advice,
        "saving_usd_per_hour": best_saving,
        "errors": list(view.errors),
    }
