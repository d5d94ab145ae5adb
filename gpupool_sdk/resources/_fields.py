"""Small validators shared by the record types: each names the field at fault."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from gpupool_sdk.errors import SpecError

T = TypeVar("T")
C = TypeVar("C", bound=type)


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


def unknown_field(name: str, known: Iterable[str], where: str, field: str | None = None) -> SpecError:
    """A :class:`SpecError` for a field ``where`` does not have, naming the closest valid one.

    Args:
        name: the unknown field as written.
        known: the valid field names.
        where: what has no such field (``"JobSpec"``), for the message.
        field: the error's field (default ``name``; ``"spec.gpu"`` for a nested record).

    Example:
        >>> str(unknown_field("preempt_grace", ["preempt_grace_s", "priority"], "JobSpec"))
        "preempt_grace: unknown field of JobSpec; did you mean 'preempt_grace_s'? valid fields: preempt_grace_s, priority"
    """
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return SpecError(field or name, f"unknown field of {where}{hint} valid fields: {', '.join(known)}")


def keyword_checked(cls: C) -> C:
    """Make a dataclass's constructor raise :class:`SpecError` instead of a raw ``TypeError``.

    A misspelt keyword (``JobSpec(..., preempt_grace=30)``) names the closest valid field; a
    missing required field, too many positional arguments, or a field given twice are named too.
    Apply it above ``@dataclass`` (it wraps the generated ``__init__``).
    """
    init: Callable[..., None] = cls.__dict__["__init__"]  # the one @dataclass generated
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = tuple(f.name for f in fields)
    known = frozenset(names)
    required = tuple(
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    where = cls.__name__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in known:
                raise unknown_field(key, names, where)
        if len(args) > len(names):
            raise SpecError(
                names[-1], f"{where} takes at most {len(names)} positional arguments, got {len(args)}; pass fields by name"
            )
        for i, key in enumerate(names[: len(args)]):
            if key in kwargs:
                raise SpecError(key, f"given twice (as positional argument {i + 1} and by name); give it once")
        given = names[: len(args)]
        for key in required:
            if key not in kwargs and key not in given:
                raise SpecError(key, f"is required: {where}({key}=...)")
        init(self, *args, **kwargs)

    setattr(cls, "__init__", __init__)  # noqa: B010 - assigning the attribute directly upsets mypy
    return cls
