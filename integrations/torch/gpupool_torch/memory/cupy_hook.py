"""Routes CuPy's device allocations through the SDK's process-global allocator.

CuPy and torch (in replace mode) then draw from the same :class:`CachingAllocator` per
device, so one quota covers both.
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk.memory.allocator import CachingAllocator, SizeLike
from gpupool_sdk.memory.errors import InstallError
from gpupool_torch.memory.torch_hook import global_allocator


class _Block:
    """Owns one allocation; CuPy keeps it alive as the owner of an ``UnownedMemory``."""

    __slots__ = ("alloc", "ptr")

    def __init__(self, alloc: CachingAllocator, ptr: int) -> None:
        self.alloc = alloc
        self.ptr = ptr

    def __del__(self) -> None:
        if not self.alloc.closed:
            self.alloc.free(self.ptr)


def cupy_malloc(size: int) -> Any:
    """A ``cupy.cuda.set_allocator`` function backed by the global allocator of the current device.

    Allocations are made on CuPy's current stream.
    """
    import cupy

    device = cupy.cuda.runtime.getDevice()
    alloc = global_allocator(device, create=False)
    stream = cupy.cuda.get_current_stream().ptr
    ptr = alloc.malloc(size, stream)
    mem = cupy.cuda.UnownedMemory(ptr, size, _Block(alloc, ptr), device)
    return cupy.cuda.MemoryPointer(mem, 0)


def install_cupy_allocator(
    quota: SizeLike | None = None, devices: list[int] | None = None
) -> CachingAllocator:
    """Makes CuPy allocate from the SDK's process-global allocator(s).

    Args:
        quota: quota for allocators created here (existing ones, e.g. from
            :func:`~gpupool_torch.memory.install_torch_allocator`, are shared as they are).
        devices: devices to prepare (default: every visible device).

    Returns:
        The allocator of the first device.

    Raises:
        InstallError: CuPy is not installed.

    Example:
        >>> from gpupool_torch.memory import install_cupy_allocator, install_torch_allocator   # doctest: +SKIP
        >>> alloc = install_torch_allocator(quota="20GiB")   # doctest: +SKIP
        >>> install_cupy_allocator() is alloc   # one quota for torch and CuPy   # doctest: +SKIP
        True
    """
    try:
        import cupy
    except ImportError as e:
        raise InstallError(
            "install_cupy_allocator needs CuPy: pip install 'gpupool-sdk[cuda]' (cupy-cuda12x)"
        ) from e
    if devices is None:
        devices = list(range(cupy.cuda.runtime.getDeviceCount()))
    if not devices:
        raise InstallError("install_cupy_allocator: no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    allocs = [global_allocator(d, quota=quota) for d in devices]
    cupy.cuda.set_allocator(cupy_malloc)
    return allocs[0]
