"""Plain values of the store API: keys read, operations of a transaction, compares, watch events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.store.codec import encode

CompareTarget = Literal["create", "mod", "version", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]
Value = Any  # bytes, str, a record with to_dict(), or a mapping (encoded with kind "dict")


def to_bytes(value: Value) -> bytes:
    """Encode a value for etcd: bytes as-is, str as UTF-8, a record or mapping as schema'd JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Mapping) or hasattr(value, "to_dict"):
        return encode(value)
    raise ConfigError("value", f"cannot store a {type(value).__name__}; pass bytes, str, a mapping or a record with to_dict()")


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd returned it.

    Attributes:
        key: the full key.
        value: raw bytes (decode with :mod:`gpupool_sdk.store.codec`).
        create_revision: revision that created this incarnation of the key (a fencing token:
            it changes when the key is deleted and created again).
        mod_revision: revision of the last change.
        version: number of writes since creation.
        lease: id of the lease it is attached to, 0 for none.
    """

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv: Any) -> KeyValue:
        return cls(
            key=kv.key.decode(),
            value=bytes(kv.value),
            create_revision=int(kv.create_revision),
            mod_revision=int(kv.mod_revision),
            version=int(kv.version),
            lease=int(kv.lease),
        )


@dataclass(frozen=True)
class Put:
    """Transaction operation: write ``value`` at ``key``, attached to ``lease`` if given."""

    key: str
    value: Value
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    """Transaction operation: delete ``key`` (every key under it when ``prefix``)."""

    key: str
    prefix: bool = False


_TARGETS = ("create", "mod", "version", "value", "lease")
_OPS = ("==", "!=", "<", ">")


@dataclass(frozen=True)
class Compare:
    """Transaction guard on one key, or on every key under a prefix.

    ``Compare(key, "create", "==", 0)`` means "the key does not exist";
    ``Compare(key, "mod", "==", kv.mod_revision)`` means "nobody wrote it since I read it";
    ``Compare(key, "create", "==", kv.create_revision)`` means "it is the same incarnation";
    ``Compare(prefix, "mod", "<", rev + 1, prefix=True)`` means "no key under ``prefix`` was
    created or rewritten after revision ``rev``" (a key deleted since passes: it is not there).

    Args:
        key: the key (with ``prefix``: the key prefix, e.g. ending in ``/``).
        target: ``create`` / ``mod`` revision, ``version``, ``value`` or ``lease``.
        op: ``==``, ``!=``, ``<`` or ``>``.
        value: an int for revisions, versions and leases; bytes, str or a record for ``value``.
        prefix: compare every key under ``key`` (etcd's range compare, ``range_end``): it holds
            when every key there satisfies it. An empty range compares as one absent key
            (revisions, version and lease 0), so a ``value`` compare on it fails.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    value: Any
    prefix: bool = False

    def __post_init__(self) -> None:
        if self.target not in _TARGETS:
            raise ConfigError("target", f"{self.target!r} is not a compare target; use one of {_TARGETS}")
        if self.op not in _OPS:
            raise ConfigError("op", f"{self.op!r} is not a compare operator; use one of {_OPS}")
        if self.target != "value" and (isinstance(self.value, bool) or not isinstance(self.value, int)):
            raise ConfigError("value", f"a {self.target} compare needs an int, got {self.value!r}")


@dataclass(frozen=True)
class LeaseInfo:
    """What etcd knows of a live lease: remaining and granted TTL, and the keys attached to it."""

    ttl_remaining: int
    granted_ttl: int
    keys: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: ``put`` or ``delete`` of ``kv`` (``prev`` is the value before)."""

    type: Literal["put", "delete"]
    kv: KeyValue
    prev: KeyValue | None = None
