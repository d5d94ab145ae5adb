"""gRPC channels to etcd and the one place where gRPC errors become typed errors.

The store speaks etcd's v3 gRPC API through the protobuf stubs shipped with ``python3-etcd3``
(``etcd3.etcdrpc``) on channels it owns, so that it controls deadlines, failover across
endpoints, transaction results and watch streams (resume revision, compaction) itself.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3 import etcdrpc

from gpupool_sdk.errors import (
    CompactedError,
    LeaseLostError,
    StoreAuthError,
    StoreError,
    StoreTLSError,
    StoreUnavailableError,
    TxnTooLargeError,
)
from gpupool_sdk.store.endpoints import ENDPOINTS_ENV, parse_endpoints
from gpupool_sdk.store.security import EtcdSecurity, TlsMaterial, describe

__all__ = ["CHANNEL_OPTIONS", "Stubs", "map_grpc_error", "parse_endpoints", "prefix_range_end", "token_rejected"]


# Reconnect quickly after an etcd restart (gRPC's default backoff grows to two minutes).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the etcd auth token of its :class:`Stubs` (if any yet) to every call's metadata."""

    def __init__(self, stubs: Stubs) -> None:
        self._stubs = stubs

    def _details(self, d: Any) -> Any:
        token = self._stubs.token
        if not token:
            return d
        metadata = [*(d.metadata or ()), ("token", token)]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


@dataclass(eq=False)
class Stubs:
    """The gRPC stubs of one channel to one endpoint, and its etcd auth token.

    ``token`` is None until :meth:`authenticate` ran (or when no user is set); simple etcd
    tokens belong to one member, so each channel (endpoint) authenticates on its own.
    """

    endpoint: str
    channel: grpc.Channel
    kv: Any
    lease: Any
    watch: Any
    maintenance: Any
    auth: Any = None
    security: EtcdSecurity = field(default_factory=EtcdSecurity)
    token: str | None = None
    auth_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, endpoint: str, security: EtcdSecurity | None = None, material: TlsMaterial | None = None) -> Stubs:
        """Open a channel to ``endpoint``: TLS with ``material`` when given, plaintext otherwise (no I/O yet)."""
        security = security or EtcdSecurity()
        if material is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=material.root_certificates,
                private_key=material.private_key,
                certificate_chain=material.certificate_chain,
            )
            raw = grpc.secure_channel(endpoint, creds, options=list(CHANNEL_OPTIONS))
        else:
            raw = grpc.insecure_channel(endpoint, options=list(CHANNEL_OPTIONS))
        stubs = cls(endpoint=endpoint, channel=raw, kv=None, lease=None, watch=None, maintenance=None, security=security)
        channel = grpc.intercept_channel(raw, _TokenInterceptor(stubs)) if security.use_auth else raw
        stubs.kv = etcdrpc.KVStub(channel)
        stubs.lease = etcdrpc.LeaseStub(channel)
        stubs.watch = etcdrpc.WatchStub(channel)
        stubs.maintenance = etcdrpc.MaintenanceStub(channel)
        stubs.auth = etcdrpc.AuthStub(raw)
        return stubs

    def authenticate(self, timeout_s: float) -> None:
        """Get an auth token for the configured user, once per channel (no-op without a user).

        Raises:
            grpc.RpcError: as etcd answered (mapped by the caller); an etcd without auth
                enabled is not an error (no token is needed, as for ``etcdctl``).
        """
        if not self.security.use_auth or self.token is not None:
            return
        with self.auth_lock:
            if self.token is not None:
                return
            req = etcdrpc.AuthenticateRequest(name=self.security.user or "", password=self.security.password or "")
            try:
                resp = self.auth.Authenticate(req, timeout_s)
            except grpc.RpcError as exc:
                if "authentication is not enabled" in (_details(exc) or ""):
                    self.token = ""
                    return
                raise
            self.token = str(resp.token)

    def forget_token(self) -> None:
        """Drop the token (expired, or etcd restarted): the next call authenticates again."""
        self.token = None

    def close(self) -> None:
        self.channel.close()


_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _details(exc: grpc.RpcError) -> str:
    return (exc.details() if hasattr(exc, "details") else None) or str(exc)


def token_rejected(exc: grpc.RpcError) -> bool:
    """True when etcd refused the call's auth token (it expired, or etcd restarted and forgot it)."""
    return "invalid auth token" in _details(exc)


#: gRPC's words for a TLS handshake this side abandoned (``Handshake read failed (...)``).
_HANDSHAKE_ABANDONED = ("shutting down endpoint", "endpoint closing")
_TLS_MARKERS = ("handshake failed", "security handshaker", "handshake read failed", "hostname verification", "ssl_error")


