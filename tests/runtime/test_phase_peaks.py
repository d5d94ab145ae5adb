"""Per-phase memory peaks: read at the phase boundaries of one sampled step per window (pure, no torch)."""

from __future__ import annotations

from gpupool_sdk.memory import CachingAllocator
from gpupool_sdk.runtime.publisher import MemoryPeakMeter, TelemetryPublisher
from gpupool_sdk.telemetry.phases import PhaseTimer
from gpupool_sdk.telemetry.summary import PEAK_HISTORY_LEN, TelemetrySummary

MiB = 1 << 20


class AllocatorTier:
    """The part of gpupool_torch's AllocatorBalloonController the meter and the probe use."""

    kind = "gpupool"

    def __init__(self, alloc: CachingAllocator) -> None:
        self.allocator = alloc
        self.reads = 0

    def phase_peak_reader(self):  # type: ignore[no-untyped-def]
        def read() -> int:
            self.reads += 1
            peak = int(self.allocator.stats()["reserved_bytes.all.peak"])
            self.allocator.reset_peak_stats()
            return peak

        return read


class Lease:
    def __init__(self) -> None:
        self.published: list[dict] = []

    def publish_telemetry(self, summary: dict) -> None:
        self.published.append(summary)


def test_phase_peaks_of_a_sampled_step_and_the_window_history() -> None:
    alloc = CachingAllocator("host", quota="1GiB")
    tier = AllocatorTier(alloc)
    meter = MemoryPeakMeter(None, lambda: tier)
    pub = TelemetryPublisher("job", PhaseTimer(), meter, interval_s=60.0)
    probe, lease = pub.phase_probe, Lease()

    def step(sampled: bool, act: int) -> None:
        # data: nothing new; forward: activations; backward: activations + gradients; optimizer: frees them
        keep = alloc.malloc(4 * MiB)
        if sampled:
            probe.phase_end("data")
        acts = alloc.malloc(act)
        if sampled:
            probe.phase_end("forward")
        grads = alloc.malloc(30 * MiB)
        if sampled:
            probe.phase_end("backward")
        alloc.free(acts)
        alloc.free(grads)
        alloc.trim()
        alloc.free(keep)
        if sampled:
            probe.step_end()

    assert not probe.armed
    pub.maybe_publish(lease, 1, now=0.0)  # first window: nothing measured yet; the next step is sampled
    assert probe.armed and lease.published[-1]["memory_peak_by_phase"] == {}
    step(sampled=probe.armed, act=24 * MiB)
    assert not probe.armed and tier.reads == 5  # arm + 4 phase boundaries, nothing per allocation
    step(sampled=probe.armed, act=60 * MiB)  # an unsampled step with a higher peak
    assert tier.reads == 5
    pub.maybe_publish(lease, 3, now=61.0)
    summary = TelemetrySummary.from_dict(lease.published[-1])
    # 4 MiB kept: a 20 MiB segment; activations 24 MiB and gradients 30 MiB: segments of their own
    assert summary.memory_peak_by_phase == {"data": 20 * MiB, "forward": 44 * MiB, "backward": 74 * MiB,
                                            "optimizer": 74 * MiB}
    # the window's peak still covers the unsampled step (the probe's resets do not lose it)
    assert summary.memory_peak_bytes == 20 * MiB + 60 * MiB + 30 * MiB
    assert summary.memory_peak_history == (summary.memory_peak_bytes,)
    for i in range(PEAK_HISTORY_LEN + 3):
        step(sampled=probe.armed, act=(i % 4 + 1) * 2 * MiB)
        pub.maybe_publish(lease, 4 + i, now=122.0 + 61 * i)
    hist = TelemetrySummary.from_dict(lease.published[-1]).memory_peak_history
    assert len(hist) == PEAK_HISTORY_LEN and hist[-1] == lease.published[-1]["memory_peak_bytes"]
    alloc.close()


def test_prometheus_exports_the_phase_peaks() -> None:
    from gpupool_sdk.telemetry.prometheus import JobMetrics

    summary = TelemetrySummary.build("j", step=1, steps_per_s=1.0, window_s=1.0, phase_seconds={},
                                     published_at=0.0, memory_peak_by_phase={"forward": 5, "backward": 9})
    from prometheus_client import generate_latest

    metrics = JobMetrics()
    metrics.update(summary)
    text = generate_latest(metrics.registry).decode()
    assert 'gpupool_job_phase_memory_peak_bytes{job_name="j",phase="backward"} 9.0' in text
