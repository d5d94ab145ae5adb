"""Telemetry of one training process: the memory-peak meter, the per-phase probe, the publisher.

They work only at step boundaries where something is due (a publish, a balloon) and at the phase
boundaries of one sampled step per window, never per allocation.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.runtime.leases import JobLease
from gpupool_sdk.telemetry.phases import PhaseTimer
from gpupool_sdk.telemetry.summary import PEAK_HISTORY_LEN, TelemetrySummary, from_phase_timer

log = logging.getLogger("gpupool_sdk.runtime")


def check_peak_bytes(value: Any, name: str) -> int:
    """``value`` as a whole number of bytes >= 0.

    Raises:
        ConfigError: it is not one (the message names ``name``).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"must be a whole number of bytes >= 0, got {value!r}")
    return value


class MemoryPeakMeter:
    """The job's per-slice memory peak over one publish window.

    Sources, in order: the user's figure (:meth:`report`, ``peak_fn``); else the balloon tier's
    measure (``host``: the SDK allocator's reserved bytes plus resident optimizer state, also
    sampled at balloon boundaries; ``gpupool``: the SDK allocator's reserved peak, then reset;
    ``torch``: ``torch.cuda.max_memory_reserved()`` never reset, so that the figures the user or
    Lightning's ``DeviceStatsMonitor`` read stay untouched); else None.

    Args:
        peak_fn: optional ``() -> bytes | None`` called once per window.
        tier: ``() -> controller | None``: the balloon controller in use (its ``kind`` tells the source).
    """

    def __init__(self, peak_fn: Callable[[], int | None] | None, tier: Callable[[], Any]) -> None:
        self.peak_fn = peak_fn
        self._tier = tier
        #: ``() -> controller | None`` (shared with :class:`PhasePeakProbe`).
        self.tier = tier
        self._reported: int | None = None
        self._boundary = 0
        self._torch_peak_seen = 0

    def report(self, peak_bytes: int) -> None:
        """A user-reported peak (cheap: one comparison)."""
        peak = check_peak_bytes(peak_bytes, "peak_bytes")
        if self._reported is None or peak > self._reported:
            self._reported = peak

    def note_boundary(self, footprint: int) -> None:
        """The footprint just before a balloon changes it (belongs to this window)."""
        self._boundary = max(self._boundary, int(footprint))

    def take(self) -> int | None:
        """The window's peak (None: nothing measured, never 0); starts the next window."""
        reported, self._reported = self._reported, None
        if self.peak_fn is not None:
            try:
                value = self.peak_fn()
                if value is not None:
                    value = check_peak_bytes(value, "memory_peak_fn()")
                    reported = value if reported is None else max(reported, value)
            except Exception as exc:  # noqa: BLE001 - a faulty hook must not stop training
                log.warning("gpupool: memory_peak_fn failed, its figure is left out: %s", exc)
        measured = self._measured()  # read anyway: it also starts the next window
        peak = reported if reported is not None else measured
        return peak if peak else None

    def _measured(self) -> int:
        boundary, self._boundary = self._boundary, 0
        ctl = self._tier()
        kind = getattr(ctl, "kind", None)
        try:
            if kind == "host":
                return max(boundary, int(ctl.usage_bytes()))
            if kind == "gpupool":
                st = ctl.allocator.stats()
                ctl.allocator.reset_peak_stats()
                return max(boundary, int(st["reserved_bytes.all.peak"]))
        except Exception as exc:  # noqa: BLE001 - measuring must never stop training
            log.debug("memory footprint not measured: %s", exc)
            return boundary
        return max(boundary, self._torch_window_peak())

    def _torch_window_peak(self) -> int:
        torch = sys.modules.get("torch")  # never import torch just to learn it has no stats
        if torch is None:
            return 0
        try:
            if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
                return 0
            lifetime = int(torch.cuda.max_memory_reserved())
            current = int(torch.cuda.memory_reserved())
        except Exception:  # noqa: BLE001 - replace-mode allocators have no torch stats
            return 0
        rose = lifetime > self._torch_peak_seen
        self._torch_peak_seen = max(self._torch_peak_seen, lifetime)
        return lifetime if rose else current


class PhasePeakProbe:
    """Per-phase memory peaks, read at the phase boundaries of one sampled step per publish window.

    Never per allocation and never on the other steps: after each publication the probe is
    armed for the next optimizer step; the adapter calls :meth:`phase_end` at that step's phase
    boundaries (one attribute read, ``armed``, on every other step). Each call reads the memory
    tier's ``phase_peak_reader()``: on the SDK allocator the reserved-bytes peak since the
    previous call (its peak counters are then reset), on PyTorch's allocator the bytes reserved
    at the boundary (reserved memory only grows within a step unless a cache is emptied, so it
    is that phase's peak), on the host tier reserved bytes plus resident optimizer state. What
    is read also counts toward the window's peak (:meth:`MemoryPeakMeter.note_boundary`).

    Args:
        meter: the window's peak meter.
        tier: ``() -> controller | None``: the balloon controller in use.
    """

    def __init__(self, meter: MemoryPeakMeter, tier: Callable[[], Any]) -> None:
        self.meter = meter
        self._tier = tier
        #: True while the sampled step runs (the adapters' hooks read only this).
        self.armed = False
        self._reader: Callable[[], int] | None = None
        self._peaks: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def arm(self) -> None:
        """Sample the next step (a no-op when the memory tier cannot be read)."""
        ctl = self._tier()
        make = getattr(ctl, "phase_peak_reader", None)
        if make is None:
            return
        try:
            reader = make()
            self.meter.note_boundary(int(reader()))  # the window so far; the phase peaks start here
        except Exception as exc:  # noqa: BLE001 - measuring must never stop training
            log.debug("per-phase memory peaks not sampled: %s", exc)
            return
        self._reader = reader
        self._peaks = {}
        self.armed = True

    def phase_end(self, phase: str) -> None:
        """The sampled step's ``phase`` ended: read the peak since the previous boundary."""
        reader = self._reader
        if reader is None:
            self.armed = False
            return
        try:
            value = int(reader())
        except Exception as exc:  # noqa: BLE001 - measuring must never stop training
            log.debug("per-phase memory peak not read: %s", exc)
            self.armed = False
            return
        self.meter.note_boundary(value)
        if value > self._peaks.get(phase, -1):
            self._peaks[phase] = value

    def step_end(self) -> None:
        """The sampled step ended with its optimizer phase; its peaks become the published ones."""
        self.phase_end("optimizer")
        if self._peaks:
            self._last = dict(self._peaks)
        self.armed = False

    def take(self) -> dict[str, int]:
        """Per-phase peaks of the last sampled step (kept until a newer step is sampled)."""
        return dict(self._last)


