"""The demo's model and training loop, shared by the nodes and the one-process baseline of ``--evaluate``.

* :func:`build_model` -- a 32-64-64-10 ReLU MLP, initialised from the seed (every node starts from the
  same weights, and so does the baseline).
* :func:`make_optimizer` -- SGD with momentum (:mod:`dpwa.tools.demo.sgd`); :func:`lr_at` -- its cosine
  learning-rate decay.
* :func:`train` -- the loop: around every batch ``exchange.update_send(previous loss)``, one SGD step,
  ``exchange.update_wait(loss)``.  A node's exchange is its
  :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`, the baseline's a :class:`NoExchange`.
* :func:`evaluate` -- held-out accuracy and loss.

The schedule is indexed by ``exchange.progress``: a node's own step, or the furthest node's if one is
ahead.  Asynchronous nodes drift apart; indexed by its own step, a node that lags would take steps several
times larger than its peers' near the end, and with data split by class its classes would win the final
average.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from dpwa.tools.demo.config import TrainConfig
from dpwa.tools.demo.data import BatchStream, Dataset
from dpwa.tools.demo.sgd import MomentumSGD, OptimizerLike

__all__ = [
    "FINAL_LOSS_WINDOW",
    "Exchange",
    "NoExchange",
    "TrainResult",
    "build_model",
    "evaluate",
    "lr_at",
    "make_optimizer",
    "train",
]

FINAL_LOSS_WINDOW = 50  # final_loss = mean training loss of the last this-many batches


def build_model(config: TrainConfig) -> nn.Module:
    """The demo's MLP, initialised from ``config.seed`` (identical on every node and in the baseline)."""
    torch.manual_seed(config.seed)
    spec = config.data
    return nn.Sequential(
        nn.Linear(spec.features, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, config.hidden),
        nn.ReLU(),
        nn.Linear(config.hidden, spec.classes),
    )


def lr_at(config: TrainConfig, step: int, steps: int) -> float:
    """Cosine decay from ``config.lr`` at step 0 to 0 at ``steps``: ``lr/2 * (1 + cos(pi * step/steps))``, ``step``
    clamped to ``[0, steps]``."""
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(max(step, 0), steps) / steps))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``x``, ``y``."""
    model.eval()
    logits = model(x)
    model.train()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return accuracy, nn.functional.cross_entropy(logits, y).item()


class Exchange(Protocol):
    """The two calls around a batch and the step index to schedule by: a node passes its DpwaPyTorchAdapter
    (``progress``: its step, or the furthest node's), the baseline :class:`NoExchange`."""

    @property
    def progress(self) -> int: ...

    def update_send(self, loss: float) -> None: ...

    def update_wait(self, loss: float) -> float: ...


class NoExchange:
    """The baseline's exchange: nothing published, nothing mixed (factor 0); ``progress`` counts its steps."""

    def __init__(self, progress: int = 0) -> None:
        self.progress = progress

    def update_send(self, loss: float) -> None:
        pass

    def update_wait(self, loss: float) -> float:
        self.progress += 1
        return 0.0


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` did."""

    steps: int
    samples: int
    final_loss: float
    seconds: float
    mean_factor: float


def make_optimizer(model: nn.Module, config: TrainConfig) -> MomentumSGD:
    """SGD with momentum (:class:`~dpwa.tools.demo.sgd.MomentumSGD`: torch's SGD bit for bit, without the 2 s of
    CPU its first use costs a process); its learning rate is set per step by :func:`train`."""
    return MomentumSGD(model.parameters(), lr=config.lr, momentum=config.momentum)


class _Window:
    """Mean loss and mixing factor over the steps since the last progress report."""

    def __init__(self) -> None:
        self.loss, self.factor, self.n = 0.0, 0.0, 0

    def add(self, loss: float, factor: float) -> None:
        self.loss, self.factor, self.n = self.loss + loss, self.factor + factor, self.n + 1

    def take(self) -> tuple[float, float]:
        """(mean loss, mean factor) of the window, which starts over."""
        means = (self.loss / self.n, self.factor / self.n)
        self.loss, self.factor, self.n = 0.0, 0.0, 0
        return means


def _opening_loss(
    model: nn.Module,
    data: Dataset,
    indices: np.ndarray,
    config: TrainConfig,
    stream_seed: Sequence[int],
    start_step: int,
    start_loss: float | None,
) -> float:
    """The loss the first ``update_send`` reports: ``start_loss`` when resuming, else the first batch's."""
    if start_step > 0 and start_loss is not None:
        return start_loss
    with torch.no_grad():
        first = next(BatchStream(indices, config.batch_size, stream_seed))
        return nn.functional.cross_entropy(model(data.x_train[first]), data.y_train[first]).item()


def _sgd_step(
    model: nn.Module, optimizer: OptimizerLike, x: torch.Tensor, y: torch.Tensor, batch: torch.Tensor
) -> float:
    """One optimizer step on the samples ``batch`` indexes; the batch's training loss."""
    loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def train(
    model: nn.Module,
    optimizer: OptimizerLike,
    data: Dataset,
    indices: np.ndarray,
    config: TrainConfig,
    steps: int,
    stream_seed: Sequence[int],
    exchange: Exchange | None = None,
    on_progress: Callable[[int, float, float, float], None] | None = None,
    start_step: int = 0,
    start_loss: float | None = None,
) -> TrainResult:
    """``steps`` steps of ``optimizer`` on ``data.x_train[indices]`` with the cosine schedule over ``steps``, indexed
    by ``exchange.progress`` (the baseline's is its step).

    Around each step: ``exchange.update_send(previous loss)``, the step, ``exchange.update_wait(loss)``.
    ``on_progress(step, mean loss, mean factor, lr)`` is called about ten times.  ``start_step`` > 0
    resumes a run (model and optimizer restored by the caller): steps ``start_step+1 .. steps`` are done,
    with the same batches and learning rates as an uninterrupted run; ``start_loss`` is the loss of
    step ``start_step`` (the first ``update_send`` reports it).
    """
    exchange = exchange if exchange is not None else NoExchange(start_step)
    stream = BatchStream(indices, config.batch_size, stream_seed)
    for _ in range(start_step):  # the batches the steps before start_step took
        next(stream)
    prev_loss = _opening_loss(model, data, indices, config, stream_seed, start_step, start_loss)
    recent: list[float] = []
    factors = 0.0
    window = _Window()
    every = max(1, steps // 10)
    start = time.monotonic()
    for step in range(start_step, steps):
        lr = lr_at(config, exchange.progress, steps)  # the furthest node's step: see the module doc
        for group in optimizer.param_groups:
            group["lr"] = lr
        exchange.update_send(prev_loss)
        prev_loss = _sgd_step(model, optimizer, data.x_train, data.y_train, next(stream))
        factor = exchange.update_wait(prev_loss)
        factors += factor
        recent.append(prev_loss)
        del recent[:-FINAL_LOSS_WINDOW]
        window.add(prev_loss, factor)
        if on_progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            on_progress(step + 1, *window.take(), lr)
    recent = recent or [prev_loss]  # resumed at the end: nothing left to train
    return TrainResult(
        steps=steps,
        samples=steps * config.batch_size,
        final_loss=sum(recent) / len(recent),
        seconds=time.monotonic() - start,
        mean_factor=factors / max(1, steps - start_step),
    )
