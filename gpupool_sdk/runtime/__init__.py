"""The in-job runtime: what a training process runs to hold a lease and obey the pool.

Framework-free (no torch, no Lightning): the adapters in the ``gpupool-lightning`` and
``gpupool-torch`` distributions build a :class:`PoolRuntime` from :class:`RuntimeOptions` and call
:meth:`PoolRuntime.step_boundary` at their step boundaries.
"""

from __future__ import annotations

from gpupool_sdk.runtime.checkpoints import CheckpointBook, checkpoint_readable
from gpupool_sdk.runtime.decision import CARRY_ON, Decision, DecisionKind
from gpupool_sdk.runtime.env import (
    CKPT_DIR_ENV,
    DEVICES_ENV,
    EX_TEMPFAIL,
    GRANT_ENV,
    JOB_ENV,
    LEASE_ID_ENV,
    LEASED_ENV,
    RESUME_ENV,
    RUN_SOCKET_ENV,
    derive_job_name,
    process_rank,
)
from gpupool_sdk.runtime.leases import Grant, JobLease, LeaseMode
from gpupool_sdk.runtime.options import RuntimeOptions
from gpupool_sdk.runtime.runtime import (
    DirectiveInbox,
    PoolAdapter,
    PoolLeaseLostError,
    PoolRuntime,
    PreemptTiming,
)

__all__ = [
    "CARRY_ON",
    "CKPT_DIR_ENV",
    "DEVICES_ENV",
    "EX_TEMPFAIL",
    "GRANT_ENV",
    "JOB_ENV",
    "LEASED_ENV",
    "LEASE_ID_ENV",
    "RESUME_ENV",
    "RUN_SOCKET_ENV",
    "CheckpointBook",
    "Decision",
    "DecisionKind",
    "DirectiveInbox",
    "Grant",
    "JobLease",
    "LeaseMode",
    "PoolAdapter",
    "PoolLeaseLostError",
    "PoolRuntime",
    "PreemptTiming",
    "RuntimeOptions",
    "checkpoint_readable",
    "derive_job_name",
    "process_rank",
]
