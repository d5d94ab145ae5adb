"""World size and node rank from the launcher's environment (pure: a mapping in, a record out).

The pool does not place processes on machines: torchrun, Slurm or Kubernetes do, and they tell
each process where it stands through environment variables. :func:`launch_info` reads them:

=============  ==========================================================================
launcher       variables (first match wins, in this order)
=============  ==========================================================================
torchrun       ``TORCHELASTIC_RUN_ID`` or ``GROUP_RANK`` present: ``WORLD_SIZE``, ``RANK``,
               ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node rank),
               ``GROUP_WORLD_SIZE`` (nodes; else ``WORLD_SIZE / LOCAL_WORLD_SIZE``).
               Kubernetes PyTorchJob / JobSet pods that run torchrun land here too.
slurm          ``SLURM_PROCID`` present (``srun``): ``SLURM_NTASKS`` (world), ``SLURM_PROCID``,
               ``SLURM_LOCALID``, ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``, ``SLURM_NODEID``;
               tasks per node from ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``
               (``"4(x2)"``), else world / nodes.
kubernetes     ``PET_NNODES`` present (Kubeflow PyTorchJob without torchrun in the process):
               ``PET_NNODES``, ``PET_NODE_RANK`` (else ``RANK``), ``PET_NPROC_PER_NODE``
               (else 1); ``WORLD_SIZE`` / ``RANK`` as the operator sets them.
env            ``WORLD_SIZE`` present (``torch.distributed`` env:// by hand): ``RANK``,
               ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` / ``GROUP_RANK``.
none           nothing of the above: one process, one node.
=============  ==========================================================================

A malformed value is a :class:`~gpupool_sdk.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpupool_sdk.errors import ConfigError


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process stands in a (possibly multi-node) launch.

    Attributes:
        launcher: ``"torchrun"``, ``"slurm"``, ``"kubernetes"``, ``"env"`` or ``"none"``.
        world_size: processes in the whole job.
        rank: this process's global rank.
        local_rank: its rank on this node.
        local_world_size: processes on this node.
        nnodes: nodes in the job.
        node_rank: this node's rank (0 .. nnodes-1).
    """

    launcher: str
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    nnodes: int = 1
    node_rank: int = 0

    @property
    def leases(self) -> bool:
        """True for the process that leases its node's part: local rank 0."""
        return self.local_rank == 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def _int(env: Mapping[str, str], name: str, default: int | None = None, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ConfigError(name, "is required by this launcher but not set")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(name, f"must be a whole number, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    return value


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_tasks_per_node(env: Mapping[str, str], world: int, nnodes: int) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    raw = env.get("SLURM_TASKS_PER_NODE", "")
    if raw:
        first = raw.split(",")[0].strip()
        m = _TASKS_RE.match(first)
        if m is None:
            raise ConfigError("SLURM_TASKS_PER_NODE", f"expected a form such as '4(x2)' or '4,2', got {raw!r}")
        return int(m.group(1))
    return max(1, world // max(1, nnodes))


def _check(info: LaunchInfo, names: str) -> LaunchInfo:
    if not 0 <= info.rank < info.world_size:
        raise ConfigError(names, f"rank {info.rank} is outside the world of {info.world_size} processes")
    if not 0 <= info.node_rank < info.nnodes:
        raise ConfigError(names, f"node rank {info.node_rank} is outside the {info.nnodes} node(s)")
    if not 0 <= info.local_rank < info.local_world_size:
        raise ConfigError(names, f"local rank {info.local_rank} is outside the {info.local_world_size} local process(es)")
    return info


def launch_info(env: Mapping[str, str]) -> LaunchInfo:
    """Read world size, ranks and node rank from a launcher's environment (see the module docstring).

    Args:
        env: the environment (``os.environ``).

    Raises:
        ConfigError: a variable is malformed or inconsistent; the message names it.

    Example:
        >>> launch_info({"TORCHELASTIC_RUN_ID": "j", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1",
        ...              "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}).node_rank
        1
    """
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        world = _int(env, "WORLD_SIZE", minimum=1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", minimum=1)
        nnodes = _int(env, "GROUP_WORLD_SIZE", max(1, world // local_world), minimum=1)
        info = LaunchInfo(
            "torchrun",
            world_size=world,
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=local_world,
            nnodes=nnodes,
            node_rank=_int(env, "GROUP_RANK"),
        )
        return _check(info, "WORLD_SIZE/RANK/LOCAL_RANK/GROUP_RANK")
    if "SLURM_PROCID" in env:
        nodes_var = "SLURM_NNODES" if env.get("SLURM_NNODES") else "SLURM_JOB_NUM_NODES"
        nnodes = _int(env, nodes_var, 1, minimum=1)
        world = _int(env, "SLURM_NTASKS", nnodes, minimum=1)
        info = LaunchInfo(
            "slurm",
            world_size=world,
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=_slurm_tasks_per_node(env, world, nnodes),
            nnodes=nnodes,
            node_rank=_int(env, "SLURM_NODEID", 0),
        )
        return _check(info, "SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID/SLURM_NNODES")
    if "PET_NNODES" in env:
        nnodes = _int(env, "PET_NNODES", minimum=1)
        per_node = _int(env, "PET_NPROC_PER_NODE", 1, minimum=1) if env.get("PET_NPROC_PER_NODE", "auto") != "auto" else 1
        node_rank = _int(env, "PET_NODE_RANK", _int(env, "RANK", 0))
        world = nnodes * per_node
        info = LaunchInfo(
            "kubernetes",
            world_size=world,
            rank=node_rank * per_node,
            local_rank=0,
            local_world_size=per_node,
            nnodes=nnodes,
            node_rank=node_rank,
        )
        return _check(info, "PET_NNODES/PET_NODE_RANK")
    if "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE", minimum=1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world, minimum=1)
        node_var = "NODE_RANK" if "NODE_RANK" in env else "GROUP_RANK"
        info = LaunchInfo(
            "env",
            world_size=world,
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=local_world,
            nnodes=max(1, world // local_world),
            node_rank=_int(env, node_var, 0),
        )
        return _check(info, "WORLD_SIZE/RANK/LOCAL_RANK/NODE_RANK")
    return LaunchInfo("none")
