"""``allocator="gpupool"``: the SDK allocator installed for a training process, on its own device.

The adapters (``GpuPoolCallback``, ``PoolSession``) call :func:`prepare_job_memory` right after
the lease is taken, which is before the framework touches CUDA (the lease comes first so that
``CUDA_VISIBLE_DEVICES`` names the leased GPUs). With ``allocator="gpupool"`` it installs the
SDK's caching allocator for torch (replace mode) and, when CuPy is importable, for CuPy too,
both on the rank's device and drawing from one :class:`~gpupool_sdk.memory.CachingAllocator`,
so one quota (the leased memory per slice) covers both.

The rank's device is :func:`rank_device`: ``LOCAL_RANK`` when the process sees that many
devices (torchrun, Lightning's DDP launcher: every rank sees all leased GPUs), else 0 (a
launcher that gives each rank one visible GPU).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gpupool_sdk.memory.allocator import CachingAllocator, SizeLike

log = logging.getLogger("gpupool_torch.memory")


def visible_device_count() -> int:
    """Devices this process can see, without initialising CUDA.

    ``CUDA_VISIBLE_DEVICES`` when set (an empty value: none), else ``torch.cuda.device_count()``
    (which asks NVML and leaves CUDA uninitialised); 0 without torch.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch or no CUDA: nothing visible
        return 0


def rank_device(visible: int | None = None) -> int:
    """The CUDA device index this process trains on.

    ``LOCAL_RANK`` when it is below the number of visible devices, else 0.

    Args:
        visible: the number of visible devices (default: :func:`visible_device_count`).

    Raises:
        ConfigError: ``LOCAL_RANK`` is set but is not a whole number >= 0.
    """
    from gpupool_sdk.errors import ConfigError

    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return 0
    try:
        local = int(raw)
    except ValueError:
        local = -1
    if local < 0:
        raise ConfigError("LOCAL_RANK", f"must be a whole number >= 0 (the rank on this machine), got {raw!r}")
    if visible is None:
        visible = visible_device_count()
    return local if local < visible else 0


def _cupy_present() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - CuPy absent or broken: torch alone
        return False
    return True


def install_pool_allocator(quota: SizeLike | None, device: int | None = None) -> CachingAllocator | None:
    """Installs the SDK allocator for torch, and CuPy when present, on one device with one quota.

    Must run before CUDA initialises in the process (the adapters call it right after the
    lease). On a machine without CUDA it does nothing and returns None: the balloon then
    uses the host tier, as ``allocator="torch"`` does.

    Args:
        quota: the hard limit on reserved bytes (the leased memory per slice), None for none.
        device: the device (default: :func:`rank_device`).

    Returns:
        The device's process-global allocator, or None without CUDA.

    Raises:
        InstallError: CUDA is already initialised (something touched the GPU before the pool's
            callback or session was created), or the device is not visible.
    """
    import torch

    from gpupool_torch.memory.cupy_hook import install_cupy_allocator
    from gpupool_torch.memory.torch_hook import install_torch_allocator

    if not torch.cuda.is_available():
        log.info("gpupool: allocator='gpupool' on a machine without CUDA: the balloon uses host memory")
        return None
    dev = rank_device() if device is None else device
    alloc = install_torch_allocator(quota=quota, devices=[dev])
    if _cupy_present():
        shared = install_cupy_allocator(quota=quota, devices=[dev])
        assert shared is alloc  # one allocator per device: one quota for torch and CuPy
    log.info("gpupool: SDK allocator installed on device %d (quota %s)%s", dev, quota,
             " for torch and CuPy" if _cupy_present() else " for torch")
    return alloc


def prepare_job_memory(allocator: str, quota_bytes: int | None) -> Any:
    """What the adapters call once the lease is held: install the allocator the options ask for.

    Args:
        allocator: the ``allocator`` option (``"torch"``, ``"gpupool"``, ``"none"``).
        quota_bytes: the leased memory per slice (None or 0: no quota).

    Returns:
        The installed allocator, or None (nothing to install, or no CUDA).
    """
    if allocator != "gpupool":
        return None
    return install_pool_allocator(quota_bytes or None)