def map_grpc_error(exc: grpc.RpcError, op: str, endpoint: str, security: EtcdSecurity | None = None) -> StoreError:
    """Turn a gRPC error into the typed store error for ``op`` against ``endpoint``.

    ``security`` (the connection's settings) lets TLS and auth failures name the setting to fix.
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = _details(exc)
    low = details.lower()
    sec = security or EtcdSecurity()
    if "handshake read failed" in low and any(m in low for m in _HANDSHAKE_ABANDONED):
        # This side gave the handshake up (its deadline passed, or the channel shut down while the
        # handshake was under way: seen on a starved machine): not a settings problem, so retried
        # like any unreachable etcd. A server that hangs up on TLS says "(Socket closed)" instead.
        return StoreUnavailableError(
            f"etcd at {endpoint} unreachable during {op}: the TLS handshake did not finish in time "
            f"(etcd or this machine overloaded, or etcd restarting) (gRPC: {details})"
        )
    if any(m in low for m in _TLS_MARKERS):
        return StoreTLSError(f"TLS with etcd at {endpoint} failed during {op}: {_tls_hint(low, sec)} (gRPC: {details})")
    if code == grpc.StatusCode.CANCELLED and "channel closed" in low:
        # Another thread failed over to the next endpoint and closed this channel under the call.
        return StoreUnavailableError(
            f"etcd call {op} on {endpoint} was cut off: its channel was closed by a fail-over to another "
            f"endpoint ({details}); retry"
        )
    if code in _UNAVAILABLE or (code is None and "connect" in low):
        name = code.name if code is not None else "UNAVAILABLE"
        hint = ""
        if "socket closed" in low and not sec.use_tls:
            hint = (
                f"; if etcd serves TLS (https), give its CA with {describe('cacert')} or write the endpoint "
                "https://host:port"
            )
        return StoreUnavailableError(
            f"etcd at {endpoint} unreachable during {op} ({name}: {details}); check that etcd runs there "
            f"(`gpupool etcd`) or point --endpoints / {ENDPOINTS_ENV} at a live member{hint}"
        )
    if "user name is empty" in low:
        return StoreAuthError(
            f"etcd at {endpoint} has authentication enabled and no user was given ({op}); set {describe('user')} "
            f"and the password through GPUPOOL_ETCD_PASSWORD or --etcd-password-file"
        )
    if "authentication failed" in low or "invalid user id or password" in low:
        where = sec.origin("password") or ("the password argument" if sec.password else "none: no password set")
        return StoreAuthError(
            f"etcd at {endpoint} refused user {sec.user!r}: wrong user or password (password from {where}); "
            f"check {describe('user')} and the password (GPUPOOL_ETCD_PASSWORD, --etcd-password-file)"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in low:
        who = f"user {sec.user!r}" if sec.user else "this client (no --etcd-user; a client certificate's CN is the user)"
        return StoreAuthError(
            f"etcd at {endpoint} denied {op} to {who}: grant it read-write on the pool's prefix, e.g. "
            "`etcdctl role grant-permission ROLE --prefix=true readwrite /gpupool/v1/` and `etcdctl user grant-role USER ROLE`"
            " (leases need no permission)"
        )
    if token_rejected(exc):
        return StoreAuthError(f"etcd at {endpoint} rejected the auth token during {op} (expired or etcd restarted); retry")
    if "too many operations in txn request" in details:
        return TxnTooLargeError(
            f"etcd at {endpoint} refused {op}: too many operations in one transaction (its --max-txn-ops): {details}"
        )
    if "lease not found" in details:
        return LeaseLostError(f"{op}: the etcd lease is gone (expired or revoked): {details}")
    if "compacted" in details:
        return CompactedError(0, 0)
    if "no leader" in details or "leader changed" in details:
        return StoreUnavailableError(f"etcd at {endpoint} has no leader during {op}: {details}; retry shortly")
    name = code.name if code is not None else "UNKNOWN"
    return StoreError(f"etcd {op} on {endpoint} failed ({name}: {details})")


def _tls_hint(low: str, sec: EtcdSecurity) -> str:
    if "handshake read failed" in low:
        return (
            "etcd closed the connection during the TLS handshake: it probably serves plaintext (http) on this port; "
            f"drop the TLS settings ({describe('cacert')}, https://) or point the endpoints at etcd's https port"
        )
    if "certificate_verify_failed" in low:
        if sec.cacert:
            src = sec.origin("cacert") or "--etcd-cacert"
            reason = low.split("certificate_verify_failed:", 1)[-1].split(":")[0].strip() if "certificate_verify_failed:" in low else ""
            why = f" ({reason})" if reason else ""
            return (
                f"etcd's server certificate is not trusted by the CA {sec.cacert!r} (from {src}){why}; give the CA that signed "
                f"etcd's --cert-file in {describe('cacert')}"
            )
        return (
            "etcd's server certificate is not signed by a CA in the system's trust store; give the CA that signed "
            f"etcd's --cert-file in {describe('cacert')}"
        )
    if "hostname verification" in low:
        return (
            "etcd's server certificate does not name this host (subjectAltName); connect with a host name or IP the "
            "certificate lists, or reissue it with this one"
        )
    if "bad_certificate" in low or "certificate_required" in low or "unknown_ca" in low:
        if not sec.cert:
            return (
                f"etcd requires a client certificate (--client-cert-auth) and none was given; set {describe('cert')} "
                f"and {describe('key')}"
            )
        src = sec.origin("cert") or "--etcd-cert"
        return (
            f"etcd rejected the client certificate {sec.cert!r} (from {src}): it is not signed by etcd's "
            "--trusted-ca-file CA, has expired, or lacks clientAuth usage; use a certificate issued by that CA"
        )
    if "security handshaker" in low:
        return "gRPC could not use the certificate files (a key that does not match its certificate?); check them with `openssl x509 -in CERT -noout -text`"
    return f"check {describe('cacert')}, {describe('cert')} and {describe('key')}"


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range that holds every key starting with ``prefix``."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"  # every key
