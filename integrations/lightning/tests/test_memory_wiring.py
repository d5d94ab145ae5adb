"""``GpuPoolCallback(allocator="gpupool")`` installs the SDK allocator and acks balloons with the bytes reached.

On a CPU, through the fake libcudart of tests/memory/fake_cudart.c (see
integrations/torch/tests/test_allocator_wiring.py): the callback is built while ``torch.cuda``
claims an uninitialised GPU, so it installs the SDK allocator on the rank's device; the Trainer
then runs on the CPU, and what torch would allocate on the GPU is allocated through the same C
entry points torch's pluggable allocator calls.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpupool_lightning import GpuPoolCallback
from gpupool_sdk.resources import Directive, DirectiveKind
from gpupool_torch.memory import torch_hook
from integrations.lightning.tests.test_callback_logic import FakeClient, FakeLease, make_trainer
from integrations.torch.tests.test_allocator_wiring import (  # noqa: F401 - fixtures
    fake_cudart,
    fake_gpu,
    torch_entry_points,
)

MiB = 1 << 20


class BalloonLease(FakeLease):
    """A FakeLease whose balloon directive asks for ``target`` bytes per slice."""

    def __init__(self, job: str, at_step: int, target: int) -> None:
        super().__init__(job, directive_at_step=at_step, kind="balloon")
        self.target = target

    def directive(self) -> Directive:
        return Directive(kind=DirectiveKind.BALLOON, seq=3, deadline=time.time() + 60,
                         target={"memory_bytes": self.target})


def test_balloon_to_a_gpupool_job_is_acked_with_the_bytes_reached(
    fake_gpu: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from gpupool_lightning.demo.job import TinyRegressor

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    lease = BalloonLease("galloc", at_step=2, target=24 * MiB)
    pool = GpuPoolCallback(memory="64MiB", name="galloc", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           allocator="gpupool")
    alloc = torch_hook.global_allocator(0, create=False)  # installed by the callback, before any CUDA use
    assert alloc.backend == "cuda" and alloc.quota == 64 * MiB and len(fake_gpu["swapped"]) == 1
    # The Trainer itself runs on the CPU; the "GPU" tensors are allocated through torch's entry points.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    malloc, free = torch_entry_points()
    live = malloc(3 * MiB, 0, None)  # a 20 MiB segment that stays in use
    cached = malloc(18 * MiB, 0, None)  # an 18 MiB segment of its own...
    free(cached, 18 * MiB, 0, None)  # ...left cached: the balloon gives it back
    assert alloc.stats()["reserved_bytes.all.current"] == 38 * MiB
    torch.manual_seed(7)
    trainer = make_trainer(pool, tmp_path, epochs=1)
    trainer.fit(TinyRegressor(seed=7, samples=64, batch_size=8, num_workers=0, step_sleep=0.0))
    assert trainer.global_step == 8 and not pool.preempted
    assert pool.memory_balloon.kind == "gpupool" and pool.memory_balloon.allocator is alloc
    assert len(lease.acks) == 1
    ack = lease.acks[0]
    assert ack["ok"] is True, ack["message"]
    assert ack["step"] == 2 and ack["reached_bytes"] == 20 * MiB
    assert alloc.stats()["reserved_bytes.all.current"] == 20 * MiB and alloc.target == 24 * MiB
    free(live, 3 * MiB, 0, None)
    pool.close()


def test_lightning_job_publishes_phase_peaks_and_history(tmp_path: Path) -> None:
    from gpupool_lightning.demo.job import TinyRegressor

    lease = FakeLease("phases")
    pool = GpuPoolCallback(memory="1GiB", name="phases", client=FakeClient(lease), checkpoint_dir=tmp_path,
                           telemetry_interval_s=0.001)
    torch.manual_seed(7)
    trainer = make_trainer(pool, tmp_path, epochs=1)
    trainer.fit(TinyRegressor(seed=7, samples=64, batch_size=8, num_workers=0, step_sleep=0.0))
    pool.close()
    last = lease.telemetry[-1]
    # host tier: resident optimizer state (SGD momentum) is the footprint, read at each phase boundary
    assert set(last["memory_peak_by_phase"]) == {"data", "forward", "backward", "optimizer"}
    assert min(last["memory_peak_by_phase"].values()) > 0
    assert len(last["memory_peak_history"]) >= 2 and last["memory_peak_history"][-1] == last["memory_peak_bytes"]
