"""The CUDA backend on a CPU: dlopen of a fake libcudart built from ``fake_cudart.c``.

Exercises what the GPU tests cannot on a CPU-only machine: symbol resolution, device
switching around cudaMalloc, events recorded on free and queried on malloc, cudaMalloc
failures reported as DeviceOutOfMemoryError, and segments returned with cudaFree.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
from testkit import build_fake_cudart  # noqa: E402

from gpupool_sdk.memory import CachingAllocator, DeviceOutOfMemoryError, NativeBuildError, QuotaExceededError

MiB = 1 << 20
SOURCE = Path(__file__).with_name("fake_cudart.c")


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ctypes.CDLL]:
    return build_fake_cudart(tmp_path_factory)  # type: ignore[no-any-return]


@pytest.fixture
def cuda(fake_cudart: tuple[str, ctypes.CDLL]) -> Iterator[tuple[CachingAllocator, ctypes.CDLL]]:
    path, lib = fake_cudart
    lib.fake_set_limit(-1)
    alloc = CachingAllocator(backend="cuda", quota="256MiB", device=1, cudart_path=path)
    yield alloc, lib
    alloc.close()
    assert lib.fake_in_use() == 0  # close() returned every segment with cudaFree


def test_segments_come_from_cuda_malloc_on_the_right_device(
    cuda: tuple[CachingAllocator, ctypes.CDLL],
) -> None:
    alloc, lib = cuda
    calls = lib.fake_set_device_calls()
    p = alloc.malloc(3 * MiB)
    assert lib.fake_in_use() == 20 * MiB
    assert lib.fake_set_device_calls() == calls + 2  # switched to device 1 and back
    assert lib.fake_device() == 0
    alloc.free(p)
    assert alloc.trim() == 20 * MiB and lib.fake_in_use() == 0
    st = alloc.stats()
    assert st["num_device_alloc"] == 1 and st["num_device_free"] == 1


def test_record_stream_waits_for_the_cuda_event(cuda: tuple[CachingAllocator, ctypes.CDLL]) -> None:
    alloc, lib = cuda
    p = alloc.malloc(4096, stream=0)
    alloc.record_stream(p, 0xBEEF)
    alloc.free(p)
    assert lib.fake_live_events() == 1 and alloc.stats()["gpupool.pending_blocks"] == 1
    q = alloc.malloc(4096, stream=0)
    assert q != p  # the event has not completed
    alloc.synchronize(0xBEEF)  # cudaStreamSynchronize completes it
    assert lib.fake_live_events() == 0 and alloc.stats()["gpupool.pending_blocks"] == 0
    assert alloc.malloc(4096, stream=0) == p
    alloc.free(q)


def test_trim_waits_for_pending_events(cuda: tuple[CachingAllocator, ctypes.CDLL]) -> None:
    alloc, lib = cuda
    p = alloc.malloc(4096)
    alloc.record_stream(p, 7)
    alloc.free(p)
    assert alloc.trim() == 2 * MiB  # cudaEventSynchronize, then cudaFree
    assert lib.fake_live_events() == 0 and lib.fake_in_use() == 0


def test_cuda_malloc_failure_is_a_device_oom(cuda: tuple[CachingAllocator, ctypes.CDLL]) -> None:
    alloc, lib = cuda
    lib.fake_set_limit(30 * MiB)
    keep = alloc.malloc(5 * MiB)  # 20 MiB segment
    with pytest.raises(DeviceOutOfMemoryError, match="backend could not"):
        alloc.malloc(18 * MiB)  # the quota allows it, the "device" does not
    with pytest.raises(QuotaExceededError):
        alloc.malloc(300 * MiB)
    alloc.free(keep)


def test_missing_cudart_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NativeBuildError, match="GPUPOOL_CUDART_PATH"):
        CachingAllocator(backend="cuda", cudart_path=str(tmp_path / "libcudart.so.404"))
