"""Right-sizing advice rules (pure, table-driven)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB, JobSpec, QoS
from gpupool_sdk.telemetry.advice import AdviceKind, AdviceSettings, advise, suggested_memory
from gpupool_sdk.telemetry.pricing import ModelOffer

from ._data import NOW, alloc, gpu, prices, spec, telemetry

GPUS = {"GPU-a0": gpu("GPU-a0", model="H100-80GB", memory_gib=80)}
TABLE = prices({"H100-80GB": 4.0})
A10 = ModelOffer("A10-24GB", 24 * GiB, 1.0, frozenset({"bf16", "fp16"}))
T4 = ModelOffer("T4-16GB", 16 * GiB, 0.35, frozenset({"fp16"}))


@dataclass
class Case:
    name: str
    spec: dict[str, Any] = field(default_factory=dict)
    tel: dict[str, Any] | None = field(default_factory=dict)  # None: the job never published
    alloc: dict[str, Any] | None = field(default_factory=dict)  # None: pending, no slices
    offers: tuple[ModelOffer, ...] = ()
    last_checkpoint_at: float | None = None
    expect: dict[AdviceKind, float] = field(default_factory=dict)  # kind -> saving $/h
    suggestion: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("healthy job: no advice"),
    Case(
        "memory far above peak, cheaper model fits",
        spec={"memory": "40GiB", "share": 0.5},
        tel={"peak_gib": 10},
        alloc={"memory_gib": 40, "share": 0.5},
        offers=(T4, A10),
        # now max(0.5, 40/80) * $4 = $2; A10: max(0.5, 12/24) * $1 = $0.5. T4 (16GiB) fits 12GiB but the
        # spec asks nothing of features here, and T4 is cheaper still: max(0.5, 12/16) * $0.35 = $0.2625.
        expect={AdviceKind.MEMORY_OVERSIZED: 2.0 - 0.2625},
        suggestion={"memory": "12.0GiB", "gpu_model": "T4-16GB"},
    ),
    Case(
        "memory far above peak, memory share dominates the bill",
        spec={"memory": "60GiB", "share": 0.25},
        tel={"peak_gib": 20},
        alloc={"memory_gib": 60, "share": 0.25},
        # now 0.75 * $4 = $3; at 24GiB: max(0.25, 0.3) * $4 = $1.2
        expect={AdviceKind.MEMORY_OVERSIZED: 1.8},
        suggestion={"memory_bytes": 24 * GiB},
    ),
    Case(
        "peak close to quota: no memory advice",
        spec={"memory": "40GiB"},
        tel={"peak_gib": 30},
        alloc={"memory_gib": 40},
    ),
    Case(
        "input-bound on a GPU",
        tel={"data": 0.3, "util": 0.3},
        alloc={"memory_gib": 20, "share": 0.5},
        expect={AdviceKind.INPUT_BOUND: 1.0},  # $2/h now, shared is half price
        suggestion={"qos": "shared"},
    ),
    Case(
        "input-bound on the CPU (no utilisation): still flagged",
        tel={"data": 0.5, "util": None},
        alloc={},
        expect={AdviceKind.INPUT_BOUND: 1.0},
    ),
    Case(
        "input-bound already shared: no saving",
        spec={"qos": "shared"},
        tel={"data": 0.3, "util": 0.3},
        alloc={"mode": QoS.SHARED},
        expect={AdviceKind.INPUT_BOUND: 0.0},
    ),
    Case("busy GPU with a big data phase: not input-bound", tel={"data": 0.3, "util": 0.95}),
    Case(
        "low utilisation, not input-bound: smaller compute share",
        spec={"share": 1.0},
        tel={"util": 0.2},
        alloc={"share": 1.0},
        expect={AdviceKind.COMPUTE_OVERSIZED: 3.0},  # $4 -> 0.25 * $4
        suggestion={"compute_share": 0.25},
    ),
    Case(
        "checkpoint-heavy",
        tel={"checkpoint": 0.1},  # 0.1 of 0.5 s per step
        expect={AdviceKind.CHECKPOINT_HEAVY: 0.4},  # 20 % of $2/h
    ),
    Case(
        "idle: no step for an hour",
        tel={"last_step_at": NOW - 3600, "steps_per_s": 0.0},
        alloc={"granted_at": NOW - 7200},
        expect={AdviceKind.IDLE: 2.0},
    ),
    Case("no telemetry since a grant an hour ago: idle", tel=None, alloc={"granted_at": NOW - 3600},
         expect={AdviceKind.IDLE: 2.0}),
    Case("pending job: never idle", tel=None, alloc=None),
    Case(
        "low-priority job that checkpoints: use shared",
        spec={"priority": 0},
        tel={"checkpoint": 0.01},
        expect={AdviceKind.USE_SHARED: 1.0},
    ),
    Case("low priority, acked a checkpoint", spec={"priority": 0}, last_checkpoint_at=NOW - 60,
         expect={AdviceKind.USE_SHARED: 1.0}),
    Case("high priority job: keep its class", spec={"priority": 10}, tel={"checkpoint": 0.01}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_advice_rules(case: Case) -> None:
    s = spec("job", **case.spec)
    tel = None if case.tel is None else telemetry("job", **case.tel)
    allocs = [] if case.alloc is None else [alloc("job", **case.alloc)]
    items = advise(
        s,
        telemetry=tel,
        allocations=allocs,
        gpus_by_uuid=GPUS,
        prices=TABLE,
        now=NOW,
        offers=case.offers,
        last_checkpoint_at=case.last_checkpoint_at,
    )
    got = {a.kind: a.saving_usd_per_hour for a in items}
    assert got.keys() == case.expect.keys()
    for kind, saving in case.expect.items():
        assert got[kind] == pytest.approx(saving)
    for item in items:
        assert item.job == "job" and item.message
    if case.suggestion:
        merged = {k: v for a in items for k, v in a.suggestion.items()}
        for k, v in case.suggestion.items():
            assert merged[k] == v
    assert [a.saving_usd_per_hour for a in items] == sorted((a.saving_usd_per_hour for a in items), reverse=True)


def test_memory_message_carries_the_figures() -> None:
    [item] = advise(
        spec("job", memory="40GiB"),
        telemetry=telemetry("job", peak_gib=10),
        allocations=[alloc("job", memory_gib=40)],
        gpus_by_uuid=GPUS,
        prices=TABLE,
        now=NOW,
        offers=(A10,),
    )
    assert "memory='12GiB'" in item.message and "A10-24GB" in item.message and "$1.50/h" in item.message


def test_cheaper_model_must_have_the_features() -> None:
    items = advise(
        JobSpec(name="job", memory="40GiB", compute_share=0.5, features=("bf16",)),
        telemetry=telemetry("job", peak_gib=10),
        allocations=[alloc("job", memory_gib=40)],
        gpus_by_uuid=GPUS,
        prices=TABLE,
        now=NOW,
        offers=(T4, A10),
    )
    assert items[0].suggestion["gpu_model"] == "A10-24GB"  # T4 has no bf16


def test_suggested_memory_rounds_up_with_margin() -> None:
    assert suggested_memory(10 * GiB, AdviceSettings()) == 12 * GiB
    assert suggested_memory(10 * GiB + 1, AdviceSettings(memory_margin=0.0)) == 11 * GiB


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"low_util": 0.0}, "low_util"), ({"idle_after_s": -1}, "idle_after_s"), ({"compute_round": 2.0}, "compute_round")],
)
def test_settings_are_validated(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        AdviceSettings(**kwargs)


def test_cheaper_model_must_hold_the_compute_the_job_uses() -> None:
    fast = {"GPU-a0": gpu("GPU-a0", model="H100-80GB", memory_gib=80)}
    fast["GPU-a0"] = fast["GPU-a0"].__class__(**{**fast["GPU-a0"].__dict__, "tflops": {"bf16": 1000.0}})
    slow = ModelOffer("T4-16GB", 16 * GiB, 0.35, frozenset(), tflops=65.0)
    mid = ModelOffer("A100-40GB", 40 * GiB, 1.5, frozenset(), tflops=400.0)
    items = advise(
        spec("job", memory="40GiB"),
        telemetry=telemetry("job", peak_gib=10, util=0.25),  # uses 0.25 * 1.2 = 0.3 of 1000 TFLOPS = 300
        allocations=[alloc("job", memory_gib=40)],
        gpus_by_uuid=fast,
        prices=TABLE,
        now=NOW,
        offers=(slow, mid),
    )
    mem = next(a for a in items if a.kind is AdviceKind.MEMORY_OVERSIZED)
    # T4 cannot deliver 300 TFLOPS; A100-40GB needs a 0.75 share: 0.75 * $1.5 = $1.125 vs $2 now
    assert mem.suggestion["gpu_model"] == "A100-40GB"
    assert mem.saving_usd_per_hour == pytest.approx(2.0 - 1.125)
