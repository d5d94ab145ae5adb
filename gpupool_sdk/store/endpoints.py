"""Parsing of etcd endpoint lists (no gRPC here: the training process may import it)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from gpupool_sdk.errors import ConfigError

ENDPOINTS_ENV = "GPUPOOL_ENDPOINTS"
DEFAULT_ENDPOINTS = "127.0.0.1:2379"


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
