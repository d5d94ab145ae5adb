"""map_grpc_error: which gRPC failures the store treats as an unreachable etcd (retried, failed over)."""

from __future__ import annotations

import grpc
import pytest

from gpupool_sdk.errors import StoreError, StoreTLSError, StoreUnavailableError
from gpupool_sdk.store.transport import map_grpc_error


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "unavailable"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True),
        # A fail-over in another thread closed the channel under this call (seen in the fault suite).
        (grpc.StatusCode.CANCELLED, "Channel closed!", True),
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", False),
        # A TLS handshake this side abandoned (a starved machine): retried, not a settings error.
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: "
         "ipv4:127.0.0.1:2379: Handshake read failed (Shutting down endpoint)", True),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: "
         "ipv4:127.0.0.1:2379: Handshake read failed (Endpoint closing)", True),
    ],
)
def test_which_failures_count_as_an_unreachable_etcd(code: grpc.StatusCode, details: str, unavailable: bool) -> None:
    err = map_grpc_error(_Rpc(code, details), "grant_lease", "127.0.0.1:2379")
    assert isinstance(err, StoreError)
    assert isinstance(err, StoreUnavailableError) is unavailable
    assert "127.0.0.1:2379" in str(err) or not unavailable


def test_a_server_hanging_up_on_the_handshake_is_a_tls_settings_error_and_an_abandoned_one_is_not() -> None:
    """``(Socket closed)``: etcd hung up (plaintext port): StoreTLSError, not retried, naming the
    fix. ``(Shutting down endpoint)``: this side gave up in time: a plain unavailability, retried."""
    base = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:2379: Handshake read failed "
    hung_up = map_grpc_error(_Rpc(grpc.StatusCode.UNAVAILABLE, base + "(Socket closed)"), "get", "127.0.0.1:2379")
    assert isinstance(hung_up, StoreTLSError) and "plaintext" in str(hung_up)
    abandoned = map_grpc_error(_Rpc(grpc.StatusCode.UNAVAILABLE, base + "(Shutting down endpoint)"), "get", "127.0.0.1:2379")
    assert not isinstance(abandoned, StoreTLSError) and isinstance(abandoned, StoreUnavailableError)
    assert "did not finish in time" in str(abandoned)
