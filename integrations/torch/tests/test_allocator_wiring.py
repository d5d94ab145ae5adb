"""``allocator="gpupool"`` on a CPU: the install path through a fake libcudart (tests/memory/fake_cudart.c).

What a CPU cannot give is replaced at the narrowest point: ``torch.cuda`` says a GPU is there
and not initialised, ``CUDAPluggableAllocator`` / ``change_current_allocator`` record the swap,
and the SDK allocator's CUDA backend dlopens a fake libcudart that serves host memory and
records the device each ``cudaMalloc`` ran on. The C entry points torch would call
(``gpupool_torch_malloc``) are called directly through ctypes.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from testkit import build_fake_cudart  # noqa: E402

from gpupool_sdk.errors import ConfigError  # noqa: E402
from gpupool_sdk.memory import InstallError, QuotaExceededError, _native  # noqa: E402
from gpupool_torch.memory import install_pool_allocator, prepare_job_memory, rank_device, torch_hook  # noqa: E402
from gpupool_torch.memory.balloon import AllocatorBalloonController  # noqa: E402
from gpupool_torch.session import memory_tier  # noqa: E402

MiB = 1 << 20
FAKE_SOURCE = Path(__file__).resolve().parents[3] / "tests" / "memory" / "fake_cudart.c"


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    return build_fake_cudart(tmp_path_factory)  # type: ignore[no-any-return]


class Swap:
    """Stands in for ``CUDAPluggableAllocator`` and records ``change_current_allocator``."""

    made: list[tuple[str, str, str]] = []

    def __init__(self, path: str, malloc: str, free: str) -> None:
        self.args = (path, malloc, free)
        Swap.made.append(self.args)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, fake_cudart: tuple[str, ctypes.CDLL]) -> Iterator[dict[str, Any]]:
    """A machine with two visible 'GPUs' (the fake libcudart), CUDA not initialised, rank 1 of 2."""
    path, lib = fake_cudart
    lib.fake_set_limit(-1)
    monkeypatch.setenv("GPUPOOL_CUDART_PATH", path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    swapped: list[Any] = []
    Swap.made = []
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", Swap)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", swapped.append)
    monkeypatch.setitem(sys.modules, "cupy", None)  # no CuPy unless a test brings one
    torch_hook._reset_for_tests()
    yield {"lib": lib, "swapped": swapped}
    torch_hook._reset_for_tests()
    assert lib.fake_in_use() == 0  # every segment went back through cudaFree


def torch_entry_points() -> tuple[Any, Any]:
    lib = _native.load()
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        ("gpupool_torch_malloc", lib)
    )
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(
        ("gpupool_torch_free", lib)
    )
    return malloc, free


def test_rank_device_follows_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device(visible=4) == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(visible=4) == 3
    assert rank_device(visible=1) == 0  # the launcher gave each rank its own single GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    assert rank_device() == 3
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        rank_device(visible=4)


def test_gpupool_allocator_is_installed_on_the_ranks_device(fake_gpu: dict[str, Any]) -> None:
    lib = fake_gpu["lib"]
    alloc = prepare_job_memory("gpupool", 64 * MiB)
    assert alloc is not None and alloc.backend == "cuda" and alloc.device == 1 and alloc.quota == 64 * MiB
    # torch's allocator was swapped once, for the SDK library's entry points
    assert len(fake_gpu["swapped"]) == 1
    assert Swap.made == [(str(_native.library_path()), "gpupool_torch_malloc", "gpupool_torch_free")]
    assert torch_hook.installed_devices() == [1] and torch_hook.torch_allocator_installed()
    # what torch's pluggable allocator calls lands in cudaMalloc on device 1
    malloc, free = torch_entry_points()
    p = malloc(3 * MiB, 1, None)
    assert p and lib.fake_last_malloc_device() == 1 and lib.fake_in_use() == 20 * MiB
    assert malloc(1024, 0, None) is None  # device 0 belongs to another rank: not served here
    assert malloc(80 * MiB, 1, None) is None  # the leased quota holds
    free(p, 3 * MiB, 1, None)
    # the balloon controller works on the same allocator and device
    ctl = memory_tier("gpupool", 64 * MiB)
    assert isinstance(ctl, AllocatorBalloonController) and ctl.device == 1 and ctl.allocator is alloc
    res = ctl.inflate(8 * MiB)
    assert res.ok and res.reached_bytes == 0 and lib.fake_in_use() == 0


def test_other_allocator_options_install_nothing(fake_gpu: dict[str, Any]) -> None:
    for kind in ("torch", "none"):
        assert prepare_job_memory(kind, 64 * MiB) is None
    assert fake_gpu["swapped"] == [] and torch_hook.installed_devices() == []


def test_without_cuda_the_gpupool_option_balloons_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch_hook._reset_for_tests()
    assert install_pool_allocator(64 * MiB) is None
    ctl = memory_tier("gpupool", 64 * MiB)
    assert ctl.kind == "host" and ctl.quota_bytes == 64 * MiB


def test_install_after_cuda_started_is_a_clear_error(
    fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(InstallError, match="before CUDA initialises"):
        prepare_job_memory("gpupool", 64 * MiB)


class FakeCupy(types.ModuleType):
    """The few ``cupy.cuda`` names the CuPy hook uses; memory objects just hold what they are given."""

    def __init__(self, device: int) -> None:
        super().__init__("cupy")
        self.allocator: Any = None
        runtime = types.SimpleNamespace(getDeviceCount=lambda: 2, getDevice=lambda: device)
        stream = types.SimpleNamespace(ptr=0)

        def set_allocator(fn: Any) -> None:
            self.allocator = fn

        self.cuda = types.SimpleNamespace(
            runtime=runtime,
            set_allocator=set_allocator,
            get_current_stream=lambda: stream,
            UnownedMemory=lambda ptr, size, owner, dev: types.SimpleNamespace(ptr=ptr, size=size, owner=owner),
            MemoryPointer=lambda mem, offset: types.SimpleNamespace(mem=mem, ptr=mem.ptr + offset),
        )


def test_torch_and_cupy_share_one_quota(fake_gpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = FakeCupy(device=1)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    alloc = prepare_job_memory("gpupool", 32 * MiB)
    assert cupy.allocator is not None  # CuPy routed through the SDK too
    malloc, free = torch_entry_points()
    p = malloc(3 * MiB, 1, None)  # torch: one 20 MiB segment of the 32 MiB quota
    assert p
    with pytest.raises(QuotaExceededError):
        cupy.allocator(18 * MiB)  # CuPy would need a second (18 MiB) segment: the same quota says no
    block = cupy.allocator(2 * MiB)  # served from the free part of torch's segment
    assert alloc.stats()["allocation.all.current"] == 2 and alloc.stats()["segment.all.current"] == 1
    del block
    free(p, 3 * MiB, 1, None)
    assert alloc.stats()["allocation.all.current"] == 0
