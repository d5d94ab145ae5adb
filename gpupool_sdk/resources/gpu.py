"""What a physical GPU is: identity, capacity, topology and health, as the agent publishes it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources._fields import opt, req, strings
from gpupool_sdk.resources.units import format_size

#: feature every MIG GPU instance publishes; such a GPU takes only jobs that ask for a MIG profile.
MIG_INSTANCE_FEATURE = "mig-instance"
#: a MIG instance of profile P publishes the feature ``mig:P``; a job's ``mig_profile`` asks for it.
MIG_PROFILE_PREFIX = "mig:"


def mig_feature(profile: str) -> str:
    """The feature a MIG instance of ``profile`` publishes (``"mig:3g.40gb"``)."""
    return MIG_PROFILE_PREFIX + profile


#: The fields of :class:`GpuReadings`, in the order the CLI shows them.
READING_FIELDS = (
    "utilization",
    "memory_bandwidth_utilization",
    "memory_used_bytes",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "nvlink_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
)
_RATIOS = frozenset({"utilization", "memory_bandwidth_utilization"})


@dataclass(frozen=True)
class GpuReadings:
    """One GPU's usage readings: fast-moving figures, reported and never judged or scheduled on.

    The inventory's :class:`~gpupool_sdk.inventory.health.HealthSample` carries them, and the node
    agent publishes them as the value of ``readings/{node}/{gpu_uuid}``, a key of their own (on the
    agent's lease; the coordinator neither reads nor watches it), at most once per
    ``usage_interval_s``. They are not part of the GPU record (``gpus/{node}/{gpu_uuid}``, the
    scheduler's input), so their churn never wakes a scheduling cycle.

    Attributes:
        utilization: fraction (0-1) of the last sample period in which a kernel ran on the
            device (NVML's ``utilization.gpu``), whoever ran it; None when unknown.
        memory_bandwidth_utilization: fraction (0-1) of the period the device memory was
            being read or written (NVML's ``utilization.memory``).
        memory_used_bytes: device memory in use by every process (and the driver).
        pcie_tx_bytes_per_s: PCIe throughput from the GPU to the host.
        pcie_rx_bytes_per_s: PCIe throughput from the host to the GPU.
        nvlink_tx_bytes_per_s: NVLink data sent, summed over the GPU's links (None on a GPU
            without NVLink).
        nvlink_rx_bytes_per_s: NVLink data received, summed over the GPU's links.

    Every field is None when the agent cannot read it (simulated GPUs, MIG instances, unsupported
    calls) and is written to a value only when known.

    Example:
        >>> GpuReadings(utilization=0.5).to_dict()
        {'utilization': 0.5}
    """

    utilization: float | None = None
    memory_bandwidth_utilization: float | None = None
    memory_used_bytes: int | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None

    @property
    def known(self) -> bool:
        """True when at least one reading is known (the agent publishes only such readings)."""
        return any(getattr(self, name) is not None for name in READING_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        # Written only when known: a value holds what the agent could read, nothing else.
        return {name: v for name in READING_FIELDS if (v := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "readings") -> GpuReadings:
        values: dict[str, Any] = {}
        for name in READING_FIELDS:
            value = opt(d, name, int if name == "memory_used_bytes" else float, where, None)
            if value is not None and value < 0:
                raise SpecError(f"{where}.{name}", f"must not be negative, got {value!r}")
            if value is not None and name in _RATIOS and value > 1:
                raise SpecError(f"{where}.{name}", f"must be a ratio between 0 and 1, got {value!r}")
            values[name] = value
        return cls(**values)


def device_readings(health: GpuHealth, readings: GpuReadings | None) -> dict[str, float | int | None]:
    """Temperature and power (from the GPU record) and the usage readings (from the readings key)
    by field name, None where unknown: what ``gpupool status`` and ``gpupool top`` show.

    Example:
        >>> device_readings(GpuHealth(temperature_c=40.0), GpuReadings(utilization=0.25))["utilization"]
        0.25
    """
    r = readings if readings is not None else GpuReadings()
    return {"temperature_c": health.temperature_c, "power_w": health.power_w,
            **{name: getattr(r, name) for name in READING_FIELDS}}


@dataclass(frozen=True)
class GpuHealth:
    """The agent's health verdict for one GPU.

    Attributes:
        healthy: False when any reason below makes the GPU unusable.
        reasons: human-readable causes (``"ecc double-bit errors: 2"``, ``"xid 79"``, ``"temperature 94C >= 90C"``).
        temperature_c: last temperature read, if known.
        power_w: last power draw, if known.
        ecc_double_bit: volatile double-bit ECC error count, if the GPU reports it.
        xids: recent XID event codes seen by the agent.

    The usage readings (utilisation, memory bandwidth, PCIe/NVLink throughput) are not here: they
    are a :class:`GpuReadings` under a key of their own. A record written by an older agent that
    still carries them in ``health`` decodes, and those fields are ignored.
    """

    healthy: bool = True
    reasons: tuple[str, ...] = ()
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_double_bit: int | None = None
    xids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        d["xids"] = list(self.xids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "health") -> GpuHealth:
        # Fields of other releases (the usage readings older agents wrote here) are ignored.
        return cls(
            healthy=req(d, "healthy", bool, where),
            reasons=tuple(opt(d, "reasons", list, where, [])),
            temperature_c=opt(d, "temperature_c", float, where, None),
            power_w=opt(d, "power_w", float, where, None),
            ecc_double_bit=opt(d, "ecc_double_bit", int, where, None),
            xids=tuple(opt(d, "xids", list, where, [])),
        )


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU in the pool.

    Attributes:
        uuid: NVML UUID (``GPU-...``), or a stable synthetic one for simulated GPUs.
        node: the node (machine) name the GPU is on.
        index: the device index on its node (what ``CUDA_VISIBLE_DEVICES`` names).
        model: catalog name such as ``"H100-80GB"``.
        memory_bytes: total device memory.
        sm_count: streaming multiprocessors.
        compute_capability: ``"9.0"`` etc.
        tflops: peak dense TFLOPS by dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``, ``int8``).
        memory_bandwidth_gbps: peak memory bandwidth in GB/s.
        features: capability tags (``bf16``, ``fp8``, ``tensor_cores``, ``mig``, ``nvlink``).
        nvlink_peers: UUIDs of GPUs reachable over NVLink.
        nvlink_island: id of the NVLink domain on the node (GPUs in one island are all-to-all), or None.
        pcie_path: PCIe bus id / switch path, used to group GPUs under one switch.
        numa_node: NUMA node of the GPU, if known.
        health: the agent's health verdict.
        simulated: True for GPUs declared with ``--simulate``.
        mig_profile: for a MIG GPU instance, its profile (``"3g.40gb"``); None for a whole GPU.
            A MIG instance is published as a GPU of its own (its ``MIG-...`` UUID, memory and SMs);
            ``index`` is its parent's index.
        mig_parent: for a MIG instance, the parent GPU's UUID.
        mps_pipe_dir: the pipe directory of the CUDA MPS control daemon serving this GPU, when
            the agent runs one (jobs sharing it then get MPS limits); None otherwise.
    """

    uuid: str
    node: str
    index: int
    model: str
    memory_bytes: int
    sm_count: int = 0
    compute_capability: str = ""
    tflops: Mapping[str, float] = field(default_factory=dict)
    memory_bandwidth_gbps: float = 0.0
    features: tuple[str, ...] = ()
    nvlink_peers: tuple[str, ...] = ()
    nvlink_island: int | None = None
    pcie_path: str = ""
    numa_node: int | None = None
    health: GpuHealth = field(default_factory=GpuHealth)
    simulated: bool = False
    mig_profile: str | None = None
    mig_parent: str | None = None
    mps_pipe_dir: str | None = None

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def is_mig(self) -> bool:
        """True for a MIG GPU instance."""
        return self.mig_profile is not None

    def describe(self) -> str:
        if self.mig_profile is not None:
            return f"{self.node}/{self.index} {self.model} MIG {self.mig_profile} {format_size(self.memory_bytes)}"
        return f"{self.node}/{self.index} {self.model} {format_size(self.memory_bytes)}"

    def to_dict(self) -> dict[str, Any]:
        d = self._base_dict()
        # Written only when set, so a whole GPU's record is unchanged from older releases.
        for name in ("mig_profile", "mig_parent", "mps_pipe_dir"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    def _base_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "node": self.node,
            "index": self.index,
            "model": self.model,
            "memory_bytes": self.memory_bytes,
            "sm_count": self.sm_count,
            "compute_capability": self.compute_capability,
            "tflops": dict(self.tflops),
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "features": list(self.features),
            "nvlink_peers": list(self.nvlink_peers),
            "nvlink_island": self.nvlink_island,
            "pcie_path": self.pcie_path,
            "numa_node": self.numa_node,
            "health": self.health.to_dict(),
            "simulated": self.simulated,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "gpu") -> GpuInfo:
        health = opt(d, "health", dict, where, None)
        return cls(
            uuid=req(d, "uuid", str, where),
            node=req(d, "node", str, where),
            index=req(d, "index", int, where),
            model=req(d, "model", str, where),
            memory_bytes=req(d, "memory_bytes", int, where),
            sm_count=opt(d, "sm_count", int, where, 0),
            compute_capability=opt(d, "compute_capability", str, where, ""),
            tflops={str(k): float(v) for k, v in opt(d, "tflops", dict, where, {}).items()},
            memory_bandwidth_gbps=opt(d, "memory_bandwidth_gbps", float, where, 0.0),
            features=strings(opt(d, "features", list, where, []), f"{where}.features"),
            nvlink_peers=strings(opt(d, "nvlink_peers", list, where, []), f"{where}.nvlink_peers"),
            nvlink_island=opt(d, "nvlink_island", int, where, None),
            pcie_path=opt(d, "pcie_path", str, where, ""),
            numa_node=opt(d, "numa_node", int, where, None),
            health=GpuHealth.from_dict(health, f"{where}.health") if health is not None else GpuHealth(),
            simulated=opt(d, "simulated", bool, where, False),
            mig_profile=opt(d, "mig_profile", str, where, None),
            mig_parent=opt(d, "mig_parent", str, where, None),
            mps_pipe_dir=opt(d, "mps_pipe_dir", str, where, None),
        )


@dataclass(frozen=True)
class NodeInfo:
    """A machine running a node agent.

    Attributes:
        name: node name (unique in the pool).
        hostname: the OS host name the agent runs on.
        agent_pid: process id of the agent.
        gpu_count: number of GPUs the agent publishes.
        backend: ``"nvml"`` or ``"simulated"``.
        started_at: wall-clock start time of the agent (seconds since the epoch).
        driver_version: NVIDIA driver version, when read through NVML.
    """

    name: str
    hostname: str
    agent_pid: int
    gpu_count: int
    backend: str
    started_at: float
    driver_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "node") -> NodeInfo:
        return cls(
            name=req(d, "name", str, where),
            hostname=opt(d, "hostname", str, where, ""),
            agent_pid=opt(d, "agent_pid", int, where, 0),
            gpu_count=req(d, "gpu_count", int, where),
            backend=opt(d, "backend", str, where, ""),
            started_at=opt(d, "started_at", float, where, 0.0),
            driver_version=opt(d, "driver_version", str, where, ""),
        )
