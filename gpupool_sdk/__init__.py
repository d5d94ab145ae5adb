"""gpupool-sdk: an elastic GPU pool for deep-learning training, delivered as a Python SDK.

The training process leases GPU slices through etcd (:class:`PoolClient`), the coordinator
schedules them, and the Lightning callback (:mod:`gpupool_sdk.integrations.lightning`)
checkpoints and releases cooperatively when the pool needs the slices elsewhere.
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.resources import JobSpec, QoS, Topology

__version__ = "0.1.0"
__all__ = ["GpuPoolCallback", "GpupoolError", "JobSpec", "PoolClient", "PoolSession", "QoS", "Topology", "__version__"]


def __getattr__(name: str) -> Any:
    # PoolClient pulls in the client machinery; import it only when asked for.
    if name == "PoolClient":
        from gpupool_sdk.client import PoolClient

        return PoolClient
    if name == "GpuPoolCallback":  # imports Lightning: only when asked for
        from gpupool_sdk.integrations.lightning import GpuPoolCallback

        return GpuPoolCallback
    if name == "PoolSession":
        from gpupool_sdk.integrations.torch_loop import PoolSession

        return PoolSession
    raise AttributeError(f"module 'gpupool_sdk' has no attribute {name!r}")
