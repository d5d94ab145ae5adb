"""The three ways a training process holds (or follows) a job's lease, behind one Protocol.

* :attr:`LeaseMode.DIRECT`: the process submits its own spec (``PoolClient.acquire``) and its
  client's helper process keeps the etcd lease alive.
* :attr:`LeaseMode.ATTACHED`: under ``gpupool run`` (``$GPUPOOL_RUN_SOCKET``) the launcher holds
  the lease and the process talks to it over a local socket (:mod:`.run_channel`).
* :attr:`LeaseMode.FOLLOWER`: a non-zero rank; it holds nothing and learns every decision from
  rank 0 through the framework's broadcast.

Both lease-holding kinds implement :class:`JobLease`, so the runtime never asks what it holds.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.resources import Directive, JobSpec
from gpupool_sdk.runtime.env import DEVICES_ENV, JOB_ENV, LEASE_ID_ENV, LEASED_ENV, RESUME_ENV, RUN_SOCKET_ENV


class LeaseMode(str, enum.Enum):
    """How this process relates to the job's lease (see the module docstring)."""

    DIRECT = "direct"
    ATTACHED = "attached"
    FOLLOWER = "follower"

    @classmethod
    def for_process(cls, rank: int, local_rank: int | None = None, gang: bool = False) -> LeaseMode:
        """The mode of a process in the current environment.

        In a single-node job the process of global rank 0 leases; in a multi-node gang
        (``gang``) every node's local rank 0 does (it joins with its node's part).
        """
        if os.environ.get(RUN_SOCKET_ENV):
            # Under `gpupool run` the node's launcher holds the node's lease: its local rank 0 attaches.
            return cls.ATTACHED if (local_rank if local_rank is not None else rank) == 0 else cls.FOLLOWER
        leads = (local_rank == 0) if gang and local_rank is not None else rank == 0
        return cls.DIRECT if leads else cls.FOLLOWER


@runtime_checkable
class JobLease(Protocol):
    """What a training process uses of a held lease (``client.Lease`` and ``ChannelLease``)."""

    @property
    def job(self) -> str: ...

    @property
    def lost(self) -> bool: ...

    @property
    def etcd_lease_hex(self) -> str: ...

    def device_indices(self) -> list[str]: ...

    def directives(self) -> Iterator[Directive]: ...

    def add_lost_callback(self, cb: Callable[[Any], None]) -> None: ...

    def ack(self, directive: Directive, step: int = 0, checkpoint: str | None = None,
            reached_bytes: int | None = None, ok: bool = True, message: str = "") -> None: ...

    def publish_telemetry(self, summary: Mapping[str, Any]) -> None: ...

    def wait_released(self, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...


@dataclass
class Grant:
    """What a process learns when it takes (or follows) the lease.

    Attributes:
        mode: how the lease is held.
        lease: the held lease (None for followers).
        job: the job name (the launcher's name wins under ``gpupool run``).
        devices: local device indices for ``CUDA_VISIBLE_DEVICES`` (empty: simulated GPUs or unknown).
        slices: slice count (the framework's device count).
        resume_hint: the checkpoint the pool (or rank 0) recorded for the job, or None.
        lease_hex: the etcd lease id in hex ("" for followers without one).
        launcher_spec: under ``gpupool run``, the launcher's spec (``JobSpec.to_dict()``).
    """

    mode: LeaseMode
    lease: JobLease | None
    job: str
    devices: list[str]
    slices: int
    resume_hint: str | None
    lease_hex: str = ""
    launcher_spec: Mapping[str, Any] | None = None


def take_lease(mode: LeaseMode, spec: JobSpec, *, rank: int, client_factory: Callable[[], Any],
               timeout: float | None, on_status: Callable[[Any], None] | None) -> Grant:
    """Take the lease in ``mode`` (or read rank 0's grant).

    Raises:
        ConfigError: a follower finds no grant exported by rank 0, or the launcher is unreachable.
        AcquireTimeoutError: not granted within ``timeout``.
    """
    if mode is LeaseMode.FOLLOWER:
        if spec.is_gang and os.environ.get(LEASED_ENV) != "1":
            # A gang's other local ranks were started by the launcher, not by their node's rank 0:
            # they follow its broadcast decisions and compute the resume point from the shared dir.
            return Grant(mode, None, spec.name, [], spec.gpus_per_node, None, os.environ.get(LEASE_ID_ENV, ""))
        if os.environ.get(LEASED_ENV) != "1":
            raise ConfigError(
                "RANK",
                f"this process is rank {rank} but rank 0 exported no grant ({LEASED_ENV} unset); "
                "start multi-process jobs from one script (Lightning's ddp launcher) or under `gpupool run`",
            )
        # The job's name is the one rank 0 (or `gpupool run`) holds the grant under, which may
        # differ from the script's name= (the launcher's --name wins on rank 0).
        return Grant(mode, None, os.environ.get(JOB_ENV) or spec.name, [],
                     int(os.environ.get(DEVICES_ENV, str(spec.gpus))), os.environ.get(RESUME_ENV) or None,
                     os.environ.get(LEASE_ID_ENV, ""))
    if mode is LeaseMode.ATTACHED:
        from gpupool_sdk.runtime.run_channel import ChannelLease

        channel = ChannelLease.connect(os.environ[RUN_SOCKET_ENV])
        devices = channel.device_indices()
        return Grant(mode, channel, channel.job, devices, max(1, len(devices)) if devices else spec.gpus,
                     channel.resume_from, channel.etcd_lease_hex, channel.spec)
    client = client_factory()
    lease = client.acquire(spec, timeout=timeout, on_status=on_status)
    ck = client.resume_info(spec.name)
    devices = lease.device_indices()
    return Grant(mode, lease, spec.name, devices, max(1, len(devices)) if devices else spec.gpus,
                 ck.path if ck is not None and ck.path else None, lease.etcd_lease_hex)


def device_list(devices: str | Sequence[Any]) -> list[str]:
    """``"0,2"`` or ``[0, 2]`` -> ``["0", "2"]``."""
    if isinstance(devices, str):
        return [x.strip() for x in devices.split(",") if x.strip()]
    return [str(x) for x in devices]
