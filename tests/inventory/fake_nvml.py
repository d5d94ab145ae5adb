"""A small fake of the ``pynvml`` module: enough NVML for the NVML backend's logic on a CPU.

It raises the real ``pynvml.NVMLError`` classes (so error-code handling is exercised as in
production) and models a box of GPUs with NVLink links, PCIe switches, NUMA nodes, health
readings and an XID event queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

MiB = 1024**2


def err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


NOT_SUPPORTED = _real.NVML_ERROR_NOT_SUPPORTED


@dataclass
class FakeGpu:
    index: int
    name: str = "NVIDIA H100 80GB HBM3"
    memory_bytes: int = 81559 * MiB
    cc: tuple[int, int] = (9, 0)
    cores: int | None = 16896
    sm_attr: int | None = None  # None: nvmlDeviceGetAttributes is NotSupported
    numa: int | None = 0  # None: nvmlDeviceGetNumaNodeId is NotSupported
    cpu_mask: list[int] = field(default_factory=lambda: [0xF])
    links: list[tuple[bool, str]] = field(default_factory=list)  # (active, remote bus id or "switch")
    switch_group: int = 0  # GPUs with equal group share a PCIe switch
    host_group: int = 0  # GPUs with equal group share a NUMA node / host bridge tree
    temperature: float | None = 40.0
    power_mw: int | None = 90_000
    ecc: int | None = 0
    # usage (None: that call or field is NotSupported on this GPU)
    util: tuple[int, int] | None = (0, 0)  # nvmlDeviceGetUtilizationRates: (.gpu, .memory) percent
    memory_used: int = 0
    pcie_kb_s: tuple[int, int] | None = (0, 0)  # nvmlDeviceGetPcieThroughput: (TX, RX) KB/s
    pcie_bytes: tuple[int, int] | None = None  # NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES counters
    nvlink_kib: tuple[int, int] = (0, 0)  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX counters (all links)
    usage_error: int | None = None  # an NVML error code every usage call raises (e.g. UNKNOWN)
    lost: bool = False
    unreadable: bool = False  # NVML cannot even read its UUID (lost before the agent started)
    mig_current: int | None = None  # None: MIG NotSupported; 0 off, 1 on
    mig_pending: int | None = None
    reset_needed: bool = False  # True: a mode change waits for a GPU reset (pending != current)
    mig_profiles: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id -> (slices, MiB, SMs)
    gis: list[FakeGi] = field(default_factory=list)
    next_gi: int = 1

    @property
    def uuid(self) -> str:
        return f"GPU-fake-{self.index:04d}-aaaa-bbbb"

    @property
    def bus_id(self) -> str:
        return f"00000000:{0x18 + self.index * 0x10:02X}:00.0"


@dataclass
class FakeGi:
    """A GPU instance; with a compute instance it is a CUDA device (a MIG device handle)."""

    parent: FakeGpu
    id: int
    profile_id: int
    slices: int
    memory_mib: int
    sms: int
    cis: list[int] = field(default_factory=list)  # compute-instance profile ids
    busy: bool = False  # a process uses it: destroy fails with IN_USE
    unreadable: bool = False
    lost: bool = False

    @property
    def uuid(self) -> str:
        return f"MIG-fake-{self.parent.index:04d}-{self.id}"

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MiB


#: GPU-instance profiles of an A100 80GB: NVML profile id -> (slices, memory MiB, SMs).
A100_80_PROFILES = {0: (1, 9728, 14), 7: (1, 9728, 14), 9: (1, 19968, 14), 1: (2, 19968, 28), 2: (3, 40192, 42),
                    3: (4, 40192, 56), 4: (7, 81152, 98)}


@dataclass
class _Info:
    id: int
    sliceCount: int = 0
    memorySizeMB: int = 0
    multiprocessorCount: int = 0


@dataclass
class _MigAttrs:
    multiprocessorCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


@dataclass
class _Pci:
    busId: bytes


@dataclass
class _Mem:
    total: int
    free: int
    used: int


@dataclass
class _Attrs:
    multiprocessorCount: int


@dataclass
class _Util:
    gpu: int
    memory: int


@dataclass
class _Value:
    ullVal: int = 0
    uiVal: int = 0
    dVal: float = 0.0


@dataclass
class _FieldValue:
    fieldId: int
    scopeId: int
    timestamp: int
    latencyUsec: int
    valueType: int
    nvmlReturn: int
    value: _Value


@dataclass
class _Event:
    device: Any
    eventType: int
    eventData: int


class FakeNvml:
    """Stands in for the ``pynvml`` module; pass it as ``NvmlBackend(nvml=FakeNvml(gpus))``."""

    NVMLError = _real.NVMLError
    NVML_FEATURE_ENABLED = _real.NVML_FEATURE_ENABLED
    NVML_FEATURE_DISABLED = _real.NVML_FEATURE_DISABLED
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_DEVICE_TYPE_GPU = _real.NVML_NVLINK_DEVICE_TYPE_GPU
    NVML_NVLINK_DEVICE_TYPE_SWITCH = _real.NVML_NVLINK_DEVICE_TYPE_SWITCH
    NVML_TOPOLOGY_SINGLE = _real.NVML_TOPOLOGY_SINGLE
    NVML_TOPOLOGY_MULTIPLE = _real.NVML_TOPOLOGY_MULTIPLE
    NVML_TOPOLOGY_NODE = _real.NVML_TOPOLOGY_NODE
    NVML_TOPOLOGY_SYSTEM = _real.NVML_TOPOLOGY_SYSTEM
    NVML_P2P_CAPS_INDEX_NVLINK = _real.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = _real.NVML_P2P_STATUS_OK
    nvmlEventTypeXidCriticalError = _real.nvmlEventTypeXidCriticalError
    NVML_TEMPERATURE_GPU = _real.NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = _real.NVML_VOLATILE_ECC
    NVML_PCIE_UTIL_TX_BYTES = _real.NVML_PCIE_UTIL_TX_BYTES
    NVML_PCIE_UTIL_RX_BYTES = _real.NVML_PCIE_UTIL_RX_BYTES
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES = _real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES = _real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: int | None = _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: int | None = _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG

    def __init__(
        self, gpus: list[FakeGpu], *, init_error: int | None = None, p2p: bool = False, link_api: bool = True
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.p2p = p2p  # False: nvmlDeviceGetP2PStatus is NotSupported (links are the only source)
        self.link_api = link_api  # False: per-link NVLink calls are NotSupported (P2P is the only source)
        self.inits = 0
        self.shutdowns = 0
        self.events: list[_Event] = []
        self.registered: set[int] = set()
        self.event_sets_freed = 0
        self.clock_us = 1_000_000  # the timestamp NVML stamps on field values (tests move it)
        self.calls: dict[str, int] = {}  # usage calls made, by function name
        self.field_ids: list[list[tuple[int, int]]] = []  # the (fieldId, scopeId) lists asked for

    # lifecycle
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise err(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "560.35.03"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    # identity
    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        if h.unreadable:
            raise err(_real.NVML_ERROR_GPU_IS_LOST)
        return h.uuid

    def nvmlDeviceGetName(self, h: FakeGpu) -> bytes:
        return h.name.encode()  # old pynvml versions return bytes

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> _Mem:
        self.calls["memory"] = self.calls.get("memory", 0) + 1
        used = h.memory_used if isinstance(h, FakeGpu) else 0
        return _Mem(total=h.memory_bytes, free=h.memory_bytes - used, used=used)

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu) -> tuple[int, int]:
        return h.cc

    def nvmlDeviceGetAttributes(self, h: FakeGpu | FakeGi) -> _Attrs | _MigAttrs:
        if isinstance(h, FakeGi):
            return _MigAttrs(h.sms, h.slices, h.slices, h.memory_mib)
        if h.sm_attr is None:
            raise err(NOT_SUPPORTED)
        return _Attrs(h.sm_attr)

    def nvmlDeviceGetNumGpuCores(self, h: FakeGpu) -> int:
        if h.cores is None:
            raise err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return h.cores

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> _Pci:
        return _Pci(h.bus_id.encode())

    def nvmlDeviceGetNumaNodeId(self, h: FakeGpu) -> int:
        if h.numa is None:
            raise err(NOT_SUPPORTED)
        return h.numa

    def nvmlDeviceGetCpuAffinity(self, h: FakeGpu, words: int) -> list[int]:
        return (h.cpu_mask + [0] * words)[:words]

    # topology
    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:
        if not h.links or not self.link_api:
            raise err(NOT_SUPPORTED)
        if link >= len(h.links):
            raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.NVML_FEATURE_ENABLED if h.links[link][0] else self.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: FakeGpu, link: int) -> _Pci:
        remote = h.links[link][1]
        return _Pci(b"00000000:F0:00.0" if remote == "switch" else remote.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: FakeGpu, link: int) -> int:
        if h.links[link][1] == "switch":
            return self.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return self.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetP2PStatus(self, a: FakeGpu, b: FakeGpu, cap: int) -> int:
        if not self.p2p:
            raise err(NOT_SUPPORTED)
        linked = any(r == b.bus_id for active, r in a.links if active)
        return self.NVML_P2P_STATUS_OK if linked else 2

    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeGpu, b: FakeGpu) -> int:
        if a.switch_group == b.switch_group:
            return self.NVML_TOPOLOGY_SINGLE
        if a.host_group == b.host_group:
            return self.NVML_TOPOLOGY_NODE
        return self.NVML_TOPOLOGY_SYSTEM

    # health
    def _alive(self, h: FakeGpu) -> None:
        if h.lost:
            raise err(_real.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> float:
        self._alive(h)
        if h.temperature is None:
            raise err(NOT_SUPPORTED)
        return h.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        self._alive(h)
        if h.power_mw is None:
            raise err(NOT_SUPPORTED)
        return h.power_mw

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, error_type: int, counter_type: int) -> int:
        self._alive(h)
        assert error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter_type == self.NVML_VOLATILE_ECC
        if h.ecc is None:
            raise err(NOT_SUPPORTED)
        return h.ecc

    # usage
    def _usage(self, name: str, h: FakeGpu) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self._alive(h)
        if h.usage_error is not None:
            raise err(h.usage_error)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> _Util:
        self._usage("utilization", h)
        if h.util is None:
            raise err(NOT_SUPPORTED)
        return _Util(*h.util)

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        self._usage("pcie_throughput", h)
        if h.pcie_kb_s is None:
            raise err(NOT_SUPPORTED)
        return h.pcie_kb_s[0 if counter == self.NVML_PCIE_UTIL_TX_BYTES else 1]

    def nvmlDeviceGetFieldValues(self, h: FakeGpu, field_ids: list[Any]) -> list[_FieldValue]:
        self._usage("field_values", h)
        asked = [(f, 0) if isinstance(f, int) else (int(f[0]), int(f[1])) for f in field_ids]
        self.field_ids.append(asked)
        has_nvlink = any(active for active, _ in h.links) and self.link_api
        counters = {
            self.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: h.pcie_bytes[0] if h.pcie_bytes is not None else None,
            self.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: h.pcie_bytes[1] if h.pcie_bytes is not None else None,
            _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: h.nvlink_kib[0] if has_nvlink else None,
            _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: h.nvlink_kib[1] if has_nvlink else None,
        }
        out = []
        for fid, scope in asked:
            value = counters.get(fid)
            ret = NOT_SUPPORTED if value is None else 0
            out.append(_FieldValue(fid, scope, self.clock_us, 1, self.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, ret,
                                   _Value(ullVal=value or 0)))
        return out

    # events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, types: int, event_set: str) -> None:
        assert types & self.nvmlEventTypeXidCriticalError
        self.registered.add(h.index)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> _Event:
        assert timeout_ms == 0, "the backend must never block on events"
        if not self.events:
            raise err(_real.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.event_sets_freed += 1

    # MIG
    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> list[int]:
        if h.mig_current is None:
            raise err(NOT_SUPPORTED)
        return [h.mig_current, h.mig_pending if h.mig_pending is not None else h.mig_current]

    def nvmlDeviceSetMigMode(self, h: FakeGpu, mode: int) -> int:
        if h.mig_current is None:
            raise err(NOT_SUPPORTED)
        h.mig_pending = mode
        if not h.reset_needed:
            h.mig_current = mode
            if mode == 0:
                h.gis.clear()
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        if h.mig_current is None:
            raise err(NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, k: int) -> FakeGi:
        devices = [gi for gi in h.gis if gi.cis]
        if k >= len(devices):
            raise err(_real.NVML_ERROR_NOT_FOUND)
        return devices[k]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: FakeGpu, pid: int) -> _Info:
        if not h.mig_current or pid not in h.mig_profiles:
            raise err(NOT_SUPPORTED)
        slices, mib, sms = h.mig_profiles[pid]
        return _Info(pid, slices, mib, sms)

    def nvmlDeviceCreateGpuInstance(self, h: FakeGpu, pid: int) -> FakeGi:
        slices, mib, sms = h.mig_profiles[pid]
        if sum(g.slices for g in h.gis) + slices > 7:
            raise err(_real.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = FakeGi(h, h.next_gi, pid, slices, mib, sms)
        h.next_gi += 1
        h.gis.append(gi)
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: FakeGi, cid: int, engine: int) -> _Info:
        return _Info(cid)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: FakeGi, cid: int) -> tuple[FakeGi, int]:
        gi.cis.append(cid)
        return (gi, cid)

    def nvmlDeviceGetGpuInstances(self, h: FakeGpu, pid: int) -> list[FakeGi]:
        return [gi for gi in h.gis if gi.profile_id == pid]

    def nvmlGpuInstanceGetComputeInstances(self, gi: FakeGi, cid: int) -> list[tuple[FakeGi, int]]:
        return [(gi, c) for c in gi.cis if c == cid]

    def nvmlComputeInstanceDestroy(self, ci: tuple[FakeGi, int]) -> None:
        gi, cid = ci
        if gi.busy:
            raise err(_real.NVML_ERROR_IN_USE)
        gi.cis.remove(cid)

    def nvmlGpuInstanceDestroy(self, gi: FakeGi) -> None:
        if gi.busy or gi.cis:
            raise err(_real.NVML_ERROR_IN_USE)
        gi.parent.gis.remove(gi)

    def inject_xid(self, index: int, xid: int) -> None:
        self.events.append(_Event(self.gpus[index], self.nvmlEventTypeXidCriticalError, xid))


def two_island_box() -> list[FakeGpu]:
    """8 H100s: NVLink islands {0-3} and {4-7} (two links between each pair of an island, one
    inactive link on GPU 0), PCIe switches {0,1} {2,3} {4,5} {6,7}, NUMA 0 for 0-3 and 1 for 4-7
    (GPU 7's NUMA id is NotSupported: found through its CPU affinity), GPU 5 reports no power."""
    gpus = [
        FakeGpu(
            index=i,
            numa=(0 if i < 4 else 1) if i != 7 else None,
            cpu_mask=[0xF if i < 4 else 0xF0],
            switch_group=i // 2,
            host_group=i // 4,
            power_mw=None if i == 5 else 90_000 + i,
        )
        for i in range(8)
    ]
    for g in gpus:
        island = range(0, 4) if g.index < 4 else range(4, 8)
        for peer in island:
            if peer != g.index:
                g.links += [(True, gpus[peer].bus_id), (True, gpus[peer].bus_id)]
    gpus[0].links.append((False, "00000000:99:00.0"))
    return gpus


def nvswitch_box(n: int = 4) -> list[FakeGpu]:
    """``n`` GPUs whose links all end on NVSwitches (one all-to-all fabric)."""
    return [FakeGpu(index=i, links=[(True, "switch")] * 4, switch_group=i, host_group=0) for i in range(n)]


def mig_box() -> list[FakeGpu]:
    """2 A100 80GB: GPU 0 in MIG mode with two 3g.40gb instances, GPU 1 a whole GPU (MIG off)."""
    gpus = [
        FakeGpu(index=i, name="NVIDIA A100-SXM4-80GB", memory_bytes=81920 * MiB, cc=(8, 0), cores=6912,
                switch_group=0, host_group=0, mig_current=1 if i == 0 else 0, mig_profiles=dict(A100_80_PROFILES))
        for i in range(2)
    ]
    nv = FakeNvml(gpus)
    for _ in range(2):
        gi = nv.nvmlDeviceCreateGpuInstance(gpus[0], 2)
        nv.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    return gpus
