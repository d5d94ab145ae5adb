"""gRPC channels to etcd and the one place where gRPC errors become typed errors.

The store speaks etcd's v3 gRPC API through the protobuf stubs shipped with ``python3-etcd3``
(``etcd3.etcdrpc``) on channels it owns, so that it controls deadlines, failover across
endpoints, transaction results and watch streams (resume revision, compaction) itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3 import etcdrpc

from gpupool_sdk.errors import CompactedError, ConfigError, LeaseLostError, StoreError, StoreUnavailableError

ENDPOINTS_ENV = "GPUPOOL_ENDPOINTS"
DEFAULT_ENDPOINTS = "127.0.0.1:2379"

# Reconnect quickly after an etcd restart (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


def parse_endpoints(endpoints: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalise ``"h1:p1,h2:p2"`` (or a list, or None: ``$GPUPOOL_ENDPOINTS``, else ``127.0.0.1:2379``).

    Raises:
        ConfigError: an endpoint is not ``host:port``; names ``endpoints`` and the fix.
    """
    if endpoints is None:
        endpoints = os.environ.get(ENDPOINTS_ENV) or DEFAULT_ENDPOINTS
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[str] = []
    for raw in items:
        ep = raw.strip()
        for scheme in ("http://", "https://"):
            if ep.startswith(scheme):
                if scheme == "https://":
                    raise ConfigError("endpoints", f"{raw!r}: TLS endpoints are not supported yet; use a plain host:port")
                ep = ep[len(scheme) :]
        ep = ep.rstrip("/")
        if not ep:
            continue
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                "endpoints", f"{raw!r} is not host:port; use e.g. '127.0.0.1:2379' (comma-separate several, or set {ENDPOINTS_ENV})"
            )
        out.append(ep)
    if not out:
        raise ConfigError("endpoints", f"no endpoint given; use e.g. '127.0.0.1:2379' or set {ENDPOINTS_ENV}")
    return tuple(dict.fromkeys(out))


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
