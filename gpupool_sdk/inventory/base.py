"""The inventory backend interface and the simulated backend.

A backend describes one node: :meth:`InventoryBackend.node_info`,
:meth:`InventoryBackend.gpus` (with health read afresh on every call) and
:meth:`InventoryBackend.readings` (the usage readings that call read). The node agent publishes
what they return. Two backends exist: :class:`SimulatedBackend` (GPUs declared with
``--simulate``) and :class:`~gpupool_sdk.inventory.nvml.NvmlBackend` (real GPUs).

Fault file (simulated GPUs only): a JSON object read on every refresh, mapping a GPU UUID to the
readings to fake, so tests and demos can break a GPU from outside the agent process::

    {"GPU-sim-node-a-0": {"temperature_c": 95},
     "GPU-sim-node-a-1": {"xid": 79},
     "GPU-sim-node-a-2": {"ecc_double_bit": 2}}

Accepted fields: ``temperature_c``, ``power_w``, ``ecc_double_bit``, ``xid`` (one code) or
``xids`` (a list), ``lost`` (bool), and the usage readings of
:class:`~gpupool_sdk.resources.GpuReadings` (``utilization``, ``memory_bandwidth_utilization``,
``memory_used_bytes``, ``pcie_tx_bytes_per_s``...), which a simulated GPU otherwise lacks:
``{"GPU-sim-node-a-0": {"utilization": 0.9, "pcie_rx_bytes_per_s": 2e9}}``. A fault lasts while it is in the file: remove the entry and
the GPU is healthy again on the next refresh. A missing file means no faults; a malformed file
is reported with a warning and the previous faults stay in force (a half-written file is not a
recovery).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpupool_sdk.errors import SpecError
from gpupool_sdk.inventory.health import HealthSample, HealthThresholds, judge_health
from gpupool_sdk.inventory.simulated import NodeDecl, parse_nodes
from gpupool_sdk.resources.gpu import READING_FIELDS, GpuHealth, GpuInfo, GpuReadings, NodeInfo

log = logging.getLogger(__name__)

SIM_IDLE_TEMPERATURE_C = 40.0
SIM_IDLE_POWER_FRACTION = 0.1


@runtime_checkable
class InventoryBackend(Protocol):
    """What the node agent needs from an inventory source (one node)."""

    @property
    def node(self) -> str:
        """The node name."""
        ...

    def node_info(self) -> NodeInfo:
        """The node's description (name, host, agent pid, GPU count, backend kind)."""
        ...

    def gpus(self) -> list[GpuInfo]:
        """Every GPU of the node, in index order, with health read now."""
        ...

    def readings(self) -> Mapping[str, GpuReadings]:
        """The usage readings the last :meth:`gpus` call read, by GPU UUID (GPUs without any: absent)."""
        ...

    def close(self) -> None:
        """Release the backend's resources (NVML handles); idempotent."""
        ...


class FaultFile:
    """Reads the JSON fault file (see the module docstring) and keeps the last valid content.

    Args:
        path: the file; it need not exist yet.
    """

    _FIELDS = frozenset({"temperature_c", "power_w", "ecc_double_bit", "xid", "xids", "lost", *READING_FIELDS})

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._faults: dict[str, dict[str, Any]] = {}
        self._last_problem: str | None = None

    def read(self) -> dict[str, dict[str, Any]]:
        """The faults by GPU UUID, re-read from disk (the previous ones if the file is malformed)."""
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            self._faults = {}
            return {}
        except OSError as exc:
            self._warn(f"cannot read fault file {self.path}: {exc}; keeping the previous faults")
            return self._faults
        try:
            faults = self._parse(raw)
        except ValueError as exc:
            self._warn(f"fault file {self.path} ignored: {exc}; keeping the previous faults")
            return self._faults
        self._last_problem = None
        self._faults = faults
        return faults

    def _warn(self, problem: str) -> None:
        if problem != self._last_problem:  # once per distinct problem, not once per refresh
            log.warning("%s", problem)
            self._last_problem = problem

    def _parse(self, raw: str) -> dict[str, dict[str, Any]]:
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object {{uuid: {{field: value}}}}, got {type(obj).__name__}")
        out: dict[str, dict[str, Any]] = {}
        for uuid, fault in obj.items():
            if not isinstance(fault, dict):
                raise ValueError(f"entry {uuid!r} must be an object such as {{\"xid\": 79}}, got {fault!r}")
            unknown = set(fault) - self._FIELDS
            if unknown:
                raise ValueError(
                    f"entry {uuid!r} has unknown field(s) {sorted(unknown)}; use {sorted(self._FIELDS)}"
                )
            for name in ("temperature_c", "power_w"):
                if name in fault and not _is_number(fault[name]):
                    raise ValueError(f"entry {uuid!r} field {name!r} must be a number, got {fault[name]!r}")
            for name in ("ecc_double_bit", "xid"):
                if name in fault and not _is_int(fault[name]):
                    raise ValueError(f"entry {uuid!r} field {name!r} must be an integer, got {fault[name]!r}")
            if "xids" in fault and not (
                isinstance(fault["xids"], list) and all(_is_int(x) for x in fault["xids"])
            ):
                raise ValueError(f"entry {uuid!r} field 'xids' must be a list of integers, got {fault['xids']!r}")
            if "lost" in fault and not isinstance(fault["lost"], bool):
                raise ValueError(f"entry {uuid!r} field 'lost' must be true or false, got {fault['lost']!r}")
            try:
                GpuReadings.from_dict({k: v for k, v in fault.items() if k in READING_FIELDS}, where=f"entry {uuid!r}")
            except SpecError as exc:
                raise ValueError(str(exc)) from None
            out[str(uuid)] = fault
        return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SimulatedBackend:
    """One simulated node: the GPUs of a ``--simulate`` declaration, with controllable health.

    Health comes from, in order: an override set with :meth:`set_health`; else idle readings
    (40 C, 10 % of the board power) with the fault file's readings on top, judged by
    :func:`~gpupool_sdk.inventory.health.judge_health`. A simulated GPU has no usage readings
    unless a test or demo gives it some: :meth:`set_readings`, else the fault file's.

    Args:
        decl: the node declaration (from :func:`~gpupool_sdk.inventory.simulated.parse_nodes`).
        fault_file: optional path of a JSON fault file read on every :meth:`gpus` call.
        thresholds: health limits.

    Example:
        >>> backend = simulated_backends("node-a:2xT4")[0]
        >>> [g.uuid for g in backend.gpus()]
        ['GPU-sim-node-a-0', 'GPU-sim-node-a-1']
    """

    kind = "simulated"

    def __init__(
        self,
        decl: NodeDecl,
        fault_file: str | os.PathLike[str] | None = None,
        thresholds: HealthThresholds | None = None,
    ) -> None:
        self._decl = decl
        self._gpus = decl.gpus()
        self._by_uuid = {g.uuid: g for g in self._gpus}
        self._fault_file = FaultFile(fault_file) if fault_file is not None else None
        self._thresholds = thresholds or HealthThresholds()
        self._overrides: dict[str, GpuHealth] = {}
        self._readings: dict[str, GpuReadings] = {}
        self._file_readings: dict[str, GpuReadings] = {}  # the fault file's, as of the last gpus()
        self._started_at = time.time()
        self._closed = False

    @property
    def node(self) -> str:
        return self._decl.name

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            name=self._decl.name,
            hostname=socket.gethostname(),
            agent_pid=os.getpid(),
            gpu_count=len(self._gpus),
            backend=self.kind,
            started_at=self._started_at,
        )

    def set_health(self, uuid: str, health: GpuHealth | None) -> None:
        """Force the health of one GPU (None removes the override).

        Raises:
            KeyError: ``uuid`` is not a GPU of this node.
        """
        if uuid not in self._by_uuid:
            raise KeyError(f"{uuid!r} is not a GPU of node {self.node!r}; known: {sorted(self._by_uuid)}")
        if health is None:
            self._overrides.pop(uuid, None)
        else:
            self._overrides[uuid] = health

    def set_readings(self, uuid: str, readings: GpuReadings | None) -> None:
        """Give one GPU usage readings, as NVML would read them (None: none again).

        Raises:
            KeyError: ``uuid`` is not a GPU of this node.
        """
        if uuid not in self._by_uuid:
            raise KeyError(f"{uuid!r} is not a GPU of node {self.node!r}; known: {sorted(self._by_uuid)}")
        if readings is None or not readings.known:
            self._readings.pop(uuid, None)
        else:
            self._readings[uuid] = readings

    def readings(self) -> Mapping[str, GpuReadings]:
        return {**self._file_readings, **self._readings}

    def gpus(self) -> list[GpuInfo]:
        faults: Mapping[str, dict[str, Any]] = self._fault_file.read() if self._fault_file else {}
        self._file_readings = {}
        for uuid, fault in faults.items():
            readings = GpuReadings.from_dict({k: v for k, v in fault.items() if k in READING_FIELDS})
            if uuid in self._by_uuid and readings.known:
                self._file_readings[uuid] = readings
        out = []
        for g in self._gpus:
            health = self._overrides.get(g.uuid)
            if health is None:
                health = judge_health(self._sample(g, faults.get(g.uuid, {})), self._thresholds)
            out.append(replace(g, health=health))
        return out

    def _sample(self, gpu: GpuInfo, fault: Mapping[str, Any]) -> HealthSample:
        model_tdp = self._decl.model.tdp_w
        xids = [int(x) for x in fault.get("xids", [])]
        if "xid" in fault:
            xids.append(int(fault["xid"]))
        return HealthSample(
            temperature_c=float(fault.get("temperature_c", SIM_IDLE_TEMPERATURE_C)),
            power_w=float(fault.get("power_w", round(model_tdp * SIM_IDLE_POWER_FRACTION, 1))),
            ecc_double_bit=int(fault.get("ecc_double_bit", 0)),
            xids=tuple(xids),
            lost=bool(fault.get("lost", False)),
        )

    def close(self) -> None:
        self._closed = True


def simulated_backends(
    spec: str,
    default_node: str | None = None,
    fault_file: str | os.PathLike[str] | None = None,
    thresholds: HealthThresholds | None = None,
    auto_base: str | None = None,
) -> list[SimulatedBackend]:
    """One :class:`SimulatedBackend` per node of a ``--simulate`` spec.

    Args:
        spec: the ``--simulate`` spec (grammar in :mod:`gpupool_sdk.inventory.simulated`).
        default_node: name of a single unnamed node, base of auto-numbered names.
        fault_file: JSON fault file shared by every node (entries are keyed by GPU UUID).
        thresholds: health limits.
        auto_base: base of auto-numbered node names, when it should differ from ``default_node``.

    Raises:
        SpecError: the spec is malformed.
    """
    return [SimulatedBackend(d, fault_file, thresholds) for d in parse_nodes(spec, default_node, auto_base)]
