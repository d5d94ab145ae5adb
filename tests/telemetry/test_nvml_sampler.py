"""NvmlSampler against a fake pynvml module (CPU), and against the real NVML on a GPU."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from testkit import wait_for

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import GiB
from gpupool_sdk.telemetry.nvml_sampler import NvmlSampler

OUR_PID = 4242


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):  # noqa: N801 - the pynvml name
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    pass


class FakeNvml:
    """The subset of pynvml the sampler uses, with scripted readings."""

    NVMLError = NVMLError
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, gpus: dict[str, dict[str, Any]], fail_init: bool = False) -> None:
        self.gpus = gpus
        self.fail_init = fail_init
        self.inited = 0
        self.shutdowns = 0
        self.sampled = threading.Event()
        self.proc_util_calls: list[tuple[str, int]] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise NVMLError("NVML Shared Library Not Found")
        self.inited += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return list(self.gpus)[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.gpus:
            raise NVMLError_NotFound(uuid)
        return uuid

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return h.encode()

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        self.sampled.set()
        return SimpleNamespace(gpu=self.gpus[h]["util"], memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        g = self.gpus[h]
        return SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self.gpus[h]["procs"].items()]

    def nvmlDeviceGetProcessUtilization(self, h: str, last: int) -> list[Any]:
        self.proc_util_calls.append((h, last))
        rows = self.gpus[h].get("proc_util")
        if rows is None:
            raise NVMLError_NotSupported("per-process utilisation")
        rows = [r for r in rows if r[1] > last]
        if not rows:
            raise NVMLError_NotFound("no samples")
        return [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=0) for pid, ts, sm in rows]


def _gpus() -> dict[str, dict[str, Any]]:
    return {
        "GPU-0": {
            "util": 90,
            "used": 30 * GiB,
            "total": 80 * GiB,
            "procs": {OUR_PID: 12 * GiB, 999: 18 * GiB},
            "proc_util": [(OUR_PID, 100, 35), (OUR_PID, 200, 45), (999, 200, 40)],
        },
        "GPU-1": {"util": 20, "used": 4 * GiB, "total": 80 * GiB, "procs": {999: 4 * GiB}, "proc_util": None},
    }


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_samples_per_process_memory_and_util() -> None:
    nv = FakeNvml(_gpus())
    s = NvmlSampler(["GPU-0", "GPU-1"], pids=[OUR_PID], nvml=nv, interval_s=1, window_s=10, clock=Clock())
    snap = s.sample_once()
    assert snap is not None
    g0, g1 = snap.gpus
    assert (g0.util, g0.process_memory_bytes, g0.process_util) == (0.9, 12 * GiB, 0.45)
    assert g0.job_memory_bytes == 12 * GiB
    # GPU-1: none of our processes, per-process util unsupported: fall back to the device's figures
    assert (g1.process_memory_bytes, g1.process_util) == (None, None)
    assert (g1.job_util, g1.job_memory_bytes) == (0.2, 4 * GiB)
    # The next read asks only for samples newer than the last one seen
    s.sample_once()
    assert nv.proc_util_calls == [("GPU-0", 0), ("GPU-1", 0), ("GPU-0", 200)]  # GPU-1: unsupported, not asked again


def test_window_mean_util_and_peak_memory() -> None:
    nv = FakeNvml(_gpus())
    clock = Clock()
    s = NvmlSampler(["GPU-0"], pids=[OUR_PID], nvml=nv, interval_s=1, window_s=10, clock=clock)
    s.sample_once()  # util 0.45 (latest sample), 12 GiB
    nv.gpus["GPU-0"]["procs"][OUR_PID] = 20 * GiB
    nv.gpus["GPU-0"]["proc_util"].append((OUR_PID, 300, 15))
    clock.t = 5.0
    s.sample_once()  # util 0.15, 20 GiB
    nv.gpus["GPU-0"]["procs"][OUR_PID] = 8 * GiB
    clock.t = 12.0
    s.sample_once()  # no new per-process sample: falls back to device util 0.9; first sample leaves the window
    [slice_] = s.slices()
    assert slice_.memory_used_bytes == 8 * GiB
    assert slice_.memory_peak_bytes == 20 * GiB
    assert slice_.util == pytest.approx((0.15 + 0.9) / 2)
    assert s.gpu_util() == pytest.approx((0.15 + 0.9) / 2)
    assert s.memory_peak_bytes() == 20 * GiB
    assert len(s.window()) == 2


def test_without_nvml_everything_is_unknown() -> None:
    nv = FakeNvml({}, fail_init=True)
    s = NvmlSampler(nvml=nv).start()
    try:
        assert not s.available
        assert s.sample_once() is None
        assert s.slices() == [] and s.gpu_util() is None and s.memory_peak_bytes() is None
        assert s.last_error is not None and "NVML" in s.last_error
    finally:
        s.stop()


def test_unknown_gpu_uuid_makes_the_sampler_unavailable() -> None:
    nv = FakeNvml(_gpus())
    s = NvmlSampler(["GPU-missing"], nvml=nv)
    assert s.open() is False
    assert nv.shutdowns == 1


def test_watches_every_gpu_when_none_named() -> None:
    nv = FakeNvml(_gpus())
    s = NvmlSampler(nvml=nv, pids=[OUR_PID])
    snap = s.sample_once()
    assert snap is not None and [g.uuid for g in snap.gpus] == ["GPU-0", "GPU-1"]


def test_background_thread_samples_and_stops() -> None:
    nv = FakeNvml(_gpus())
    with NvmlSampler(["GPU-0"], pids=[OUR_PID], nvml=nv, interval_s=0.01, window_s=1) as s:
        assert nv.sampled.wait(30), "the sampler thread never sampled"
        # The fake signals from inside a read; the sample is stored when the read returns.
        wait_for(lambda: s.latest() is not None, 30, "the sampler to store its first sample")
        assert s.latest() is not None
    assert nv.shutdowns == 1 and not s.available


def test_a_failing_read_does_not_kill_the_thread() -> None:
    nv = FakeNvml(_gpus())
    calls = {"n": 0}
    recovered = threading.Event()

    def flaky(h: str) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("driver hiccup")
        recovered.set()
        return SimpleNamespace(used=1, total=2, free=1)

    nv.nvmlDeviceGetMemoryInfo = flaky  # type: ignore[method-assign]
    with NvmlSampler(["GPU-0"], nvml=nv, interval_s=0.01, window_s=1) as s:
        assert recovered.wait(30)
    assert s.errors >= 1 and "hiccup" in (s.last_error or "")


@pytest.mark.parametrize(("kwargs", "field"), [({"interval_s": 0}, "interval_s"), ({"window_s": 0.5}, "window_s")])
def test_bad_settings_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        NvmlSampler(**kwargs)


@pytest.mark.gpu
def test_real_nvml_sees_this_process_on_the_gpu() -> None:
    import torch

    x = torch.ones(64 * 1024 * 1024, device="cuda")  # 256 MiB held by this process
    for _ in range(20):
        x = x * 1.0001
    torch.cuda.synchronize()
    s = NvmlSampler(interval_s=0.5, window_s=5)
    try:
        snap = s.sample_once()
        assert snap is not None and s.available
        assert all(g.memory_total_bytes > 0 for g in snap.gpus)
        ours = [g for g in snap.gpus if g.process_memory_bytes]
        # In a container NVML may not map our PID; then the device totals must still be there.
        if ours:
            assert ours[0].process_memory_bytes >= 256 * 1024 * 1024
        assert all(sl.memory_used_bytes is not None for sl in s.slices())
    finally:
        s.stop()
        del x
