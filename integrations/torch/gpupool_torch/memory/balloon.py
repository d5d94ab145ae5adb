"""Ballooning: give device memory back to the pool without stopping the job.

A :class:`BalloonController` holds a job to its quota and, on a ``balloon(target)``
directive, shrinks its footprint in three steps: lower the limit and release cached memory
(trim), then, if still above the target, offload optimizer state to (pinned) host memory
and trim again, then report the bytes actually reached. ``deflate`` lifts the target and
brings the state back. The controller only does the memory work; the Lightning callback
decides when (at a step boundary) and sends the ack.

Tiers (:func:`make_balloon_controller`):

* ``"torch"`` (default): PyTorch's own caching allocator, limited with
  ``torch.cuda.set_per_process_memory_fraction`` and trimmed with ``torch.cuda.empty_cache``.
* ``"gpupool"``: the SDK's allocator in replace mode (:func:`install_torch_allocator`).
* ``"host"``: the SDK's allocator on its host backend, for CPU jobs and tests; optimizer state
  on the CPU counts as device memory.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.memory.allocator import CachingAllocator, SizeLike
from gpupool_sdk.memory.errors import InstallError
from gpupool_sdk.resources.units import format_size, parse_size
from gpupool_torch.memory.offload import OptimizerOffloader

if TYPE_CHECKING:
    import torch

TierKind = Literal["torch", "gpupool", "host"]

log = logging.getLogger("gpupool_torch.memory")


@dataclass(frozen=True)
class BalloonResult:
    """What an inflate or deflate achieved.

    Attributes:
        target_bytes: the target asked for (None for a deflate).
        reached_bytes: the footprint after the operation (reserved device memory, plus
            resident optimizer state on the host tier). This is what the ack reports.
        released_bytes: bytes of cached memory released to the device.
        offloaded_bytes: bytes of optimizer state moved to host memory.
        restored_bytes: bytes of optimizer state moved back (deflate).
        live_bytes: the live working set (allocated, not cached) after the operation.
        reached_target: True when ``reached_bytes <= target_bytes`` (always True for a deflate).
        working_set_exceeds_target: True when the live working set alone is above the
            target: the job cannot comply without freeing tensors (smaller batch, preemption).
        message: a sentence for operators and the ack.
    """

    target_bytes: int | None
    reached_bytes: int
    released_bytes: int
    offloaded_bytes: int
    restored_bytes: int
    live_bytes: int
    reached_target: bool
    working_set_exceeds_target: bool
    message: str

    @property
    def ok(self) -> bool:
        """Whether the job complied (the ``ok`` of the ack)."""
        return self.reached_target


class BalloonController(abc.ABC):
    """Holds a job to its quota and inflates or deflates its balloon.

    Subclasses implement the tier-specific primitives (limit, trim, measure); the inflate and
    deflate sequence is shared. Register optimizers with :meth:`add_optimizer` so their state
    can be offloaded.

    Args:
        quota_bytes: the leased quota in bytes (or ``"8GiB"``), None for none.
        device: device index.
    """

    kind: str = "abstract"

    def __init__(self, quota_bytes: SizeLike | None, device: int = 0) -> None:
        self.device = device
        self._quota: int | None = (
            None if quota_bytes is None else parse_size(quota_bytes, field="quota_bytes")
        )
        self._target: int | None = None
        self._offloaders: list[OptimizerOffloader] = []
        self._lock = threading.RLock()
        self.last_result: BalloonResult | None = None
        self._limit_listeners: list[Callable[[int | None], None]] = []

    # ------------------------------------------------------------------ tier primitives

    @abc.abstractmethod
    def _apply_limit(self, limit: int | None) -> int:
        """Sets the growth limit (min of quota and target); returns bytes released doing so."""

    @abc.abstractmethod
    def _trim(self) -> int:
        """Releases cached memory; returns bytes released."""

    @abc.abstractmethod
    def _device_usage(self) -> tuple[int, int]:
        """Returns (reserved, allocated) bytes of the tier."""

    @abc.abstractmethod
    def _tier_stats(self) -> dict[str, Any]:
        """Tier-specific statistics."""

    # State on the host tier lives outside the allocator and must be counted separately.
    _count_optimizer_state = False

    # ------------------------------------------------------------------ shared logic

    def _limit(self) -> int | None:
        limits = [x for x in (self._quota, self._target) if x is not None]
        return min(limits) if limits else None

    def usage_bytes(self) -> int:
        """The footprint the balloon is measured by (the ack's ``reached_bytes``)."""
        reserved, _ = self._device_usage()
        return reserved + (self._resident_state() if self._count_optimizer_state else 0)

    def live_bytes(self) -> int:
        """The live working set: allocated (not cached) bytes."""
        _, allocated = self._device_usage()
        return allocated + (self._resident_state() if self._count_optimizer_state else 0)

    def _resident_state(self) -> int:
        return sum(o.resident_bytes() for o in self._offloaders)

    @property
    def limit_bytes(self) -> int | None:
        """The limit the job trains under now: the smaller of the quota and the balloon target."""
        return self._limit()

    def add_limit_listener(self, listener: Callable[[int | None], None]) -> None:
        """Call ``listener(limit_bytes)`` whenever the limit changes (inflate, deflate, set_quota).

        It runs on the thread that changed the limit (the step boundary) and must be cheap; an
        exception it raises is logged and ignored.
        """
        if listener not in self._limit_listeners:
            self._limit_listeners.append(listener)

    def remove_limit_listener(self, listener: Callable[[int | None], None]) -> None:
        """Stop calling ``listener``."""
        if listener in self._limit_listeners:
            self._limit_listeners.remove(listener)

    def _notify_limit(self) -> None:
        limit = self._limit()
        for listener in list(self._limit_listeners):
            try:
                listener(limit)
            except Exception as exc:  # noqa: BLE001 - a listener must not break the balloon
                log.warning("gpupool: memory limit listener %r failed: %s", listener, exc)

    @property
    def quota_bytes(self) -> int | None:
        """The current quota."""
        return self._quota

    @property
    def target_bytes(self) -> int | None:
        """The balloon target while inflated, else None."""
        return self._target

    @property
    def inflated(self) -> bool:
        """True between :meth:`inflate` and :meth:`deflate`."""
        return self._target is not None

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerOffloader:
        """Registers an optimizer whose state may be offloaded while the balloon is inflated.

        Returns:
            The :class:`OptimizerOffloader` managing it.
        """
        with self._lock:
            for off in self._offloaders:
                if off.optimizer is optimizer:
                    return off
            off = OptimizerOffloader(optimizer, include_cpu_tensors=self._count_optimizer_state)
            self._offloaders.append(off)
            return off

    def set_quota(self, quota_bytes: SizeLike | None) -> None:
        """Sets the hard quota (the leased size) and releases cached memory above it."""
        with self._lock:
            self._quota = None if quota_bytes is None else parse_size(quota_bytes, field="quota_bytes")
            self._apply_limit(self._limit())
            self._notify_limit()

    def inflate(self, target_bytes: SizeLike) -> BalloonResult:
        """Shrinks the footprint to ``target_bytes``: trim, then offload optimizer state.

        Never raises because the target cannot be reached: the result says so
        (``reached_target``, ``working_set_exceeds_target``, ``message``).

        Args:
            target_bytes: the footprint the coordinator asks for.

        Returns:
            What was reached.
        """
        target = parse_size(target_bytes, field="target_bytes")
        with self._lock:
            self._target = target
            # Listeners (the batch adapter) shrink the next micro-batches before the limit bites.
            self._notify_limit()
            released = self._apply_limit(self._limit())
            released += self._trim()
            offloaded = 0
            if self.usage_bytes() > target and self._offloaders:
                for off in self._offloaders:
                    offloaded += off.hold()
                released += self._trim()
            reached, live = self.usage_bytes(), self.live_bytes()
            ok = reached <= target
            too_big = live > target
            if ok:
                msg = (
                    f"balloon inflated to {format_size(reached)} (target {format_size(target)}): released "
                    f"{format_size(released)} of cache, offloaded {format_size(offloaded)} of optimizer state"
                )
            elif too_big:
                msg = (
                    f"cannot reach the balloon target {format_size(target)}: the live working set is "
                    f"{format_size(live)} (allocated, not cached) even after releasing {format_size(released)} of "
                    f"cache and offloading {format_size(offloaded)} of optimizer state; the job keeps running at "
                    f"{format_size(reached)} but cannot grow. Reduce the batch size or let the pool preempt it."
                )
            else:
                msg = (
                    f"balloon reached {format_size(reached)}, above the target {format_size(target)}: "
                    f"{format_size(reached - live)} is cached in segments that still hold live blocks "
                    "(fragmentation); growth is denied and it is released as those blocks are freed"
                )
            result = BalloonResult(
                target_bytes=target,
                reached_bytes=reached,
                released_bytes=released,
                offloaded_bytes=offloaded,
                restored_bytes=0,
                live_bytes=live,
                reached_target=ok,
                working_set_exceeds_target=too_big,
                message=msg,
            )
            self.last_result = result
            return result

    def deflate(self) -> BalloonResult:
        """Lifts the target (back to the quota) and restores offloaded optimizer state.

        Call it before the next optimizer step; if a step comes first, the offloader's step
        pre-hook restores the state anyway.

        Returns:
            The footprint after the restore.
        """
        with self._lock:
            self._target = None
            self._apply_limit(self._limit())
            self._notify_limit()
            restored = sum(off.release() for off in self._offloaders)
            reached, live = self.usage_bytes(), self.live_bytes()
            result = BalloonResult(
                target_bytes=None,
                reached_bytes=reached,
                released_bytes=0,
                offloaded_bytes=0,
                restored_bytes=restored,
                live_bytes=live,
                reached_target=True,
                working_set_exceeds_target=False,
                message=f"balloon deflated: restored {format_size(restored)} of optimizer state; "
                f"footprint {format_size(reached)}",
            )
            self.last_result = result
            return result

    def park(self) -> BalloonResult:
        """A time-slicing hand-over: free what the job does not need while another job has the GPU.

        Releases the cache and moves the optimizer state to host memory (held there between
        steps) until :meth:`unpark`. The limit is left alone: the job runs no step while parked.
        Called on the training thread when the job hands the GPU over
        (``gpupool_sdk.runtime.sharing``, ``handover_offload``).

        Returns:
            What was freed (``offloaded_bytes``: optimizer state moved to host memory).
        """
        with self._lock:
            released = self._trim()
            offloaded = sum(off.hold() for off in self._offloaders)
            released += self._trim()
            reached, live = self.usage_bytes(), self.live_bytes()
            result = BalloonResult(
                target_bytes=None, reached_bytes=reached, released_bytes=released, offloaded_bytes=offloaded,
                restored_bytes=0, live_bytes=live, reached_target=True, working_set_exceeds_target=False,
                message=f"parked for a hand-over: released {format_size(released)} of cache, offloaded "
                f"{format_size(offloaded)} of optimizer state; footprint {format_size(reached)}",
            )
            self.last_result = result
            return result

    def unpark(self) -> BalloonResult:
        """The turn came back: bring the optimizer state back, unless a balloon target still holds it out.

        Returns:
            What was restored.
        """
        with self._lock:
            restored = 0 if self._target is not None else sum(off.release() for off in self._offloaders)
            reached, live = self.usage_bytes(), self.live_bytes()
            result = BalloonResult(
                target_bytes=self._target, reached_bytes=reached, released_bytes=0, offloaded_bytes=0,
                restored_bytes=restored, live_bytes=live, reached_target=True, working_set_exceeds_target=False,
                message=f"unparked: restored {format_size(restored)} of optimizer state; footprint {format_size(reached)}",
            )
            self.last_result = result
            return result

    def stats(self) -> dict[str, Any]:
        """Balloon state and the tier's memory statistics (``gpupool_*`` metric names)."""
        with self._lock:
            reserved, allocated = self._device_usage()
            out: dict[str, Any] = {
                "gpupool_balloon_tier": self.kind,
                "gpupool_balloon_inflated": self.inflated,
                "gpupool_memory_quota_bytes": self._quota,
                "gpupool_balloon_target_bytes": self._target,
                "gpupool_memory_usage_bytes": self.usage_bytes(),
                "gpupool_memory_live_bytes": self.live_bytes(),
                "gpupool_memory_reserved_bytes": reserved,
                "gpupool_memory_allocated_bytes": allocated,
                "gpupool_optimizer_resident_bytes": self._resident_state(),
                "gpupool_optimizer_offloaded_bytes": sum(o.offloaded_bytes() for o in self._offloaders),
                "gpupool_optimizer_offload_total": sum(o.offload_count for o in self._offloaders),
                "gpupool_optimizer_restore_total": sum(o.restore_count for o in self._offloaders),
            }
            out.update(self._tier_stats())
            return out


class AllocatorBalloonController(BalloonController):
    """Balloon over the SDK's :class:`CachingAllocator` (tiers ``"gpupool"`` and ``"host"``).

    Args:
        allocator: the allocator holding the job's device memory.
        quota_bytes: the quota (applied to the allocator), None to keep the allocator's.
        device: device index.
        count_optimizer_state: count resident optimizer state as device memory (the host tier,
            where that state is not allocated from ``allocator``).
        kind: the tier name reported in stats.
    """

    def __init__(
        self,
        allocator: CachingAllocator,
        quota_bytes: SizeLike | None = None,
        device: int = 0,
        count_optimizer_state: bool = False,
        kind: str = "gpupool",
    ) -> None:
        super().__init__(quota_bytes if quota_bytes is not None else allocator.quota, device)
        self.allocator = allocator
        self.kind = kind
        self._count_optimizer_state = count_optimizer_state
        self._apply_limit(self._limit())

    def _apply_limit(self, limit: int | None) -> int:
        # The quota is the hard limit; the target is the allocator's balloon target.
        released = self.allocator.set_quota(self._quota)
        if self._target is None:
            released += self.allocator.set_target(None)
        else:
            # On the host tier resident optimizer state shares the budget with the allocator.
            extra = self._resident_state() if self._count_optimizer_state else 0
            released += self.allocator.set_target(max(0, self._target - extra))
        return released

    def _trim(self) -> int:
        released = self.allocator.trim()
        if self._count_optimizer_state and self._target is not None:
            released += self.allocator.set_target(max(0, self._target - self._resident_state()))
        return released

    def _device_usage(self) -> tuple[int, int]:
        st = self.allocator.stats()
        return st["reserved_bytes.all.current"], st["allocated_bytes.all.current"]

    def phase_peak_reader(self) -> Callable[[], int]:
        """``() -> bytes``: the reserved-bytes peak since the previous call (resets the allocator's peaks).

        Plus resident optimizer state on the host tier. For per-phase peaks at phase boundaries.
        """
        alloc = self.allocator

        def read() -> int:
            peak = int(alloc.stats()["reserved_bytes.all.peak"])
            alloc.reset_peak_stats()
            return peak + (self._resident_state() if self._count_optimizer_state else 0)

        return read

    def _tier_stats(self) -> dict[str, Any]:
        st = self.allocator.stats()
        return {
            "gpupool_memory_fragmentation_ratio": st["gpupool.fragmentation"],
            "gpupool_memory_reserved_peak_bytes": st["reserved_bytes.all.peak"],
            "gpupool_memory_allocated_peak_bytes": st["allocated_bytes.all.peak"],
            "gpupool_memory_ooms_total": st["num_ooms"],
            "allocator": st,
        }


EXPANDABLE_SEGMENTS_ADVICE = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA initialises: torch.cuda.empty_cache() "
    "can then unmap the free tail of partially used segments, so a balloon releases more"
)


