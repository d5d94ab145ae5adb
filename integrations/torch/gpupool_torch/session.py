"""Plain PyTorch adapter: lease GPU slices around a hand-written training loop.

Example::

    import torch
    from gpupool_torch import PoolSession
    from gpupool_sdk.telemetry.phases import Phase

    with PoolSession(gpus=1, memory="8GiB", checkpoint_dir="ckpt/") as pool:
        model = torch.nn.Linear(10, 1).to(pool.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = 0
        if pool.resume_from:
            state = torch.load(pool.resume_from)
            model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
            pool.load_state_dict(state["pool"]); start = state["step"]

        def save(path):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "pool": pool.state_dict(), "step": step}, path)

        for step in range(start + 1, 1001):
            pool.step_begin()
            with pool.phase(Phase.DATA):
                x, y = next(batches)
            with pool.phase(Phase.FORWARD):
                loss = torch.nn.functional.mse_loss(model(x), y)
            with pool.phase(Phase.BACKWARD):
                opt.zero_grad(); loss.backward()
            with pool.phase(Phase.OPTIMIZER):
                opt.step()
            if pool.step_end(step, save):
                break                       # preempted: checkpointed, acked, released
    # leaving the block exits with code 75 when preempted (gpupool run runs the script again)

Distributed loops: pass ``broadcast`` (an ``obj -> obj`` function that sends rank 0's object to
every rank); by default ``torch.distributed.broadcast_object_list`` is used when a process group
is initialised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from gpupool_sdk.runtime.runtime import EX_TEMPFAIL, Decision, PoolAdapter, PoolLeaseLostError, PoolRuntime
from gpupool_sdk.telemetry.phases import Phase

__all__ = ["EX_TEMPFAIL", "PoolLeaseLostError", "PoolSession"]


def _default_broadcast(obj: Any) -> Any:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
    except ImportError:
        pass
    return obj


class PoolSession(PoolAdapter):
    """Context manager that holds a lease for a plain PyTorch loop and applies directives.

    Args:
        gpus, memory, qos, priority, name, checkpoint_dir, endpoints, compute_share, allocator,
            check_every_n_steps, telemetry_interval_s, acquire_timeout, **spec_fields: as for
            :class:`~gpupool_lightning.GpuPoolCallback`.
        memory_peak_fn, metrics_port: as for
            :class:`~gpupool_lightning.GpuPoolCallback` (see :meth:`report_memory_peak`).
        broadcast: ``obj -> obj`` sending rank 0's object to all ranks (distributed loops).
        exit_on_preempt: leaving the ``with`` block after a preemption raises ``SystemExit(75)``.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(
        self,
        gpus: int = 1,
        memory: int | str | None = None,
        qos: str = "shared",
        priority: int = 0,
        name: str | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        endpoints: str | None = None,
        compute_share: float = 1.0,
        allocator: str = "torch",
        check_every_n_steps: int = 1,
        telemetry_interval_s: float = 5.0,
        acquire_timeout: float | None = None,
        memory_peak_fn: Callable[[], int | None] | None = None,
        metrics_port: int | None = None,
        broadcast: Callable[[Any], Any] | None = None,
        exit_on_preempt: bool = True,
        **spec_fields: Any,
    ) -> None:
        self.runtime = PoolRuntime(
            gpus=gpus,
            memory=memory,
            qos=qos,
            priority=priority,
            name=name,
            checkpoint_dir=checkpoint_dir,
            endpoints=endpoints,
            compute_share=compute_share,
            allocator=allocator,
            check_every_n_steps=check_every_n_steps,
            telemetry_interval_s=telemetry_interval_s,
            acquire_timeout=acquire_timeout,
            memory_peak_fn=memory_peak_fn,
            metrics_port=metrics_port,
            **spec_fields,
        )
        self._broadcast = broadcast or _default_broadcast
        self.exit_on_preempt = bool(exit_on_preempt)
        self._entered = False

    def __enter__(self) -> PoolSession:
        self.runtime.acquire()
        self._entered = True
        # The balloon controller measures the footprint from the first publish on; optimizers
        # join it as the loop registers them (add_optimizer).
        self.runtime.start_training()
        return self

    # -- grant ---------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """``"cuda"`` when the leased GPUs are visible to CUDA, else ``"cpu"``."""
        return "cuda" if self.runtime.accelerator == "gpu" else "cpu"

    @property
    def timer(self) -> Any:
        return self.runtime.timer

    def add_optimizer(self, optimizer: Any) -> None:
        """Let balloon directives offload this optimizer's state (counted in the published memory peak)."""
        self.runtime.start_training([optimizer])

    # -- step hooks ---------------------------------------------------------------------------
    def step_begin(self) -> None:
        """Mark the start of a step; raises :class:`PoolLeaseLostError` if the lease is gone."""
        if not self._entered:
            raise RuntimeError("use PoolSession as a context manager: `with PoolSession(...) as pool:`")
        rt = self.runtime
        if rt.lease_lost():
            raise rt.fence(Decision(kind="lost", reason=rt.lost_reason()), rt.step, None)

    def phase(self, phase: Phase) -> Any:
        """``with pool.phase(Phase.FORWARD): ...`` times one phase of the step."""
        return self.runtime.timer.phase(phase)

    def step_end(self, step: int, save: Callable[[str], None]) -> bool:
        """Close the step; act on a directive. Returns True when the loop must stop (preempted).

        Args:
            step: the number of optimizer steps done so far (recorded in the ack).
            save: writes a checkpoint to the given path (called on preemption, and on lease
                loss as an emergency checkpoint).

        Raises:
            PoolLeaseLostError: the lease was lost; training must not continue.
        """
        rt = self.runtime
        rt.timer.step_end()
        rt.step = step
        if step % rt.check_every_n_steps != 0:
            rt.maybe_publish(step)
            return False
        wire = rt.decide().to_wire() if rt.is_leader else None
        dec = Decision.from_wire(self._broadcast(wire))
        if dec.kind == "lost":
            raise rt.fence(dec, step, save)
        if dec.kind == "preempt":
            rt.preempt(dec, step, save)
            return True
        if dec.kind in ("balloon", "deflate"):
            rt.balloon(dec, step)
        rt.maybe_publish(step)
        return False
