"""GPU memory under a leased quota: the SDK's caching allocator (framework-free core).

Entry points:

* :class:`CachingAllocator`: the SDK's own caching allocator (C core, host or CUDA backend)
  with a hard quota and a balloon target.
* :func:`fragmentation`, :func:`round_size`: helpers the allocator and its reports share.

The torch and CuPy hookups (``install_torch_allocator``, ``install_cupy_allocator``), the balloon
controllers and the optimizer offload live in the ``gpupool-torch`` distribution
(``gpupool_torch.memory``): they are torch-specific and the core does not depend on torch.
See ``docs/memory.md``.
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk.memory.allocator import BlockInfo, CachingAllocator, fragmentation, round_size
from gpupool_sdk.memory.errors import (
    AllocatorClosedError,
    InstallError,
    InvalidPointerError,
    MemoryErrorBase,
    NativeBuildError,
)

__all__ = [
    "AllocatorClosedError",
    "BlockInfo",
    "CachingAllocator",
    "DeviceOutOfMemoryError",
    "InstallError",
    "InvalidPointerError",
    "MemoryErrorBase",
    "NativeBuildError",
    "QuotaExceededError",
    "fragmentation",
    "round_size",
]


def __getattr__(name: str) -> Any:
    # The OOM classes are built on first access so that importing this package does not import torch.
    if name in ("QuotaExceededError", "DeviceOutOfMemoryError"):
        from gpupool_sdk.memory import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