class TorchBalloonController(BalloonController):
    """Balloon over PyTorch's own CUDA caching allocator (the default ``"torch"`` tier).

    The quota and target become ``torch.cuda.set_per_process_memory_fraction`` (a limit on
    reserved bytes, like the SDK's quota); trimming is ``torch.cuda.empty_cache``. The
    user's allocator settings are left as they are; :attr:`advice` says whether
    ``expandable_segments`` would help.

    Args:
        quota_bytes: the quota, None for none.
        device: CUDA device index.
        cuda: the ``torch.cuda`` module (injectable so the logic is testable without a GPU).
    """

    kind = "torch"

    def __init__(self, quota_bytes: SizeLike | None = None, device: int = 0, cuda: Any = None) -> None:
        super().__init__(quota_bytes, device)
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda
        self.total_bytes = int(cuda.get_device_properties(device).total_memory)
        self._apply_limit(self._limit())

    @property
    def advice(self) -> str | None:
        """A tuning hint for the allocator configuration, or None when nothing to suggest."""
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.replace(" ", "").lower():
            return None
        return EXPANDABLE_SEGMENTS_ADVICE

    def _apply_limit(self, limit: int | None) -> int:
        fraction = 1.0 if limit is None else min(1.0, limit / self.total_bytes)
        self.cuda.set_per_process_memory_fraction(fraction, self.device)
        return 0

    def _trim(self) -> int:
        before = int(self.cuda.memory_reserved(self.device))
        self.cuda.empty_cache()
        return max(0, before - int(self.cuda.memory_reserved(self.device)))

    def _device_usage(self) -> tuple[int, int]:
        return int(self.cuda.memory_reserved(self.device)), int(self.cuda.memory_allocated(self.device))

    def phase_peak_reader(self) -> Callable[[], int]:
        """``() -> bytes``: PyTorch's reserved bytes now (its peak counters are the user's: never reset).

        Reserved memory only grows within a step unless a cache is emptied, so at the end of a
        phase it is that phase's peak.
        """
        cuda, device = self.cuda, self.device
        return lambda: int(cuda.memory_reserved(device))

    def _tier_stats(self) -> dict[str, Any]:
        st = self.cuda.memory_stats(self.device)
        return {
            "gpupool_memory_reserved_peak_bytes": int(st.get("reserved_bytes.all.peak", 0)),
            "gpupool_memory_allocated_peak_bytes": int(st.get("allocated_bytes.all.peak", 0)),
            "gpupool_memory_ooms_total": int(st.get("num_ooms", 0)),
            "gpupool_memory_total_bytes": self.total_bytes,
            "advice": self.advice,
        }


