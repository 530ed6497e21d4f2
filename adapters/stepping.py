"""The exchange of a training loop that dpwa does not drive: one per optimizer step, overlapped with the next batch.

The optimizer wrapper (:mod:`dpwa.adapters.optimizer`), the Lightning callback (:mod:`dpwa.adapters.lightning`)
and the Hugging Face callback (:mod:`dpwa.adapters.huggingface`) all see the loop only *after* an optimizer step.
:class:`StepExchange` turns that into the adapter's two calls: at each step it mixes what the exchange started
at the previous step brought (``update_wait``), then publishes the stepped parameters and starts the next one
(``update_send``), which runs while the next batch's forward and backward do. When training ends,
:meth:`StepExchange.finish` (the callbacks' and the optimizer's ``close``) mixes what the last one brought: N
steps are N exchanges, each with its ``update_wait`` and its metrics record.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.adapters.sampler import DpwaSampler, node_sampler
from dpwa.checkpoint import DpwaState
from dpwa.config import ClusterConfig

__all__ = ["IntegrationNode", "NodeCallback", "StepExchange", "gossip_state_dict", "load_gossip_state_dict"]


class StepExchange:
    """``adapter``'s exchange, once per optimizer step: ``update_wait`` (from the 2nd step), then ``update_send``;
    :meth:`finish` gives the last step its ``update_wait``. After N steps and ``finish``, the adapter's ``step``
    and its metrics records number N, as in a loop that calls both at every step."""

    def __init__(self, adapter: DpwaPyTorchAdapter) -> None:
        self.adapter = adapter
        self.loss = 0.0
        """The loss the next exchange reports: the last finite one given (0.0 before any)."""
        self.exchanges = 0
        self.factor = 0.0
        """The mixing factor of the last ``update_wait`` (0.0: nothing mixed)."""
        self._sent = False

    def set_loss(self, loss: Any) -> None:
        """Take ``loss`` (a number or a 0-dim tensor) for the next exchange; a non-finite one is ignored."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if math.isfinite(value):
            self.loss = value

    def exchange(self) -> None:
        """After an optimizer step: mix the previous exchange's peers in, then publish and start the next. The
        model holds one step more than the exchanges completed (``adapter.steps_ahead``) until :meth:`finish`."""
        self.adapter.steps_ahead = 1
        if self._sent:
            self.factor = self.adapter.update_wait(self.loss)
        self.adapter.update_send(self.loss)
        self._sent = True
        self.exchanges += 1

    def finish(self) -> None:
        """End of training: complete the exchange the last step started (``update_wait``: its peers are mixed in
        and its metrics record written), so that every step has had its ``update_wait``. Nothing to do when no
        exchange is open or the adapter is closed; the next :meth:`exchange` starts afresh."""
        self.adapter.steps_ahead = 0
        if self._sent and not self.adapter.closed:
            self.factor = self.adapter.update_wait(self.loss)
        self._sent = False

    def metrics(self) -> dict[str, float]:
        """What an integration logs: the last factor, its fetch time (also as ``dpwa/fetch_ms/<peer>``, per peer,
        when one peer was fetched), the counts of exchanges and mixes."""
        last = self.adapter.connection.last_exchange or {}
        fetch_ms = float(last.get("fetch_ms") or 0.0)
        out = {
            "dpwa/factor": self.factor,
            "dpwa/fetch_ms": fetch_ms,
            "dpwa/exchanges": float(self.exchanges),
            "dpwa/mixes": float(self.adapter.stats()["mixes"]),
        }
        peer, status = last.get("peer"), last.get("status")
        if isinstance(peer, str) and "," not in peer and status == "ok":
            out[f"dpwa/fetch_ms/{peer}"] = fetch_ms
        return out


def gossip_state_dict(adapter: DpwaPyTorchAdapter) -> dict[str, Any]:
    """The node's gossip state as torch checkpoints hold it: ``{"meta": JSON-safe values, "arrays": tensors}``
    (steps, clock, loss, the rule's extras and arrays such as push-sum's weight)."""
    state = adapter.gossip_state()
    arrays = {key: torch.from_numpy(np.array(a, copy=True)) for key, a in state.arrays.items()}
    return {"meta": state.to_meta(), "arrays": arrays}


