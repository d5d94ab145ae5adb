"""The in-job runtime: what a training process runs to hold a lease and obey the pool.

Framework-free (no torch, no Lightning): the adapters in the ``gpupool-lightning`` and
``gpupool-torch`` distributions drive it from their step boundaries.
"""

from __future__ import annotations

from gpupool_sdk.runtime.runtime import (
    CKPT_DIR_ENV,
    DEVICES_ENV,
    EX_TEMPFAIL,
    JOB_ENV,
    LEASED_ENV,
    RESUME_ENV,
    RUN_SOCKET_ENV,
    Decision,
    PoolAdapter,
    PoolLeaseLostError,
    PoolRuntime,
    PreemptTiming,
    derive_job_name,
    process_rank,
)

__all__ = [
    "CKPT_DIR_ENV",
    "DEVICES_ENV",
    "EX_TEMPFAIL",
    "JOB_ENV",
    "LEASED_ENV",
    "RESUME_ENV",
    "RUN_SOCKET_ENV",
    "Decision",
    "PoolAdapter",
    "PoolLeaseLostError",
    "PoolRuntime",
    "PreemptTiming",
    "derive_job_name",
    "process_rank",
]