def make_balloon_controller(
    kind: TierKind = "torch",
    quota_bytes: SizeLike | None = None,
    device: int = 0,
    allocator: CachingAllocator | None = None,
) -> BalloonController:
    """Builds the balloon controller of a memory tier.

    Args:
        kind: ``"torch"`` (default: PyTorch's allocator, nothing swapped), ``"gpupool"`` (the
            SDK's allocator; :func:`install_torch_allocator` must have run before CUDA
            initialised) or ``"host"`` (the SDK's host backend: CPU jobs and tests).
        quota_bytes: the leased quota per device.
        device: device index.
        allocator: for ``"host"``, an existing host allocator (default: a new one).

    Raises:
        ConfigError: unknown ``kind``.
        InstallError: the tier cannot work in this process (no CUDA, allocator not installed).

    Example:
        >>> import torch
        >>> from gpupool_torch.memory import make_balloon_controller
        >>> balloon = make_balloon_controller("host", quota_bytes="1GiB")
        >>> model = torch.nn.Linear(256, 256); opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 256)).sum().backward(); opt.step()
        >>> _ = balloon.add_optimizer(opt)
        >>> balloon.inflate(0).offloaded_bytes
        526344
        >>> balloon.deflate().restored_bytes
        526344
    """
    if kind == "torch":
        import torch

        if not torch.cuda.is_available():
            raise InstallError(
                "the 'torch' memory tier needs CUDA (torch.cuda.is_available() is False); use kind='host' on CPU"
            )
        return TorchBalloonController(quota_bytes, device)
    if kind == "gpupool":
        from gpupool_torch.memory.torch_hook import global_allocator

        alloc = global_allocator(device, create=False)
        return AllocatorBalloonController(alloc, quota_bytes, device, kind="gpupool")
    if kind == "host":
        alloc = allocator if allocator is not None else CachingAllocator(backend="host", quota=quota_bytes)
        return AllocatorBalloonController(alloc, quota_bytes, device, count_optimizer_state=True, kind="host")
    raise ConfigError("kind", f"must be 'torch', 'gpupool' or 'host', got {kind!r}")
