"""gpupool-sdk: an elastic GPU pool for deep-learning training, delivered as a Python SDK.

The training process leases GPU slices through etcd (:class:`PoolClient`), the coordinator
schedules them, and the framework adapters (the ``gpupool-lightning`` and ``gpupool-torch``
distributions: ``gpupool_lightning.GpuPoolCallback``, ``gpupool_torch.PoolSession``) checkpoint and
release cooperatively when the pool needs the slices elsewhere. This package imports neither
torch nor Lightning.
"""

from __future__ import annotations

from typing import Any

from gpupool_sdk.errors import GpupoolError
from gpupool_sdk.resources import JobSpec, QoS, Topology

__version__ = "0.1.0"
__all__ = ["GpupoolError", "JobSpec", "PoolClient", "QoS", "Topology", "__version__"]


def __getattr__(name: str) -> Any:
    # PoolClient pulls in the client machinery; import it only when asked for.
    if name == "PoolClient":
        from gpupool_sdk.client import PoolClient

        return PoolClient
    raise AttributeError(f"module 'gpupool_sdk' has no attribute {name!r}")
