"""Usage and cost accounting: what each job consumed, kept under ``usage/{job}``.

The coordinator's leader calls :func:`accrue` (or :meth:`UsageLedger.accrue_all`) once per
cycle with the allocations it sees and the time since the previous accrual, and writes each
changed record to ``usage/{job}`` (no lease: the record outlives the job). Everything here is
pure: no etcd, no clock.

Cost model (documented in ``docs/telemetry.md``)::

    share       = max(compute_share, memory_bytes / gpu.memory_bytes)   # capped at 1; exclusive = 1
    cost        = share * hours * price_per_gpu_hour(model) * qos_factor(mode)
    gpu_seconds = compute_share * seconds                               # exclusive = 1

The dominant share is charged because a slice that holds most of a GPU's memory blocks it for
others as surely as one that holds its compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import Allocation, GiB, GpuInfo, QoS
from gpupool_sdk.resources._fields import opt, req
from gpupool_sdk.telemetry.pricing import PriceTable


def _non_negative(value: float, fieldname: str) -> float:
    if math.isnan(value) or value < 0:
        raise SpecError(fieldname, f"must be >= 0, got {value!r}")
    return value


def slice_share(alloc: Allocation, gpu: GpuInfo | None) -> float:
    """The share of a GPU a slice is charged for: the larger of compute and memory share (max 1)."""
    if alloc.mode is QoS.EXCLUSIVE:
        return 1.0
    share = alloc.compute_share
    if gpu is not None and gpu.memory_bytes > 0:
        share = max(share, alloc.memory_bytes / gpu.memory_bytes)
    return min(1.0, max(0.0, share))


def compute_weight(alloc: Allocation) -> float:
    """Weight of a slice in GPU-seconds: its compute share (1 for exclusive)."""
    return 1.0 if alloc.mode is QoS.EXCLUSIVE else min(1.0, max(0.0, alloc.compute_share))


def hourly_cost(
    allocations: Iterable[Allocation], gpus_by_uuid: Mapping[str, GpuInfo], prices: PriceTable
) -> float:
    """What these slices cost per hour now, in USD (unpriced or unknown GPUs count 0)."""
    total = 0.0
    for a in allocations:
        gpu = gpus_by_uuid.get(a.gpu_uuid)
        if gpu is None:
            continue
        price = prices.price_per_hour(gpu.model, a.mode)
        if price is not None:
            total += slice_share(a, gpu) * price
    return total


@dataclass(frozen=True)
class UsageRecord:
    """What one job consumed over its life (``usage/{job}``).

    Attributes:
        job: the job name.
        owner: the team or user charged (from the spec).
        qos: the QoS class of its latest slices.
        gpu_seconds: slice-seconds weighted by compute share.
        gpu_seconds_by_model: ``gpu_seconds`` split by GPU model.
        memory_gib_seconds: granted memory (GiB) integrated over time.
        first_seen: wall-clock time of the first accrual.
        last_seen: wall-clock time of the latest accrual.
        cost_usd: accumulated cost (see the module docstring for the model).
        unpriced_gpu_seconds: GPU-seconds on models with no price (not in ``cost_usd``).

    Example:
        >>> UsageRecord.new("bert", owner="nlp", qos="guaranteed", now=0.0).gpu_seconds
        0.0
    """

    job: str
    owner: str = ""
    qos: QoS = QoS.GUARANTEED
    gpu_seconds: float = 0.0
    gpu_seconds_by_model: Mapping[str, float] = field(default_factory=dict)
    memory_gib_seconds: float = 0.0
    first_seen: float = 0.0
    last_seen: float = 0.0
    cost_usd: float = 0.0
    unpriced_gpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job:
            raise SpecError("job", f"must be the job name, got {self.job!r}")
        try:
            object.__setattr__(self, "qos", QoS(self.qos))
        except ValueError:
            raise SpecError("qos", f"unknown QoS {self.qos!r}; use one of {[q.value for q in QoS]}") from None
        for name in ("gpu_seconds", "memory_gib_seconds", "cost_usd", "unpriced_gpu_seconds"):
            object.__setattr__(self, name, _non_negative(float(getattr(self, name)), name))
        object.__setattr__(
            self,
            "gpu_seconds_by_model",
            {str(k): _non_negative(float(v), f"gpu_seconds_by_model.{k}") for k, v in self.gpu_seconds_by_model.items()},
        )

    @classmethod
    def new(cls, job: str, *, owner: str = "", qos: QoS | str = QoS.GUARANTEED, now: float = 0.0) -> UsageRecord:
        """An empty record for a job seen for the first time at ``now``."""
        return cls(job=job, owner=owner, qos=QoS(qos), first_seen=now, last_seen=now)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "owner": self.owner,
            "qos": self.qos.value,
            "gpu_seconds": self.gpu_seconds,
            "gpu_seconds_by_model": dict(self.gpu_seconds_by_model),
            "memory_gib_seconds": self.memory_gib_seconds,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "cost_usd": self.cost_usd,
            "unpriced_gpu_seconds": self.unpriced_gpu_seconds,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "usage") -> UsageRecord:
        by_model = opt(d, "gpu_seconds_by_model", dict, where, {})
        for k, v in by_model.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SpecError(f"{where}.gpu_seconds_by_model.{k}", f"expected a number, got {v!r}")
        return cls(
            job=req(d, "job", str, where),
            owner=opt(d, "owner", str, where, ""),
            qos=opt(d, "qos", str, where, "guaranteed"),
            gpu_seconds=opt(d, "gpu_seconds", float, where, 0.0),
            gpu_seconds_by_model=by_model,
            memory_gib_seconds=opt(d, "memory_gib_seconds", float, where, 0.0),
            first_seen=opt(d, "first_seen", float, where, 0.0),
            last_seen=opt(d, "last_seen", float, where, 0.0),
            cost_usd=opt(d, "cost_usd", float, where, 0.0),
            unpriced_gpu_seconds=opt(d, "unpriced_gpu_seconds", float, where, 0.0),
        )


def accrue(
    record: UsageRecord,
    allocations: Iterable[Allocation],
    gpus_by_uuid: Mapping[str, GpuInfo],
    dt_s: float,
    prices: PriceTable,
    now: float | None = None,
) -> UsageRecord:
    """Add ``dt_s`` seconds of holding ``allocations`` to ``record``.

    Args:
        record: the job's record so far (:meth:`UsageRecord.new` for a new job).
        allocations: the job's slices during the interval (other jobs' slices are ignored).
        gpus_by_uuid: the pool's GPUs, for model and memory size; a slice on a GPU that is no
            longer published still counts GPU-seconds, under model ``"unknown"``, unpriced.
        dt_s: length of the interval in seconds (>= 0).
        prices: the price table.
        now: wall-clock end of the interval (becomes ``last_seen``); defaults to
            ``record.last_seen + dt_s``.

    Returns:
        The updated record (records are immutable).

    Raises:
        SpecError: ``dt_s`` is negative or not a number.

    Example:
        >>> from gpupool_sdk.resources import Allocation, GpuInfo, GiB
        >>> gpu = GpuInfo(uuid="GPU-1", node="n", index=0, model="X", memory_bytes=80 * GiB)
        >>> a = Allocation("bert", "n", "GPU-1", 0, 20 * GiB, 0.5, QoS.GUARANTEED)
        >>> r = accrue(UsageRecord.new("bert"), [a], {"GPU-1": gpu}, 3600.0,
        ...            PriceTable(overrides={"X": 2.0}, catalog=lambda m: None))
        >>> (r.gpu_seconds, r.cost_usd)
        (1800.0, 1.0)
    """
    if isinstance(dt_s, bool) or not isinstance(dt_s, (int, float)) or math.isnan(dt_s) or dt_s < 0:
        raise SpecError("dt_s", f"must be a number of seconds >= 0, got {dt_s!r}")
    gpu_s = record.gpu_seconds
    by_model = dict(record.gpu_seconds_by_model)
    mem_gib_s = record.memory_gib_seconds
    cost = record.cost_usd
    unpriced = record.unpriced_gpu_seconds
    qos = record.qos
    for a in allocations:
        if a.job != record.job:
            continue
        qos = a.mode
        gpu = gpus_by_uuid.get(a.gpu_uuid)
        model = gpu.model if gpu is not None else "unknown"
        w = compute_weight(a) * dt_s
        gpu_s += w
        by_model[model] = by_model.get(model, 0.0) + w
        mem_gib_s += a.memory_bytes / GiB * dt_s
        price = prices.price_per_hour(model, a.mode) if gpu is not None else None
        if price is None:
            unpriced += w
        else:
            cost += slice_share(a, gpu) * dt_s / 3600.0 * price
    return replace(
        record,
        qos=qos,
        gpu_seconds=gpu_s,
        gpu_seconds_by_model=by_model,
        memory_gib_seconds=mem_gib_s,
        cost_usd=cost,
        unpriced_gpu_seconds=unpriced,
        last_seen=record.last_seen + dt_s if now is None else now,
    )


@dataclass(frozen=True)
class OwnerTotal:
    """Usage summed over one owner's jobs."""

    owner: str
    jobs: int
    gpu_seconds: float
    cost_usd: float


