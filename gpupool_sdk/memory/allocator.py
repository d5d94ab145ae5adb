"""Python face of the caching allocator's C core."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Literal

from gpupool_sdk.errors import ConfigError
from gpupool_sdk.memory import _native
from gpupool_sdk.memory.errors import (
    AllocatorClosedError,
    InvalidPointerError,
    MemoryErrorBase,
    oom_error_classes,
)
from gpupool_sdk.resources.units import format_size, parse_size

Backend = Literal["host", "cuda"]
SizeLike = int | float | str

_POOLS = ("all", "small_pool", "large_pool")
_FIELDS = ("current", "peak", "allocated", "freed")
_STATE_NAMES = ("free", "allocated", "pending")


@dataclass(frozen=True)
class BlockInfo:
    """One block of a :meth:`CachingAllocator.snapshot`.

    Attributes:
        segment: base address of the segment holding the block.
        segment_size: size of that segment in bytes.
        stream: the stream that owns the segment.
        pool: ``"small"`` or ``"large"``.
        ptr: address of the block.
        size: size of the block in bytes (a multiple of 512).
        requested: bytes the caller asked for (0 unless allocated).
        state: ``"free"``, ``"allocated"`` or ``"pending"`` (freed, waiting for other streams).
    """

    segment: int
    segment_size: int
    stream: int
    pool: str
    ptr: int
    size: int
    requested: int
    state: str


def _size_arg(value: SizeLike | None, field: str) -> int:
    if value is None:
        return -1
    return parse_size(value, field=field)


def fragmentation(free_bytes: int, largest_free_block: int) -> float:
    """Fragmentation of the cached free memory, between 0 and 1.

    ``1 - largest_free_block / free_bytes``: 0 when all cached free memory is one block (any
    request that fits in the free total can be served without growing), approaching 1 when
    it is scattered in many small pieces. 0 when nothing is cached.

    Args:
        free_bytes: total bytes in free (reusable) blocks.
        largest_free_block: the largest of those blocks.
    """
    if free_bytes <= 0:
        return 0.0
    return 1.0 - largest_free_block / free_bytes


class CachingAllocator:
    """A caching allocator with a hard quota and a balloon target.

    Blocks are rounded to 512 bytes; requests up to 1 MiB come from 2 MiB segments (small
    pool), larger ones from 20 MiB segments or their own (large pool). Freed blocks are cached
    per stream and coalesced with free neighbours. Reserved bytes (all segments) never grow
    above ``min(quota, target)``; an allocation that would need that raises
    ``QuotaExceededError`` (a ``torch.OutOfMemoryError``).

    Args:
        backend: ``"host"`` (host memory, fake streams; for tests and CPU jobs) or ``"cuda"``
            (``cudaMalloc`` through a ``dlopen``'d libcudart).
        quota: hard limit on reserved bytes: an int or a string such as ``"8GiB"``; None for
            no limit.
        device: CUDA device index (ignored by the host backend).
        cudart_path: explicit ``libcudart.so`` for the CUDA backend (default:
            ``GPUPOOL_CUDART_PATH``, then the copy shipped with PyTorch, then dlopen's search).

    Raises:
        ConfigError: bad backend, quota or device.
        NativeBuildError: the C core cannot be built or libcudart cannot be loaded.

    Example:
        >>> from gpupool_sdk.memory import CachingAllocator
        >>> alloc = CachingAllocator(backend="host", quota="64MiB")
        >>> p = alloc.malloc(1000)
        >>> alloc.stats()["allocated_bytes.all.current"]
        1024
        >>> alloc.free(p)
        >>> alloc.trim()
        2097152
        >>> alloc.close()
    """

    def __init__(
        self,
        backend: Backend = "host",
        quota: SizeLike | None = None,
        device: int = 0,
        cudart_path: str | None = None,
    ) -> None:
        if backend not in ("host", "cuda"):
            raise ConfigError("backend", f"must be 'host' or 'cuda', got {backend!r}")
        if not isinstance(device, int) or device < 0:
            raise ConfigError("device", f"must be a device index >= 0, got {device!r}")
        self.backend: Backend = backend
        self.device = device
        quota_bytes = _size_arg(quota, "quota")
        self._lib = _native.load()
        err = ctypes.create_string_buffer(512)
        path = (
            cudart_path if cudart_path is not None else (_native.find_cudart() if backend == "cuda" else "")
        )
        code = _native.BACKEND_CUDA if backend == "cuda" else _native.BACKEND_HOST
        handle = self._lib.gp_create(code, device, quota_bytes, path.encode(), err, len(err))
        if not handle:
            raise _native.NativeBuildError(
                f"cannot create the {backend} allocator: {err.value.decode(errors='replace')}"
            )
        self._handle: int | None = handle
        self._close_lock = threading.Lock()
        self._malloc_ptr = self._lib.gp_malloc_ptr
        self._free = self._lib.gp_free

    # ------------------------------------------------------------------ lifecycle

    def _h(self) -> int:
        h = self._handle
        if h is None:
            raise AllocatorClosedError("the allocator is closed; create a new CachingAllocator")
        return h

    @property
    def handle(self) -> int:
        """The C handle (``gp_alloc*``), for the torch and CuPy hooks."""
        return self._h()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._handle is None

    def close(self) -> None:
        """Frees every segment and the allocator itself. Live pointers become invalid."""
        with self._close_lock:
            if self._handle is not None:
                self._lib.gp_destroy(self._handle)
                self._handle = None

    def __enter__(self) -> CachingAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only host memory is released implicitly; a CUDA allocator may back live tensors.
        if getattr(self, "_handle", None) is not None and getattr(self, "backend", None) == "host":
            self.close()

    # ------------------------------------------------------------------ allocation

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocates ``size`` bytes for use on ``stream``.

        Args:
            size: bytes requested (rounded up to a multiple of 512, minimum 512).
            stream: the stream handle (``cudaStream_t`` as an int; any int on the host backend).

        Returns:
            The address of the block.

        Raises:
            QuotaExceededError: the allocation would take reserved memory above the quota or
                the balloon target, even after releasing every cached segment.
            DeviceOutOfMemoryError: the device itself is out of memory.
        """
        if size < 0:
            raise ConfigError("size", f"must be >= 0, got {size}")
        ptr = self._malloc_ptr(self._h(), size, stream)
        if ptr:
            return int(ptr)
        raise self._malloc_error(int(self._lib.gp_last_rc()), size, stream)

    def _malloc_error(self, rc: int, size: int, stream: int) -> Exception:
        quota_cls, device_cls = oom_error_classes()
        st = self.stats()
        quota = st["gpupool.quota_bytes"]
        target = st["gpupool.target_bytes"]
        reserved = st["reserved_bytes.all.current"]
        allocated = st["allocated_bytes.all.current"]
        cached = st["gpupool.free_bytes"]
        rounded = _native.round_size(size)
        fields: dict[str, Any] = {
            "requested_bytes": size,
            "quota_bytes": quota,
            "target_bytes": target,
            "reserved_bytes": reserved,
            "allocated_bytes": allocated,
            "cached_bytes": cached,
        }
        usage = (
            f"reserved {format_size(reserved)}, allocated {format_size(allocated)}, "
            f"cached free {format_size(cached)} (largest free block "
            f"{format_size(st['gpupool.largest_free_block_bytes'])}), "
            f"pending other streams {format_size(st['gpupool.pending_bytes'])}"
        )
        if rc == _native.GP_ERR_QUOTA:
            limit = "quota" if target is None or target >= (quota or 0) else "balloon target"
            quota_txt = "unlimited" if quota is None else f"{format_size(quota)} ({quota} bytes)"
            target_txt = "none" if target is None else f"{format_size(target)} ({target} bytes)"
            return quota_cls(
                f"gpupool {self.backend} allocator (device {self.device}): cannot allocate "
                f"{format_size(size)} ({size} bytes, block {rounded} bytes) on stream {stream}: the "
                f"{limit} would be exceeded. quota {quota_txt}, balloon target {target_txt}; {usage}. "
                "Free tensors, lower the batch size, or ask the pool for a larger quota.",
                **fields,
            )
        if rc == _native.GP_ERR_DEVICE:
            return device_cls(
                f"gpupool {self.backend} allocator (device {self.device}): the backend could not "
                f"allocate a segment for {format_size(size)} ({size} bytes) although the quota allowed "
                f"it (the device is shared or its memory is used outside this allocator); {usage}.",
                **fields,
            )
        return MemoryErrorBase(self._last_error())

    def _last_error(self) -> str:
        msg = self._lib.gp_last_error(self._h())
        return msg.decode(errors="replace") if msg else "unknown error"

    def free(self, ptr: int) -> None:
        """Returns a block to the cache.

        If the block was used on other streams (:meth:`record_stream`), it is reused only
        after those streams pass the point where it was freed.

        Raises:
            InvalidPointerError: ``ptr`` is not a live allocation of this allocator.
        """
        if self._free(self._h(), ptr) != _native.GP_OK:
            raise InvalidPointerError(self._last_error())

    def record_stream(self, ptr: int, stream: int) -> None:
        """Marks a live block as used on ``stream`` (like ``Tensor.record_stream``).

        Raises:
            InvalidPointerError: ``ptr`` is not a live allocation.
        """
        rc = self._lib.gp_record_stream(self._h(), ptr, stream)
        if rc == _native.GP_ERR_INVALID:
            raise InvalidPointerError(self._last_error())
        if rc != _native.GP_OK:
            raise MemoryErrorBase(self._last_error())

    def block_size(self, ptr: int) -> int:
        """Size in bytes of the live block at ``ptr``.

        Raises:
            InvalidPointerError: ``ptr`` is not a live allocation.
        """
        n = int(self._lib.gp_block_size(self._h(), ptr))
        if n < 0:
            raise InvalidPointerError(f"pointer {ptr:#x} is not a live allocation of this allocator")
        return n

    # ------------------------------------------------------------------ streams

    def synchronize(self, stream: int | None = None) -> None:
        """Waits for ``stream`` (or every stream) and reclaims blocks that were waiting on it.

        On the host backend fake streams complete exactly when synchronised, which makes
        :meth:`record_stream` behaviour deterministic in tests.
        """
        h = self._h()
        rc = self._lib.gp_synchronize(h) if stream is None else self._lib.gp_stream_synchronize(h, stream)
        if rc != 0:
            raise MemoryErrorBase(f"stream synchronisation failed (cuda error {rc})")

    # ------------------------------------------------------------------ quota and balloon

    def set_quota(self, quota: SizeLike | None) -> int:
        """Sets the hard limit on reserved bytes and releases free segments to get under it.

        Live blocks are never moved: if they alone exceed the new quota, reserved bytes stay
        above it and every growth is denied until enough is freed.

        Args:
            quota: bytes (int or ``"8GiB"``), or None for no limit.

        Returns:
            Bytes released.
        """
        return int(self._lib.gp_set_quota(self._h(), _size_arg(quota, "quota")))

    def set_target(self, target: SizeLike | None) -> int:
        """Sets (or with None clears) the balloon target.

        Above the target the allocator denies growth and releases free segments, largest
        first, until reserved bytes are under it (waiting for pending streams if needed).

        Returns:
            Bytes released.
        """
        return int(self._lib.gp_set_target(self._h(), _size_arg(target, "target")))

    def trim(self) -> int:
        """Releases every fully free segment (like ``torch.cuda.empty_cache``).

        Waits for blocks pending on other streams first, so they can be released too.

        Returns:
            Bytes released.
        """
        return int(self._lib.gp_trim(self._h()))

    @property
    def quota(self) -> int | None:
        """The hard limit on reserved bytes, None when unlimited."""
        return self.stats()["gpupool.quota_bytes"]

    @property
    def target(self) -> int | None:
        """The balloon target, None when not set."""
        return self.stats()["gpupool.target_bytes"]

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Allocator statistics under PyTorch's ``memory_stats`` key names, plus ``gpupool.*``.

        Keys ``<stat>.<pool>.<field>`` for stat in allocation, segment, active, inactive_split,
        allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
        pool in all, small_pool, large_pool; field in current, peak, allocated, freed. Counters
        ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``, ``num_device_free``,
        ``num_sync_all_streams``. And ``gpupool.quota_bytes`` / ``gpupool.target_bytes`` (None
        when unset), ``gpupool.free_bytes``, ``gpupool.largest_free_block_bytes``,
        ``gpupool.fragmentation`` (see :func:`fragmentation`), ``gpupool.pending_blocks``,
        ``gpupool.pending_bytes``, ``gpupool.released_bytes_total``.
        """
        buf = (ctypes.c_int64 * _native.STATS_LEN)()
        self._lib.gp_stats(self._h(), buf, _native.STATS_LEN)
        out: dict[str, Any] = {}
        k = 0
        for name in _native.ST_NAMES:
            for pool in _POOLS:
                for field in _FIELDS:
                    out[f"{name}.{pool}.{field}"] = int(buf[k])
                    k += 1
        c = {name: int(buf[k + i]) for i, name in enumerate(_native.COUNTER_NAMES)}
        for name in (
            "num_alloc_retries",
            "num_ooms",
            "num_device_alloc",
            "num_device_free",
            "num_sync_all_streams",
        ):
            out[name] = c[name]
        quota = c["quota"]
        out["gpupool.quota_bytes"] = None if quota >= 2**63 - 1 else quota
        out["gpupool.target_bytes"] = None if c["target"] < 0 else c["target"]
        out["gpupool.free_bytes"] = c["free_bytes"]
        out["gpupool.largest_free_block_bytes"] = c["largest_free_block"]
        out["gpupool.fragmentation"] = fragmentation(c["free_bytes"], c["largest_free_block"])
        out["gpupool.pending_blocks"] = c["pending_blocks"]
        out["gpupool.pending_bytes"] = c["pending_bytes"]
        out["gpupool.released_bytes_total"] = c["released_bytes_total"]
        return out

    def reset_peak_stats(self) -> None:
        """Sets every peak to its current value (per-phase peaks for telemetry)."""
        self._lib.gp_reset_peak_stats(self._h())

    def snapshot(self) -> list[BlockInfo]:
        """Every block of every segment, in segment order and address order within a segment."""
        h = self._h()
        for _ in range(8):
            rows = int(self._lib.gp_snapshot(h, None, 0))
            cap = rows + 64
            buf = (ctypes.c_int64 * (cap * _native.SNAPSHOT_COLS))()
            n = int(self._lib.gp_snapshot(h, buf, cap))
            if n <= cap:
                break
        out = []
        for i in range(n):
            r = buf[i * _native.SNAPSHOT_COLS : (i + 1) * _native.SNAPSHOT_COLS]
            out.append(
                BlockInfo(
                    segment=r[0] & (2**64 - 1),
                    segment_size=r[1],
                    stream=r[2] & (2**64 - 1),
                    pool="small" if r[3] == 0 else "large",
                    ptr=r[4] & (2**64 - 1),
                    size=r[5],
                    requested=r[6],
                    state=_STATE_NAMES[r[7]],
                )
            )
        return out

    def __repr__(self) -> str:
        if self._handle is None:
            return f"CachingAllocator(backend={self.backend!r}, closed)"
        st = self.stats()
        return (
            f"CachingAllocator(backend={self.backend!r}, device={self.device}, "
            f"reserved={format_size(st['reserved_bytes.all.current'])}, "
            f"allocated={format_size(st['allocated_bytes.all.current'])}, "
            f"quota={'none' if st['gpupool.quota_bytes'] is None else format_size(st['gpupool.quota_bytes'])})"
        )


def round_size(size: int) -> int:
    """The block size used for a request of ``size`` bytes (512-byte rounding, minimum 512)."""
    return _native.round_size(size)
