"""Routes PyTorch's CUDA allocations through the SDK's allocator (replace mode).

The C core exports ``gpupool_torch_malloc`` / ``gpupool_torch_free`` with the signatures of
``torch.cuda.memory.CUDAPluggableAllocator``. They serve every request from a process-global
:class:`CachingAllocator` per device, the same instance CuPy uses
(:mod:`gpupool_torch.memory.cupy_hook`), so torch and CuPy share one quota.

Replace mode must be installed before CUDA initialises in the process; it gives up CUDA
graph capture, ``torch.cuda.memory_stats`` (use :func:`global_allocator` ``.stats()``), and
``Tensor.record_stream`` (the pluggable allocator's record-stream hook is not reachable from
Python). ``torch.cuda.empty_cache`` does not reach the SDK's cache: call :func:`empty_cache`.
"""

from __future__ import annotations

import threading

from gpupool_sdk.memory import _native
from gpupool_sdk.memory.allocator import Backend, CachingAllocator, SizeLike
from gpupool_sdk.memory.errors import InstallError

_lock = threading.Lock()
_globals: dict[int, CachingAllocator] = {}
_torch_installed = False


def global_allocator(
    device: int = 0,
    quota: SizeLike | None = None,
    backend: Backend = "cuda",
    create: bool = True,
) -> CachingAllocator:
    """The process-global allocator of ``device``, which the torch and CuPy hooks use.

    Args:
        device: CUDA device index.
        quota: quota for a newly created allocator (an existing one keeps its quota; call
            ``set_quota`` to change it).
        backend: backend for a newly created allocator (``"host"`` only for tests).
        create: create the allocator if there is none yet.

    Raises:
        InstallError: none exists and ``create`` is False.
    """
    with _lock:
        alloc = _globals.get(device)
        if alloc is not None and not alloc.closed:
            return alloc
        if not create:
            raise InstallError(
                f"no gpupool allocator is installed for device {device}; call install_torch_allocator() "
                "or install_cupy_allocator() first"
            )
        alloc = CachingAllocator(backend=backend, quota=quota, device=device)
        if _native.load().gp_global_set(device, alloc.handle) != _native.GP_OK:
            alloc.close()
            raise InstallError(f"device index {device} is out of range for the global allocator table (0-63)")
        _globals[device] = alloc
        return alloc


def installed_devices() -> list[int]:
    """Devices that have a process-global allocator."""
    with _lock:
        return sorted(d for d, a in _globals.items() if not a.closed)


def torch_allocator_installed() -> bool:
    """True once :func:`install_torch_allocator` has replaced torch's CUDA allocator."""
    return _torch_installed


def install_torch_allocator(
    quota: SizeLike | None = None, devices: list[int] | None = None
) -> CachingAllocator:
    """Replaces PyTorch's CUDA caching allocator with the SDK's (replace mode).

    Args:
        quota: hard limit on reserved bytes per device (``"8GiB"`` or an int); None for none.
        devices: devices to serve (default: every visible device).

    Returns:
        The allocator of the first device (``torch.cuda.current_device()`` is not queried:
        that would initialise CUDA).

    Raises:
        InstallError: torch has no CUDA, or CUDA is already initialised in this process (the
            allocator can only be swapped before the first CUDA tensor or context).

    Example:
        >>> from gpupool_torch.memory import install_torch_allocator   # doctest: +SKIP
        >>> alloc = install_torch_allocator(quota="20GiB")   # first thing in the script   # doctest: +SKIP
        >>> # ... build the model, train; alloc.stats() replaces torch.cuda.memory_stats()
    """
    global _torch_installed
    import torch

    if _torch_installed:
        return global_allocator((devices or [0])[0], quota=quota)
    if not torch.cuda.is_available():
        raise InstallError(
            "install_torch_allocator: torch has no usable CUDA device (torch.cuda.is_available() is False); "
            "use make_balloon_controller('host') on CPU"
        )
    if torch.cuda.is_initialized():
        raise InstallError(
            "install_torch_allocator must run before CUDA initialises in this process, but "
            "torch.cuda.is_initialized() is already True (a tensor was moved to a GPU or a torch.cuda call "
            "created a context). Call it first thing in the training script, or use the default 'torch' "
            "tier (GpuPoolCallback(allocator='torch')), which needs no swap."
        )
    if devices is None:
        devices = list(range(torch.cuda.device_count()))
    if not devices:
        raise InstallError("install_torch_allocator: no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    allocs = [global_allocator(d, quota=quota) for d in devices]
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(
        str(_native.library_path()), "gpupool_torch_malloc", "gpupool_torch_free"
    )
    torch.cuda.memory.change_current_allocator(pluggable)
    _torch_installed = True
    return allocs[0]


def empty_cache(device: int | None = None) -> int:
    """Releases cached segments of the global allocator(s), and torch's own cache if it is in use.

    Args:
        device: one device, or None for every device with a global allocator.

    Returns:
        Bytes released by the SDK's allocators.
    """
    released = 0
    for d in installed_devices() if device is None else [device]:
        with _lock:
            alloc = _globals.get(d)
        if alloc is not None and not alloc.closed:
            released += alloc.trim()
    if not _torch_installed:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    return released


def set_memory_fraction(fraction: float, device: int = 0, total_bytes: int | None = None) -> int:
    """The replace-mode counterpart of ``torch.cuda.set_per_process_memory_fraction``.

    Sets the global allocator's quota to ``fraction`` of the device's memory.

    Args:
        fraction: between 0 and 1.
        device: device index.
        total_bytes: device memory (default: queried from torch).

    Returns:
        Bytes released to get under the new quota.

    Raises:
        ConfigError: ``fraction`` is outside [0, 1].
    """
    from gpupool_sdk.errors import ConfigError

    if not 0.0 <= fraction <= 1.0:
        raise ConfigError("fraction", f"must be between 0 and 1, got {fraction}")
    if total_bytes is None:
        import torch

        total_bytes = int(torch.cuda.get_device_properties(device).total_memory)
    return global_allocator(device, create=False).set_quota(int(fraction * total_bytes))


def _reset_for_tests() -> None:
    """Closes the global allocators (host backend tests only; never with live CUDA tensors)."""
    global _torch_installed
    with _lock:
        for d, alloc in list(_globals.items()):
            _native.load().gp_global_set(d, None)
            alloc.close()
        _globals.clear()
        _torch_installed = False
