"""TelemetrySummary: the telemetry/{job} record (pure)."""

from __future__ import annotations

import enum
import json

import pytest

from gpupool_sdk.errors import SchemaError, SpecError
from gpupool_sdk.resources import GiB
from gpupool_sdk.store.codec import decode, encode
from gpupool_sdk.telemetry.summary import PHASES, SliceTelemetry, TelemetrySummary, fractions, phase_name

from ._data import telemetry


class FakePhase(enum.Enum):
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"


def test_round_trip_through_the_codec() -> None:
    t = telemetry("bert")
    back = decode("/p/telemetry/bert", encode(t), TelemetrySummary)
    assert back == t
    body = json.loads(encode(t))
    assert body["kind"] == "TelemetrySummary" and body["schema"] == 1
    assert set(body["phase_seconds"]) == set(PHASES)


def test_build_derives_fractions_peak_and_util() -> None:
    s = TelemetrySummary.build(
        "j",
        step=3,
        steps_per_s=1.0,
        window_s=10,
        phase_seconds={FakePhase.DATA: 1.0, FakePhase.FORWARD: 1.0, FakePhase.BACKWARD: 2.0},
        published_at=5.0,
        slices=[
            SliceTelemetry("GPU-1", memory_used_bytes=GiB, util=0.2, memory_peak_bytes=3 * GiB),
            SliceTelemetry("GPU-2", memory_used_bytes=GiB, util=0.6),
        ],
    )
    assert s.phase_fraction["backward"] == pytest.approx(0.5)
    assert s.phase_fraction["checkpoint"] == 0.0
    assert s.memory_peak_bytes == 3 * GiB
    assert s.gpu_util == pytest.approx(0.4)
    assert s.step_seconds == pytest.approx(4.0)
    assert s.dominant_phase() == "backward"


def test_from_dict_is_lenient_on_missing_optional_fields() -> None:
    s = TelemetrySummary.from_dict({"job": "j"})
    assert s.step == 0 and s.gpu_util is None and s.memory_peak_bytes is None and s.slices == ()
    assert s.phase_fraction == dict.fromkeys(PHASES, 0.0)
    assert s.dominant_phase() is None


def test_unknown_phases_and_fields_fold_into_other() -> None:
    s = TelemetrySummary.from_dict(
        {"job": "j", "phase_seconds": {"FORWARD": 1.0, "comm": 0.5, "other": 0.5}, "new_field": 1}
    )
    assert s.phase_seconds["forward"] == 1.0
    assert s.phase_seconds["other"] == 1.0
    assert phase_name(FakePhase.DATA) == "data"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"job": "j", "gpu_util": 62}, "gpu_util"),
        ({"job": "j", "steps_per_s": -1}, "steps_per_s"),
        ({"job": "j", "phase_seconds": {"data": "x"}}, "phase_seconds.data"),
        ({"job": "j", "slices": [{"util": 0.5}]}, "gpu_uuid"),
        ({"job": "j", "slices": [{"gpu_uuid": "G", "util": 3.0}]}, "util"),
        ({"step": 1}, "job"),
    ],
)
def test_bad_values_name_the_field(body: dict[str, object], field: str) -> None:
    raw = json.dumps({"schema": 1, "kind": "TelemetrySummary", **body})
    with pytest.raises(SchemaError, match=field):
        decode("/p/telemetry/j", raw, TelemetrySummary)


def test_constructor_rejects_percentages() -> None:
    with pytest.raises(SpecError, match="divide percentages by 100"):
        TelemetrySummary("j", gpu_util=55.0)


def test_fractions_of_nothing_are_zero() -> None:
    assert fractions({}) == dict.fromkeys(PHASES, 0.0)


def test_reads_the_store_envelope_too() -> None:
    from gpupool_sdk.store.records import TelemetryRecord

    t = telemetry("bert")
    wrapped = TelemetryRecord(job="bert", at=t.published_at, summary=t.to_dict())
    assert decode("/p/telemetry/bert", encode(wrapped), TelemetrySummary) == t
    bare = {k: v for k, v in t.to_dict().items() if k not in ("job", "published_at")}
    back = decode("/p/telemetry/bert", encode(TelemetryRecord(job="bert", at=7.0, summary=bare)), TelemetrySummary)
    assert back.job == "bert" and back.published_at == 7.0 and back.phase_seconds == t.phase_seconds


def test_from_phase_timer_with_a_real_timer_and_a_sampler() -> None:
    from gpupool_sdk.telemetry.phases import Phase, PhaseTimer
    from gpupool_sdk.telemetry.summary import from_phase_timer

    timer = PhaseTimer()
    for _ in range(3):
        timer.add(Phase.DATA, 0.1)
        timer.add(Phase.FORWARD, 0.3)
        timer.step_end()

    class Sampler:
        def slices(self) -> list[SliceTelemetry]:
            return [SliceTelemetry("GPU-1", memory_used_bytes=GiB, util=0.5, memory_peak_bytes=2 * GiB)]

    s = from_phase_timer("bert", 3, timer.summary(), published_at=9.0, sampler=Sampler())
    assert s.phase_fraction["data"] == pytest.approx(0.25)
    assert s.gpu_util == 0.5 and s.memory_peak_bytes == 2 * GiB and s.last_step_at == 9.0
    assert decode("/p/telemetry/bert", encode(s), TelemetrySummary) == s
