"""PyTorch Lightning: a Callback that gossips the LightningModule's parameters after every optimizer step.

::

    from dpwa.adapters.lightning import DpwaCallback

    trainer = lightning.Trainer(max_steps=1000, callbacks=[DpwaCallback()])   # node from dpwa run / srun / torchrun
    trainer.fit(module, data)

After each optimizer step (``trainer.global_step`` moved: with ``accumulate_grad_batches`` once per N batches,
and also when a mixed-precision scaler skipped the step) it mixes what the exchange started at the previous
step brought and starts the next one (:class:`~dpwa.adapters.stepping.StepExchange`), with the loss the
``training_step`` returned. It logs ``dpwa/factor``, ``dpwa/fetch_ms``, ``dpwa/exchanges`` and ``dpwa/mixes``
through the module's logger at every step, and keeps the node's gossip state in Lightning's checkpoints.

A Callback, not a Strategy: the exchange needs only a hook after the optimizer step and the module's
parameters, and leaves Lightning's own device, precision and (single-process) strategy handling alone; a
Strategy would have to re-implement those. The adapter is built at ``on_fit_start``, once the module is on its
device and in its dtype, and closed (the node leaves the cluster cleanly) at ``teardown``.

Every node trains on its own shard of the training data: when Lightning builds the training loader, the
callback puts a :class:`~dpwa.adapters.sampler.DpwaSampler` (``partition``, default ``iid``, seeded by
``data_seed``) in place of the default sampler, through Lightning's own loader re-instantiation -- the one it
uses to insert a ``DistributedSampler`` (a DataLoader subclass keeps its class and arguments). A loader that
already has a DistributedSampler or a sampler of the user's is refused with a message saying what to do;
``partition=None`` leaves the loader alone. This hooks ``trainer._data_connector._prepare_dataloader`` (Lightning
has no public hook before the loader's length is taken); a Lightning without it is refused at ``setup``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning
import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader

from dpwa.adapters.stepping import (
    NodeCallback,
    gossip_state_dict,
    load_gossip_state_dict,
)
from dpwa.config import ClusterConfig

__all__ = ["DpwaCallback"]


class DpwaCallback(NodeCallback, lightning.pytorch.Callback):
    """Gossip ``pl_module``'s parameters after every optimizer step; see the module doc-string. The keywords
    (``partition`` and ``data_seed``: this node's shard) are :class:`~dpwa.adapters.stepping.NodeCallback`'s; the
    adapter is built at ``on_fit_start``."""

    def __init__(
        self,
        name: str | None = None,
        config: ClusterConfig | str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(name, config, **options)  # NodeCallback: the node's settings (linger, idle, adapter's)
        self._saved: dict[str, Any] | None = None
        self._global_step = 0

    def setup(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, stage: str) -> None:
        """Before Lightning loads the data: have its training loader built over this node's shard."""
        if stage != "fit" or self.partition is None:
            return
        connector = getattr(trainer, "_data_connector", None)
        original = getattr(connector, "_prepare_dataloader", None)
        if original is None or getattr(original, "dpwa_shard", False):
            if original is None:
                raise RuntimeError(
                    f"DpwaCallback: this Lightning {lightning.__version__} has no loader hook to put the node's shard "
                    "in place; pass partition=None and give the loader a dpwa.adapters.sampler.DpwaSampler yourself"
                )
            return

        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            if mode == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
                if dataloader.batch_size is None:  # the user's batch_sampler chooses the items
                    raise ValueError(
                        "DpwaCallback: the training data loader has a batch_sampler of its own "
                        f"({type(dataloader.batch_sampler).__name__}), so the callback cannot put this node's shard in "
                        "place; pass partition=None to the callback and build the batches over dpwa.shard's items"
                    )
                sampler = self.shard_sampler(dataloader.sampler, dataloader.dataset)
                if sampler is not None:
                    dataloader = _update_dataloader(dataloader, sampler, mode=mode)
            return original(dataloader, shuffle=shuffle, mode=mode)

        prepare.dpwa_shard = True  # type: ignore[attr-defined]
        connector._prepare_dataloader = prepare

    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.node.start(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        if self._saved is not None and self.adapter is not None:  # resumed from a Lightning checkpoint
            load_gossip_state_dict(self.adapter, self._saved)
            self._saved = None
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.exchange is None or trainer.global_step == self._global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, (torch.Tensor, int, float)):
            if pl_module.automatic_optimization:  # Lightning hands on the loss divided by the accumulation
                loss = loss * trainer.accumulate_grad_batches
            self.exchange.set_loss(loss)
        self.exchange.exchange()
        if trainer.loggers:
            pl_module.log_dict(self.exchange.metrics(), on_step=True, on_epoch=False, logger=True)

    def teardown(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, stage: str) -> None:
        self.node.close()

    def on_exception(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, exception: BaseException
    ) -> None:
        """A fit that failed (Lightning calls no ``teardown`` then): the node leaves and frees its port; no model
        is saved."""
        self.node.close(save=False)

    def state_dict(self) -> dict[str, Any]:
        """The node's gossip state (steps, clock, the rule's state) in Lightning's checkpoint."""
        return gossip_state_dict(self.adapter) if self.adapter is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._saved = state_dict
