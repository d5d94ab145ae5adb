"""The coordinator: leader election, snapshot building from etcd, fenced application of decisions.

* :mod:`~gpupool_sdk.coordinator.election`: Patroni-style leader election and terms.
* :mod:`~gpupool_sdk.coordinator.fencing`: every leader write as a transaction fenced on the leader key.
* :mod:`~gpupool_sdk.coordinator.snapshot`: the whole prefix parsed into a frozen snapshot.
* :mod:`~gpupool_sdk.coordinator.apply`: decisions planned as writes (pure) and applied.
* :mod:`~gpupool_sdk.coordinator.coordinator`: the loop.
"""

from gpupool_sdk.coordinator.apply import Applier, Plan, plan
from gpupool_sdk.coordinator.coordinator import Coordinator, CoordinatorStats, CycleReport
from gpupool_sdk.coordinator.election import Election, ElectionTiming, default_coordinator_id
from gpupool_sdk.coordinator.fencing import Fence, FencedWriter
from gpupool_sdk.coordinator.snapshot import JobMeta, PoolState, Problem, build_state

__all__ = [
    "Applier",
    "Coordinator",
    "CoordinatorStats",
    "CycleReport",
    "Election",
    "ElectionTiming",
    "Fence",
    "FencedWriter",
    "JobMeta",
    "Plan",
    "PoolState",
    "Problem",
    "build_state",
    "default_coordinator_id",
    "plan",
]
