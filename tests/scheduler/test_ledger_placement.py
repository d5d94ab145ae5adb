"""Reserve / un-reserve in the ledger and the score / placement stage (table-driven)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sched_helpers import gpus, job, running, snap

from gpupool_sdk.resources import GiB, QoS
from gpupool_sdk.scheduler import Holding, Ledger, SchedulerConfig, SliceRequest, build_ledger
from gpupool_sdk.scheduler.placement import holdings_for, place


def ledger_of(spec: str, ratio: float = 1.0) -> Ledger:
    g = gpus(spec)
    return Ledger(g.values(), g.keys(), ratio)


def req(qos: str = "guaranteed", mem: int = 10, compute: float = 0.5, count: int = 1, min_count: int | None = None,
        topology: str = "pack", **kw: object) -> SliceRequest:
    return SliceRequest(
        job=str(kw.pop("job", "p")), qos=QoS(qos), memory=mem * GiB, compute=compute,
        peak=int(kw.pop("peak", mem)) * GiB, count=count, min_count=count if min_count is None else min_count,
        topology=topology, **kw,  # type: ignore[arg-type]
    )


def index_state(ledger: Ledger) -> tuple[object, ...]:
    ledger._flush()  # the indexes are brought up to date lazily, at their next read
    classes = ledger._classes.values()
    return tuple(
        (list(c.empty), [list(b) for b in c.part_g], list(c.part_s)) for c in classes
    ) + (tuple((gl.reserved, gl.compute, gl.shared_quota, gl.shared_peak, gl.slices) for gl in ledger.loads),)


def test_reserve_unreserve_restore_round_trip() -> None:
    ledger = ledger_of("a:4xH100-80GB:nvlink,b:2xA100-40GB:pcie")
    before = index_state(ledger)
    held = [Holding(0, QoS.GUARANTEED, 10 * GiB, 0.5, 10 * GiB), Holding(4, QoS.SHARED, 8 * GiB, 0.0, 4 * GiB)]
    ledger.reserve("x", held, group="g")
    assert ledger.groups["g"] == {"a": 1, "b": 1}
    mid = index_state(ledger)
    assert mid != before
    got = ledger.unreserve("x")
    assert index_state(ledger) == before and "a" not in ledger.groups["g"]
    ledger.restore("x", got)
    assert index_state(ledger) == mid
    assert ledger.holders(0) == ["x"]


def test_unreserve_bumps_frees_only_when_something_freed() -> None:
    ledger = ledger_of("a:2xH100-80GB:nvlink")
    assert ledger.unreserve("nobody") == [] and ledger.frees == 0
    ledger.reserve("x", [Holding(0, QoS.EXCLUSIVE, 80 * GiB, 1.0, 80 * GiB)])
    ledger.unreserve("x")
    assert ledger.frees == 1


CANDIDATES = [
    # (name, request, preloaded holdings, expected first candidate)
    ("idle smallest first", req(mem=10), [], 4),  # A100-40GB (index 4) before the H100s
    ("partly used before idle", req(mem=10), [Holding(2, QoS.GUARANTEED, 10 * GiB, 0.5, 10 * GiB)], 2),
    ("best fit: least leftover", req(mem=10),
     [Holding(1, QoS.GUARANTEED, 10 * GiB, 0.25, 10 * GiB), Holding(2, QoS.GUARANTEED, 60 * GiB, 0.25, 60 * GiB)], 2),
    ("exclusive skips partly used", req("exclusive", 0, 1.0), [Holding(4, QoS.SHARED, 1 * GiB, 0.0, GiB)], 5),
    ("compute full skipped", req(mem=10), [Holding(4, QoS.GUARANTEED, 10 * GiB, 1.0, 10 * GiB)], 5),
    ("model filter", req(mem=10, gpu_model="H100-80GB"), [], 0),
    ("feature filter", req(mem=10, features=("fp8",)), [], 0),
]


@pytest.mark.parametrize(("name", "request_", "pre", "expected"), CANDIDATES, ids=[c[0] for c in CANDIDATES])
def test_candidates_best_fit(name: str, request_: SliceRequest, pre: list[Holding], expected: int) -> None:
    ledger = ledger_of("a:4xH100-80GB:nvlink,b:2xA100-40GB:pcie")
    for k, h in enumerate(pre):
        ledger.reserve(f"pre{k}", [h])
    assert ledger.gpus[4].model == "A100-40GB"
    assert next(ledger.candidates(request_)) == expected


def test_blocked_and_anti_affinity_skipped() -> None:
    ledger = ledger_of("a:2xH100-80GB:nvlink,b:2xH100-80GB:nvlink")
    ledger.block([0, 1], "other")
    assert list(ledger.candidates(req())) == [2, 3]
    assert list(ledger.candidates(req(job="other"))) == [0, 1, 2, 3]
    ledger.reserve("m", [Holding(2, QoS.GUARANTEED, GiB, 0.1, GiB)], group="grp")
    assert list(ledger.candidates(req(anti_affinity="grp"))) == []
    assert list(ledger.candidates(req(anti_affinity="grp", job="other"))) == [0, 1]


TWO_ISLANDS = "a:8xH100-80GB:nvlink=2x4,b:8xH100-80GB:nvlink=2x4"

PLACE = [
    # (name, spec, request, preloaded GPU indices (one exclusive holder each), expected nodes, expected island set size)
    ("pack 4 on one island", TWO_ISLANDS, req(mem=70, compute=1.0, count=4), [], {"a"}, 1),
    ("pack 4 skips broken island", TWO_ISLANDS, req(mem=70, compute=1.0, count=4), [0], {"a"}, 1),
    ("pack 4 needs node when islands broken", TWO_ISLANDS, req(mem=70, compute=1.0, count=4), [0, 4, 8, 12], {"a"}, 2),
    ("pack 8 one node", TWO_ISLANDS, req(mem=70, compute=1.0, count=8), [], {"a"}, 2),
    ("pack fewest nodes", "a:4xH100-80GB:nvlink,b:4xH100-80GB:nvlink,c:4xH100-80GB:nvlink",
     req(mem=70, compute=1.0, count=6), [0, 1, 4], {"b", "c"}, 2),
    ("spread distinct nodes", "a:2xH100-80GB:nvlink,b:2xH100-80GB:nvlink,c:2xH100-80GB:nvlink",
     req(mem=10, count=3, topology="spread"), [], {"a", "b", "c"}, 3),
]


@pytest.mark.parametrize(("name", "spec", "request_", "pre", "nodes", "islands"), PLACE, ids=[p[0] for p in PLACE])
def test_place_topology(name: str, spec: str, request_: SliceRequest, pre: list[int], nodes: set[str], islands: int) -> None:
    ledger = ledger_of(spec)
    for i in pre:
        ledger.reserve(f"x{i}", [Holding(i, QoS.EXCLUSIVE, ledger.loads[i].phys, 1.0, ledger.loads[i].phys)])
    got = place(ledger, request_)
    assert got is not None and len(got) == request_.count and len(set(got)) == len(got)
    assert {ledger.nodes[i] for i in got} == nodes
    assert len({(ledger.nodes[i], ledger.islands[i]) for i in got}) == islands
    assert not set(got) & set(pre)


def test_gang_all_or_none_and_elastic_fewer() -> None:
    ledger = ledger_of("a:4xH100-80GB:nvlink")
    ledger.reserve("x", [Holding(0, QoS.EXCLUSIVE, 80 * GiB, 1.0, 80 * GiB)])
    assert place(ledger, req(mem=70, compute=1.0, count=4)) is None
    assert place(ledger, req(mem=70, compute=1.0, count=4, topology="spread")) is None
    got = place(ledger, req(mem=70, compute=1.0, count=4, min_count=2))
    assert got is not None and len(got) == 3


def test_holdings_for_exclusive_takes_whole_gpu() -> None:
    ledger = ledger_of("a:1xA100-40GB:pcie")
    (h,) = holdings_for(ledger, req("exclusive", 0, 1.0), [0])
    assert (h.memory, h.compute, h.qos) == (40 * GiB, 1.0, QoS.EXCLUSIVE)


def test_build_ledger_counts_allocations_and_skips_unknown_gpus() -> None:
    g = gpus("a:2xH100-80GB:nvlink")
    first, second = g.values()
    gone = replace(first, uuid="GPU-gone")
    views = [
        running(job("s", memory="30GiB", qos="shared", peak=10 * GiB), [first]),
        running(job("q", memory="20GiB", compute_share=0.5), [first, gone]),
    ]
    ledger = build_ledger(snap(g, views), SchedulerConfig(peak_margin=0.0))
    gl = ledger.loads[0]
    assert (gl.shared_quota, gl.shared_peak, gl.reserved, gl.compute, gl.slices) == (30 * GiB, 10 * GiB, 20 * GiB, 0.5, 2)
    assert ledger.loads[1].slices == 0 and len(ledger.holdings["q"]) == 1
    assert second.uuid in ledger.index_of


def test_bulk_load_then_rebuild_equals_incremental() -> None:
    spec = "a:4xH100-80GB:nvlink=2x2,b:2xA100-40GB:pcie"
    held = {
        "x": [Holding(0, QoS.GUARANTEED, 10 * GiB, 0.25, 10 * GiB), Holding(5, QoS.SHARED, 8 * GiB, 0.0, 4 * GiB)],
        "y": [Holding(0, QoS.SHARED, 30 * GiB, 0.0, 9 * GiB)],
        "z": [Holding(2, QoS.EXCLUSIVE, 80 * GiB, 1.0, 80 * GiB)],
        "w": [Holding(3, QoS.GUARANTEED, 20 * GiB, 0.5, 20 * GiB)],
    }
    inc, bulk = ledger_of(spec, 1.5), ledger_of(spec, 1.5)
    for job_name, hs in held.items():
        inc.reserve(job_name, hs)
        bulk.reserve(job_name, hs, reindex=False)
    bulk.rebuild_index()
    assert index_state(bulk) == index_state(inc)
    shared = SliceRequest(job="p", qos=QoS.SHARED, memory=20 * GiB, compute=0.5, peak=5 * GiB)
    assert list(bulk.candidates(shared)) == list(inc.candidates(shared))
