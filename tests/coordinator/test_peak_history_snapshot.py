"""The snapshot reads a job's window-peak history from its telemetry record (leniently)."""

from __future__ import annotations

from gpupool_sdk.coordinator.snapshot import _peak_history_from_telemetry


def test_history_is_read_from_the_summary_or_its_envelope() -> None:
    assert _peak_history_from_telemetry({"memory_peak_history": [1, 2, 3]}) == (1, 2, 3)
    assert _peak_history_from_telemetry({"job": "j", "summary": {"memory_peak_history": [4.0, 5]}}) == (4, 5)
    assert _peak_history_from_telemetry({"memory_peak_history": list(range(40))}) == tuple(range(8, 40))


def test_malformed_or_absent_history_reads_as_none() -> None:
    for body in (None, {}, {"memory_peak_history": "12"}, {"memory_peak_history": [1, -2]},
                 {"memory_peak_history": [1, True]}, {"memory_peak_history": [float("inf")]}):
        assert _peak_history_from_telemetry(body) == ()
