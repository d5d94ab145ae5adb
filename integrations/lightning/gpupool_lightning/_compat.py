"""The ``Callback`` base classes of the Lightning packages installed (``pytorch_lightning``, ``lightning.pytorch``).

The SDK's callbacks derive from every one present, so either package's ``Trainer`` accepts them.
"""

from __future__ import annotations

CALLBACK_BASES: tuple[type, ...] = ()
try:
    from pytorch_lightning import Callback as _PLCallback

    CALLBACK_BASES += (_PLCallback,)
except ImportError:  # pragma: no cover - depends on the environment
    pass
try:
    from lightning.pytorch import Callback as _LCallback

    CALLBACK_BASES += (_LCallback,)
except ImportError:  # pragma: no cover - depends on the environment
    pass
if not CALLBACK_BASES:  # pragma: no cover
    raise ImportError(
        "gpupool-lightning needs Lightning: pip install pytorch-lightning (or lightning), "
        "or use gpupool_torch.PoolSession for a plain PyTorch loop"
    )
