"""Parsing of etcd endpoint lists (no gRPC here: the training process may import it)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from gpupool_sdk.errors import ConfigError

ENDPOINTS_ENV = "GPUPOOL_ENDPOINTS"
#: etcdctl's variable, read when ``$GPUPOOL_ENDPOINTS`` is not set (as the TLS settings fall back
#: to ``ETCDCTL_*``): a shell where ``etcdctl`` reaches the pool's etcd works for ``gpupool`` too.
ETCDCTL_ENDPOINTS_ENV = "ETCDCTL_ENDPOINTS"
DEFAULT_ENDPOINTS = "127.0.0.1:2379"


def env_endpoints() -> str:
    """``$GPUPOOL_ENDPOINTS``, else ``$ETCDCTL_ENDPOINTS``, else ``127.0.0.1:2379``."""
    return os.environ.get(ENDPOINTS_ENV) or os.environ.get(ETCDCTL_ENDPOINTS_ENV) or DEFAULT_ENDPOINTS


def parse_endpoints(endpoints: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalise ``"h1:p1,h2:p2"`` (or a list, or None: :func:`env_endpoints`).

    An ``http://`` or ``https://`` scheme is dropped here; :func:`endpoints_scheme` reads it
    (``https://`` switches TLS on, see :mod:`gpupool_sdk.store.security`).

    Raises:
        ConfigError: an endpoint is not ``host:port``; names ``endpoints`` and the fix.
    """
    if endpoints is None:
        endpoints = env_endpoints()
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[str] = []
    for raw in items:
        ep = raw.strip()
        for scheme in ("http://", "https://"):
            if ep.startswith(scheme):
                ep = ep[len(scheme) :]
        ep = ep.rstrip("/")
        if "://" in ep:
            raise ConfigError("endpoints", f"{raw!r}: unknown scheme; write host:port, http://host:port or https://host:port")
        if not ep:
            continue
        host, sep, port = ep.rpartition(":")
        if sep and host and port.isdigit() and not 0 < int(port) < 65536:
            raise ConfigError("endpoints", f"{raw!r}: port {int(port)} is out of range (1-65535)")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                "endpoints", f"{raw!r} is not host:port; use e.g. '127.0.0.1:2379' (comma-separate several, or set {ENDPOINTS_ENV})"
            )
        out.append(ep)
    if not out:
        raise ConfigError("endpoints", f"no endpoint given; use e.g. '127.0.0.1:2379' or set {ENDPOINTS_ENV}")
    return tuple(dict.fromkeys(out))


def endpoints_scheme(endpoints: str | Sequence[str] | None) -> str | None:
    """``"https"`` or ``"http"`` when the endpoints are written with that scheme, None when bare ``host:port``.

    Raises:
        ConfigError: some endpoints say ``https://`` and others ``http://``.
    """
    if endpoints is None:
        endpoints = env_endpoints()
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    schemes = {ep.strip().split("://", 1)[0].lower() for ep in items if "://" in ep}
    if len(schemes) > 1:
        raise ConfigError("endpoints", f"{','.join(items)!r} mixes http:// and https://; one pool speaks one of them to etcd")
    return schemes.pop() if schemes else None
