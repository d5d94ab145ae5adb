"""Property tests of the caching allocator on the host backend.

A rule-based state machine drives random sequences of malloc / free / record_stream /
stream synchronisation / trim / set_quota / set_target against a Python shadow model and
checks after every step that live blocks never overlap, the stats equal a recount, reserved
bytes never grow above the limit, and trim releases every fully free segment.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpupool_sdk.memory import BlockInfo, CachingAllocator, QuotaExceededError, round_size

MiB = 1 << 20
SMALL = 1 * MiB
STREAMS = st.integers(min_value=0, max_value=2)
SIZES = st.one_of(
    st.integers(min_value=0, max_value=4096),
    st.integers(min_value=4097, max_value=SMALL),
    st.integers(min_value=SMALL + 1, max_value=24 * MiB),
)
QUOTAS = st.integers(min_value=4 * MiB, max_value=160 * MiB)


def min_segment(rsize: int) -> int:
    """The smallest segment a request can be served from when the cache has nothing to offer."""
    if rsize <= SMALL:
        return 2 * MiB
    return -(-rsize // (2 * MiB)) * (2 * MiB)


def recount(blocks: list[BlockInfo]) -> dict[str, int]:
    """Recomputes the stats from a snapshot."""
    out: dict[str, int] = defaultdict(int)
    by_segment: dict[int, list[BlockInfo]] = defaultdict(list)
    for b in blocks:
        by_segment[b.segment].append(b)
    for seg_blocks in by_segment.values():
        seg = seg_blocks[0]
        pools = ("all", f"{seg.pool}_pool")
        for pool in pools:
            out[f"segment.{pool}.current"] += 1
            out[f"reserved_bytes.{pool}.current"] += seg.segment_size
        split = len(seg_blocks) > 1
        for b in seg_blocks:
            for pool in pools:
                if b.state == "allocated":
                    out[f"allocation.{pool}.current"] += 1
                    out[f"allocated_bytes.{pool}.current"] += b.size
                    out[f"requested_bytes.{pool}.current"] += b.requested
                if b.state in ("allocated", "pending"):
                    out[f"active.{pool}.current"] += 1
                    out[f"active_bytes.{pool}.current"] += b.size
                if b.state == "free" and split:
                    out[f"inactive_split.{pool}.current"] += 1
                    out[f"inactive_split_bytes.{pool}.current"] += b.size
            if b.state == "free":
                out["gpupool.free_bytes"] += b.size
                out["gpupool.largest_free_block_bytes"] = max(out["gpupool.largest_free_block_bytes"], b.size)
            if b.state == "pending":
                out["gpupool.pending_blocks"] += 1
    return out


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: CachingAllocator | None = None
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (requested, stream)
        self.uses: dict[int, set[int]] = {}  # ptr -> streams recorded
        self.pending: list[tuple[int, int, set[int]]] = []  # (ptr, block size, streams still to pass)
        self.quota = 0
        self.target: int | None = None
        self.reserved_before = 0
        self.after_trim = False

    @initialize(quota=QUOTAS)
    def start(self, quota: int) -> None:
        self.alloc = CachingAllocator(backend="host", quota=quota)
        self.quota = quota

    def teardown(self) -> None:
        if self.alloc is not None:
            self.alloc.close()

    # ------------------------------------------------------------------ helpers

    @property
    def a(self) -> CachingAllocator:
        assert self.alloc is not None
        return self.alloc

    def limit(self) -> int:
        return self.quota if self.target is None else min(self.quota, self.target)

    def begin(self) -> None:
        self.reserved_before = self.a.stats()["reserved_bytes.all.current"]
        self.after_trim = False

    def sync_shadow_pending(self) -> None:
        # The allocator completes every pending block when it synchronises all streams
        # (trim, an allocation retry, a limit it cannot meet otherwise).
        if self.a.stats()["gpupool.pending_blocks"] == 0:
            self.pending.clear()

    # ------------------------------------------------------------------ rules

    @rule(size=SIZES, stream=STREAMS)
    def malloc(self, size: int, stream: int) -> None:
        self.begin()
        retries = self.a.stats()["num_alloc_retries"]
        try:
            ptr = self.a.malloc(size, stream)
        except QuotaExceededError as e:
            st_ = self.a.stats()
            rsize = round_size(size)
            assert str(size) in str(e) and "quota" in str(e)
            assert e.requested_bytes == size
            # It failed only because growth was impossible: no free block fits on this
            # stream and pool, and a new segment would cross the limit.
            assert st_["reserved_bytes.all.current"] + min_segment(rsize) > self.limit()
            pool = "small" if rsize <= SMALL else "large"
            for b in self.a.snapshot():
                if b.state == "free" and b.stream == stream and b.pool == pool:
                    assert b.size < rsize
            self.sync_shadow_pending()
            return
        if self.a.stats()["num_alloc_retries"] > retries:
            self.sync_shadow_pending()
        block = self.a.block_size(ptr)
        assert block >= round_size(size)
        for pptr, psize, _ in self.pending:
            assert ptr + block <= pptr or pptr + psize <= ptr, "reused a block still in use by another stream"
        self.live[ptr] = (size, stream)
        self.uses[ptr] = set()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.begin()
        ptr = data.draw(
            st.sampled_from(list(self.live))
        )  # insertion order: replays do not depend on addresses
        _, stream = self.live.pop(ptr)
        size = self.a.block_size(ptr)
        others = self.uses.pop(ptr) - {stream}
        self.a.free(ptr)
        if others:
            self.pending.append((ptr, size, others))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=STREAMS)
    def record_stream(self, data: st.DataObject, stream: int) -> None:
        self.begin()
        ptr = data.draw(
            st.sampled_from(list(self.live))
        )  # insertion order: replays do not depend on addresses
        self.a.record_stream(ptr, stream)
        self.uses[ptr].add(stream)

    @rule(stream=STREAMS)
    def sync_stream(self, stream: int) -> None:
        self.begin()
        self.a.synchronize(stream)
        for _, _, streams in self.pending:
            streams.discard(stream)
        self.pending = [p for p in self.pending if p[2]]

    @rule()
    def sync_all(self) -> None:
        self.begin()
        self.a.synchronize()
        self.pending.clear()

    @rule()
    def trim(self) -> None:
        self.begin()
        before = self.a.stats()["reserved_bytes.all.current"]
        released = self.a.trim()
        assert before - released == self.a.stats()["reserved_bytes.all.current"]
        self.pending.clear()
        self.after_trim = True

    @rule(quota=QUOTAS)
    def set_quota(self, quota: int) -> None:
        self.begin()
        self.a.set_quota(quota)
        self.quota = quota
        self.sync_shadow_pending()

    @rule(new_target=st.one_of(st.none(), st.integers(min_value=0, max_value=96 * MiB)))
    def set_target(self, new_target: int | None) -> None:
        self.begin()
        self.a.set_target(new_target)
        self.target = new_target
        self.sync_shadow_pending()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def structure(self) -> None:
        if self.alloc is None:
            return
        blocks = self.a.snapshot()
        by_segment: dict[int, list[BlockInfo]] = defaultdict(list)
        for b in blocks:
            by_segment[b.segment].append(b)
        segments = sorted((s, bl[0].segment_size) for s, bl in by_segment.items())
        for (s0, n0), (s1, _) in zip(segments, segments[1:], strict=False):
            assert s0 + n0 <= s1, "segments overlap"
        for seg, seg_blocks in by_segment.items():
            # Blocks tile the segment exactly, in address order, 512-byte aligned.
            cursor = seg
            for b in seg_blocks:
                assert b.ptr == cursor and b.size % 512 == 0 and b.size > 0
                cursor += b.size
            assert cursor == seg + seg_blocks[0].segment_size
            # Coalescing: never two free neighbours.
            for b0, b1 in zip(seg_blocks, seg_blocks[1:], strict=False):
                assert not (b0.state == "free" and b1.state == "free")
            assert len({b.stream for b in seg_blocks}) == 1
        live = {b.ptr: b for b in blocks if b.state == "allocated"}
        assert set(live) == set(self.live)
        for ptr, (requested, stream) in self.live.items():
            assert live[ptr].requested == requested
            assert live[ptr].stream == stream
        spans = sorted((p, p + max(r, 1)) for p, (r, _) in self.live.items())
        for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
            assert e0 <= s1, "live blocks overlap"

    @invariant()
    def stats_match_recount(self) -> None:
        if self.alloc is None:
            return
        stats = self.a.stats()
        counted = recount(self.a.snapshot())
        for stat in (
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
        ):
            for pool in ("all", "small_pool", "large_pool"):
                key = f"{stat}.{pool}.current"
                assert stats[key] == counted[key], key
                assert stats[f"{stat}.{pool}.peak"] >= stats[key]
                assert stats[f"{stat}.{pool}.allocated"] - stats[f"{stat}.{pool}.freed"] == stats[key]
        for key in ("gpupool.free_bytes", "gpupool.largest_free_block_bytes", "gpupool.pending_blocks"):
            assert stats[key] == counted[key], key
        assert stats["allocation.all.current"] == len(self.live)
        assert stats["requested_bytes.all.current"] == sum(r for r, _ in self.live.values())
        assert stats["gpupool.pending_blocks"] == len(self.pending)
        frag = stats["gpupool.fragmentation"]
        assert 0.0 <= frag < 1.0

    @invariant()
    def reserved_never_grows_past_limit(self) -> None:
        if self.alloc is None:
            return
        reserved = self.a.stats()["reserved_bytes.all.current"]
        assert reserved <= self.limit() or reserved <= self.reserved_before
        assert reserved <= self.quota or reserved <= self.reserved_before

    @invariant()
    def trim_released_every_free_segment(self) -> None:
        if self.alloc is None or not self.after_trim:
            return
        by_segment: dict[int, list[BlockInfo]] = defaultdict(list)
        for b in self.a.snapshot():
            by_segment[b.segment].append(b)
        for seg_blocks in by_segment.values():
            assert not (len(seg_blocks) == 1 and seg_blocks[0].state == "free")
        assert self.a.stats()["gpupool.pending_blocks"] == 0


AllocatorMachine.TestCase.settings = settings(
    # 150 keeps the suite fast; GPUPOOL_HYPOTHESIS_EXAMPLES=2000 for a soak run.
    max_examples=int(os.environ.get("GPUPOOL_HYPOTHESIS_EXAMPLES", "150")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_allocator_state_machine = pytest.mark.timeout(120)(AllocatorMachine.TestCase)
