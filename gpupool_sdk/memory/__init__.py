"""GPU memory under a leased quota: a caching allocator, ballooning and optimizer offload.

Entry points:

* :class:`CachingAllocator`: the SDK's own caching allocator (C core, host or CUDA backend)
  with a hard quota and a balloon target.
* :func:`make_balloon_controller`: the :class:`BalloonController` for a tier (``"torch"``,
  the default; ``"gpupool"``; ``"host"``) that inflates and deflates the job's balloon.
* :class:`OptimizerOffloader`: moves optimizer state to pinned host memory and back.
* :func:`install_torch_allocator` / :func:`install_cupy_allocator`: route torch and CuPy
  through one process-global allocator (one quota for both).

See ``docs/memory.md``.
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk.memory.allocator import BlockInfo, CachingAllocator, fragmentation, round_size
from gpupool_sdk.memory.balloon import (
    AllocatorBalloonController,
    BalloonController,
    BalloonResult,
    TorchBalloonController,
    make_balloon_controller,
)
from gpupool_sdk.memory.cupy_hook import install_cupy_allocator
from gpupool_sdk.memory.errors import (
    AllocatorClosedError,
    InstallError,
    InvalidPointerError,
    MemoryErrorBase,
    NativeBuildError,
)
from gpupool_sdk.memory.offload import OptimizerOffloader
from gpupool_sdk.memory.torch_hook import (
    empty_cache,
    global_allocator,
    install_torch_allocator,
    set_memory_fraction,
)

__all__ = [
    "AllocatorBalloonController",
    "AllocatorClosedError",
    "BalloonController",
    "BalloonResult",
    "BlockInfo",
    "CachingAllocator",
    "DeviceOutOfMemoryError",
    "InstallError",
    "InvalidPointerError",
    "MemoryErrorBase",
    "NativeBuildError",
    "OptimizerOffloader",
    "QuotaExceededError",
    "TorchBalloonController",
    "empty_cache",
    "fragmentation",
    "global_allocator",
    "install_cupy_allocator",
    "install_torch_allocator",
    "make_balloon_controller",
    "round_size",
    "set_memory_fraction",
]


def __getattr__(name: str) -> Any:
    # The OOM classes are built on first access so that importing this package does not import torch.
    if name in ("QuotaExceededError", "DeviceOutOfMemoryError"):
        from gpupool_sdk.memory import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
