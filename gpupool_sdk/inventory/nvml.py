"""Real GPUs through NVML (``pynvml``, from the ``nvidia-ml-py`` package).

What is read, and when:

- **Once, at start** (identity and topology): UUID, name, index, total memory, compute
  capability, SM count (``nvmlDeviceGetAttributes``, else CUDA cores / cores per SM, else the
  catalog), PCIe bus id, NUMA node (``nvmlDeviceGetNumaNodeId``, else the CPU affinity mask
  matched against ``/sys/devices/system/node``, else the PCI device's ``numa_node`` in sysfs),
  NVLink (per link: ``nvmlDeviceGetNvLinkState`` and the remote end's PCI bus id, and a peer
  check with ``nvmlDeviceGetP2PStatus(..., NVLINK)``; GPUs whose active links end on an
  NVSwitch are one all-to-all fabric), PCIe grouping (``nvmlDeviceGetTopologyCommonAncestor``:
  GPUs whose common ancestor is at most a PCIe switch share ``pcie_path``).
- **On every refresh** (MIG): a GPU whose current MIG mode is enabled
  (``nvmlDeviceGetMigMode``) is not published itself (CUDA work runs only inside its instances);
  each existing instance (``nvmlDeviceGetMigDeviceHandleByIndex`` up to
  ``nvmlDeviceGetMaxMigDeviceCount``) is, with its ``MIG-`` UUID, memory, SM count and profile
  (``{gi}g.{GiB rounded up}gb``, ``{ci}c.`` in front when the compute instance is smaller than the
  GPU instance, from ``nvmlDeviceGetAttributes``). Read on every refresh, so instances an operator
  creates or destroys (``gpupool mig``) appear and vanish without an agent restart.
- **On every refresh** (health): temperature, power, volatile uncorrectable ECC count, and XID
  events drained from an event set with a 0 ms wait. Fatal XIDs are remembered until the agent
  restarts (a fatal XID needs a GPU reset, after which the agent is restarted anyway).
- **On every refresh** (usage, reported and never judged; one NVML call per metric per GPU):
  SM and memory-controller utilisation (``nvmlDeviceGetUtilizationRates``: ``.gpu``, ``.memory``
  percent, as ratios), memory used (``nvmlDeviceGetMemoryInfo().used``), and one
  ``nvmlDeviceGetFieldValues`` call for the byte counters: ``NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES``
  and, on a GPU with an active NVLink link, ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX`` (KiB,
  summed over all links: scope ``UINT_MAX``). A rate is the difference of two readings over the
  difference of the timestamps NVML puts on them, so the first refresh has none, and neither has a
  refresh after a counter went backwards (driver reload, wrap). They are a
  :class:`~gpupool_sdk.resources.GpuReadings` per GPU (:meth:`NvmlBackend.readings`), not part of
  the health verdict or the GPU record. Where the PCIe counters are not
  supported (older drivers) PCIe falls back to ``nvmlDeviceGetPcieThroughput`` TX and RX
  (KB/s, taken as KiB/s): one call per direction, each sampling 20 ms, so 40 ms per GPU per
  refresh. A pynvml without the NVLink throughput fields leaves NVLink unknown. A MIG-enabled GPU's
  instances carry no usage readings (NVML's figures are the whole GPU's).

Every NVML call that a GPU does not support (``NotSupported``, ``FunctionNotFound``,
``NoPermission``) leaves that one field unknown; any other error leaves it unknown too and is
warned about once per GPU and field; a GPU that NVML reports lost is unhealthy.

``nvlink_island``: islands are the connected components of the NVLink graph, numbered in the
order of their lowest device index; a GPU with no NVLink has None. ``nvlink_peers``: GPUs with
a direct link (through an NVSwitch, every GPU of the fabric).
``pcie_path``: ``pci:<bus id of the lowest-index GPU of the switch group>``, equal for GPUs under
one PCIe switch (or a tree of switches below one host bridge).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.inventory.catalog import GpuModel, match_nvml_name
from gpupool_sdk.inventory.health import HealthSample, HealthThresholds, judge_health
from gpupool_sdk.inventory.mig import mig_instance
from gpupool_sdk.resources.gpu import GpuInfo, GpuReadings, NodeInfo

log = logging.getLogger(__name__)

# NVML error codes (stable C ABI values) that mean "this GPU cannot tell you this field".
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_TIMEOUT = 10
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_UNSUPPORTED = frozenset({_ERR_NOT_SUPPORTED, _ERR_NO_PERMISSION, _ERR_FUNCTION_NOT_FOUND})
_MAX_EVENTS_PER_REFRESH = 256
_ALL_LINKS = 0xFFFFFFFF  # scope id of an NVLink throughput field: the sum over every link
# nvmlValue_t member by nvmlValueType_t (NVML_VALUE_TYPE_DOUBLE = 0 ... UNSIGNED_SHORT = 6).
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

# CUDA cores per SM by compute capability major.minor (for the NumGpuCores fallback).
_CORES_PER_SM = {"7.0": 64, "7.2": 64, "7.5": 64, "8.0": 64, "8.6": 128, "8.7": 128, "8.9": 128, "9.0": 128}


class NvmlUnavailableError(ConfigError):
    """NVML cannot be used here (no NVIDIA driver, no GPU, or no ``pynvml``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            "nvml",
            f"NVIDIA GPUs cannot be read through NVML ({reason}); on a machine without GPUs declare "
            "simulated ones with --simulate, e.g. gpupool agent --node node-a --simulate '4xH100-80GB:nvlink'",
        )


