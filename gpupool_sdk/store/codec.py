"""JSON values with a schema version.

Every value the pool writes is a JSON object ``{"schema": 1, "kind": "...", ...fields}``. Reading
a value checks the schema and the kind, then builds the record; anything else (hand-edited,
truncated, from a newer release) raises :class:`~gpupool_sdk.errors.SchemaError` naming the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from gpupool_sdk.errors import SchemaError, SpecError

SCHEMA_VERSION = 1


class Record(Protocol):
    """A value type the store can encode: ``to_dict`` and a ``from_dict`` class method."""

    def to_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = ...) -> Any: ...


R = TypeVar("R")


def kind_of(cls: type) -> str:
    return cls.__name__


def encode(record: Record | Mapping[str, Any], kind: str | None = None) -> bytes:
    """Serialise a record (or a plain mapping with an explicit ``kind``) to JSON bytes."""
    if isinstance(record, Mapping):
        body = dict(record)
        k = kind or "dict"
    else:
        body = record.to_dict()
        k = kind or kind_of(type(record))
    return json.dumps({"schema": SCHEMA_VERSION, "kind": k, **body}, sort_keys=True, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; write a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number; write a finite number")
    return value


def decode_dict(key: str, raw: bytes | str, keep_kind: bool = False) -> dict[str, Any]:
    """Parse raw bytes into the JSON body (without ``schema``/``kind``), checking the schema version.

    ``keep_kind`` keeps ``kind`` for records that have a field of that name (``Directive``): their
    own ``kind`` overrides the envelope's when encoded.
    """
    try:
        # Strict JSON: NaN, Infinity and overflowing numbers (which Python's parser accepts) would
        # reach comparisons and int() conversions far from the key that holds them.
        obj = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(key, f"not valid JSON ({exc}); rewrite it or delete the key") from None
    except RecursionError:
        raise SchemaError(key, "not valid JSON (nested too deeply); rewrite it or delete the key") from None
    if not isinstance(obj, dict):
        raise SchemaError(key, f"expected a JSON object, got {type(obj).__name__}; delete the key")
    schema = obj.pop("schema", None)
    if schema != SCHEMA_VERSION:
        raise SchemaError(
            key,
            f"schema version {schema!r} is not {SCHEMA_VERSION}; written by another release or by hand: upgrade "
            "gpupool-sdk everywhere if a newer release wrote it, else rewrite it or delete the key",
        )
    if not keep_kind:
        obj.pop("kind", None)
    return obj


def decode(key: str, raw: bytes | str, cls: type[R]) -> R:
    """Parse raw bytes into ``cls`` via ``cls.from_dict``; every failure is a :class:`SchemaError`."""
    body = decode_dict(key, raw, keep_kind="kind" in getattr(cls, "__dataclass_fields__", {}))
    try:
        return cls.from_dict(body, where=key.rsplit("/", 1)[-1])  # type: ignore[attr-defined,no-any-return]
    except SpecError as exc:
        raise SchemaError(key, f"invalid value: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RecursionError) as exc:
        raise SchemaError(key, f"invalid value: {exc}") from None
