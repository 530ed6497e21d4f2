"""DpwaOptimizer: wrap the optimizer, and an unchanged training loop gossips.

::

    optimizer = DpwaOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)   # node from dpwa run
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step(loss=loss)      # the wrapped step, then the exchange (loss= optional, see below)
        optimizer.zero_grad()

``step()`` runs the wrapped optimizer's step, then mixes what the exchange started at the previous step
brought (``update_wait``: ``p <- (1-f)*p + f*p_peer``), then publishes the result and starts the next
exchange (``update_send``), which runs while the next batch's forward and backward do. ``close()`` (or
``finish()``) mixes what the last step's exchange brought, so N steps are N exchanges in the metrics.
Optimizer state (momentum, Adam moments) is never touched by mixing.

* **Loss**: rules that weigh by loss (``loss``, divergence damping) need it. Pass it to ``step(loss=...)``,
  return it from the closure, or call :meth:`DpwaOptimizer.set_loss` (with a ``GradScaler``: the unscaled loss).
  Otherwise the last one given is used (0.0 before any).
* **GradScaler**: ``scaler.step(optimizer)`` skips the wrapped step when gradients overflowed, and so never
  calls ``step()``. The exchange still happens, at the next ``zero_grad()``: a ``zero_grad`` that finds no
  ``step`` since the previous ``zero_grad`` exchanges (once), so every iteration exchanges exactly once.
* **Gradient accumulation**: only real steps exchange (``step()`` once per N micro-batches).
* **state_dict / load_state_dict**: the wrapped optimizer's state plus dpwa's (steps done, clock, the rule's
  state such as push-sum's weight), so a restart goes on where it stopped.

It subclasses :class:`torch.optim.Optimizer` (as torch's ``PostLocalSGDOptimizer`` does) so that LR
schedulers and ``isinstance`` checks accept it; ``param_groups`` and ``state`` are the wrapped optimizer's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.adapters.stepping import StepExchange, gossip_state_dict, load_gossip_state_dict
from dpwa.config import ClusterConfig

__all__ = ["DpwaOptimizer"]

log = logging.getLogger(__name__)


class DpwaOptimizer(torch.optim.Optimizer):
    """``optimizer``'s step, then the gossip exchange of ``model``'s parameters; see the module doc-string.

    ``name`` / ``config`` and every keyword of :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter` (``buffers``,
    ``seed``, ``run_dir``) go to the adapter underneath (:attr:`adapter`), which is built here with
    ``optimizer=`` so its checkpoints hold the optimizer too.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        name: str | None = None,
        config: ClusterConfig | str | os.PathLike[str] | None = None,
        **adapter_options: Any,
    ) -> None:
        # No super().__init__: the wrapped optimizer owns the parameter groups and the state.
        self.optim = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.adapter = DpwaPyTorchAdapter(model, name, config, optimizer=optimizer, **adapter_options)
        self._exchange = StepExchange(self.adapter)
        self._stepped = False  # step() ran since the last zero_grad()
        self._zeroed = False  # zero_grad() ran at least once

    @property
    def exchanges(self) -> int:
        """Exchanges done through this optimizer (one per real step, or per skipped step at zero_grad)."""
        return self._exchange.exchanges

    # ------------------------------------------------------------ what torch expects of an optimizer

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    def __repr__(self) -> str:
        return f"DpwaOptimizer({self.optim!r}, node={self.adapter.name!r})"

    def __getstate__(self) -> dict[str, Any]:  # pragma: no cover - not picklable: it holds sockets
        raise TypeError("a DpwaOptimizer holds a running node; save its state_dict() instead")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("the exchanged tensors are fixed when the adapter is built: add groups before wrapping")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped ``zero_grad``; if no ``step()`` ran since the previous one (a step a GradScaler skipped),
        the exchange of that iteration happens here."""
        if self._zeroed and not self._stepped:
            self._exchange.exchange()
        self._zeroed, self._stepped = True, False
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> Any:  # type: ignore[override]
        """The wrapped step (with ``closure``, whose result is the loss), then the exchange; returns what the
        wrapped step returned."""
        result = self.optim.step(closure) if closure is not None else self.optim.step()
        given = loss if loss is not None else result
        if given is not None:
            self.set_loss(given)
        self._stepped = True
        self._exchange.exchange()
        return result

    def set_loss(self, loss: Any) -> None:
        """The loss the next exchange reports (a float or a 0-dim tensor: with a GradScaler, the unscaled one;
        a non-finite one, from an overflowed step, is ignored)."""
        self._exchange.set_loss(loss)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"optimizer": the wrapped optimizer's state_dict, "dpwa": {"meta": ..., "arrays": ...}}``: the
        wrapped state plus the node's gossip state (steps, clock, loss, the rule's extras and arrays)."""
        return {"optimizer": self.optim.state_dict(), "dpwa": gossip_state_dict(self.adapter)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Take back a :meth:`state_dict` (or a plain optimizer state_dict: the gossip state then starts afresh)."""
        if "optimizer" not in state_dict or "dpwa" not in state_dict:
            self.optim.load_state_dict(state_dict)
            return
        self.optim.load_state_dict(state_dict["optimizer"])
        state = load_gossip_state_dict(self.adapter, state_dict["dpwa"])
        self._exchange.set_loss(state.loss)

    def finish(self) -> None:
        """Complete the exchange the last ``step()`` started (mix its peers in, write its metrics record): after
        N steps the adapter's ``step`` and metrics then number N. :meth:`close` calls it; call it yourself to
        read or report the final model before closing. A later ``step()`` starts a new exchange."""
        self._exchange.finish()

    def save_model(self, path: str | os.PathLike[str] | None = None, meta: dict[str, Any] | None = None) -> Path:
        """The model's file for ``dpwa average`` (:meth:`DpwaPyTorchAdapter.save_model`): save after :meth:`close`
        (which completes the last step's exchange and hands a push-sum node's mass over)."""
        return self.adapter.save_model(path, meta)

    def close(self, linger: float = 0.0, idle: float = 1.0) -> None:
        """Complete the last step's exchange (:meth:`finish`), then close the node underneath
        (:meth:`DpwaPyTorchAdapter.close`): it leaves the cluster cleanly."""
        try:
            self.finish()
        finally:
            self.adapter.close(linger=linger, idle=idle)
