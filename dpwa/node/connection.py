"""DpwaConnection: one gossip node, framework-free (numpy arrays in, numpy arrays mixed in place).

Around each batch::

    conn.update_send(params, loss)   # clock += 1, publish a snapshot, maybe start a fetch
    loss = train(batch)              # the trainer changes params in place
    f = conn.update_wait(loss)       # wait <= timeout_ms after the fetch started, mix, return f

This module is the public facade only; the node itself is :class:`dpwa.node.core.Node`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.checkpoint import DpwaState
from dpwa.config import ClusterConfig, resolve_config
from dpwa.node.core import Node
from dpwa.node.membership import MemberEvent
from dpwa.node.transport import Transport, TransportFactory
from dpwa.rules import Rule, make_rule
from dpwa.rules.outer import with_outer
from dpwa.rules.schedules import make_schedule

__all__ = ["DpwaConnection"]

log = logging.getLogger(__name__)


class DpwaConnection:
    """A dpwa node: serves its parameters to peers and mixes theirs into its own.

    ``DpwaConnection(name, config)`` where ``config`` is a cluster file path or a
    loaded :class:`~dpwa.config.ClusterConfig`. ``seed`` makes peer choice and
    fetch coin-flips reproducible; ``rule`` overrides the configured rule (the cluster file's ``outer`` still applies
    to it; an :class:`~dpwa.rules.outer.OuterRule` brings its own). ``params``, the arrays later
    passed to :meth:`update_send`, sets the node's buffers up before it answers anyone, so that a push
    arriving before the first ``update_send`` is taken instead of refused "not ready" (push-sum's first
    rounds then stay synchronous).

    ``transport`` builds the node's sockets and threads, called like :class:`~dpwa.node.transport.Transport`
    (the default): tests and tools may pass a wrapping transport (one that drops, delays or fails on purpose).
    """

    def __init__(
        self,
        name: str,
        config: ClusterConfig | str | os.PathLike[str],
        *,
        seed: int | None = None,
        rule: Rule | None = None,
        params: Sequence[np.ndarray] | None = None,
        transport: TransportFactory = Transport,
    ) -> None:
        cfg = resolve_config(config)
        cfg.node(name)  # a clear ConfigError before anything starts
        if rule is None:
            rule = make_rule(cfg.interpolation, cfg.settings, cfg.divergence_threshold)
        roster = () if cfg.join_address is not None else [n.name for n in cfg.nodes]  # a joiner: at its JOIN
        rule, schedule = with_outer(rule, make_schedule(cfg.schedule, cfg.settings, roster), cfg.outer)
        self._node = Node(name, cfg, rule, schedule, seed, params, transport)
        self._finalizer = weakref.finalize(self, Node.close, self._node)

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def config(self) -> ClusterConfig:
        return self._node.config

    @property
    def endpoint(self) -> str:
        """The tcp:// endpoint the RX thread is bound to."""
        return self._node.transport.endpoint

    @property
    def clock(self) -> float:
        """Batches trained, fractional after clock-mixing."""
        return self._node.state.clock

    @property
    def front(self) -> int:
        """The most ``update_send`` calls this node has heard of: its own, or any peer's (each snapshot and push
        carries its sender's front, and a node keeps the maximum, so it spreads through the cluster in a few
        exchanges). A lower bound of how far the furthest node is, late by the age of what arrived."""
        return self._node.front

    @property
    def last_exchange(self) -> dict[str, Any] | None:
        """The last update_wait as a metrics record.

        Keys: step, factor, peer, status, bytes, fetch_ms, clock_gap, wait_ms (how long update_wait
        blocked waiting for the fetch, or for its pushes' ACKs), mix_ms (the rule's mix), and the rule's own
        metrics; push rules add received (inbox messages mixed), pushed, returned and unacked.
        """
        return self._node.last_exchange

    @property
    def params_changed(self) -> bool:
        """Whether the latest update_wait wrote to the parameters: a mix (factor > 0), or one with factor 0 that
        still moved them (push-sum folding a returned push back, or moving the local step to the numerator)."""
        return self._node.params_moved

    def update_send(self, params: Sequence[np.ndarray], loss: Any) -> None:
        """clock += 1; publish a copy of ``params`` (same list every call); maybe start a fetch.

        A fetch starts with probability ``fetch_probability``; its deadline is ``timeout_ms`` from now.
        """
        self._node.update_send(params, loss)

    def update_wait(self, loss: Any) -> float:
        """Wait at most until the fetch's deadline, mix into params in place; return the factor (0.0 = no mix).

        Never waits past the deadline plus 50 ms: a verdict the TX thread has not given by then is a
        timeout (``fetches_late``), and the reply, should it come later, is dropped. Raises RuntimeError
        (the cause chained) once the RX or TX thread has died of a bug, as does update_send.
        """
        return self._node.update_wait(loss)

    def bootstrap(self, params: Sequence[np.ndarray], timeout_s: float | None = None) -> str | None:
        """Before the first ``update_send``: copy one peer's model into ``params`` (factor 1) if that peer's
        clock is ahead; return its name, or None when no peer answered within ``timeout_s`` (default: the
        cluster's ``bootstrap_timeout_s``) or the one that answered was not ahead.  See :mod:`dpwa.node.recovery`.
        """
        return self._node.bootstrap(params, self.config.bootstrap_timeout_s if timeout_s is None else timeout_s)

    def wait_for_peers(self, timeout_s: float) -> dict[str, bool]:
        """Before training: wait until every peer's node is up (its server answers), at most ``timeout_s``
        seconds; return, for each peer, whether it answered. Nodes started together (``dpwa run``) then also start
        training together, which matters in short runs (see "Short runs" in the Mixing rules docs): a node
        that trains while its peer is still starting trains alone. Costs one header-sized message per peer.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        return self._node.wait_for_peers(timeout_s)

    def dpwa_state(self) -> DpwaState:
        """The node's gossip state for a checkpoint: clock, step, loss, the rule's scalar extras and arrays."""
        return self._node.export_state()

    def restore_state(self, state: DpwaState, params: Sequence[np.ndarray] | None = None) -> None:
        """Take back a :meth:`dpwa_state` (trainer thread, before training goes on); ``params`` lets the rule's
        arrays (GEM's proxy) be checked against the parameters and restored."""
        self._node.restore_state(state, params)

    def wait_published(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until the last ``update_send``'s snapshot can be served whole; True if so.

        A narrower ``wire_dtype`` (16-bit, int8; not a ``memory: low`` node that rounds in ``update_send``) makes
        this wait while the snapshot is rounded in the background, and a node in shared memory that lent a snapshot
        lately while it checks the new one; False also before the first ``update_send``.
        """
        pool = self._node.pool
        return pool is not None and pool.wait_ready(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters (fetches ok / timed out / refused / rejected, bytes, mean fetch ms, ...) and flow-control scores.

        Also ``rx_alive`` / ``tx_alive`` (the threads run) and ``thread_errors`` (role -> repr of what killed it).
        """
        return self._node.snapshot_stats()

    def member_events(self) -> list[MemberEvent]:
        """The membership changes this node saw since the last call, oldest first (docs/membership.md)."""
        return self._node.membership.events()

    def close(self, linger: float = 0.0, idle: float = 1.0, *, final_mix: bool = False) -> None:
        """Stop the RX/TX threads and free the port; idempotent.

        ``linger`` > 0: first keep serving peers that still fetch, for at most that many seconds,
        returning early once nobody fetched for ``idle`` seconds (set it above a peer's step time).
        Then the node leaves cleanly: a push-sum node hands its mass to a member, and every member
        learns at once that it left (docs/membership.md). To hand it over, a push rule first folds in the
        pushes that arrived since the last ``update_wait``; ``final_mix`` False (the default) leaves the arrays
        given to the node as the trainer last saw them, True leaves that fold in them. An exchange rule's node
        waits for the exchanges it served to settle, and ``final_mix`` mixes the committed ones (their fetchers
        mixed their halves; False counts them in ``exchanges_unmixed``). An exception while lingering (a Ctrl-C)
        still closes the node, then propagates.
        """
        try:
            if linger > 0 and not self.closed:
                spent = self._node.linger(linger, idle)
                log.info("node %s served its peers %.1fs after training", self.name, spent)
        finally:  # a Ctrl-C while lingering still stops the threads, frees the port and leaves
            if self._finalizer.alive:
                self._finalizer.detach()
                self._node.close(final_mix=final_mix)

    @property
    def closed(self) -> bool:
        return self._node.closed

    def __enter__(self) -> DpwaConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DpwaConnection({self.name!r}, {self.endpoint!r}, rule={self._node.rule.name!r})"
