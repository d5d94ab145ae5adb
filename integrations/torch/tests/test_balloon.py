"""Balloon controllers: inflate / deflate sequences on the CPU with a real torch optimizer."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gpupool_sdk.errors import ConfigError  # noqa: E402
from gpupool_sdk.memory import CachingAllocator, InstallError, QuotaExceededError  # noqa: E402
from gpupool_torch.memory import (  # noqa: E402
    AllocatorBalloonController,
    TorchBalloonController,
    make_balloon_controller,
    torch_hook,
)

MiB = 1 << 20


def make_job(seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: Any, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    y = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def state_bytes(opt: Any) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def snapshot_state(opt: Any) -> dict:
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


@pytest.fixture
def host_balloon() -> Iterator[AllocatorBalloonController]:
    b = make_balloon_controller("host", quota_bytes="256MiB")
    assert isinstance(b, AllocatorBalloonController)
    yield b
    b.allocator.close()


def test_inflate_trims_cache_first(host_balloon: AllocatorBalloonController) -> None:
    alloc = host_balloon.allocator
    live = alloc.malloc(4 * MiB)  # 20 MiB segment, stays
    for p in [alloc.malloc(18 * MiB) for _ in range(2)]:
        alloc.free(p)  # two cached 18 MiB segments (the 16 MiB free tail is too small)
    result = host_balloon.inflate(24 * MiB)
    assert result.released_bytes == 36 * MiB
    assert result.offloaded_bytes == 0
    assert result.reached_bytes == 20 * MiB and result.reached_target and result.ok
    assert result.live_bytes == 4 * MiB
    alloc.free(live)


def test_inflate_offloads_optimizer_state_when_trim_is_not_enough(
    host_balloon: AllocatorBalloonController,
) -> None:
    model, opt = make_job()
    for step in range(3):
        train_step(model, opt, step)
    host_balloon.add_optimizer(opt)
    expected = state_bytes(opt)
    before = snapshot_state(opt)
    usage_before = host_balloon.usage_bytes()
    assert usage_before == expected  # the host tier counts resident state as device memory

    result = host_balloon.inflate(1024)
    assert result.offloaded_bytes == expected
    assert result.reached_bytes == 0 and result.reached_target
    assert host_balloon.inflated and host_balloon.stats()["gpupool_optimizer_offloaded_bytes"] == expected
    # Growth above the target is denied while inflated.
    with pytest.raises(QuotaExceededError, match="balloon target"):
        host_balloon.allocator.malloc(4096)

    result = host_balloon.deflate()
    assert result.restored_bytes == expected and result.target_bytes is None
    assert not host_balloon.inflated
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[id(p)][k]) and v.dtype == before[id(p)][k].dtype
    host_balloon.allocator.free(host_balloon.allocator.malloc(4096))


def test_training_through_a_balloon_matches_training_without(
    host_balloon: AllocatorBalloonController,
) -> None:
    model, opt = make_job(seed=1)
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    host_balloon.add_optimizer(opt)
    for step in range(6):
        if step == 2:
            assert host_balloon.inflate(0).offloaded_bytes > 0
        if step == 4:
            host_balloon.deflate()
        train_step(model, opt, step)
        train_step(twin, twin_opt, step)
        if 2 <= step < 4:
            # Inflated: the step pre-hook brought the state back, the post-hook offloaded it again.
            assert host_balloon.stats()["gpupool_optimizer_resident_bytes"] == 0
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    off = host_balloon.add_optimizer(opt)
    assert off.restore_count >= 3 and not off.offloaded


def test_working_set_above_target_is_reported_not_raised(host_balloon: AllocatorBalloonController) -> None:
    alloc = host_balloon.allocator
    held = [alloc.malloc(8 * MiB) for _ in range(2)]
    result = host_balloon.inflate(4 * MiB)
    assert not result.reached_target and not result.ok
    assert result.working_set_exceeds_target
    assert result.live_bytes == 16 * MiB and result.reached_bytes == 20 * MiB
    assert "live working set" in result.message and "16.0MiB" in result.message
    assert host_balloon.last_result is result
    for p in held:
        alloc.free(p)
    assert host_balloon.inflate(4 * MiB).reached_target  # freed: now the trim gets there


def test_fragmentation_above_target_is_explained(host_balloon: AllocatorBalloonController) -> None:
    alloc = host_balloon.allocator
    p = alloc.malloc(2 * MiB)  # 20 MiB segment holding 2 MiB live
    result = host_balloon.inflate(4 * MiB)
    assert not result.reached_target and not result.working_set_exceeds_target
    assert "fragmentation" in result.message
    alloc.free(p)


def test_set_quota_applies_to_the_allocator(host_balloon: AllocatorBalloonController) -> None:
    host_balloon.set_quota("32MiB")
    assert host_balloon.allocator.quota == 32 * MiB and host_balloon.quota_bytes == 32 * MiB
    with pytest.raises(QuotaExceededError):
        host_balloon.allocator.malloc(40 * MiB)
    st = host_balloon.stats()
    assert st["gpupool_memory_quota_bytes"] == 32 * MiB and st["gpupool_balloon_tier"] == "host"


def test_gpupool_tier_uses_the_global_allocator() -> None:
    try:
        alloc = torch_hook.global_allocator(0, quota="64MiB", backend="host")
        balloon = make_balloon_controller("gpupool", quota_bytes="64MiB")
        assert isinstance(balloon, AllocatorBalloonController) and balloon.allocator is alloc
        p = alloc.malloc(MiB)
        alloc.free(p)
        assert balloon.inflate(0).released_bytes == 2 * MiB
        balloon.deflate()
        assert alloc.target is None
    finally:
        torch_hook._reset_for_tests()


def test_gpupool_tier_needs_an_installed_allocator() -> None:
    with pytest.raises(InstallError, match="install_torch_allocator"):
        make_balloon_controller("gpupool", quota_bytes="1GiB", device=5)


def test_unknown_tier() -> None:
    with pytest.raises(ConfigError, match="kind"):
        make_balloon_controller("tpu")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_torch_tier_needs_cuda() -> None:
    with pytest.raises(InstallError, match="kind='host'"):
        make_balloon_controller("torch", quota_bytes="1GiB")


class FakeCuda:
    """Stands in for torch.cuda: a caching allocator that frees `cached` on empty_cache."""

    def __init__(self, total: int, allocated: int, cached: int) -> None:
        self.total, self.allocated, self.cached = total, allocated, cached
        self.fractions: list[tuple[float, int]] = []

    def get_device_properties(self, device: int) -> Any:
        return type("Props", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.fractions.append((fraction, device))

    def empty_cache(self) -> None:
        self.cached = 0

    def memory_reserved(self, device: int) -> int:
        return self.allocated + self.cached

    def memory_allocated(self, device: int) -> int:
        return self.allocated

    def memory_stats(self, device: int) -> dict:
        return {"reserved_bytes.all.peak": 123, "num_ooms": 0}


def test_torch_tier_logic_with_a_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = FakeCuda(total=80 * (1 << 30), allocated=10 * (1 << 30), cached=6 * (1 << 30))
    b = TorchBalloonController(quota_bytes="40GiB", device=1, cuda=cuda)
    assert cuda.fractions[-1] == (0.5, 1)
    result = b.inflate("20GiB")
    assert cuda.fractions[-1] == (0.25, 1)
    assert result.released_bytes == 6 * (1 << 30) and result.reached_bytes == 10 * (1 << 30)
    assert result.reached_target
    assert b.advice is not None and "expandable_segments" in b.advice
    b.deflate()
    assert cuda.fractions[-1] == (0.5, 1)
    b.set_quota(None)
    assert cuda.fractions[-1] == (1.0, 1)
    result = b.inflate("8GiB")
    assert result.working_set_exceeds_target and not result.ok
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert b.advice is None
    assert b.stats()["gpupool_memory_reserved_peak_bytes"] == 123


def test_host_tier_accepts_an_existing_allocator() -> None:
    with CachingAllocator(backend="host", quota="8MiB") as alloc:
        b = make_balloon_controller("host", allocator=alloc)
        assert b.quota_bytes == 8 * MiB


def test_park_and_unpark_at_hand_overs_keep_training_bit_exact(host_balloon: AllocatorBalloonController) -> None:
    """Time-slicing hand-overs (``handover_offload``): state out while another job has the GPU, back on our turn."""
    model, opt = make_job(seed=2)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    host_balloon.add_optimizer(opt)
    for step in range(8):
        train_step(model, opt, step)
        train_step(twin, twin_opt, step)
        expected = state_bytes(opt)
        before = snapshot_state(opt)
        parked = host_balloon.park()
        assert parked.offloaded_bytes == expected and host_balloon.usage_bytes() == 0 and not host_balloon.inflated
        back = host_balloon.unpark()
        assert back.restored_bytes == expected and host_balloon.usage_bytes() == expected
        for p, s in opt.state.items():
            for k, v in s.items():
                assert torch.equal(v, before[id(p)][k])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_unpark_leaves_state_out_while_a_balloon_target_holds_it(host_balloon: AllocatorBalloonController) -> None:
    model, opt = make_job(seed=3)
    train_step(model, opt, 0)
    host_balloon.add_optimizer(opt)
    expected = state_bytes(opt)
    host_balloon.inflate(0)  # the coordinator's balloon directive
    host_balloon.park()
    assert host_balloon.unpark().restored_bytes == 0 and host_balloon.usage_bytes() == 0
    assert host_balloon.deflate().restored_bytes == expected