@dataclass
class UsageLedger:
    """The usage records of every job the leader has seen (pure bookkeeping, no I/O).

    A new leader seeds the ledger from the ``usage/`` records in etcd (:meth:`from_records`)
    and continues accruing; the records it changed are those returned by :meth:`accrue_all`.

    Example:
        >>> ledger = UsageLedger()
        >>> changed = ledger.accrue_all({}, {}, {}, dt_s=5.0, prices=PriceTable(catalog=lambda m: None), now=5.0)
        >>> changed
        []
    """

    records: dict[str, UsageRecord] = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: Iterable[UsageRecord]) -> UsageLedger:
        return cls({r.job: r for r in records})

    def get(self, job: str) -> UsageRecord | None:
        return self.records.get(job)

    def accrue_all(
        self,
        allocations_by_job: Mapping[str, Iterable[Allocation]],
        owners: Mapping[str, str],
        gpus_by_uuid: Mapping[str, GpuInfo],
        dt_s: float,
        prices: PriceTable,
        now: float,
    ) -> list[UsageRecord]:
        """Accrue ``dt_s`` seconds for every job holding slices; return the records that changed.

        Args:
            allocations_by_job: each job's current slices.
            owners: owner by job (from the specs); a job missing here keeps its recorded owner.
            gpus_by_uuid: the pool's GPUs.
            dt_s: seconds since the previous accrual (measure with ``time.monotonic()``).
            prices: the price table.
            now: wall-clock time of this accrual.
        """
        changed: list[UsageRecord] = []
        for job, allocs in sorted(allocations_by_job.items()):
            allocs = [a for a in allocs if a.job == job]
            if not allocs:
                continue
            rec = self.records.get(job) or UsageRecord.new(
                job, owner=owners.get(job, ""), qos=allocs[0].mode, now=now - dt_s
            )
            if owners.get(job) and owners[job] != rec.owner:
                rec = replace(rec, owner=owners[job])
            rec = accrue(rec, allocs, gpus_by_uuid, dt_s, prices, now=now)
            self.records[job] = rec
            changed.append(rec)
        return changed

    def by_owner(self) -> list[OwnerTotal]:
        """Totals per owner, most expensive first (jobs without owner are under ``""``)."""
        acc: dict[str, list[float]] = {}
        for r in self.records.values():
            a = acc.setdefault(r.owner, [0, 0.0, 0.0])
            a[0] += 1
            a[1] += r.gpu_seconds
            a[2] += r.cost_usd
        totals = [OwnerTotal(o, int(v[0]), v[1], v[2]) for o, v in acc.items()]
        return sorted(totals, key=lambda t: (-t.cost_usd, t.owner))

    def total_cost_usd(self) -> float:
        return sum(r.cost_usd for r in self.records.values())
