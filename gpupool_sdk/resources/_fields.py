"""Small validators shared by the record types: each names the field at fault."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from gpupool_sdk.errors import SpecError

T = TypeVar("T")


def req(d: Mapping[str, Any], key: str, typ: type[T] | tuple[type, ...], where: str) -> T:
    """Return ``d[key]`` checked against ``typ``; raise :class:`SpecError` naming ``where.key``."""
    if key not in d:
        raise SpecError(f"{where}.{key}", "is required but missing")
    return check(d[key], typ, f"{where}.{key}")


def opt(d: Mapping[str, Any], key: str, typ: type[T] | tuple[type, ...], where: str, default: Any) -> Any:
    """Like :func:`req` but returns ``default`` when the key is absent or null."""
    if d.get(key) is None:
        return default
    return check(d[key], typ, f"{where}.{key}")


def check(value: Any, typ: type[T] | tuple[type, ...], field: str) -> T:
    """Check ``value`` against ``typ`` (ints are accepted where floats are expected)."""
    types = typ if isinstance(typ, tuple) else (typ,)
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # type: ignore[return-value]
    if isinstance(value, bool) and bool not in types:
        raise SpecError(field, f"expected {_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise SpecError(field, f"expected {_names(types)}, got {type(value).__name__} {value!r}")
    return value  # type: ignore[return-value]


def strings(value: Any, field: str) -> tuple[str, ...]:
    """Check ``value`` is a list, tuple or set of strings (a bare string is refused, not split into letters)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise SpecError(field, f"expected a list of strings such as ['bf16'], got {type(value).__name__} {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise SpecError(field, f"expected a list of strings such as ['bf16'], got an item {item!r}")
    return tuple(value)


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)
