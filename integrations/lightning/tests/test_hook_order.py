"""Pins the Lightning hook order GpuPoolCallback relies on (a Lightning upgrade that changes it fails here)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

HOOKS = (
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_validation_start",
)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in HOOKS:
            calls = object.__getattribute__(self, "calls")

            def hook(*args: Any, **kwargs: Any) -> None:
                calls.append(name)

            return hook
        return object.__getattribute__(self, name)


class Tiny(pl.LightningModule):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.calls = calls

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # The callback counts the host-to-device copy in the data phase: it must precede on_train_batch_start.
        self.calls.append("transfer_batch_to_device")
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_hook_order_is_what_the_callback_relies_on(tmp_path: Any) -> None:
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(4, 4), torch.randn(4, 1))
    rec = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[rec],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(rec.calls), DataLoader(ds, batch_size=2))
    step = [
        "transfer_batch_to_device",
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    ]
    assert rec.calls == ["on_train_epoch_start", *step, *step, "on_train_epoch_end"]
