"""gpupool-lightning: :class:`GpuPoolCallback` leases GPU slices for a Lightning Trainer.

Works with ``pytorch_lightning`` and with ``lightning.pytorch``. :class:`BatchAdapter` (opt in)
keeps the global batch when the pool changes the job's memory limit. Also brings ``gpupool demo``
(registered with the core CLI through the ``gpupool.commands`` entry point).

Example::

    import pytorch_lightning as pl          # or: import lightning.pytorch as pl
    from gpupool_lightning import GpuPoolCallback

    pool = GpuPoolCallback(gpus=1, memory="20GiB", qos="shared", priority=5, checkpoint_dir="ckpt/")
    trainer = pl.Trainer(accelerator=pool.accelerator, devices=pool.devices, callbacks=[pool], max_epochs=10)
    trainer.fit(model, ckpt_path=pool.resume_from)
"""

from __future__ import annotations

from gpupool_lightning.batch_adapter import BatchAdapter, BatchChange
from gpupool_lightning.callback import EX_TEMPFAIL, GpuPoolCallback, PoolLeaseLostError
from gpupool_torch.data import ResumableDataLoader

__version__ = "0.1.0"
__all__ = ["EX_TEMPFAIL", "BatchAdapter", "BatchChange", "GpuPoolCallback", "PoolLeaseLostError", "ResumableDataLoader", "__version__"]
