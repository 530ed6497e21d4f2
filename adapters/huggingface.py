"""Hugging Face ``Trainer``: a TrainerCallback that gossips the model's parameters after every optimizer step.

::

    from dpwa.adapters.huggingface import DpwaTrainerCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DpwaTrainerCallback()])
    trainer.train()                                 # node from dpwa run or srun (not torchrun: below)

The Trainer calls ``on_step_end`` after each optimizer step (after gradient accumulation, the scheduler step
and ``zero_grad``): there the callback mixes what the exchange started at the previous step brought and starts
the next one (:class:`~dpwa.adapters.stepping.StepExchange`). The adapter is built at ``on_train_begin``, once
the Trainer has put the model on its device, and closed at ``on_train_end`` (the node leaves the cluster
cleanly). The loss an exchange reports is the last one the Trainer logged (``logging_steps=1``: every step's).
Every log entry of ``trainer.state.log_history`` (and so ``trainer_state.json``) gets ``dpwa/factor``,
``dpwa/fetch_ms``, ``dpwa/exchanges`` and ``dpwa/mixes``.

Every node trains on its own shard of the training data: the Trainer's training sampler becomes a
:class:`~dpwa.adapters.sampler.DpwaSampler` (``partition``, default ``iid``, seeded by ``data_seed``), so that
its epochs, ``max_steps`` and learning-rate schedule are those of the shard. The callback learns its Trainer at
``on_init_end`` (the Trainer's constructor is the caller: the only moment before the loader is built, since no
hook receives the Trainer) and wraps its ``_get_train_sampler``; a sampler of the user's own (a
DistributedSampler, a custom one) is refused with a message saying what to do, and ``on_train_begin`` refuses
to train when the loader it got is not sharded (a callback added after construction: pass it to ``Trainer(...,
callbacks=[...])``). ``partition=None`` leaves the data alone.

Not under torchrun: the Trainer reads torchrun's ``WORLD_SIZE`` and ``LOCAL_RANK`` and makes itself one rank of a
torch.distributed job (DistributedDataParallel's gradient all-reduce every step, and the data split again between
the ranks), the synchronous training dpwa replaces. The callback refuses such a Trainer at its construction
(``args.world_size`` > 1) with a message naming ``dpwa run``; the adapter, ``DpwaOptimizer`` and the Lightning
callback do run under torchrun.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dpwa.adapters.sampler import DpwaSampler
from dpwa.adapters.stepping import NodeCallback

__all__ = ["DpwaTrainerCallback"]

_CALLER_DEPTH = 8
"""How many frames up ``on_init_end`` looks for the Trainer whose constructor called it (3 in transformers 5)."""


def _calling_trainer() -> Trainer | None:
    """The Trainer whose method is on the call stack (the constructor calling ``on_init_end``), or None."""
    frame = sys._getframe(1)
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _loader_sampler(loader: Any) -> Any:
    """The item sampler of a DataLoader, also of one accelerate prepared (its batch sampler's sampler)."""
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def _refuse_distributed(args: TrainingArguments) -> None:
    """ValueError when the Trainer is one rank of a torch.distributed job (``args.world_size`` > 1: torchrun)."""
    if args.world_size > 1:
        raise ValueError(
            f"DpwaTrainerCallback: this Trainer is one of {args.world_size} torch.distributed processes (torchrun's "
            "WORLD_SIZE / LOCAL_RANK): it would all-reduce the gradients every step (DistributedDataParallel) and "
            "split the data again between the ranks, the synchronous training dpwa replaces. Start the script with "
            "`dpwa run` (or srun) instead, where each node's Trainer is a single process; under torchrun use the "
            "adapter, DpwaOptimizer or the Lightning callback"
        )


class DpwaTrainerCallback(NodeCallback, TrainerCallback):
    """Gossip the Trainer's model after every optimizer step; see the module doc-string. The keywords
    (``partition`` and ``data_seed``: this node's shard) are :class:`~dpwa.adapters.stepping.NodeCallback`'s; the
    adapter is built at ``on_train_begin``."""

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        _refuse_distributed(args)
        trainer = _calling_trainer()
        if trainer is None or self.partition is None:
            return
        original = trainer._get_train_sampler

        def train_sampler(train_dataset: Any = None) -> Any:
            theirs = original(train_dataset)
            dataset = train_dataset if train_dataset is not None else trainer.train_dataset
            mine = self.shard_sampler(theirs, dataset)
            return theirs if mine is None else mine

        trainer._get_train_sampler = train_sampler  # type: ignore[method-assign]

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_distributed(args)  # also for a callback added after the Trainer was built
        if model is None:
            raise ValueError("DpwaTrainerCallback: the Trainer gave no model to on_train_begin")
        loader = kwargs.get("train_dataloader")
        if self.partition is not None and loader is not None and not isinstance(_loader_sampler(loader), DpwaSampler):
            raise ValueError(
                "DpwaTrainerCallback: the training data are not split between the nodes (the callback was added "
                "after the Trainer was built, or the Trainer has no training sampler); pass it as "
                "Trainer(..., callbacks=[DpwaTrainerCallback()]), or pass partition=None and split the data yourself "
                "(dpwa.shard)"
            )
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
