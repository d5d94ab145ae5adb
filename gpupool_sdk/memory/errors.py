"""Errors of the memory subsystem.

The out-of-memory errors subclass ``torch.OutOfMemoryError`` when torch is importable, so
code that already catches PyTorch's OOM (Lightning's batch-size finder, user retry loops)
handles a quota hit the same way; without torch they subclass :class:`MemoryError`. torch is
imported lazily, on first access to one of those classes, so importing the allocator stays
cheap.
"""

from __future__ import annotations

import functools
from typing import Any

from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.memory._native import NativeBuildError

__all__ = [
    "AllocatorClosedError",
    "InstallError",
    "InvalidPointerError",
    "MemoryErrorBase",
    "NativeBuildError",
    "oom_error_classes",
]


class MemoryErrorBase(GpupoolError):
    """Root of the memory subsystem's errors (except the OOM pair, which also derive from it)."""


class InvalidPointerError(MemoryErrorBase, ValueError):
    """A pointer passed to ``free`` or ``record_stream`` is not a live allocation."""


class AllocatorClosedError(MemoryErrorBase):
    """The allocator was used after ``close()``."""


class InstallError(MemoryErrorBase):
    """A torch or CuPy hook cannot be installed in the current process state."""


@functools.lru_cache(maxsize=1)
def oom_error_classes() -> tuple[type[Exception], type[Exception]]:
    """Builds ``(QuotaExceededError, DeviceOutOfMemoryError)`` once, on a torch base if available."""
    base: type[BaseException]
    try:
        import torch

        base = torch.OutOfMemoryError
    except (ImportError, AttributeError):
        base = MemoryError

    doc_quota = (
        "An allocation would take reserved memory above the quota or the balloon target.\n\n"
        "Subclasses ``torch.OutOfMemoryError`` when torch is importable (else ``MemoryError``) and\n"
        ":class:`gpupool_sdk.errors.GpupoolError`. Attributes: ``requested_bytes``, ``quota_bytes``,\n"
        "``target_bytes`` (or None), ``reserved_bytes``, ``allocated_bytes``, ``cached_bytes``."
    )
    doc_device = (
        "The backend (``cudaMalloc`` or host ``malloc``) failed although the quota allowed the growth."
    )

    def _init(self: Any, message: str, **fields: Any) -> None:
        Exception.__init__(self, message)
        for k, v in fields.items():
            setattr(self, k, v)

    ns_q = {"__doc__": doc_quota, "__init__": _init, "__module__": __name__}
    ns_d = {"__doc__": doc_device, "__init__": _init, "__module__": __name__}
    quota = type("QuotaExceededError", (base, MemoryErrorBase), ns_q)
    device = type("DeviceOutOfMemoryError", (base, MemoryErrorBase), ns_d)
    return quota, device


def __getattr__(name: str) -> Any:
    if name == "QuotaExceededError":
        return oom_error_classes()[0]
    if name == "DeviceOutOfMemoryError":
        return oom_error_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
