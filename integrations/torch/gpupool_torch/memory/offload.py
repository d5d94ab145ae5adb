"""Optimizer-state offload to (pinned) host memory and back.

Optimizer state is the coldest large thing a training job holds on the GPU: Adam keeps two
fp32 tensors per parameter, touched only inside ``optimizer.step()``. Moving them to pinned
host memory between steps gives the balloon real bytes without changing the model.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class OptimizerOffloader:
    """Moves an optimizer's state tensors to host memory and back, bit for bit.

    While offloaded, a step pre-hook restores the state before ``optimizer.step()`` runs (so
    a step never sees host tensors), and if the offloader is *held* (a balloon is inflated)
    a step post-hook offloads it again right after the step: forward and backward run with
    the state out of device memory, at the cost of one host round trip per step.

    Args:
        optimizer: a ``torch.optim.Optimizer``.
        pin_memory: use pinned host buffers (default: when CUDA is available), so the copies
            are asynchronous DMA transfers.
        include_cpu_tensors: also treat state tensors already on the CPU as "device" state
            (the host tier, where the CPU stands in for the device); without it CPU tensors,
            such as Adam's ``step`` counters, are left alone.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 4)).sum().backward(); opt.step()
        >>> off = OptimizerOffloader(opt, include_cpu_tensors=True)
        >>> off.offload() > 0
        True
        >>> off.restore() > 0
        True
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pin_memory: bool | None = None,
        include_cpu_tensors: bool = False,
    ) -> None:
        import torch

        self.optimizer = optimizer
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.include_cpu_tensors = include_cpu_tensors
        self._lock = threading.RLock()
        # (param, key) -> original device of the tensor now held on the host
        self._moved: dict[tuple[int, str], torch.device] = {}
        self._held = False
        self.offload_count = 0
        self.restore_count = 0
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    # ------------------------------------------------------------------ state

    @property
    def offloaded(self) -> bool:
        """True while some state tensors live in host memory."""
        return bool(self._moved)

    @property
    def held(self) -> bool:
        """True while a balloon keeps the state offloaded between steps."""
        return self._held

    def _tensors(self) -> list[tuple[Any, str, torch.Tensor]]:
        import torch

        out = []
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out.append((param, key, value))
        return out

    def _eligible(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.include_cpu_tensors

    def resident_bytes(self) -> int:
        """Bytes of eligible state tensors currently in device memory."""
        with self._lock:
            return sum(
                t.numel() * t.element_size()
                for p, k, t in self._tensors()
                if (id(p), k) not in self._moved and self._eligible(t)
            )

    def offloaded_bytes(self) -> int:
        """Bytes of state tensors currently held in host memory by this offloader."""
        with self._lock:
            return sum(
                t.numel() * t.element_size() for p, k, t in self._tensors() if (id(p), k) in self._moved
            )

    # ------------------------------------------------------------------ moves

    def offload(self) -> int:
        """Copies every eligible state tensor to host memory and drops the device copy.

        Returns:
            Bytes moved by this call (0 if already offloaded).
        """
        import torch

        with self._lock:
            moved = 0
            any_cuda = False
            for param, key, t in self._tensors():
                ident = (id(param), key)
                if ident in self._moved or not self._eligible(t):
                    continue
                pin = self.pin_memory and t.device.type != "cpu"
                host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=pin)
                host.copy_(t, non_blocking=pin)
                any_cuda = any_cuda or t.device.type == "cuda"
                self.optimizer.state[param][key] = host
                self._moved[ident] = t.device
                moved += t.numel() * t.element_size()
            if any_cuda:
                # The device copies may be freed only once the DMA has read them.
                torch.cuda.synchronize()
            if moved:
                self.offload_count += 1
            return moved

    def restore(self) -> int:
        """Copies offloaded state back to its original device.

        Returns:
            Bytes moved back by this call (0 if nothing was offloaded).

        Raises:
            torch.OutOfMemoryError: the device (or the quota) has no room for the state.
        """
        import torch

        with self._lock:
            restored = 0
            any_cuda = False
            for param, key, t in self._tensors():
                ident = (id(param), key)
                device = self._moved.get(ident)
                if device is None:
                    continue
                if device.type == "cpu":
                    # The host tier: a fresh copy stands in for the device buffer.
                    back = t.clone()
                else:
                    back = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, device=device)
                    back.copy_(t, non_blocking=t.is_pinned())
                    any_cuda = True
                self.optimizer.state[param][key] = back
                del self._moved[ident]
                restored += t.numel() * t.element_size()
            if any_cuda:
                # Pinned sources must stay alive until the copies have run.
                torch.cuda.synchronize()
            if restored:
                self.restore_count += 1
            return restored

    def hold(self) -> int:
        """Offloads and keeps the state offloaded between steps (balloon inflated).

        Returns:
            Bytes moved.
        """
        with self._lock:
            self._held = True
            return self.offload()

    def release(self) -> int:
        """Stops holding and restores the state now (balloon deflated).

        Returns:
            Bytes moved back.
        """
        with self._lock:
            self._held = False
            return self.restore()

    def remove(self) -> None:
        """Restores the state and removes the optimizer hooks."""
        self.release()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ hooks

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._moved:
            self.restore()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._held:
            self.offload()
