"""What the runtime publishes on ``telemetry/{job}``: the memory peak, the user's hook, NVML, the exporter.

Fake lease, real Lightning trainer on the CPU (host memory tier); the pool end to end is in
``tests/scenarios/test_balloon_training.py``.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_lightning import GpuPoolCallback
from gpupool_sdk.coordinator.snapshot import _peak_from_telemetry
from gpupool_sdk.errors import ConfigError
from gpupool_sdk.runtime import Decision, DecisionKind, PoolRuntime, RuntimeOptions
from gpupool_sdk.telemetry.summary import SliceTelemetry, TelemetrySummary
from gpupool_torch.session import memory_tier
from integrations.lightning.tests.test_callback_logic import FakeClient, FakeLease, fit


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def trained_adam() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    return opt


def runtime(name: str, **kw: Any) -> tuple[PoolRuntime, FakeLease]:
    lease = FakeLease(name)
    rt = PoolRuntime(RuntimeOptions.from_kwargs(memory="1GiB", name=name, **kw), client=FakeClient(lease),
                     memory_tier=memory_tier)
    rt.acquire()
    return rt, lease


def test_cpu_job_publishes_its_footprint_as_the_peak_before_any_balloon(tmp_path: Path) -> None:
    lease = FakeLease("peak")
    pool = GpuPoolCallback(memory="1GiB", name="peak", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           telemetry_interval_s=0.001)
    trainer, _ = fit(pool, tmp_path, epochs=1)
    assert lease.telemetry and not lease.acks  # published, never ballooned
    expected = state_bytes(trainer.optimizers[0])  # SGD momentum: the host tier's footprint
    assert expected > 0
    peaks = [s["memory_peak_bytes"] for s in lease.telemetry]
    assert peaks == [expected] * len(peaks), peaks
    # The coordinator and the readers see it.
    assert _peak_from_telemetry({"job": "peak", "at": 0.0, "summary": lease.telemetry[0]}) == expected
    assert TelemetrySummary.from_dict(lease.telemetry[-1]).memory_peak_bytes == expected


def test_hook_value_replaces_the_measured_peak_and_is_called_only_at_publishes(tmp_path: Path) -> None:
    lease = FakeLease("hook")
    calls: list[int] = []

    def peak() -> int:
        calls.append(1)
        return 12345

    pool = GpuPoolCallback(memory="1GiB", name="hook", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           telemetry_interval_s=0.001, memory_peak_fn=peak)
    trainer, _ = fit(pool, tmp_path, epochs=1)
    assert trainer.global_step == 8
    assert len(calls) == len(lease.telemetry) > 0  # no per-step calls
    assert {s["memory_peak_bytes"] for s in lease.telemetry} == {12345}
    # The rest of the summary is still the callback's own.
    assert all(s["job"] == "hook" and s["phase_seconds"] for s in lease.telemetry)


def test_reported_peaks_take_the_largest_of_the_window_and_a_none_hook_leaves_the_measure() -> None:
    hook_values: list[int | None] = [None, 100, None]
    rt, _ = runtime("rep", memory_peak_fn=lambda: hook_values.pop(0))
    opt = trained_adam()
    rt.start_training([opt])
    rt.report_memory_peak(7)
    rt.report_memory_peak(9)
    rt.report_memory_peak(8)
    assert rt.publisher.build(1).memory_peak_bytes == 9  # the hook said None; reports win
    assert rt.publisher.build(2).memory_peak_bytes == 100  # the hook's figure
    assert rt.publisher.build(3).memory_peak_bytes == state_bytes(opt)  # nothing reported: measured
    rt.close()


def test_nothing_is_published_as_zero_when_unmeasured(tmp_path: Path) -> None:
    lease = FakeLease("none")
    pool = GpuPoolCallback(memory="1GiB", name="none", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           telemetry_interval_s=0.001, allocator="none")
    fit(pool, tmp_path, epochs=1)
    assert lease.telemetry
    for s in lease.telemetry:
        assert s["memory_peak_bytes"] is None and s["gpu_util"] is None and s["slices"] == []
        assert _peak_from_telemetry(s) is None
    # A hook that reports 0 is not taken for a measure either.
    rt, _ = runtime("zero", allocator="none", memory_peak_fn=lambda: 0)
    rt.start_training()
    assert rt.publisher.build(1).memory_peak_bytes is None
    rt.close()


def test_balloon_window_keeps_the_footprint_before_the_inflate_then_none_once_all_is_offloaded() -> None:
    rt, lease = runtime("bal")
    opt = trained_adam()
    rt.start_training([opt])
    full = state_bytes(opt)
    rt.balloon(Decision(kind=DecisionKind.BALLOON, seq=1, target={"memory_bytes": 0}), step=1)
    assert lease.acks[-1]["ok"] and lease.acks[-1]["reached_bytes"] == 0
    assert rt.publisher.build(1).memory_peak_bytes == full  # the peak of the window, not the 0 after it
    assert rt.publisher.build(2).memory_peak_bytes is None  # everything offloaded: nothing measured
    rt.balloon(Decision(kind=DecisionKind.DEFLATE, seq=2), step=2)
    assert rt.publisher.build(3).memory_peak_bytes == full
    rt.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"memory_peak_fn": 5}, "memory_peak_fn"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"metrics_port": "9100"}, "metrics_port"),
    ],
)
def test_bad_telemetry_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GpuPoolCallback(memory="1GiB", client=FakeClient(FakeLease("x")), **kwargs)
    assert exc.value.field == field


@pytest.mark.parametrize("value", [-1, 1.5, True, "1GiB"])
def test_report_memory_peak_refuses_what_is_not_bytes(value: Any) -> None:
    rt, _ = runtime("bad")
    with pytest.raises(ConfigError) as exc:
        rt.report_memory_peak(value)
    assert exc.value.field == "peak_bytes"
    rt.close()


def test_a_failing_or_wrong_hook_never_stops_publishing() -> None:
    def boom() -> int:
        raise RuntimeError("broken hook")

    for fn in (boom, lambda: -5):
        rt, lease = runtime("boom", allocator="none", memory_peak_fn=fn)
        assert rt.publisher.maybe_publish(rt.lease, 1, now=1.0)
        assert lease.telemetry[-1]["memory_peak_bytes"] is None
        rt.close()


def test_job_metrics_exporter_serves_the_published_summary_and_stops_at_teardown() -> None:
    rt, _ = runtime("metrics", metrics_port=0)
    rt.report_memory_peak(4096)
    rt.start_training()
    server = rt.publisher._server
    assert server is not None
    assert rt.publisher.maybe_publish(rt.lease, 3, now=1.0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode()
    assert 'gpupool_job_memory_peak_bytes{job_name="metrics"} 4096.0' in body
    assert 'gpupool_job_step{job_name="metrics"} 3.0' in body
    rt.stop_training()
    assert rt.publisher._server is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)
    rt.close()


class FakeSampler:
    instances: list[FakeSampler] = []

    def __init__(self, gpu_uuids: list[str]) -> None:
        self.gpu_uuids = gpu_uuids
        self.available = True
        self.stopped = False
        FakeSampler.instances.append(self)

    def start(self) -> FakeSampler:
        return self

    def stop(self) -> None:
        self.stopped = True

    def slices(self) -> list[SliceTelemetry]:
        return [SliceTelemetry(gpu_uuid=u, memory_used_bytes=2048, util=0.5, memory_peak_bytes=3072)
                for u in self.gpu_uuids]


class Alloc:
    def __init__(self, uuid: str) -> None:
        self.gpu_uuid = uuid
        self.gpu_index = 0


def test_nvml_sampler_watches_the_leased_gpus_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpupool_sdk.telemetry.nvml_sampler as nvml_sampler

    monkeypatch.setattr(nvml_sampler, "NvmlSampler", FakeSampler)
    monkeypatch.setattr(PoolRuntime, "accelerator", property(lambda self: "gpu"))
    FakeSampler.instances.clear()
    rt, lease = runtime("nvml", allocator="none")
    lease.allocations = [Alloc("GPU-a")]  # type: ignore[attr-defined]
    rt.start_training()
    (sampler,) = FakeSampler.instances
    assert sampler.gpu_uuids == ["GPU-a"]
    assert rt.publisher.maybe_publish(rt.lease, 1, now=1.0)
    s = lease.telemetry[-1]
    assert s["gpu_util"] == 0.5 and s["slices"][0]["gpu_uuid"] == "GPU-a"
    assert s["memory_peak_bytes"] == 3072  # no allocator figure: NVML's
    rt.close()
    assert sampler.stopped


def test_no_sampler_without_nvml_or_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, lease = runtime("cpu", allocator="none")
    lease.allocations = [Alloc("GPU-a")]  # type: ignore[attr-defined]
    rt.start_training()
    assert rt.publisher.sampler is None  # the CPU: never sampled
    rt.close()
    monkeypatch.setattr(PoolRuntime, "accelerator", property(lambda self: "gpu"))
    rt, lease = runtime("gpu-no-nvml", allocator="none")
    lease.allocations = [Alloc("GPU-a")]  # type: ignore[attr-defined]
    rt.start_training()  # no pynvml here (or a fake GPU): skipped cleanly
    assert rt.publisher.sampler is None
    assert rt.publisher.maybe_publish(rt.lease, 1, now=1.0) and lease.telemetry[-1]["gpu_util"] is None
    rt.close()


class FakeCuda:
    """``torch.cuda`` as the torch tier's peak reads it (no GPU needed)."""

    def __init__(self) -> None:
        self.reserved = 0
        self.max_reserved = 0
        self.resets = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_reserved(self) -> int:
        return self.max_reserved

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1


def test_torch_tier_peak_is_windowed_without_resetting_the_users_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    rt, _ = runtime("torchpeak", allocator="none")
    cuda = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    cuda.reserved, cuda.max_reserved = 600, 1000
    assert rt.meter.take() == 1000  # the lifetime peak rose in this window: it is the window's
    cuda.reserved = 500
    assert rt.meter.take() == 500  # no new peak: what is reserved now
    cuda.max_reserved = 1200
    assert rt.meter.take() == 1200
    cuda.reserved = 0
    assert rt.meter.take() is None  # cache emptied, nothing held: unknown, never 0
    assert cuda.resets == 0
    monkeypatch.undo()
    rt.close()
