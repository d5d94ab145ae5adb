"""The batch and learning-rate rule of an elastic job whose world size changes at a resize.

An elastic job (``gpupool run --min-gpus N --max-gpus M``) is restarted from its checkpoint with
one rank per slice after each resize. What the optimizer sees across the restart is the user's
choice; these pure functions implement the two usual rules:

* ``"keep_global"`` (the **default**): the global batch and the learning rate stay as they
  were; each of the ``W`` ranks takes ``global_batch / W`` samples of every step, so the
  averaged gradient (DDP's all-reduce mean) is the gradient of the same global batch whatever
  ``W`` is. The optimizer's math does not change with the world size: a run resized at steps
  ``k1, k2`` reaches the weights of an uninterrupted run up to floating-point summation order.
* ``"linear"``: the per-rank batch stays as it was (``global_batch`` is then per rank) and the
  learning rate scales with the world size (Goyal et al., "Accurate, Large Minibatch SGD"):
  ``lr = base_lr * W / base_world``. Throughput grows with the slices; the trajectory changes.

Example:
    >>> rank_slice(global_batch=8, world_size=2, rank=1)
    (4, 8)
    >>> scaled_lr(0.1, world_size=2, base_world=1, rule="keep_global")
    0.1
    >>> scaled_lr(0.1, world_size=2, base_world=1, rule="linear")
    0.2
"""

from __future__ import annotations

from typing import Literal

from gpupool_sdk.errors import ConfigError

#: The rules :func:`scaled_lr` knows; ``"keep_global"`` is the default.
ResizeRule = Literal["keep_global", "linear"]
RULES: tuple[str, ...] = ("keep_global", "linear")


def rank_slice(global_batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` of one global batch that ``rank`` of ``world_size`` trains on.

    Contiguous equal shards, so that the ranks together cover the global batch exactly once.

    Raises:
        ConfigError: ``global_batch`` is not a multiple of ``world_size`` (the message names
            the largest world size it supports), or a value is out of range.
    """
    if world_size < 1:
        raise ConfigError("world_size", f"must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError("rank", f"must be in 0..{world_size - 1}, got {rank}")
    if global_batch < 1 or global_batch % world_size:
        raise ConfigError(
            "global_batch",
            f"{global_batch} samples cannot be split evenly over {world_size} ranks; choose a global batch "
            f"that is a multiple of every world size the job may run at (its --max-gpus), e.g. "
            f"{max(1, global_batch) * world_size}",
        )
    per = global_batch // world_size
    return rank * per, (rank + 1) * per


def scaled_lr(base_lr: float, world_size: int, base_world: int = 1, rule: str = "keep_global") -> float:
    """The learning rate at ``world_size`` ranks under ``rule`` (see the module docstring).

    Raises:
        ConfigError: an unknown ``rule`` or a world size below 1.
    """
    if rule not in RULES:
        raise ConfigError("rule", f"unknown resize rule {rule!r}; use one of {', '.join(RULES)}")
    if world_size < 1 or base_world < 1:
        raise ConfigError("world_size", f"world sizes must be >= 1, got {world_size} (base {base_world})")
    if rule == "keep_global":
        return base_lr
    return base_lr * world_size / base_world
