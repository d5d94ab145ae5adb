"""A read-only snapshot of the pool for reporting: ``gpupool top``, the exporter, the cost report.

:func:`load_view` reads the whole keyspace in one etcd range (so every part of the view is from
the same revision) and decodes what reporting needs. A malformed value is recorded in
:attr:`PoolView.errors` (naming the key) and skipped, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool_sdk.errors import SchemaError
from gpupool_sdk.resources import Allocation, GpuInfo, GpuReadings, JobSpec, JobStatus, LeaderRecord, NodeInfo
from gpupool_sdk.store.codec import decode
from gpupool_sdk.store.keyspace import Keyspace
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.summary import TelemetrySummary
from gpupool_sdk.telemetry.usage import UsageRecord

_DECODERS: Mapping[str, type] = {
    "nodes": NodeInfo,
    "gpus": GpuInfo,
    "readings": GpuReadings,
    "jobs.spec": JobSpec,
    "jobs.status": JobStatus,
    "allocations": Allocation,
    "telemetry": TelemetrySummary,
    "usage": UsageRecord,
    "leader": LeaderRecord,
    "prices": PriceTable,
}


@dataclass(frozen=True)
class PoolView:
    """What reporting sees of the pool at one etcd revision.

    Attributes:
        now: wall-clock time of the read.
        revision: etcd revision of the read (0 for views built by hand).
        gpus: published GPUs by UUID.
        readings: the agents' usage readings (``readings/{node}/{gpu}``) by GPU UUID.
        nodes: node records published by the agents, by node name.
        cordoned: UUIDs with an operator cordon.
        specs: job specs by job name (live jobs).
        statuses: job statuses by job name.
        allocations: every granted slice.
        telemetry: latest telemetry summary by job.
        usage: usage records by job (they outlive the jobs).
        leader: the leader record, None when no coordinator leads.
        errors: one line per malformed value skipped (``"<key>: <what is wrong>"``).
        prices: the price table the leader accrues with (``{prefix}/prices``: the policy file's
            ``[prices]``), None when no leader published one.
    """

    now: float
    revision: int = 0
    gpus: Mapping[str, GpuInfo] = field(default_factory=dict)
    readings: Mapping[str, GpuReadings] = field(default_factory=dict)
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    cordoned: frozenset[str] = frozenset()
    specs: Mapping[str, JobSpec] = field(default_factory=dict)
    statuses: Mapping[str, JobStatus] = field(default_factory=dict)
    allocations: tuple[Allocation, ...] = ()
    telemetry: Mapping[str, TelemetrySummary] = field(default_factory=dict)
    usage: Mapping[str, UsageRecord] = field(default_factory=dict)
    leader: LeaderRecord | None = None
    errors: tuple[str, ...] = ()
    prices: PriceTable | None = None

    def price_table(self, explicit: PriceTable | None = None) -> PriceTable:
        """The prices to report with: ``explicit`` (``--prices``, ``$GPUPOOL_PRICES``), else the
        leader's published table, else the catalog's list prices."""
        if explicit is not None:
            return explicit
        return self.prices if self.prices is not None else PriceTable.load()

    def allocations_of(self, job: str) -> list[Allocation]:
        """The slices ``job`` holds."""
        return [a for a in self.allocations if a.job == job]

    def allocations_on(self, gpu_uuid: str) -> list[Allocation]:
        """The slices granted on one GPU."""
        return [a for a in self.allocations if a.gpu_uuid == gpu_uuid]

    def job_names(self) -> list[str]:
        """Every job the view knows of: live (spec, status, slices, telemetry) and finished (usage)."""
        names: set[str] = set(self.specs) | set(self.statuses) | set(self.telemetry) | set(self.usage)
        names.update(a.job for a in self.allocations)
        return sorted(names)


def view_from_kvs(
    kvs: Iterable[tuple[str, bytes]], keyspace: Keyspace, now: float, revision: int = 0
) -> PoolView:
    """Build a :class:`PoolView` from raw ``(key, value)`` pairs of the pool's keyspace.

    Keys of kinds reporting does not use (acks, directives, checkpoints...) are ignored;
    keys of unknown shape are ignored; malformed values of known kinds land in ``errors``.
    """
    gpus: dict[str, GpuInfo] = {}
    readings: dict[str, GpuReadings] = {}
    nodes: dict[str, NodeInfo] = {}
    cordoned: set[str] = set()
    specs: dict[str, JobSpec] = {}
    statuses: dict[str, JobStatus] = {}
    allocs: list[Allocation] = []
    telemetry: dict[str, TelemetrySummary] = {}
    usage: dict[str, UsageRecord] = {}
    leader: LeaderRecord | None = None
    prices: PriceTable | None = None
    errors: list[str] = []
    for key, raw in kvs:
        parsed = keyspace.parse(key)
        if parsed is None:
            continue
        if parsed.kind == "cordons":
            cordoned.add(parsed.parts[0])
            continue
        cls = _DECODERS.get(parsed.kind)
        if cls is None:
            continue
        try:
            rec: Any = decode(key, raw, cls)
        except SchemaError as exc:
            errors.append(str(exc))
            continue
        if parsed.kind == "gpus":
            gpus[rec.uuid] = rec
        elif parsed.kind == "readings":
            readings[parsed.parts[1]] = rec
        elif parsed.kind == "nodes":
            nodes[parsed.parts[0]] = rec
        elif parsed.kind == "jobs.spec":
            specs[parsed.parts[0]] = rec
        elif parsed.kind == "jobs.status":
            statuses[parsed.parts[0]] = rec
        elif parsed.kind == "allocations":
            allocs.append(rec)
        elif parsed.kind == "telemetry":
            telemetry[parsed.parts[0]] = rec
        elif parsed.kind == "usage":
            usage[parsed.parts[0]] = rec
        elif parsed.kind == "leader":
            leader = rec
        elif parsed.kind == "prices":
            prices = rec
    return PoolView(
        now=now,
        revision=revision,
        gpus=gpus,
        readings=readings,
        nodes=nodes,
        cordoned=frozenset(cordoned),
        specs=specs,
        statuses=statuses,
        allocations=tuple(allocs),
        telemetry=telemetry,
        usage=usage,
        leader=leader,
        errors=tuple(errors),
        prices=prices,
    )


def load_view(store: Any, clock: Callable[[], float] = time.time) -> PoolView:
    """Read the pool through an :class:`~gpupool_sdk.store.EtcdStore` in one range request.

    Raises:
        StoreUnavailableError: etcd cannot be reached.
    """
    kvs, revision = store.get_prefix(store.keys.root())
    return view_from_kvs(((kv.key, kv.value) for kv in kvs), store.keys, now=clock(), revision=revision)
