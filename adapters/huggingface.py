"""Hugging Face ``Trainer``: a TrainerCallback that gossips the model's parameters after every optimizer step.

::

    from dpwa.adapters.huggingface import DpwaTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DpwaTrainerCallback()])
    trainer.train()                                 # node from dpwa run / srun / torchrun

The Trainer calls ``on_step_end`` after each optimizer step (after gradient accumulation, the scheduler step
and ``zero_grad``): there the callback mixes what the exchange started at the previous step brought and starts
the next one (:class:`~dpwa.adapters.stepping.StepExchange`). The adapter is built at ``on_train_begin``, once
the Trainer has put the model on its device, and closed at ``on_train_end`` (the node leaves the cluster
cleanly). The loss an exchange reports is the last one the Trainer logged (``logging_steps=1``: every step's).
Every log entry of ``trainer.state.log_history`` (and so ``trainer_state.json``) gets ``dpwa/factor``,
``dpwa/fetch_ms``, ``dpwa/exchanges`` and ``dpwa/mixes``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dpwa.adapters.stepping import NodeCallback

__all__ = ["DpwaTrainerCallback"]


class DpwaTrainerCallback(NodeCallback, TrainerCallback):
    """Gossip the Trainer's model after every optimizer step; see the module doc-string. The keywords are
    :class:`~dpwa.adapters.stepping.NodeCallback`'s; the adapter is built at ``on_train_begin``."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("DpwaTrainerCallback: the Trainer gave no model to on_train_begin")
        self.node.start(model, optimizer)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.exchange is not None:
            self.exchange.exchange()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.exchange is None:
            return
        if logs and isinstance(logs.get("loss"), (int, float)):
            self.exchange.set_loss(logs["loss"])
        if state.log_history:
            state.log_history[-1].update(self.exchange.metrics())

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.node.close()
