"""Pure scheduling policy: a frozen :class:`ClusterSnapshot` in, a list of decisions out.

The coordinator, the simulator and the benchmarks all run :class:`Scheduler`. See
``docs/scheduler.md`` for the stages and the rules.
"""

from gpupool_sdk.scheduler.filter import GpuLoad, SliceRequest, fits, predicted_peak, request_for
from gpupool_sdk.scheduler.ledger import Holding, Ledger
from gpupool_sdk.scheduler.policy import Scheduler, build_ledger
from gpupool_sdk.scheduler.types import (
    Balloon,
    ClusterSnapshot,
    Decision,
    Deflate,
    Grant,
    JobView,
    Preempt,
    Queue,
    Reject,
    Release,
    Resize,
    Revoke,
    SchedulerConfig,
    ScheduleResult,
    Shrink,
    SliceGrant,
    Withdraw,
)

__all__ = [
    "Balloon",
    "ClusterSnapshot",
    "Decision",
    "Deflate",
    "GpuLoad",
    "Grant",
    "Holding",
    "JobView",
    "Ledger",
    "Preempt",
    "Queue",
    "Reject",
    "Release",
    "Resize",
    "Revoke",
    "ScheduleResult",
    "Scheduler",
    "SchedulerConfig",
    "Shrink",
    "SliceGrant",
    "SliceRequest",
    "Withdraw",
    "build_ledger",
    "fits",
    "predicted_peak",
    "request_for",
]
