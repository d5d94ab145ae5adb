"""map_grpc_error: which gRPC failures the store treats as an unreachable etcd (retried, failed over)."""

from __future__ import annotations

import grpc
import pytest

from gpupool_sdk.errors import StoreError, StoreUnavailableError
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
    ],
)
def test_which_failures_count_as_an_unreachable_etcd(code: grpc.StatusCode, details: str, unavailable: bool) -> None:
    err = map_grpc_error(_Rpc(code, details), "grant_lease", "127.0.0.1:2379")
    assert isinstance(err, StoreError)
    assert isinstance(err, StoreUnavailableError) is unavailable
    assert "127.0.0.1:2379" in str(err) or not unavailable
