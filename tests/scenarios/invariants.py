"""Safety invariants of the pool, checked from etcd state alone (reusable by any test).

* Capacity: on each GPU the granted memory never exceeds its physical memory (``shared`` slices
  may reach ``overcommit_ratio`` times it), and compute shares of non-shared slices sum to <= 1.
* Exclusivity: an ``exclusive`` slice is alone on its GPU; no GPU holds two slices of one job.
* Ownership: every allocation is attached to the lease of its job's spec (so it vanishes with
  the job), and a GRANTED status names exactly as many slices as the job holds.
* Terms: every allocation was written in a term no newer than the leader term counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool_sdk.errors import SchemaError
from gpupool_sdk.resources import Allocation, GpuInfo, JobSpec, JobState, JobStatus, QoS
from gpupool_sdk.store import EtcdStore
from gpupool_sdk.store.codec import decode, decode_dict

EPS = 1e-9


@dataclass(frozen=True)
class PoolFacts:
    """What the invariant check read (returned for further assertions)."""

    revision: int
    gpus: dict[str, GpuInfo]
    allocations: list[tuple[Allocation, int]]  # with the lease each key is attached to
    specs: dict[str, tuple[JobSpec, int]]  # with the spec key's lease
    statuses: dict[str, JobStatus]


def read_facts(store: EtcdStore) -> PoolFacts:
    """Read the pool prefix once (at one revision); malformed keys are ignored here."""
    ks = store.keys
    kvs, revision = store.get_prefix(ks.root())
    gpus: dict[str, GpuInfo] = {}
    allocs: list[tuple[Allocation, int]] = []
    specs: dict[str, tuple[JobSpec, int]] = {}
    statuses: dict[str, JobStatus] = {}
    for kv in kvs:
        p = ks.parse(kv.key)
        if p is None:
            continue
        try:
            if p.kind == "gpus":
                g = decode(kv.key, kv.value, GpuInfo)
                gpus[g.uuid] = g
            elif p.kind == "allocations":
                allocs.append((decode(kv.key, kv.value, Allocation), kv.lease))
            elif p.kind == "jobs.spec":
                specs[p.parts[0]] = (decode(kv.key, kv.value, JobSpec), kv.lease)
            elif p.kind == "jobs.status":
                statuses[p.parts[0]] = decode(kv.key, kv.value, JobStatus)
        except SchemaError:
            continue
    return PoolFacts(revision, gpus, allocs, specs, statuses)


def check_invariants(store: EtcdStore, overcommit_ratio: float = 1.0) -> PoolFacts:
    """Assert every invariant above on the current etcd state; returns what was read.

    Raises:
        AssertionError: an invariant is broken; the message says which and where.
    """
    facts = read_facts(store)
    by_gpu: dict[str, list[Allocation]] = {}
    for a, lease in facts.allocations:
        by_gpu.setdefault(a.gpu_uuid, []).append(a)
        spec = facts.specs.get(a.job)
        if spec is not None:
            assert lease == spec[1], f"allocation {a.node}/{a.gpu_uuid}/{a.job} is on lease {lease:x}, not its job's {spec[1]:x}"
        assert lease != 0, f"allocation {a.node}/{a.gpu_uuid}/{a.job} has no lease: it would outlive its job"
    term_kv = store.get(store.keys.term())
    if term_kv is not None:
        top = decode_dict(term_kv.key, term_kv.value).get("term", 0)
        for a, _ in facts.allocations:
            assert a.term <= top, f"allocation of {a.job} carries term {a.term} > term counter {top}"
    for uuid, allocs in by_gpu.items():
        jobs = [a.job for a in allocs]
        assert len(jobs) == len(set(jobs)), f"GPU {uuid} holds two slices of one job: {sorted(jobs)}"
        if any(a.mode is QoS.EXCLUSIVE for a in allocs):
            assert len(allocs) == 1, f"exclusive slice on GPU {uuid} shares it with {sorted(jobs)}"
        gpu = facts.gpus.get(uuid)
        if gpu is None:
            continue  # its agent is gone; nothing to compare with
        strict = sum(a.memory_bytes for a in allocs if a.mode is not QoS.SHARED)
        shared = sum(a.memory_bytes for a in allocs if a.mode is QoS.SHARED)
        assert strict <= gpu.memory_bytes, f"GPU {uuid}: reserved memory {strict} > capacity {gpu.memory_bytes} ({sorted(jobs)})"
        assert strict + shared <= gpu.memory_bytes * overcommit_ratio + EPS, (
            f"GPU {uuid}: granted memory {strict + shared} > {overcommit_ratio} x capacity {gpu.memory_bytes} ({sorted(jobs)})"
        )
        share = sum(a.compute_share for a in allocs if a.mode is not QoS.SHARED)
        assert share <= 1.0 + EPS, f"GPU {uuid}: reserved compute share {share:.3f} > 1 ({sorted(jobs)})"
    held: dict[str, int] = {}
    for a, _ in facts.allocations:
        held[a.job] = held.get(a.job, 0) + 1
    for job, status in facts.statuses.items():
        if status.state is JobState.GRANTED and job in facts.specs:
            assert held.get(job, 0) == status.gpus, f"job {job} is GRANTED {status.gpus} slice(s) but holds {held.get(job, 0)}"
    return facts
