"""The environment contract between a training process, its other ranks and ``gpupool run``.

``GPUPOOL_JOB`` job name; ``GPUPOOL_ENDPOINTS``/``GPUPOOL_PREFIX`` where the pool is;
``GPUPOOL_RUN_SOCKET`` attach to a ``gpupool run`` launcher; ``GPUPOOL_LEASED=1``,
``GPUPOOL_DEVICES`` (slice count), ``GPUPOOL_RESUME_FROM`` (checkpoint path) exported for the
other ranks; ``GPUPOOL_CHECKPOINT_DIR`` default checkpoint directory; ``GPUPOOL_LEASE_ID`` the
job's etcd lease in the hex form ``etcdctl lease timetolive`` takes.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

#: Exit code of a training process that was preempted and wants to be run again (sysexits.h).
EX_TEMPFAIL = 75

JOB_ENV = "GPUPOOL_JOB"
RUN_SOCKET_ENV = "GPUPOOL_RUN_SOCKET"
LEASED_ENV = "GPUPOOL_LEASED"
DEVICES_ENV = "GPUPOOL_DEVICES"
RESUME_ENV = "GPUPOOL_RESUME_FROM"
CKPT_DIR_ENV = "GPUPOOL_CHECKPOINT_DIR"
LEASE_ID_ENV = "GPUPOOL_LEASE_ID"

#: Variables that describe one grant; cleared before a new one is exported.
GRANT_ENV = (RUN_SOCKET_ENV, LEASED_ENV, DEVICES_ENV, RESUME_ENV, JOB_ENV, LEASE_ID_ENV)


def derive_job_name(explicit: str | None = None, argv0: str | None = None) -> str:
    """The job name: ``explicit``, else ``$GPUPOOL_JOB``, else the script's file name.

    The script name is lowercased and reduced to the allowed characters.

    Example:
        >>> derive_job_name(argv0="/home/me/Train BERT.py")
        'train-bert'
    """
    if explicit:
        return explicit
    env = os.environ.get(JOB_ENV)
    if env:
        return env
    return job_slug(argv0 if argv0 is not None else (sys.argv[0] if sys.argv and sys.argv[0] else "job"))


def job_slug(path: str) -> str:
    """A job name from a file name: its stem, lowercased, reduced to the allowed characters.

    Example:
        >>> job_slug("/src/Train BERT.py")
        'train-bert'
    """
    stem = Path(path).stem
    name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._")[:63].strip("-._")
    return name or "job"


def process_rank() -> int:
    """Global rank of this process as the launchers set it (0 when not distributed)."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return 0
