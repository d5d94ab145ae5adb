"""Small builders of pool records shared by the telemetry tests."""

from __future__ import annotations

from gpupool_sdk.resources import (
    Allocation,
    GiB,
    GpuHealth,
    GpuInfo,
    GpuReadings,
    JobSpec,
    JobState,
    JobStatus,
    QoS,
)
from gpupool_sdk.telemetry.pricing import PriceTable
from gpupool_sdk.telemetry.summary import SliceTelemetry, TelemetrySummary

NOW = 1_800_000_000.0


#: what the agent reads on a real, busy GPU (GPU-a0 of :func:`populate`)
READINGS = {"temperature_c": 63.0, "power_w": 455.0, "utilization": 0.91, "memory_bandwidth_utilization": 0.47,
            "memory_used_bytes": 52 * GiB, "pcie_tx_bytes_per_s": 1.5 * GiB, "pcie_rx_bytes_per_s": 3 * GiB,
            "nvlink_tx_bytes_per_s": 120 * GiB, "nvlink_rx_bytes_per_s": 110 * GiB}


def gpu(uuid: str = "GPU-a0", node: str = "node-a", index: int = 0, model: str = "H100-80GB",
        memory_gib: int = 80, healthy: bool = True, readings: dict[str, float] | None = None) -> GpuInfo:
    """A GPU record; of ``readings`` it keeps temperature and power (the rest: :func:`usage_readings`)."""
    kept = {k: v for k, v in (readings or {}).items() if k in ("temperature_c", "power_w")}
    return GpuInfo(
        uuid=uuid, node=node, index=index, model=model, memory_bytes=memory_gib * GiB,
        health=GpuHealth(healthy=healthy, reasons=() if healthy else ("xid 79",), **kept),
    )


def usage_readings(readings: dict[str, float]) -> GpuReadings:
    """The value of ``readings/{node}/{gpu}`` for ``readings`` (temperature and power are the GPU record's)."""
    return GpuReadings(**{k: v for k, v in readings.items() if k not in ("temperature_c", "power_w")})


def alloc(job: str, gpu_uuid: str = "GPU-a0", memory_gib: float = 20, share: float = 0.5,
          mode: QoS = QoS.GUARANTEED, node: str = "node-a", granted_at: float = NOW - 600) -> Allocation:
    return Allocation(job=job, node=node, gpu_uuid=gpu_uuid, gpu_index=0, memory_bytes=int(memory_gib * GiB),
                      compute_share=share, mode=mode, term=1, granted_at=granted_at)


def spec(name: str, memory: str = "20GiB", share: float = 0.5, qos: str = "guaranteed", gpus: int = 1,
         priority: int = 5, owner: str = "team-a") -> JobSpec:
    return JobSpec(name=name, gpus=gpus, memory=memory if qos != "exclusive" else 0, compute_share=share,
                   qos=qos, priority=priority, owner=owner)


def status(state: JobState = JobState.GRANTED) -> JobStatus:
    return JobStatus(state=state, reason="", updated_at=NOW - 600, term=1)


def telemetry(job: str, *, data: float = 0.05, forward: float = 0.1, backward: float = 0.2,
              optimizer: float = 0.03, checkpoint: float = 0.0, other: float = 0.02,
              peak_gib: float | None = 15, util: float | None = 0.8, gpu_uuid: str = "GPU-a0",
              steps_per_s: float = 2.5, last_step_at: float | None = NOW - 1,
              published_at: float = NOW - 2) -> TelemetrySummary:
    peak = None if peak_gib is None else int(peak_gib * GiB)
    return TelemetrySummary.build(
        job,
        step=1234,
        steps_per_s=steps_per_s,
        window_s=30.0,
        phase_seconds={"data": data, "forward": forward, "backward": backward, "optimizer": optimizer,
                       "checkpoint": checkpoint, "other": other},
        memory_peak_by_phase={"backward": peak} if peak else None,
        slices=[SliceTelemetry(gpu_uuid, memory_used_bytes=peak, util=util, memory_peak_bytes=peak)],
        gpu_util=util,
        last_step_at=last_step_at,
        published_at=published_at,
    )


def prices(models: dict[str, float] | None = None, default: float | None = None) -> PriceTable:
    """A price table independent of the catalog and the environment (H100-80GB at $4/h by default)."""
    table = {"H100-80GB": 4.0} if models is None else models
    return PriceTable(overrides=table, default_per_hour_usd=default, catalog=lambda m: None)


def populate(store: object) -> None:
    """Write a small pool through the store: 2 GPUs, 3 jobs, usage, a leader and one bad value."""
    from gpupool_sdk.resources import LeaderRecord
    from gpupool_sdk.telemetry.usage import UsageRecord

    keys = store.keys  # type: ignore[attr-defined]
    put = store.put  # type: ignore[attr-defined]
    put(keys.gpu("node-a", "GPU-a0"), gpu("GPU-a0", "node-a", 0, readings=READINGS))
    put(keys.readings("node-a", "GPU-a0"), usage_readings(READINGS))
    put(keys.gpu("node-a", "GPU-a1"), gpu("GPU-a1", "node-a", 1, healthy=False))
    put(keys.cordon("GPU-a1"), {"by": "ops"})
    put(keys.leader(), LeaderRecord(id="coord-1", term=7, since=NOW - 3600))
    # bert: granted, oversized memory, healthy telemetry
    put(keys.job_spec("bert"), spec("bert", memory="40GiB", share=0.5, owner="nlp"))
    put(keys.job_status("bert"), status())
    put(keys.allocation("node-a", "GPU-a0", "bert"), alloc("bert", memory_gib=40, share=0.5))
    put(keys.telemetry("bert"), telemetry("bert", peak_gib=10))
    put(keys.usage("bert"), UsageRecord("bert", owner="nlp", gpu_seconds=7200.0, cost_usd=8.0, first_seen=NOW - 7200,
                                        last_seen=NOW))
    # loader: granted, input-bound, shared
    put(keys.job_spec("loader"), spec("loader", memory="20GiB", share=0.25, qos="shared", owner="cv"))
    put(keys.job_status("loader"), status())
    put(keys.allocation("node-a", "GPU-a0", "loader"), alloc("loader", memory_gib=20, share=0.25, mode=QoS.SHARED))
    put(keys.telemetry("loader"), telemetry("loader", data=0.6, util=0.2, peak_gib=18))
    # waiting: pending, nothing else
    put(keys.job_spec("waiting"), spec("waiting", owner="nlp"))
    put(keys.job_status("waiting"), status(JobState.PENDING))
    # finished: only usage left
    put(keys.usage("old-run"), UsageRecord("old-run", owner="cv", gpu_seconds=3600.0, cost_usd=3.0))
    # a hand-edited, malformed telemetry value
    put(keys.telemetry("broken"), b"{not json")