@dataclass
class _Device:
    handle: Any
    pos: int  # position in the backend's device list (a GPU NVML cannot read is skipped)
    index: int
    uuid: str
    name: str
    memory_bytes: int
    compute_capability: str
    sm_count: int
    bus_id: str
    numa_node: int | None
    model: GpuModel | None


class NvmlBackend:
    """The GPUs of this machine, read through NVML.

    Args:
        node: node name (default: the host name).
        thresholds: health limits.
        nvml: the NVML module (default ``pynvml``); tests pass a fake.
        sysfs_root: root of ``/sys`` (tests point it elsewhere).

    Raises:
        NvmlUnavailableError: NVML cannot be initialised or sees no GPU.

    Example:
        >>> backend = NvmlBackend()          # doctest: +SKIP
        >>> [g.model for g in backend.gpus()]  # doctest: +SKIP
        ['H100-80GB', 'H100-80GB']
    """

    kind = "nvml"

    def __init__(
        self,
        node: str | None = None,
        thresholds: HealthThresholds | None = None,
        nvml: Any = None,
        sysfs_root: str | os.PathLike[str] = "/sys",
    ) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailableError(f"pynvml is not installed: {exc}") from None
        self._nvml = nvml
        self._sysfs = Path(sysfs_root)
        self._thresholds = thresholds or HealthThresholds()
        self._node = node or socket.gethostname()
        self._started_at = time.time()
        self._closed = False
        self._warned: set[tuple[str, str]] = set()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailableError(f"nvmlInit failed: {exc}") from None
        try:
            count = nvml.nvmlDeviceGetCount()
            if count < 1:
                raise NvmlUnavailableError("NVML sees no GPU")
            self._driver_version = self._opt("system", "driver_version", nvml.nvmlSystemGetDriverVersion) or ""
            self._devices: list[_Device] = []
            for i in range(count):
                try:
                    self._devices.append(self._identify(i, pos=len(self._devices)))
                except nvml.NVMLError as exc:
                    log.warning("GPU %d cannot be read through NVML (%s); it is not published", i, exc)
            if not self._devices:
                raise NvmlUnavailableError(f"none of the {count} GPU(s) NVML lists can be read")
            self._nvlink_links: set[int] = set()  # positions of GPUs with an active NVLink link
            self._peers, self._islands = self._nvlink_topology()
            self._counters: dict[tuple[str, str], tuple[int, int]] = {}  # (uuid, counter) -> (value, µs)
            self._readings: dict[str, GpuReadings] = {}  # what the last gpus() call read, by UUID
            self._pcie_paths = self._pcie_groups()
            self._xids: dict[str, set[int]] = {d.uuid: set() for d in self._devices}
            self._event_set = self._register_xid_events()
        except BaseException:
            self._shutdown()
            raise

    # ----------------------------------------------------------------------------------- public

    @property
    def node(self) -> str:
        return self._node

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            name=self._node,
            hostname=socket.gethostname(),
            agent_pid=os.getpid(),
            gpu_count=sum(len(m) if (m := self._mig_instances(d)) is not None else 1 for d in self._devices),
            backend=self.kind,
            started_at=self._started_at,
            driver_version=_text(self._driver_version),
        )

    def gpus(self) -> list[GpuInfo]:
        self._drain_xid_events()
        out = []
        readings: dict[str, GpuReadings] = {}
        for d in self._devices:
            instances = self._mig_instances(d)
            sample = self._sample(d, usage=instances is None)
            health = judge_health(sample, self._thresholds)
            if sample.readings.known:
                readings[d.uuid] = sample.readings
            peers = tuple(self._devices[j].uuid for j in sorted(self._peers[d.pos]))
            island = self._islands[d.pos]
            info = self._info(d, peers, island, health)
            if instances is None:
                out.append(info)
            else:
                out.extend(mig_instance(info, *inst) for inst in instances)
        self._readings = readings
        return out

    def readings(self) -> Mapping[str, GpuReadings]:
        return dict(self._readings)

    def mig_enabled(self, index: int) -> bool:
        """True when GPU ``index``'s current MIG mode is enabled."""
        d = next((d for d in self._devices if d.index == index), None)
        return d is not None and self._mig_instances(d) is not None

    # ------------------------------------------------------------------------------------ MIG

    def _mig_instances(self, d: _Device) -> list[tuple[str, str, int, int]] | None:
        """``(profile, uuid, memory_bytes, sm_count)`` of each instance; None when MIG mode is off."""
        nv = self._nvml
        if not hasattr(nv, "nvmlDeviceGetMigMode"):
            return None
        mode = self._opt(d.uuid, "mig_mode", lambda: nv.nvmlDeviceGetMigMode(d.handle))
        if mode is None or int(mode[0]) != 1:  # NVML_DEVICE_MIG_ENABLE
            return None
        top = self._opt(d.uuid, "mig_device_count", lambda: nv.nvmlDeviceGetMaxMigDeviceCount(d.handle)) or 0
        out = []
        for k in range(int(top)):
            try:
                h = nv.nvmlDeviceGetMigDeviceHandleByIndex(d.handle, k)
            except nv.NVMLError:
                continue  # an empty slot (NotFound)
            uuid = _text(self._opt(d.uuid, f"mig{k}_uuid", lambda h=h: nv.nvmlDeviceGetUUID(h)) or "")
            if not uuid:
                continue
            mem = self._opt(uuid, "memory", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            attrs = self._opt(uuid, "attributes", lambda h=h: nv.nvmlDeviceGetAttributes(h))
            memory_bytes = int(mem.total) if mem is not None else 0
            sms = int(getattr(attrs, "multiprocessorCount", 0) or 0)
            gi = int(getattr(attrs, "gpuInstanceSliceCount", 0) or 0)
            ci = int(getattr(attrs, "computeInstanceSliceCount", 0) or 0)
            mem_mib = int(getattr(attrs, "memorySizeMB", 0) or 0) or memory_bytes // (1 << 20)
            out.append((mig_profile_name(gi, ci, mem_mib), uuid, memory_bytes or mem_mib << 20, sms))
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    # ------------------------------------------------------------------------------- identity

    def _identify(self, index: int, pos: int) -> _Device:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nv.nvmlDeviceGetUUID(h))
        name = _text(nv.nvmlDeviceGetName(h))
        mem = self._opt(uuid, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        memory_bytes = int(mem.total) if mem is not None else 0
        cc_pair = self._opt(uuid, "compute_capability", lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
        cc = f"{cc_pair[0]}.{cc_pair[1]}" if cc_pair is not None else ""
        model = match_nvml_name(name, memory_bytes or None)
        if not cc and model is not None:
            cc = model.compute_capability
        pci = self._opt(uuid, "pci", lambda: nv.nvmlDeviceGetPciInfo(h))
        bus_id = _bus_id(pci) if pci is not None else ""
        return _Device(
            handle=h,
            pos=pos,
            index=index,
            uuid=uuid,
            name=name,
            memory_bytes=memory_bytes or (model.memory_bytes if model else 0),
            compute_capability=cc,
            sm_count=self._sm_count(h, uuid, cc, model),
            bus_id=bus_id,
            numa_node=self._numa_node(h, uuid, bus_id),
            model=model,
        )

    def _sm_count(self, h: Any, uuid: str, cc: str, model: GpuModel | None) -> int:
        nv = self._nvml
        attrs = self._opt(uuid, "attributes", lambda: nv.nvmlDeviceGetAttributes(h))
        sms = int(getattr(attrs, "multiprocessorCount", 0) or 0) if attrs is not None else 0
        if sms > 0:
            return sms
        cores = self._opt(uuid, "num_gpu_cores", lambda: nv.nvmlDeviceGetNumGpuCores(h))
        per_sm = _CORES_PER_SM.get(cc) or (128 if cc and float(cc) >= 8.6 else 0)
        if cores and per_sm:
            return int(cores) // per_sm
        return model.sm_count if model else 0

    def _numa_node(self, h: Any, uuid: str, bus_id: str) -> int | None:
        nv = self._nvml
        numa = self._opt(uuid, "numa_node", lambda: nv.nvmlDeviceGetNumaNodeId(h))
        if isinstance(numa, int) and numa >= 0:
            return numa
        node_cpus = _numa_cpus(self._sysfs)
        if node_cpus:
            words = (os.cpu_count() or 64) // 64 + 1
            mask = self._opt(uuid, "cpu_affinity", lambda: nv.nvmlDeviceGetCpuAffinity(h, words))
            if mask is not None:
                cpus = {w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1}
                for node_id, node_set in sorted(node_cpus.items()):
                    if cpus and cpus <= node_set:
                        return node_id
        if bus_id:
            # sysfs names PCI devices with a 4-digit domain; NVML uses 8 digits.
            dom, _, rest = bus_id.partition(":")
            path = self._sysfs / "bus" / "pci" / "devices" / f"{dom[-4:]}:{rest}".lower() / "numa_node"
            try:
                value = int(path.read_text().strip())
            except (OSError, ValueError):
                return None
            return value if value >= 0 else None
        return None

    # ------------------------------------------------------------------------------- topology

    def _nvlink_topology(self) -> tuple[list[set[int]], list[int | None]]:
        nv = self._nvml
        n = len(self._devices)
        by_bus = {d.bus_id: d.pos for d in self._devices if d.bus_id}
        peers: list[set[int]] = [set() for _ in range(n)]
        on_switch: set[int] = set()
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
        switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        for d in self._devices:
            for link in range(max_links):
                try:
                    state = nv.nvmlDeviceGetNvLinkState(d.handle, link)
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) == _ERR_GPU_IS_LOST:
                        log.warning("GPU %s is lost while reading NVLink state", d.uuid)
                    break  # no such link (InvalidArgument) or no NVLink at all (NotSupported)
                if state != getattr(nv, "NVML_FEATURE_ENABLED", 1):
                    continue
                self._nvlink_links.add(d.pos)
                remote = self._opt(d.uuid, "nvlink_remote_pci", lambda d=d, link=link: nv.nvmlDeviceGetNvLinkRemotePciInfo(d.handle, link))
                remote_bus = _bus_id(remote) if remote is not None else ""
                if remote_bus in by_bus and by_bus[remote_bus] != d.pos:
                    peers[d.pos].add(by_bus[remote_bus])
                    peers[by_bus[remote_bus]].add(d.pos)
                    continue
                rtype = self._opt(d.uuid, "nvlink_remote_type", lambda d=d, link=link: nv.nvmlDeviceGetNvLinkRemoteDeviceType(d.handle, link)) if hasattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType") else None
                if rtype == switch_type:
                    on_switch.add(d.pos)
        for i in on_switch:  # an NVSwitch fabric is all-to-all
            peers[i].update(on_switch - {i})
        p2p_ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
        nvlink_cap = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
        if hasattr(nv, "nvmlDeviceGetP2PStatus"):
            for a in self._devices:
                for b in self._devices[a.pos + 1 :]:
                    status = self._opt(a.uuid, "p2p_nvlink", lambda a=a, b=b: nv.nvmlDeviceGetP2PStatus(a.handle, b.handle, nvlink_cap))
                    if status is not None and status == p2p_ok:
                        peers[a.pos].add(b.pos)
                        peers[b.pos].add(a.pos)
        self._nvlink_links.update(i for i in range(n) if peers[i])
        islands: list[int | None] = [None] * n
        next_island = 0
        for start in range(n):
            if islands[start] is not None or not peers[start]:
                continue
            stack = [start]
            islands[start] = next_island
            while stack:
                i = stack.pop()
                for j in peers[i]:
                    if islands[j] is None:
                        islands[j] = next_island
                        stack.append(j)
            next_island += 1
        return peers, islands

    def _pcie_groups(self) -> list[str]:
        nv = self._nvml
        multiple = getattr(nv, "NVML_TOPOLOGY_MULTIPLE", 20)
        n = len(self._devices)
        parent = list(range(n))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for a in self._devices:
            for b in self._devices[a.pos + 1 :]:
                level = self._opt(a.uuid, "topology_common_ancestor", lambda a=a, b=b: nv.nvmlDeviceGetTopologyCommonAncestor(a.handle, b.handle))
                if level is not None and int(level) <= multiple:
                    ra, rb = find(a.pos), find(b.pos)
                    parent[max(ra, rb)] = min(ra, rb)
        paths = []
        for d in self._devices:
            root = self._devices[find(d.pos)]
            paths.append(f"pci:{root.bus_id or root.index}")
        return paths

    # --------------------------------------------------------------------------------- health

    def _register_xid_events(self) -> Any:
        nv = self._nvml
        event_set = self._opt("system", "event_set", nv.nvmlEventSetCreate)
        if event_set is None:
            return None
        xid_type = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
        for d in self._devices:
            self._opt(d.uuid, "xid_events", lambda d=d: nv.nvmlDeviceRegisterEvents(d.handle, xid_type, event_set))
        return event_set

    def _drain_xid_events(self) -> None:
        nv = self._nvml
        if self._event_set is None:
            return
        xid_type = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
        for _ in range(_MAX_EVENTS_PER_REFRESH):
            try:
                event = nv.nvmlEventSetWait(self._event_set, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != _ERR_TIMEOUT:
                    self._warn_once("system", "xid_wait", exc)
                return
            if int(getattr(event, "eventType", 0)) & xid_type == 0:
                continue
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(event.device))
            except nv.NVMLError:
                uuid = ""
            xid = int(event.eventData)
            if uuid in self._xids:
                if xid not in self._xids[uuid]:
                    log.warning("GPU %s reported XID %d", uuid, xid)
                self._xids[uuid].add(xid)
            else:
                log.warning("XID %d from a device NVML could not name", xid)

    def _sample(self, d: _Device, usage: bool = True) -> HealthSample:
        nv = self._nvml
        lost = False

        def read(field: str, fn: Any) -> Any:
            nonlocal lost
            try:
                return fn()
            except nv.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == _ERR_GPU_IS_LOST:
                    lost = True
                elif code not in _UNSUPPORTED:
                    self._warn_once(d.uuid, field, exc)
                return None

        temp = read("temperature", lambda: nv.nvmlDeviceGetTemperature(d.handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0)))
        power_mw = read("power", lambda: nv.nvmlDeviceGetPowerUsage(d.handle))
        ecc = read(
            "ecc",
            lambda: nv.nvmlDeviceGetTotalEccErrors(
                d.handle,
                getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                getattr(nv, "NVML_VOLATILE_ECC", 0),
            ),
        )
        readings: dict[str, Any] = {}
        if usage and not lost:
            util = read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(d.handle))
            if util is not None:
                readings["utilization"] = _ratio(util.gpu)
                readings["memory_bandwidth_utilization"] = _ratio(util.memory)
            mem = read("memory_used", lambda: nv.nvmlDeviceGetMemoryInfo(d.handle))
            if mem is not None:
                readings["memory_used_bytes"] = int(mem.used)
            readings.update(self._throughput(d, read))
        return HealthSample(
            temperature_c=float(temp) if temp is not None else None,
            power_w=round(float(power_mw) / 1000.0, 1) if power_mw is not None else None,
            ecc_double_bit=int(ecc) if ecc is not None else None,
            xids=tuple(sorted(self._xids.get(d.uuid, ()))),
            lost=lost,
            readings=GpuReadings(**readings),
        )

    def _throughput(self, d: _Device, read: Any) -> dict[str, float | None]:
        """PCIe and NVLink bytes/s from one ``nvmlDeviceGetFieldValues`` call (PCIe: else the 20 ms call)."""
        nv = self._nvml
        # name -> (field id, scope id, bytes per counter unit)
        wanted: dict[str, tuple[int, int, int]] = {}
        for name, attr in (("pcie_tx", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES"), ("pcie_rx", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")):
            fid = getattr(nv, attr, None)
            if fid is not None:
                wanted[name] = (int(fid), 0, 1)
        if d.pos in self._nvlink_links:
            for name, attr in (("nvlink_tx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"), ("nvlink_rx", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX")):
                fid = getattr(nv, attr, None)
                if fid is not None:
                    wanted[name] = (int(fid), _ALL_LINKS, 1024)  # KiB
        values = None
        if wanted and hasattr(nv, "nvmlDeviceGetFieldValues"):
            values = read("field_values", lambda: nv.nvmlDeviceGetFieldValues(d.handle, [(f, sc) for f, sc, _ in wanted.values()]))
        out: dict[str, float | None] = {}
        counted: set[str] = set()
        for i, (name, (_, _, unit)) in enumerate(wanted.items()):
            v = values[i] if values is not None and i < len(values) else None
            raw = self._field_value(d.uuid, name, v) if v is not None else None
            if raw is None:
                self._counters.pop((d.uuid, name), None)
                continue
            counted.add(name)
            stamp = int(getattr(v, "timestamp", 0) or 0) or int(time.monotonic() * 1e6)
            out[f"{name}_bytes_per_s"] = self._rate(d.uuid, name, raw, stamp, unit)
        if "pcie_tx" not in counted or "pcie_rx" not in counted:
            # No PCIe byte counters: the throughput call samples a 20 ms window per direction, in KB/s.
            for name, attr, default in (("pcie_tx", "NVML_PCIE_UTIL_TX_BYTES", 0), ("pcie_rx", "NVML_PCIE_UTIL_RX_BYTES", 1)):
                counter = getattr(nv, attr, default)
                kb_s = read(name, lambda counter=counter: nv.nvmlDeviceGetPcieThroughput(d.handle, counter))
                out[f"{name}_bytes_per_s"] = float(kb_s) * 1024.0 if kb_s is not None else None
        return out

    def _field_value(self, uuid: str, name: str, v: Any) -> int | None:
        """The counter in one ``nvmlFieldValue_t``; None when NVML could not read that field."""
        ret = int(getattr(v, "nvmlReturn", 0) or 0)
        if ret != 0:
            if ret not in _UNSUPPORTED:
                self._warn_once(uuid, f"{name}_counter", self._nvml.NVMLError(ret))
            return None
        vt = int(getattr(v, "valueType", 3))
        member = _VALUE_MEMBERS[vt] if 0 <= vt < len(_VALUE_MEMBERS) else "ullVal"
        return int(getattr(v.value, member))

    def _rate(self, uuid: str, name: str, value: int, stamp_us: int, unit: int) -> float | None:
        """Bytes/s between this counter reading and the last; None for the first or after a reset."""
        prev = self._counters.get((uuid, name))
        self._counters[(uuid, name)] = (value, stamp_us)
        if prev is None:
            return None
        dv, dt = value - prev[0], stamp_us - prev[1]
        if dv < 0 or dt <= 0:
            return None
        return dv * unit / (dt / 1e6)

    # -------------------------------------------------------------------------------- helpers

    def _info(self, d: _Device, peers: tuple[str, ...], island: int | None, health: Any) -> GpuInfo:
        m = d.model
        if m is not None:
            features = [f for f in m.features if f != "nvlink"]
            tflops: dict[str, float] = dict(m.tflops)
            bandwidth = m.memory_bandwidth_gbps
            model_name = m.name
        else:
            features = _features_from_cc(d.compute_capability)
            tflops = {}
            bandwidth = 0.0
            model_name = _model_name(d.name)
        if peers:
            features.append("nvlink")
        return GpuInfo(
            uuid=d.uuid,
            node=self._node,
            index=d.index,
            model=model_name,
            memory_bytes=d.memory_bytes,
            sm_count=d.sm_count,
            compute_capability=d.compute_capability,
            tflops=tflops,
            memory_bandwidth_gbps=bandwidth,
            features=tuple(features),
            nvlink_peers=peers,
            nvlink_island=island,
            pcie_path=self._pcie_paths[d.pos],
            numa_node=d.numa_node,
            health=health,
            simulated=False,
        )

    def _opt(self, who: str, field: str, fn: Any) -> Any:
        """Call ``fn``; None when the GPU does not support it (warn once for other NVML errors)."""
        try:
            return fn()
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in _UNSUPPORTED:
                self._warn_once(who, field, exc)
            return None

    def _warn_once(self, who: str, field: str, exc: BaseException) -> None:
        if (who, field) not in self._warned:
            self._warned.add((who, field))
            log.warning("NVML cannot read %s of %s: %s", field, who, exc)

    def _shutdown(self) -> None:
        nv = self._nvml
        event_set = getattr(self, "_event_set", None)
        if event_set is not None:
            self._opt("system", "event_set_free", lambda: nv.nvmlEventSetFree(event_set))
            self._event_set = None
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def mig_profile_name(gpu_slices: int, compute_slices: int, memory_mib: int) -> str:
    """The nvidia-smi name of a MIG instance from its attributes: ``3g.40gb``, ``1c.3g.40gb``.

    The memory figure is the instance's memory in GiB rounded up (a 3g.40gb instance of an
    A100 80GB has 40192 MiB). The ``+me`` media-extension variants are named as their base profile.

    Example:
        >>> mig_profile_name(3, 3, 40192), mig_profile_name(3, 1, 40192), mig_profile_name(1, 1, 4864)
        ('3g.40gb', '1c.3g.40gb', '1g.5gb')
    """
    gb = -(-memory_mib // 1024)
    name = f"{gpu_slices}g.{gb}gb"
    return f"{compute_slices}c.{name}" if 0 < compute_slices < gpu_slices else name


def nvml_available(nvml: Any = None) -> bool:
    """True when NVML initialises and sees at least one GPU (used to pick a backend)."""
    try:
        nv = nvml if nvml is not None else importlib.import_module("pynvml")
    except ImportError:
        return False
    try:
        nv.nvmlInit()
    except Exception:
        return False
    try:
        return int(nv.nvmlDeviceGetCount()) > 0
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def _ratio(percent: Any) -> float:
    return min(1.0, max(0.0, float(percent) / 100.0))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(pci: Any) -> str:
    raw = getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b"")
    return _text(raw).strip().lower()


def _model_name(nvml_name: str) -> str:
    """``"NVIDIA A10G"`` -> ``"A10G"``: a readable model name for GPUs outside the catalog."""
    name = re.sub(r"^(NVIDIA|Tesla)\s+", "", nvml_name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-") or "unknown"


def _features_from_cc(cc: str) -> list[str]:
    try:
        v = float(cc)
    except ValueError:
        return ["fp32"]
    feats = ["fp64", "fp32", "fp16"]
    if v >= 6.1:
        feats.append("int8")
    if v >= 7.0:
        feats.append("tensor_cores")
    if v >= 8.0:
        feats += ["tf32", "bf16"]
    if v >= 8.9:
        feats.append("fp8")
    return feats


def _numa_cpus(sysfs: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    try:
        entries = list((sysfs / "devices" / "system" / "node").glob("node[0-9]*"))
    except OSError:
        return out
    for entry in entries:
        try:
            cpus = _parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        out[int(entry.name[4:])] = cpus
    return out


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus
