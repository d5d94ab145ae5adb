"""GPU and per-process utilisation sampling through NVML, on a background thread.

The training process runs one :class:`NvmlSampler` over the GPUs of its slices. Every
``interval_s`` it reads, per GPU, the device utilisation and memory, the memory used by the
job's own processes (``nvmlDeviceGetComputeRunningProcesses``) and their SM utilisation
(``nvmlDeviceGetProcessUtilization``), and keeps a window of samples from which
:meth:`NvmlSampler.slices` and :meth:`NvmlSampler.gpu_util` feed the
:class:`~gpupool_sdk.telemetry.summary.TelemetrySummary`.

Without a GPU or driver (``nvmlInit`` fails), the sampler is *unavailable*: it starts no
thread and returns ``None`` utilisation, so the summary says "unknown" rather than "0 %".
NVML calls never run on the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.telemetry.summary import SliceTelemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    """One NVML reading of one GPU.

    Attributes:
        uuid: the GPU's UUID.
        util: device SM utilisation 0-1 (all processes), None if NVML would not say.
        memory_used_bytes: device memory in use by everyone.
        memory_total_bytes: device memory size.
        process_memory_bytes: memory used by the watched processes, None when NVML lists no
            matching process (e.g. a PID namespace hides them).
        process_util: SM utilisation 0-1 of the watched processes, None when per-process
            samples are unsupported or absent.
    """

    uuid: str
    util: float | None
    memory_used_bytes: int
    memory_total_bytes: int
    process_memory_bytes: int | None = None
    process_util: float | None = None

    @property
    def job_util(self) -> float | None:
        """The job's utilisation: per-process when known, else the whole device's."""
        return self.process_util if self.process_util is not None else self.util

    @property
    def job_memory_bytes(self) -> int:
        """The job's memory: per-process when known, else the whole device's."""
        return self.process_memory_bytes if self.process_memory_bytes is not None else self.memory_used_bytes


@dataclass(frozen=True)
class NvmlSnapshot:
    """Samples of every watched GPU taken at one instant (``at`` is ``time.monotonic()``)."""

    at: float
    gpus: tuple[GpuSample, ...]


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class NvmlSampler:
    """Samples NVML on a daemon thread and keeps a sliding window.

    Args:
        gpu_uuids: the GPUs to watch (the job's slices); None watches every GPU NVML sees.
        pids: the processes whose memory and utilisation count as the job's (default: this
            process).
        interval_s: seconds between samples (> 0).
        window_s: how much history the averages and peaks cover (>= interval_s).
        nvml: the NVML binding (default ``pynvml``); tests pass a fake module.
        clock: monotonic clock (tests pass a fake).

    Raises:
        ConfigError: ``interval_s`` or ``window_s`` is out of range.

    Example:
        >>> with NvmlSampler(interval_s=2.0) as s:   # a no-op on a machine without NVML
        ...     util = s.gpu_util()
    """

    def __init__(
        self,
        gpu_uuids: Sequence[str] | None = None,
        *,
        pids: Iterable[int] | None = None,
        interval_s: float = 2.0,
        window_s: float = 30.0,
        nvml: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ConfigError("interval_s", f"must be > 0 seconds, got {interval_s!r}")
        if not window_s >= interval_s:
            raise ConfigError("window_s", f"must be >= interval_s ({interval_s}), got {window_s!r}")
        self._uuids = list(gpu_uuids) if gpu_uuids is not None else None
        self._pids = frozenset(pids) if pids is not None else frozenset({os.getpid()})
        self.interval_s = float(interval_s)
        self.window_s = float(window_s)
        self._clock = clock
        self._nvml = nvml
        self._handles: list[tuple[str, Any]] = []
        self._last_ts: dict[str, int] = {}
        self._proc_util_unsupported: set[str] = set()
        self._window: deque[NvmlSnapshot] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._initialised = False
        self.available = False
        self.errors = 0
        self.last_error: str | None = None

    # Lifecycle.
    def open(self) -> bool:
        """Initialise NVML and resolve the GPUs; returns :attr:`available`. Idempotent."""
        if self._initialised:
            return self.available
        self._initialised = True
        try:
            if self._nvml is None:
                self._nvml = _load_pynvml()
            nv = self._nvml
            nv.nvmlInit()
        except Exception as exc:  # no driver, no library, no GPU: degrade to "unknown"
            self.last_error = f"NVML unavailable: {exc}"
            log.debug("%s", self.last_error)
            return False
        try:
            if self._uuids is None:
                handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
                self._handles = [(_text(nv.nvmlDeviceGetUUID(h)), h) for h in handles]
            else:
                self._handles = [(u, nv.nvmlDeviceGetHandleByUUID(u)) for u in self._uuids]
        except Exception as exc:
            self.last_error = f"NVML cannot open the GPUs {self._uuids}: {exc}"
            log.warning("%s", self.last_error)
            self._shutdown_nvml()
            return False
        self.available = True
        return True

    def start(self) -> NvmlSampler:
        """Open NVML and start the sampling thread (nothing happens when NVML is unavailable)."""
        if self.open() and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpupool-nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and shut NVML down. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.available:
            self._shutdown_nvml()
            self.available = False

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _shutdown_nvml(self) -> None:
        with contextlib.suppress(Exception):  # shutting down is best effort
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as exc:  # a failed read must never kill the training process
                self.errors += 1
                self.last_error = str(exc)
                log.debug("NVML sample failed: %s", exc)
            self._stop.wait(self.interval_s)

    # Sampling.
    def sample_once(self) -> NvmlSnapshot | None:
        """Take one sample of every watched GPU now and add it to the window (None if unavailable)."""
        if not self.open():
            return None
        nv = self._nvml
        samples = tuple(self._sample_gpu(nv, uuid, h) for uuid, h in self._handles)
        snap = NvmlSnapshot(self._clock(), samples)
        with self._lock:
            self._window.append(snap)
            horizon = snap.at - self.window_s
            while self._window and self._window[0].at < horizon:
                self._window.popleft()
        return snap

    def _sample_gpu(self, nv: Any, uuid: str, handle: Any) -> GpuSample:
        nvml_error: type[BaseException] = getattr(nv, "NVMLError", Exception)
        try:
            util: float | None = _ratio(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml_error:
            util = None
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        proc_mem: int | None = None
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml_error:
            procs = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if p.pid in self._pids and isinstance(used, int):
                proc_mem = (proc_mem or 0) + used
        return GpuSample(
            uuid=uuid,
            util=util,
            memory_used_bytes=int(mem.used),
            memory_total_bytes=int(mem.total),
            process_memory_bytes=proc_mem,
            process_util=self._process_util(nv, uuid, handle, nvml_error),
        )

    def _process_util(self, nv: Any, uuid: str, handle: Any, nvml_error: type[BaseException]) -> float | None:
        if uuid in self._proc_util_unsupported:
            return None
        last = self._last_ts.get(uuid, 0)
        try:
            rows = nv.nvmlDeviceGetProcessUtilization(handle, last)
        except nvml_error as exc:
            not_supported = getattr(nv, "NVMLError_NotSupported", None)
            if not_supported is not None and isinstance(exc, not_supported):
                self._proc_util_unsupported.add(uuid)
            return None  # NotFound: no samples since ``last`` (the job was idle or not yet running)
        ours = [r for r in rows if r.pid in self._pids]
        if rows:
            self._last_ts[uuid] = max(int(r.timeStamp) for r in rows)
        if not ours:
            return None
        # Several samples per process may arrive between two reads; the latest is the freshest.
        return _ratio(max(ours, key=lambda r: r.timeStamp).smUtil)

    # Results.
    def latest(self) -> NvmlSnapshot | None:
        """The most recent snapshot, or None before the first sample."""
        with self._lock:
            return self._window[-1] if self._window else None

    def window(self) -> list[NvmlSnapshot]:
        """The snapshots of the current window, oldest first."""
        with self._lock:
            return list(self._window)

    def slices(self) -> list[SliceTelemetry]:
        """Per-GPU detail for the summary: latest memory, window peak, mean utilisation."""
        snaps = self.window()
        if not snaps:
            return []
        out = []
        for latest in snaps[-1].gpus:
            series = [g for s in snaps for g in s.gpus if g.uuid == latest.uuid]
            utils = [g.job_util for g in series if g.job_util is not None]
            out.append(
                SliceTelemetry(
                    gpu_uuid=latest.uuid,
                    memory_used_bytes=latest.job_memory_bytes,
                    util=min(1.0, sum(utils) / len(utils)) if utils else None,
                    memory_peak_bytes=max(g.job_memory_bytes for g in series),
                )
            )
        return out

    def gpu_util(self) -> float | None:
        """Mean utilisation 0-1 over the watched GPUs and the window; None when unknown."""
        utils = [s.util for s in self.slices() if s.util is not None]
        return sum(utils) / len(utils) if utils else None

    def memory_peak_bytes(self) -> int | None:
        """Largest per-GPU memory of the job in the window; None before the first sample."""
        peaks = [s.memory_peak_bytes for s in self.slices() if s.memory_peak_bytes is not None]
        return max(peaks) if peaks else None


def _ratio(percent: Any) -> float | None:
    try:
        v = float(percent) / 100.0
    except (TypeError, ValueError):
        return None
    return min(1.0, max(0.0, v))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
