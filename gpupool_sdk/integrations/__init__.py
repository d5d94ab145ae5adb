"""Framework adapters: Lightning (:mod:`.lightning`) and a plain PyTorch loop (:mod:`.torch_loop`).

Import the adapter you use directly (``from gpupool_sdk.integrations.lightning import
GpuPoolCallback``); this package does not import Lightning on its own.
"""

from gpupool_sdk.integrations._core import EX_TEMPFAIL, PoolLeaseLostError, derive_job_name

__all__ = ["EX_TEMPFAIL", "PoolLeaseLostError", "derive_job_name"]