def load_gossip_state_dict(adapter: DpwaPyTorchAdapter, saved: dict[str, Any]) -> DpwaState:
    """Take back a :func:`gossip_state_dict` into ``adapter`` (before training goes on); the state taken."""
    arrays = {key: t.detach().cpu().numpy() for key, t in saved.get("arrays", {}).items()}
    state = DpwaState.from_meta(saved["meta"], arrays)
    adapter.load_gossip_state(state)
    return state


class IntegrationNode:
    """The node a framework callback runs: what its adapter is built from (``name`` / ``config`` / the adapter's
    keywords), the adapter and its :class:`StepExchange` once started, and how long it lingers when it closes."""

    def __init__(
        self,
        name: str | None,
        config: ClusterConfig | str | os.PathLike[str] | None,
        linger: float,
        idle: float,
        options: dict[str, Any],
    ) -> None:
        self._name, self._config, self._options = name, config, options
        self._linger, self._idle = linger, idle
        self.adapter: DpwaPyTorchAdapter | None = None
        self.exchange: StepExchange | None = None

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> StepExchange:
        """Build the adapter for ``model`` (on its device, in its dtype by now) and its exchange."""
        self.adapter = DpwaPyTorchAdapter(model, self._name, self._config, optimizer=optimizer, **self._options)
        self.exchange = StepExchange(self.adapter)
        return self.exchange

    def close(self, save: bool = True) -> None:
        """Complete the last step's exchange (:meth:`StepExchange.finish`), serve peers still training for up to
        ``linger`` s, leave the cluster cleanly, then save the model to ``<run_dir>/<node>.model.npz`` when there is
        a run directory (what ``dpwa average RUN_DIR`` averages) and ``save``. Idempotent."""
        if self.adapter is None or self.adapter.closed:
            return
        try:
            if self.exchange is not None:
                self.exchange.finish()
        finally:
            self.adapter.close(linger=self._linger, idle=self._idle)
        if save and self.adapter.run_dir is not None:  # after the close: a push-sum hand-off is in the weight saved
            self.adapter.save_model()


class NodeCallback:
    """A framework callback's node (mixed into the Lightning and Hugging Face callbacks): ``name`` / ``config`` and
    the adapter's keywords (``buffers``, ``seed``, ``run_dir``) go to the adapter built when training starts;
    ``linger`` / ``idle``: how long the node keeps serving peers still training after it ends; ``partition``
    (``iid``, ``dirichlet:ALPHA``, ``classes:K``; None: the training data are left alone) and ``data_seed``:
    this node's shard, put in place of the framework's default sampler. ``adapter`` and ``exchange`` are None
    until training starts."""

    def __init__(
        self,
        name: str | None = None,
        config: ClusterConfig | str | os.PathLike[str] | None = None,
        *,
        linger: float = 2.0,
        idle: float = 0.5,
        partition: str | None = "iid",
        data_seed: int = 0,
        **adapter_options: Any,
    ) -> None:
        self.node = IntegrationNode(name, config, linger, idle, adapter_options)
        self.partition, self.data_seed = partition, data_seed
        self._where = (name, config)

    def shard_sampler(self, sampler: Any, dataset: Any) -> DpwaSampler | None:
        """What goes in place of a training loader's ``sampler`` (:func:`~dpwa.adapters.sampler.node_sampler`):
        None to keep it; ValueError naming this callback for a sampler of the user's. Only with a ``partition``."""
        assert self.partition is not None
        name, config = self._where
        return node_sampler(
            sampler, dataset, self.partition, seed=self.data_seed, framework=type(self).__name__, name=name,
            config=config,
        )  # fmt: skip

    @property
    def adapter(self) -> DpwaPyTorchAdapter | None:
        """The adapter underneath, once training started."""
        return self.node.adapter

    @property
    def exchange(self) -> StepExchange | None:
        """The step exchange, once training started (``exchanges``, ``loss``, ``factor``, ``metrics()``)."""
        return self.node.exchange