class TelemetryPublisher:
    """Hands a rolling summary to the lease every ``interval_s`` (the lease's I/O is off-thread).

    Args:
        job: the job name.
        timer: the process's phase timer.
        meter: the memory-peak meter.
        interval_s: seconds between summaries.
    """

    def __init__(self, job: str, timer: PhaseTimer, meter: MemoryPeakMeter, interval_s: float) -> None:
        self.job = job
        self.timer = timer
        self.meter = meter
        self.interval_s = interval_s
        #: ``time.monotonic()`` at which the next summary is due (the hot path compares with it).
        self.next_due = 0.0
        self.sampler: Any = None
        self.metrics: Any = None
        self._server: Any = None
        #: The job's declared length in optimizer steps, when it knows it.
        self.total_steps: int | None = None
        #: Per-phase peaks of one sampled step per window (the adapters drive it).
        self.phase_probe = PhasePeakProbe(meter, meter.tier)
        #: The peaks of the recent windows, published as ``memory_peak_history``.
        self.peak_history: collections.deque[int] = collections.deque(maxlen=PEAK_HISTORY_LEN)

    def set_total_steps(self, total_steps: int | float | None) -> None:
        """The job's declared length (steps); None or infinite when unknown."""
        ok = total_steps is not None and total_steps == total_steps and 0 < total_steps < float("inf")
        self.total_steps = int(total_steps) if ok else None  # type: ignore[arg-type]

    def maybe_publish(self, lease: JobLease | None, step: int, now: float | None = None) -> bool:
        """Publish when due; between publishes this is one comparison. Returns True when published."""
        if lease is None:
            return False
        if now is None:
            now = time.monotonic()
        if now < self.next_due:
            return False
        self.next_due = now + self.interval_s
        try:
            summary = self.build(step)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
            log.warning("gpupool: telemetry summary not built: %s", exc)
            return False
        try:
            lease.publish_telemetry(summary.to_dict())
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
            log.debug("publish_telemetry failed: %s", exc)
        metrics = self.metrics
        if metrics is not None:
            with contextlib.suppress(Exception):
                metrics.update(summary)
        return True

    def build(self, step: int) -> TelemetrySummary:
        """The summary to publish now; starts the next memory-peak window."""
        peak = self.meter.take()
        if peak is not None:
            self.peak_history.append(peak)
        summary = from_phase_timer(self.job, step, self.timer.summary(), published_at=time.time(),
                                   sampler=self.sampler, memory_peak_bytes=peak,
                                   memory_peak_by_phase=self.phase_probe.take())
        if self.peak_history:
            summary = dataclasses.replace(summary, memory_peak_history=tuple(self.peak_history))
        self.phase_probe.arm()
        return self._with_progress(summary, step)

    def _with_progress(self, summary: TelemetrySummary, step: int) -> TelemetrySummary:
        # The remaining-time estimate the scheduler's shortest-remaining-first ordering uses:
        # declared length minus the global step, at the step rate measured over the window.
        total = self.total_steps
        if not total:
            return summary
        progress = min(1.0, max(0.0, step / total))
        remaining_s = max(0, total - step) / summary.steps_per_s if summary.steps_per_s > 0 else None
        return dataclasses.replace(summary, progress=progress, remaining_s=remaining_s)

    def start_exporter(self, port: int, addr: str) -> None:
        """Serve the job's summary as Prometheus metrics (failures are logged, never raised)."""
        if self._server is not None:
            return
        try:
            from gpupool_sdk.telemetry.prometheus import JobMetrics

            self.metrics = JobMetrics()
            self._server = self.metrics.serve(port, addr=addr)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
            self.metrics = None
            log.warning("gpupool: job metrics exporter on %s:%s not started: %s", addr, port, exc)

    def start_sampler(self, uuids: list[str]) -> None:
        """Sample the leased GPUs through NVML on its own thread (rank 0 with real GPUs)."""
        if self.sampler is not None or not uuids:
            return
        try:
            from gpupool_sdk.telemetry.nvml_sampler import NvmlSampler

            sampler = NvmlSampler(gpu_uuids=uuids).start()
        except Exception as exc:  # noqa: BLE001 - NVML is optional
            log.debug("gpupool: NVML sampler not started: %s", exc)
            return
        self.sampler = sampler if sampler.available else None

    def stop(self) -> None:
        """Stop the sampler and the exporter."""
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.stop()
        server, self._server = self._server, None
        self.metrics = None
        if server is not None:
            with contextlib.suppress(Exception):
                server.close()
