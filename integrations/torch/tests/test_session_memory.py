"""PoolSession (plain PyTorch loop): per-phase memory peaks and allocator='gpupool' on a CPU machine."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from gpupool_sdk.telemetry.phases import Phase  # noqa: E402
from gpupool_torch import PoolSession  # noqa: E402


class Lease:
    """A JobLease held in memory (see gpupool_sdk.runtime.leases)."""

    etcd_lease_hex = "5eed"

    def __init__(self) -> None:
        self.telemetry: list[dict[str, Any]] = []
        self.acks: list[dict[str, Any]] = []
        self.q: queue.Queue[Any] = queue.Queue()

    def device_indices(self) -> list[str]:
        return []

    def directives(self) -> Any:
        while (item := self.q.get()) is not None:
            yield item

    def add_lost_callback(self, cb: Any) -> None:
        pass

    def ack(self, directive: Any, **kw: Any) -> None:
        self.acks.append(kw)

    def publish_telemetry(self, summary: dict[str, Any]) -> None:
        self.telemetry.append(summary)

    def wait_released(self, timeout: float | None = None) -> bool:
        return True

    def release(self) -> None:
        self.q.put(None)


class Client:
    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def acquire(self, spec: Any, timeout: float | None = None, on_status: Any = None) -> Lease:
        return self.lease

    def resume_info(self, job: str) -> None:
        return None


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUPOOL_RUN_SOCKET", "GPUPOOL_LEASED", "GPUPOOL_DEVICES", "GPUPOOL_RESUME_FROM", "GPUPOOL_JOB",
                "GPUPOOL_LEASE_ID", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_plain_loop_publishes_phase_peaks_with_the_gpupool_option_on_cpu(tmp_path: Path) -> None:
    lease = Lease()
    with PoolSession(client=Client(lease), memory="1GiB", name="plain", checkpoint_dir=tmp_path,
                     allocator="gpupool", telemetry_interval_s=0.001, exit_on_preempt=False) as pool:
        model = torch.nn.Linear(32, 1)
        opt = torch.optim.Adam(model.parameters())
        pool.add_optimizer(opt)
        for step in range(1, 7):
            pool.step_begin()
            with pool.phase(Phase.DATA):
                x, y = torch.randn(16, 32), torch.randn(16, 1)
            with pool.phase(Phase.FORWARD):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with pool.phase(Phase.BACKWARD):
                opt.zero_grad()
                loss.backward()
            with pool.phase(Phase.OPTIMIZER):
                opt.step()
            assert not pool.step_end(step, lambda path: torch.save(model.state_dict(), path))
        # no CUDA here: allocator="gpupool" installs nothing and the balloon uses host memory
        assert pool.runtime._balloon.kind == "host"
    last = lease.telemetry[-1]
    assert set(last["memory_peak_by_phase"]) == {"data", "forward", "backward", "optimizer"}
    # Adam's state appears at the first step: the optimizer phase holds the step's peak
    assert last["memory_peak_by_phase"]["optimizer"] >= last["memory_peak_by_phase"]["data"] > 0
    assert len(last["memory_peak_history"]) >= 2
