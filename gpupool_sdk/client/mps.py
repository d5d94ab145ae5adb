"""What a job's grant means for its process environment: visible devices and CUDA MPS limits.

Pure functions (no I/O): the training-side integration calls them with the job's allocations on
this node and puts the result into the training process's environment *before* CUDA initialises.

* :func:`visible_devices`: the ``CUDA_VISIBLE_DEVICES`` entries, in the order the job's CUDA
  ordinals follow (a MIG instance is named by its ``MIG-...`` UUID, a whole GPU by its index).
* :func:`mps_environment`: under CUDA MPS (the agent publishes ``mps_pipe_dir`` on the GPUs its
  control daemon serves), ``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from
  the compute share and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from the memory quota, so the GPU
  itself enforces both.

Example:
    >>> from gpupool_sdk.resources import Allocation, QoS
    >>> a = Allocation("bert", "node-a", "GPU-1", 3, 20 * 2**30, 0.3, QoS.GUARANTEED)
    >>> visible_devices([a], "node-a")
    ['3']
    >>> env = mps_environment([a], "node-a", pipe_dir="/run/gpupool-mps/pipe")
    >>> env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    ('30', '0=20480M')
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpupool_sdk.resources import Allocation, QoS

#: MIG instance UUIDs as NVML reports them (``MIG-<uuid>``); simulated ones are ``MIG-sim-...``.
MIG_PREFIX = "MIG-"

ACTIVE_THREAD_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEM_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIR_ENV = "CUDA_MPS_LOG_DIRECTORY"


def _local(allocations: Sequence[Allocation], node: str) -> list[Allocation]:
    """This node's allocations, one per device, in ``CUDA_VISIBLE_DEVICES`` order."""
    seen: dict[str, Allocation] = {}
    for a in sorted(allocations, key=lambda a: (a.gpu_index, a.gpu_uuid)):
        if a.node == node and a.gpu_uuid not in seen:
            seen[a.gpu_uuid] = a
    return list(seen.values())


def is_mig(gpu_uuid: str) -> bool:
    """True for a MIG instance's UUID."""
    return gpu_uuid.startswith(MIG_PREFIX)


def visible_devices(allocations: Sequence[Allocation], node: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` entries for the job's slices on ``node``.

    Whole GPUs by index (sorted), MIG instances by their ``MIG-`` UUID (CUDA addresses MIG
    instances only by UUID). The job's CUDA ordinal ``k`` is the ``k``-th entry.
    """
    return [a.gpu_uuid if is_mig(a.gpu_uuid) else str(a.gpu_index) for a in _local(allocations, node)]


def thread_percentage(compute_share: float) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for a compute share: the share in percent, rounded up, 1-100.

    Example:
        >>> thread_percentage(0.3), thread_percentage(0.333), thread_percentage(0.001), thread_percentage(1.0)
        (30, 34, 1, 100)
    """
    return max(1, min(100, math.ceil(round(compute_share * 100, 6))))


def mem_limit(memory_bytes: int) -> str:
    """A pinned-memory limit in whole MiB, rounded down (never above the quota): ``"20480M"``."""
    return f"{memory_bytes // (1 << 20)}M"


def mps_environment(
    allocations: Sequence[Allocation], node: str, pipe_dir: str | None, log_dir: str | None = None
) -> dict[str, str]:
    """Environment for a job's process under CUDA MPS, from its allocations on ``node``.

    Args:
        allocations: the job's granted slices (any node; only ``node``'s are used).
        node: the node the process runs on.
        pipe_dir: the MPS control daemon's pipe directory (the GPUs' published ``mps_pipe_dir``);
            None when MPS is not in use: the result is then empty.
        log_dir: the daemon's log directory, if it is not the default.

    Returns:
        ``CUDA_MPS_PIPE_DIRECTORY`` (and ``CUDA_MPS_LOG_DIRECTORY``),
        ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the largest compute share of the job's slices here,
        in percent: one value applies to every device of the process), and
        ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` as ``ordinal=limit`` pairs over the job's CUDA
        ordinals (the order of :func:`visible_devices`). Exclusive slices and MIG instances get
        no limit (the job holds the whole device); a job holding only those gets no share limit.
    """
    local = _local(allocations, node)
    if pipe_dir is None or not local:
        return {}
    env = {PIPE_DIR_ENV: pipe_dir}
    if log_dir is not None:
        env[LOG_DIR_ENV] = log_dir
    limited = [(k, a) for k, a in enumerate(local) if a.mode is not QoS.EXCLUSIVE and not is_mig(a.gpu_uuid)]
    if not limited:
        return env
    env[ACTIVE_THREAD_ENV] = str(thread_percentage(max(a.compute_share for _, a in limited)))
    limits = [f"{k}={mem_limit(a.memory_bytes)}" for k, a in limited if a.memory_bytes > 0]
    if limits:
        env[PINNED_MEM_ENV] = ",".join(limits)
    return env
