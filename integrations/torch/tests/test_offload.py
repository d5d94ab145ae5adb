"""OptimizerOffloader on the CPU: state moves out and back bit for bit."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gpupool_torch.memory import OptimizerOffloader  # noqa: E402


def trained_adam() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def test_offload_and_restore_are_bit_identical() -> None:
    _, opt = trained_adam()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    originals = [v for s in opt.state.values() for v in s.values()]
    off = OptimizerOffloader(opt, include_cpu_tensors=True)
    nbytes = off.offload()
    assert nbytes == sum(v.numel() * v.element_size() for v in originals)
    assert off.offloaded and off.resident_bytes() == 0 and off.offloaded_bytes() == nbytes
    assert off.offload() == 0  # idempotent
    moved = [v for s in opt.state.values() for v in s.values()]
    assert all(a is not b for a, b in zip(originals, moved, strict=True))
    assert off.restore() == nbytes
    assert not off.offloaded and off.restore() == 0
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[id(p)][k])


def test_cpu_state_is_left_alone_unless_asked() -> None:
    _, opt = trained_adam()
    off = OptimizerOffloader(opt)
    assert off.offload() == 0 and not off.offloaded


def test_a_step_restores_state_first_and_held_state_goes_back_out() -> None:
    model, opt = trained_adam()
    off = OptimizerOffloader(opt, include_cpu_tensors=True)
    off.offload()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert not off.offloaded and off.restore_count == 1  # pre-hook restored, not held
    off.hold()
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert off.held and off.offloaded  # post-hook offloaded again
    assert off.release() > 0 and not off.held and not off.offloaded
    off.remove()
    off2_calls = off.offload_count
    opt.step()
    assert off.offload_count == off2_calls


def test_empty_optimizer_state() -> None:
    model = torch.nn.Linear(2, 2)
    off = OptimizerOffloader(torch.optim.SGD(model.parameters(), lr=0.1), include_cpu_tensors=True)
    assert off.offload() == 0 and off.restore() == 0
