"""gRPC channels to etcd and the one place where gRPC errors become typed errors.

The store speaks etcd's v3 gRPC API through the protobuf stubs shipped with ``python3-etcd3``
(``etcd3.etcdrpc``) on channels it owns, so that it controls deadlines, failover across
endpoints, transaction results and watch streams (resume revision, compaction) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from etcd3 import etcdrpc

from gpupool_sdk.errors import CompactedError, LeaseLostError, StoreError, StoreUnavailableError
from gpupool_sdk.store.endpoints import ENDPOINTS_ENV, parse_endpoints

__all__ = ["CHANNEL_OPTIONS", "Stubs", "map_grpc_error", "parse_endpoints", "prefix_range_end"]


# Reconnect quickly after an etcd restart (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@dataclass
class Stubs:
    """The gRPC stubs of one channel to one endpoint."""

    endpoint: str
    channel: grpc.Channel
    kv: Any
    lease: Any
    watch: Any
    maintenance: Any

    @classmethod
    def open(cls, endpoint: str) -> Stubs:
        channel = grpc.insecure_channel(endpoint, options=list(CHANNEL_OPTIONS))
        return cls(
            endpoint=endpoint,
            channel=channel,
            kv=etcdrpc.KVStub(channel),
            lease=etcdrpc.LeaseStub(channel),
            watch=etcdrpc.WatchStub(channel),
            maintenance=etcdrpc.MaintenanceStub(channel),
        )

    def close(self) -> None:
        self.channel.close()


_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def map_grpc_error(exc: grpc.RpcError, op: str, endpoint: str) -> StoreError:
    """Turn a gRPC error into the typed store error for ``op`` against ``endpoint``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code in _UNAVAILABLE or (code is None and "connect" in details.lower()):
        name = code.name if code is not None else "UNAVAILABLE"
        return StoreUnavailableError(
            f"etcd at {endpoint} unreachable during {op} ({name}: {details}); check that etcd runs there "
            f"(`gpupool etcd`) or point --endpoints / {ENDPOINTS_ENV} at a live member"
        )
    if "lease not found" in details:
        return LeaseLostError(f"{op}: the etcd lease is gone (expired or revoked): {details}")
    if "compacted" in details:
        return CompactedError(0, 0)
    if "no leader" in details or "leader changed" in details:
        return StoreUnavailableError(f"etcd at {endpoint} has no leader during {op}: {details}; retry shortly")
    name = code.name if code is not None else "UNKNOWN"
    return StoreError(f"etcd {op} on {endpoint} failed ({name}: {details})")


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that holds every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"  # every key
