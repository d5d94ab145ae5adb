"""A job's measured GPU utilisation reaches ``JobView.gpu_util`` from its telemetry summary
(what colocation-aware placement reads; ``SchedulerConfig.colocation_aware``)."""

from __future__ import annotations

from coordinator.kvkit import KS, NOW, Items, pool_items
from gpupool_sdk.coordinator.snapshot import build_state
from gpupool_sdk.resources import JobSpec
from gpupool_sdk.telemetry.summary import TelemetrySummary


def _pool_with_job() -> Items:
    it = pool_items("node-a:2xT4-16GB:pcie", leader=True)
    it.put(KS.job_spec("a"), JobSpec(name="a", gpus=1, memory="1GiB", qos="shared"), lease=0xA)
    return it


def _util(it: Items) -> float | None:
    return build_state(it.kvs, KS, NOW).snapshot.jobs["a"].gpu_util


def test_no_telemetry_means_unknown() -> None:
    assert _util(_pool_with_job()) is None


def test_summary_gpu_util_is_read() -> None:
    it = _pool_with_job()
    it.put(KS.telemetry("a"), {"job": "a", "at": 1.0, "summary": {"gpu_util": 0.62}}, lease=0xA)
    assert _util(it) == 0.62


def test_a_published_summary_round_trips() -> None:
    it = _pool_with_job()
    it.put(KS.telemetry("a"), TelemetrySummary.build(
        "a", step=10, steps_per_s=2.0, window_s=5.0, phase_seconds={}, published_at=1.0, gpu_util=0.3), lease=0xA)
    assert _util(it) == 0.3


def test_null_or_out_of_range_reads_as_unknown() -> None:
    for bad in (None, 1.5, -0.1, True, "0.5"):
        it = _pool_with_job()
        it.put(KS.telemetry("a"), {"job": "a", "at": 1.0, "summary": {"gpu_util": bad}}, lease=0xA)
        assert _util(it) is None, bad
