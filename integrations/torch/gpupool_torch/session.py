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

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from gpupool_sdk.runtime import EX_TEMPFAIL, PoolAdapter, PoolLeaseLostError, PoolRuntime, RuntimeOptions
from gpupool_sdk.runtime.decision import DecisionKind
from gpupool_sdk.telemetry.phases import Phase
from gpupool_torch.memory import make_balloon_controller, prepare_job_memory, rank_device
from gpupool_torch.memory.torch_hook import installed_devices

__all__ = ["EX_TEMPFAIL", "PoolLeaseLostError", "PoolSession"]


def _default_broadcast() -> Callable[[Any], Any] | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    return broadcast


@contextlib.contextmanager
def _probed(timed: Any, probe: Any, phase: str) -> Iterator[None]:
    with timed:
        yield
    if phase != "optimizer":  # the optimizer phase is read by step_end
        probe.phase_end(phase)


def memory_tier(kind: str, quota_bytes: int | None) -> Any:
    """The balloon controller of ``kind`` for the in-job runtime, on this rank's device.

    ``"gpupool"`` uses the allocator :func:`~gpupool_torch.memory.prepare_job_memory` installed
    for the rank's device; on a machine without CUDA (nothing installed) it falls back to the
    host tier, as ``"torch"`` does.
    """
    device = rank_device()
    if kind == "gpupool" and device not in installed_devices():
        import torch

        if not torch.cuda.is_available():
            kind = "host"
    return make_balloon_controller(kind=kind, quota_bytes=quota_bytes, device=device)  # type: ignore[arg-type]


class PoolSession(PoolAdapter):
    """Context manager that holds a lease for a plain PyTorch loop and applies directives.

    Args:
        broadcast: ``obj -> obj`` sending rank 0's object to all ranks (distributed loops);
            default ``torch.distributed.broadcast_object_list`` when a process group of more
            than one rank is initialised.
        client: a ready ``PoolClient``-like object (tests).
        **options: the pool options, :class:`~gpupool_sdk.runtime.RuntimeOptions` (``gpus``,
            ``memory``, ``qos``, ``priority``, ``checkpoint_dir``, ``exit_on_preempt``...), and
            :class:`~gpupool_sdk.resources.JobSpec` fields.

    Raises:
        ConfigError: an option is invalid or unknown (the message names it and the closest valid one).
    """

    def __init__(self, broadcast: Callable[[Any], Any] | None = None, client: Any = None, **options: Any) -> None:
        self.options = RuntimeOptions.from_kwargs(**options)
        self.runtime = PoolRuntime(self.options, client=client, memory_tier=memory_tier)
        self._broadcast = broadcast
        self._entered = False
        #: The preemption signals are handled from the first step on (PoolRuntime.arm_signals).
        self._armed = False

    def __enter__(self) -> PoolSession:
        self.runtime.acquire()
        # allocator="gpupool": the SDK allocator goes in now, before the loop touches CUDA.
        prepare_job_memory(self.options.allocator, self.runtime.spec.memory_bytes or None)
        self._entered = True
        # The balloon tier measures the footprint from the first publish on; optimizers join it
        # as the loop registers them (add_optimizer).
        self.runtime.start_training()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        rt = self.runtime
        if exc_type is None and not rt.preempted:
            rt.finish(rt.step)
        rt.close()
        if exc_type is None and rt.preempted and self.options.exit_on_preempt:
            raise SystemExit(EX_TEMPFAIL)

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

    def set_total_steps(self, total_steps: int | None) -> None:
        """Declare the job's length in steps: the pool then schedules it by its remaining time."""
        self.runtime.set_total_steps(total_steps)

    # -- step hooks ---------------------------------------------------------------------------
    def step_begin(self) -> None:
        """Mark the start of a step; raises :class:`PoolLeaseLostError` if the lease is gone."""
        if not self._entered:
            raise RuntimeError("use PoolSession as a context manager: `with PoolSession(...) as pool:`")
        rt = self.runtime
        if not self._armed:
            self._armed = True
            rt.arm_signals()
        if rt.lease_lost():
            from gpupool_sdk.runtime.decision import Decision

            raise rt.fence(Decision(kind=DecisionKind.LOST, reason=rt.inbox.lost_reason), rt.step, None)

    def phase(self, phase: Phase) -> Any:
        """``with pool.phase(Phase.FORWARD): ...`` times one phase of the step.

        On one sampled step per telemetry window it also reads the memory peak of the phase.
        """
        probe = self.runtime.publisher.phase_probe
        if not probe.armed:
            return self.runtime.timer.phase(phase)
        return _probed(self.runtime.timer.phase(phase), probe, phase.value)

    def step_end(self, step: int, save: Callable[[str], None]) -> bool:
        """Close the step; act on a directive or signal. Returns True when the loop must stop (preempted).

        Args:
            step: the number of optimizer steps done so far (recorded in the ack).
            save: writes a checkpoint to the given path (called on preemption, and on lease
                loss as an emergency checkpoint; in a distributed loop write it on rank 0 only).

        Raises:
            PoolLeaseLostError: the lease was lost; training must not continue.
        """
        rt = self.runtime
        if not self._armed:  # a loop that does not call step_begin
            self._armed = True
            rt.arm_signals()
        rt.timer.step_end()
        if rt.publisher.phase_probe.armed:
            rt.publisher.phase_probe.step_end()
        rt.step = step
        if step % self.options.check_every_n_steps != 0:
            rt.publisher.maybe_publish(rt.lease, step)
            return False
        broadcast = self._broadcast or _default_broadcast()
        dec = rt.step_boundary(lambda: step, save, broadcast)
        return bool(dec.kind is not None and dec.kind.stops)
