"""Resource model: sizes, GPUs, job specs, allocations, directives and acks."""

from gpupool_sdk.resources.gang import GangMember
from gpupool_sdk.resources.gpu import GpuHealth, GpuInfo, GpuReadings, NodeInfo
from gpupool_sdk.resources.grant import Ack, Allocation, Directive, DirectiveKind, LeaderRecord
from gpupool_sdk.resources.job import Checkpoint, JobSpec, JobState, JobStatus, QoS, Topology
from gpupool_sdk.resources.units import GiB, KiB, MiB, TiB, format_size, parse_size

__all__ = [
    "Ack",
    "Allocation",
    "Checkpoint",
    "Directive",
    "DirectiveKind",
    "GangMember",
    "GiB",
    "GpuHealth",
    "GpuInfo",
    "GpuReadings",
    "JobSpec",
    "JobState",
    "JobStatus",
    "KiB",
    "LeaderRecord",
    "MiB",
    "NodeInfo",
    "QoS",
    "TiB",
    "Topology",
    "format_size",
    "parse_size",
]
