"""Torch and CuPy side of the SDK's memory management.

* :func:`install_torch_allocator` / :func:`install_cupy_allocator`: route torch and CuPy through
  one process-global :class:`~gpupool_sdk.memory.CachingAllocator` (one quota for both).
* :func:`prepare_job_memory` / :func:`install_pool_allocator`: what ``allocator="gpupool"``
  does once the lease is held: both hooks on the rank's device (:func:`rank_device`).
* :func:`make_balloon_controller`: the :class:`BalloonController` for a tier (``"torch"``,
  the default; ``"gpupool"``; ``"host"``) that inflates and deflates the job's balloon.
* :class:`OptimizerOffloader`: moves optimizer state to pinned host memory and back.

See ``docs/memory.md``.
"""

from __future__ import annotations

from gpupool_torch.memory.balloon import (
    AllocatorBalloonController,
    BalloonController,
    BalloonResult,
    TorchBalloonController,
    make_balloon_controller,
)
from gpupool_torch.memory.cupy_hook import install_cupy_allocator
from gpupool_torch.memory.install import install_pool_allocator, prepare_job_memory, rank_device
from gpupool_torch.memory.offload import OptimizerOffloader
from gpupool_torch.memory.torch_hook import (
    empty_cache,
    global_allocator,
    install_torch_allocator,
    set_memory_fraction,
)

__all__ = [
    "AllocatorBalloonController",
    "BalloonController",
    "BalloonResult",
    "OptimizerOffloader",
    "TorchBalloonController",
    "empty_cache",
    "global_allocator",
    "install_cupy_allocator",
    "install_pool_allocator",
    "install_torch_allocator",
    "make_balloon_controller",
    "prepare_job_memory",
    "rank_device",
    "set_memory_fraction",
]
