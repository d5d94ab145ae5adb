"""Unit tests of the caching allocator on the host backend."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import pytest

from gpupool_sdk.errors import ConfigError, GpupoolError
from gpupool_sdk.memory import (
    AllocatorClosedError,
    CachingAllocator,
    InvalidPointerError,
    QuotaExceededError,
    fragmentation,
    round_size,
)

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def alloc() -> Iterator[CachingAllocator]:
    a = CachingAllocator(backend="host", quota="1GiB")
    yield a
    a.close()


def segments(a: CachingAllocator) -> dict[int, list]:
    out: dict[int, list] = {}
    for b in a.snapshot():
        out.setdefault(b.segment, []).append(b)
    return out


@pytest.mark.parametrize(
    ("request_bytes", "block"),
    [(0, 512), (1, 512), (512, 512), (513, 1024), (1000, 1024), (MiB, MiB), (MiB + 1, MiB + 512)],
)
def test_round_size(request_bytes: int, block: int) -> None:
    assert round_size(request_bytes) == block


@pytest.mark.parametrize(
    ("request_bytes", "pool", "segment_size"),
    [
        (100, "small", 2 * MiB),
        (MiB, "small", 2 * MiB),
        (MiB + 1, "large", 20 * MiB),
        (9 * MiB, "large", 20 * MiB),
        (10 * MiB, "large", 10 * MiB),
        (11 * MiB + 3, "large", 12 * MiB),
    ],
)
def test_small_and_large_pools(
    alloc: CachingAllocator, request_bytes: int, pool: str, segment_size: int
) -> None:
    p = alloc.malloc(request_bytes)
    (blocks,) = segments(alloc).values()
    assert blocks[0].ptr == p and blocks[0].pool == pool and blocks[0].segment_size == segment_size
    st = alloc.stats()
    assert st[f"reserved_bytes.{pool}_pool.current"] == segment_size
    other = "large" if pool == "small" else "small"
    assert st[f"reserved_bytes.{other}_pool.current"] == 0


def test_split_then_coalesce(alloc: CachingAllocator) -> None:
    a, b, c = (alloc.malloc(100 * KiB) for _ in range(3))
    assert b == a + 100 * KiB and c == b + 100 * KiB  # carved from one 2 MiB segment
    (blocks,) = segments(alloc).values()
    assert [x.state for x in blocks] == ["allocated", "allocated", "allocated", "free"]
    alloc.free(b)
    st = alloc.stats()
    assert st["inactive_split.all.current"] == 2
    assert st["inactive_split_bytes.all.current"] == 2 * MiB - 200 * KiB
    alloc.free(c)  # merges with b and with the tail
    (blocks,) = segments(alloc).values()
    assert [(x.state, x.size) for x in blocks] == [("allocated", 100 * KiB), ("free", 2 * MiB - 100 * KiB)]
    alloc.free(a)
    (blocks,) = segments(alloc).values()
    assert [(x.state, x.size) for x in blocks] == [("free", 2 * MiB)]
    assert alloc.stats()["inactive_split.all.current"] == 0


def test_small_blocks_are_reused_exact_size_lifo(alloc: CachingAllocator) -> None:
    small = alloc.malloc(4 * KiB)
    big = alloc.malloc(64 * KiB)
    keep = alloc.malloc(4 * KiB)
    alloc.free(small)
    alloc.free(big)
    assert alloc.malloc(64 * KiB) == big  # the quick list of its exact size, no split
    assert alloc.malloc(4 * KiB) == small
    assert alloc.stats()["segment.all.current"] == 1
    for p in (small, big, keep):
        alloc.free(p)
    (blocks,) = segments(alloc).values()  # observed state is always coalesced
    assert [(b.state, b.size) for b in blocks] == [("free", 2 * MiB)]


def test_large_blocks_are_reused_best_fit(alloc: CachingAllocator) -> None:
    a = alloc.malloc(3 * MiB)
    k1 = alloc.malloc(2 * MiB)
    b = alloc.malloc(8 * MiB)
    k2 = alloc.malloc(2 * MiB)  # leaves a 5 MiB tail in the 20 MiB segment
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(5 * MiB // 2) == a  # 3 MiB hole beats the 5 MiB tail and the 8 MiB hole
    assert alloc.malloc(7 * MiB) == b  # the tail is too small now
    assert alloc.stats()["segment.all.current"] == 1
    for p in (a, b, k1, k2):
        alloc.free(p)


def test_large_pool_does_not_split_tails_of_one_mib_or_less(alloc: CachingAllocator) -> None:
    p = alloc.malloc(19 * MiB + 1)  # 20 MiB segment, remainder < 1 MiB stays with the block
    assert alloc.block_size(p) == 20 * MiB
    q = alloc.malloc(18 * MiB)  # a new segment; the 2 MiB tail is split off (> 1 MiB)
    assert alloc.block_size(q) == 18 * MiB
    assert alloc.stats()["allocated_bytes.all.current"] == 38 * MiB


def test_streams_have_separate_free_lists(alloc: CachingAllocator) -> None:
    p = alloc.malloc(4 * KiB, stream=1)
    alloc.free(p)
    q = alloc.malloc(4 * KiB, stream=2)
    assert alloc.stats()["segment.all.current"] == 2  # stream 2 cannot take stream 1's block
    assert alloc.malloc(4 * KiB, stream=1) == p
    alloc.free(q)


def test_record_stream_delays_reuse_until_the_stream_passes(alloc: CachingAllocator) -> None:
    p = alloc.malloc(4 * KiB, stream=0)
    alloc.record_stream(p, 7)
    alloc.free(p)
    st = alloc.stats()
    assert st["gpupool.pending_blocks"] == 1
    assert st["active_bytes.all.current"] == 4 * KiB and st["allocated_bytes.all.current"] == 0
    q = alloc.malloc(4 * KiB, stream=0)
    assert q != p  # still in use by stream 7
    alloc.synchronize(7)
    assert alloc.stats()["gpupool.pending_blocks"] == 0
    assert alloc.malloc(4 * KiB, stream=0) == p
    alloc.free(q)


def test_record_stream_on_own_stream_is_a_no_op(alloc: CachingAllocator) -> None:
    p = alloc.malloc(4 * KiB, stream=3)
    alloc.record_stream(p, 3)
    alloc.free(p)
    assert alloc.stats()["gpupool.pending_blocks"] == 0
    assert alloc.malloc(4 * KiB, stream=3) == p


def test_record_stream_waits_for_every_recorded_stream(alloc: CachingAllocator) -> None:
    p = alloc.malloc(4 * KiB)
    alloc.record_stream(p, 1)
    alloc.record_stream(p, 2)
    alloc.free(p)
    alloc.synchronize(1)
    assert alloc.stats()["gpupool.pending_blocks"] == 1
    alloc.synchronize(2)
    assert alloc.stats()["gpupool.pending_blocks"] == 0


def test_quota_error_message_and_type() -> None:
    with CachingAllocator(backend="host", quota="48MiB") as a:
        a.malloc(30 * MiB)
        held = a.malloc(100 * KiB)
        with pytest.raises(QuotaExceededError) as info:
            a.malloc(20 * MiB)
        e = info.value
        msg = str(e)
        assert "48.0MiB" in msg and str(48 * MiB) in msg  # the quota
        assert str(20 * MiB) in msg  # the request
        assert "reserved 32.0MiB" in msg and "allocated 30.1MiB" in msg and "cached free" in msg
        assert e.quota_bytes == 48 * MiB and e.requested_bytes == 20 * MiB
        assert e.reserved_bytes == 32 * MiB
        assert isinstance(e, GpupoolError) and isinstance(e, MemoryError | Exception)
        torch = pytest.importorskip("torch")
        assert isinstance(e, torch.OutOfMemoryError)
        st = a.stats()
        assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1
        a.free(held)


def test_quota_retry_releases_cache_before_failing() -> None:
    with CachingAllocator(backend="host", quota="24MiB") as a:
        p = a.malloc(4 * MiB)  # 20 MiB large segment
        a.free(p)
        q = a.malloc(100 * KiB)  # needs a 2 MiB small segment: 22 MiB, fits
        r = a.malloc(1500 * KiB)  # served from the cached large segment
        a.free(r)
        s = a.malloc(512 * KiB)  # small pool has room
        a.free(s)
        big = a.malloc(22 * MiB)  # only fits once the cached 20 MiB segment is released
        st = a.stats()
        assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 0
        assert st["reserved_bytes.all.current"] == 24 * MiB
        a.free(big)
        a.free(q)


def test_tight_quota_gets_an_exact_large_segment() -> None:
    with CachingAllocator(backend="host", quota="8MiB") as a:
        p = a.malloc(3 * MiB)  # a 20 MiB segment would not fit: falls back to 4 MiB
        assert a.stats()["reserved_bytes.all.current"] == 4 * MiB
        a.free(p)


def test_set_quota_releases_free_segments_and_keeps_live_ones(alloc: CachingAllocator) -> None:
    live = alloc.malloc(15 * MiB)  # its own 16 MiB segment
    cached = [alloc.malloc(200 * KiB) for _ in range(3)]
    for p in cached:
        alloc.free(p)
    assert alloc.stats()["reserved_bytes.all.current"] == 18 * MiB
    released = alloc.set_quota(4 * MiB)
    assert released == 2 * MiB
    st = alloc.stats()
    assert st["reserved_bytes.all.current"] == 16 * MiB  # live: above the quota, not moved
    with pytest.raises(QuotaExceededError):
        alloc.malloc(1)
    alloc.free(live)
    assert alloc.malloc(4 * MiB) == live  # the cached segment can still be used


def test_target_denies_growth_and_releases_until_under(alloc: CachingAllocator) -> None:
    ptrs = [alloc.malloc(MiB) for _ in range(6)]  # 3 small segments of 2 MiB
    for p in ptrs[:4]:
        alloc.free(p)
    assert alloc.stats()["reserved_bytes.all.current"] == 6 * MiB
    released = alloc.set_target(3 * MiB)
    assert released == 4 * MiB
    assert alloc.stats()["gpupool.target_bytes"] == 3 * MiB
    with pytest.raises(QuotaExceededError, match="balloon target"):
        alloc.malloc(MiB)
    alloc.set_target(None)
    alloc.malloc(MiB)


def test_trim_releases_every_fully_free_segment(alloc: CachingAllocator) -> None:
    keep = alloc.malloc(100 * KiB)
    frees = [alloc.malloc(5 * MiB) for _ in range(5)] + [alloc.malloc(30 * MiB)]
    pending = alloc.malloc(200 * KiB, stream=0)
    alloc.record_stream(pending, 5)
    for p in frees:
        alloc.free(p)
    alloc.free(pending)
    before = alloc.stats()["reserved_bytes.all.current"]
    released = alloc.trim()
    assert released == 2 * 20 * MiB + 30 * MiB
    st = alloc.stats()
    assert st["reserved_bytes.all.current"] == before - released == 2 * MiB
    assert st["gpupool.pending_blocks"] == 0  # trim waits for other streams
    assert st["gpupool.released_bytes_total"] == released
    alloc.free(keep)
    assert alloc.trim() == 2 * MiB
    assert alloc.stats()["reserved_bytes.all.current"] == 0


def test_fragmentation_figure(alloc: CachingAllocator) -> None:
    assert alloc.stats()["gpupool.fragmentation"] == 0.0
    ptrs = [alloc.malloc(256 * KiB) for _ in range(8)]  # fills one 2 MiB segment exactly
    for p in ptrs[::2]:
        alloc.free(p)  # four separate 256 KiB holes
    st = alloc.stats()
    assert st["gpupool.free_bytes"] == 1 * MiB
    assert st["gpupool.largest_free_block_bytes"] == 256 * KiB
    assert st["gpupool.fragmentation"] == pytest.approx(0.75)
    for p in ptrs[1::2]:
        alloc.free(p)
    assert alloc.stats()["gpupool.fragmentation"] == 0.0


@pytest.mark.parametrize(("free", "largest", "expected"), [(0, 0, 0.0), (100, 100, 0.0), (100, 25, 0.75)])
def test_fragmentation_function(free: int, largest: int, expected: float) -> None:
    assert fragmentation(free, largest) == pytest.approx(expected)


def test_peak_stats_and_reset(alloc: CachingAllocator) -> None:
    p = alloc.malloc(3 * MiB)
    alloc.free(p)
    st = alloc.stats()
    assert st["allocated_bytes.all.peak"] == 3 * MiB and st["allocated_bytes.all.current"] == 0
    assert st["allocated_bytes.all.allocated"] == 3 * MiB and st["allocated_bytes.all.freed"] == 3 * MiB
    alloc.reset_peak_stats()
    assert alloc.stats()["allocated_bytes.all.peak"] == 0


def test_memory_is_usable(alloc: CachingAllocator) -> None:
    p = alloc.malloc(4096)
    buf = (ctypes.c_ubyte * 4096).from_address(p)
    buf[0], buf[4095] = 7, 9
    assert (buf[0], buf[4095]) == (7, 9)
    alloc.free(p)


def test_invalid_pointers(alloc: CachingAllocator) -> None:
    p = alloc.malloc(10)
    alloc.free(p)
    with pytest.raises(InvalidPointerError, match="already freed"):
        alloc.free(p)
    with pytest.raises(InvalidPointerError):
        alloc.record_stream(p, 1)
    with pytest.raises(InvalidPointerError):
        alloc.block_size(12345)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="backend"):
        CachingAllocator(backend="tpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="quota"):
        CachingAllocator(backend="host", quota="eight gigs")
    with CachingAllocator(backend="host", quota="1.5GB") as a:
        assert a.quota == 1_500_000_000
        with pytest.raises(ConfigError, match="size"):
            a.malloc(-1)


def test_closed_allocator() -> None:
    a = CachingAllocator(backend="host")
    assert a.quota is None
    a.close()
    a.close()
    with pytest.raises(AllocatorClosedError):
        a.malloc(1)


def test_threads_share_one_allocator_safely(alloc: CachingAllocator) -> None:
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            held = []
            for i in range(2000):
                held.append(alloc.malloc(((seed * 7919 + i * 104729) % (3 * MiB)) + 1, stream=seed % 2))
                if len(held) > 8:
                    alloc.free(held.pop(0))
            for p in held:
                alloc.free(p)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = alloc.stats()
    assert st["allocation.all.current"] == 0 and st["allocated_bytes.all.current"] == 0
    assert st["allocation.all.allocated"] == 8000


def test_absurd_requests_fail_cleanly() -> None:
    from gpupool_sdk.memory import DeviceOutOfMemoryError

    with CachingAllocator(backend="host", quota="4MiB") as a:
        with pytest.raises(QuotaExceededError):
            a.malloc(1 << 62)
        assert a.stats()["num_ooms"] == 1
    with (
        CachingAllocator(backend="host") as a,
        pytest.raises(DeviceOutOfMemoryError, match="backend could not"),
    ):
        a.malloc(1 << 62)
