"""gpupool-torch: the gpupool pool for plain PyTorch loops, and what is torch-specific.

* :class:`PoolSession`: lease GPU slices around a hand-written training loop.
* :class:`ResumableDataLoader`: a DataLoader that resumes mid-epoch exactly; with
  ``global_batch_size=`` also at another world size (elastic jobs, :class:`ElasticDistributedSampler`).
* :func:`elastic_dataloader`: micro-batches that follow the memory limit at a fixed global batch.
* :mod:`gpupool_torch.memory`: the SDK allocator hooked into torch and CuPy, memory balloons,
  optimizer offload.

The Lightning callback is in ``gpupool-lightning`` (``gpupool_lightning.GpuPoolCallback``).
"""

from __future__ import annotations

from gpupool_sdk.runtime import EX_TEMPFAIL, PoolLeaseLostError
from gpupool_torch.batching import ElasticBatchSampler, elastic_dataloader, plan_micro_batch
from gpupool_torch.data import ResumableDataLoader
from gpupool_torch.elastic_sampler import ElasticDistributedSampler
from gpupool_torch.session import PoolSession

__version__ = "0.1.0"
__all__ = [
    "EX_TEMPFAIL",
    "ElasticBatchSampler",
    "ElasticDistributedSampler",
    "PoolLeaseLostError",
    "PoolSession",
    "ResumableDataLoader",
    "__version__",
    "elastic_dataloader",
    "plan_micro_batch",
]
