"""The training process's side of the pool: :class:`PoolClient` and :class:`Lease`.

All etcd I/O runs in a helper process started as a fresh interpreter (never forked), so the
training process never loads gRPC and may fork DataLoader workers freely.
"""

from gpupool_sdk.client.lease import Lease
from gpupool_sdk.client.pool import PoolClient
from gpupool_sdk.client.protocol import HelperDiedError, JobAlreadyRunningError

__all__ = ["HelperDiedError", "JobAlreadyRunningError", "Lease", "PoolClient"]
