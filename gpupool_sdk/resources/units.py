"""Sizes with units: ``"24GiB"``, ``"512MiB"``, ``"1.5GB"``, Kubernetes quantities (``"20Gi"``, ``"512Mi"``) or bytes."""

from __future__ import annotations

import math
import re

from gpupool_sdk.errors import SpecError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": KiB,
    "KI": KiB,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": MiB,
    "MI": MiB,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": GiB,
    "GI": GiB,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": TiB,
    "TI": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float, field: str = "size") -> int:
    """Parse a memory size into bytes.

    Args:
        value: ``"24GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"80G"`` (decimal), a Kubernetes quantity
            (``"20Gi"``, ``"512Mi"``: binary, as ``GiB``/``MiB``), or a number of bytes.
        field: the name reported in the error when ``value`` is malformed.

    Returns:
        The size in bytes (rounded down to a whole byte).

    Raises:
        SpecError: the value is negative, not a number, or has an unknown unit.

    Example:
        >>> parse_size("2GiB")
        2147483648
        >>> parse_size("2Gi")
        2147483648
    """
    if isinstance(value, bool):
        raise SpecError(field, f"expected a size such as '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise SpecError(field, f"expected a finite size such as '24GiB', got {value!r}")
        if value < 0:
            raise SpecError(field, f"size must be >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise SpecError(field, f"expected a size such as '24GiB', got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    if not m:
        raise SpecError(field, f"cannot parse size {value!r}; write e.g. '24GiB', '512MiB' or a byte count")
    number, unit = float(m.group(1)), m.group(2).upper()
    if unit not in _UNITS:
        raise SpecError(
            field, f"unknown unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB (or Ki, Mi, Gi, Ti as in Kubernetes; KB, MB, GB, TB decimal)"
        )
    return int(number * _UNITS[unit])


def format_size(nbytes: int | float) -> str:
    """Format bytes with binary units, e.g. ``format_size(3 * GiB) == "3.0GiB"``."""
    n = float(nbytes)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"
