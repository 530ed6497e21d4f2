"""Recovering a node: its gossip state to and from a checkpoint, and catching up by copying a peer.

Three things a node that (re)starts may do, all on the trainer's thread, through
:class:`~dpwa.connection.DpwaConnection` (this module works on its internal node):

* :func:`export_state` / :func:`restore_state`: the node's :class:`~dpwa.checkpoint.DpwaState`
  (clock, step, loss, the rule's scalar extras such as push-sum's weight, GEM's momentum proxy).
* :func:`bootstrap` -- before the first local step: publish the node's own (restored) parameters,
  then pull ONE peer's model and copy it outright (factor 1) if that peer's clock is ahead of ours.
  Peers are asked one at a time (each attempt bounded by ``timeout_ms``) until one answers or
  ``timeout_s`` passes; a peer still starting up ("not ready") is asked again.  If nobody answers
  the node keeps its own state and says so in the log.
* :func:`take_over_if_far_behind` -- "far behind": the FIRST successful reply a node gets
  (once per process, unless a bootstrap already copied a peer) is checked; if the peer's clock
  exceeds the node's own by more than the cluster's ``bootstrap_gap`` (clock units = batches;
  0 disables the check), that step copies the peer outright instead of running the rule.

Copying a push-sum peer also absorbs the weight the reply carried (``w_given``), so the
cluster's total weight is conserved; the copy itself sets ``x`` to the peer's model and the
clock to the peer's clock.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .checkpoint import CheckpointError, DpwaState, scalar_extras
from .rules import MixOutcome, NodeState, PeerSnapshot
from .rules.gem import GemRule
from .rules.mixing import _compute_dtype
from .rules.pushsum import PushSumRule, valid_mass
from .transport import FetchJob, FetchTarget

if TYPE_CHECKING:  # pragma: no cover
    from .connection import _Node

log = logging.getLogger(__name__)

__all__ = ["bootstrap", "export_state", "restore_state", "take_over_if_far_behind"]

VERDICT_SLACK_S = 0.05
"""How long bootstrap waits past an attempt's deadline for the TX thread's verdict (as update_wait does)."""
RETRY_PAUSE_S = 0.05
"""Pause before asking again after a quick refusal (a peer not ready yet)."""
GEM_PROXY = "gem_m"


# --------------------------------------------------------------------------- checkpoint state


def export_state(node: _Node) -> DpwaState:
    """The node's gossip state now (copies; the rule's arrays too)."""
    with node.state_lock:
        state = DpwaState(
            clock=float(node.state.clock),
            step=int(node.step),
            loss=float(node.state.loss),
            rule=node.rule.name,
            extras=scalar_extras(node.state.extras),
        )
        if isinstance(node.rule, GemRule) and node.rule.proxy is not None:
            state.arrays = {f"{GEM_PROXY}/{i}": np.array(m, copy=True) for i, m in enumerate(node.rule.proxy)}
    return state


def restore_state(node: _Node, state: DpwaState, params: Sequence[np.ndarray] | None = None) -> None:
    """Set clock, step and loss from ``state``; the rule's extras and arrays too if it is the same rule.

    Only extras the rule already has as numbers are restored (push-sum's ``weight``).  GEM's proxy is
    restored when ``params`` is given and its arrays match their shapes; else it starts from zero.
    CheckpointError when ``state`` holds values the node cannot take (nothing changed then).
    """
    if not (math.isfinite(state.clock) and math.isfinite(state.loss)) or state.step < 0:
        raise CheckpointError(f"bad dpwa state: clock {state.clock}, step {state.step}, loss {state.loss}")
    same_rule = state.rule == node.rule.name
    if not same_rule:
        log.warning(
            "node %s: checkpoint was taken with rule %r, now %r: restoring clock and step only",
            node.name,
            state.rule,
            node.rule.name,
        )
    proxy = _gem_proxy(node, state, params) if same_rule else None
    with node.state_lock:
        node.state.clock = float(state.clock)
        node.state.loss = float(state.loss)
        node.step = int(state.step)
        if same_rule:
            numeric = scalar_extras(node.state.extras)
            for key, value in state.extras.items():
                if key in numeric:
                    node.state.extras[key] = float(value)
            if proxy is not None:
                assert isinstance(node.rule, GemRule)
                node.rule.restore_proxy(proxy)
    log.info("node %s: restored clock %g, step %d", node.name, state.clock, state.step)


def _gem_proxy(node: _Node, state: DpwaState, params: Sequence[np.ndarray] | None) -> list[np.ndarray] | None:
    if not isinstance(node.rule, GemRule) or params is None:
        return None
    proxy = [state.arrays.get(f"{GEM_PROXY}/{i}") for i in range(len(params))]
    if not any(m is not None for m in proxy):
        return None
    stored = [key for key in state.arrays if key.startswith(GEM_PROXY + "/")]
    if len(stored) != len(params) or any(
        m is None or m.shape != p.shape or m.dtype != _compute_dtype(p.dtype) for m, p in zip(proxy, params)
    ):
        log.warning("node %s: the checkpoint's GEM proxy does not fit the parameters; starting it from zero", node.name)
        return None
    return [np.array(m, copy=True) for m in proxy if m is not None]


# --------------------------------------------------------------------------- bootstrap


def bootstrap(node: _Node, params: Sequence[np.ndarray], timeout_s: float) -> str | None:
    """Copy one peer's model into ``params`` before the first local step; the peer's name, or None.

    See the module doc-string.  ``params`` must be the arrays later passed to ``update_send``.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if node.layout is None:
        node.setup_layout(params)
    elif not node.layout.matches(params):
        raise ValueError("params changed layout (count, dtype or shape) since the first update_send")
    assert node.pool is not None
    if node.pending is not None and not node.pending.done.is_set():
        raise RuntimeError("bootstrap() while a fetch is in flight: call it before the first update_send")
    node.params = list(params)
    _publish_own(node)
    peers = [n for n in node.names if n != node.name]
    if not peers:
        return None
    node.rng.shuffle(peers)
    deadline = time.monotonic() + timeout_s
    buffer, views = node.receive_slots[0]
    attempt = 0
    while time.monotonic() < deadline:
        peer = peers[attempt % len(peers)]
        attempt += 1
        started = time.monotonic()
        target = FetchTarget(peer, buffer, views)
        job = FetchJob(next(node.requests), [target], min(deadline, started + node.config.timeout_ms / 1000.0))
        node.tx.submit(job)
        if not job.done.wait(max(0.0, job.deadline - time.monotonic()) + VERDICT_SLACK_S):
            for late in job.expire():  # the TX thread is late: time the fetch out here, as update_wait does
                node.on_target(job, late)
        if target.status == "ok" and target.header is not None:
            return _adopt(node, params, PeerSnapshot(_peer_state(target), views))
        if time.monotonic() - started < RETRY_PAUSE_S:
            time.sleep(RETRY_PAUSE_S)  # a quick refusal (not ready yet): do not spin
    log.warning(
        "node %s: no peer answered within %.1f s; training from its own state (not bootstrapped)", node.name, timeout_s
    )
    return None


def _peer_state(target: FetchTarget) -> NodeState:
    header = target.header
    assert header is not None
    return NodeState(target.peer, header.clock, header.loss, dict(header.extras))


def _publish_own(node: _Node) -> None:
    """Serve the node's current parameters (clock unchanged) while it bootstraps, so peers that
    bootstrap at the same time (``dpwa run --resume``) get an answer instead of "not ready"."""
    assert node.pool is not None and node.params is not None
    with node.state_lock:
        clock, loss, extras = node.state.clock, node.state.loss, dict(node.state.extras)
    snapshot = node.pool.publish(node.params, clock, loss, extras)
    if snapshot is not None:
        with node.state_lock:
            node.rule.on_publish(node.state, snapshot.readonly)


def _adopt(node: _Node, params: Sequence[np.ndarray], peer: PeerSnapshot) -> str | None:
    """Copy ``peer`` if it is ahead of the node (clock), absorbing its push-sum weight either way."""
    with node.state_lock:
        own = node.state.clock
        _absorb_mass(node, peer.state.extras)
        if not peer.state.clock > own:
            log.info(
                "node %s: peer %s is not ahead (clock %g, own %g); keeping its own state",
                node.name,
                peer.state.name,
                peer.state.clock,
                own,
            )
            return None
        _copy(node, params, peer)
    log.info("node %s: bootstrapped from %s (clock %g -> %g)", node.name, peer.state.name, own, peer.state.clock)
    return peer.state.name


def _copy(node: _Node, params: Sequence[np.ndarray], peer: PeerSnapshot) -> None:
    """x <- x_peer, clock <- peer clock (caller holds the state lock)."""
    for dst, src in zip(params, peer.arrays):
        np.copyto(dst, src, casting="no")
    node.state.clock = float(peer.state.clock)
    node.rule.on_params_replaced(node.state)  # push-sum: the published snapshot no longer carries the mass
    node.caught_up = True
    node.stats.add("bootstraps")


def _absorb_mass(node: _Node, extras: Mapping[str, Any]) -> None:
    """Push-sum: ``w <- w + w_given`` of a reply that is copied or skipped (caller holds the state lock)."""
    if isinstance(node.rule, PushSumRule):
        given = valid_mass(extras.get("w_given"), float(len(node.names)))
        if given is not None:
            node.state.extras["weight"] = node.rule.weight(node.state) + given


def take_over_if_far_behind(node: _Node, peers: Sequence[PeerSnapshot]) -> MixOutcome | None:
    """At a node's first successful reply (caller holds the state lock): copy the most advanced peer if it
    is more than ``bootstrap_gap`` ahead, returning the outcome (factor 1); else None (run the rule)."""
    node.caught_up = True
    gap = node.config.bootstrap_gap
    ahead = max(peers, key=lambda p: p.state.clock)
    own = node.state.clock
    if gap <= 0 or not math.isfinite(ahead.state.clock) or not ahead.state.clock - own > gap:
        return None
    log.warning(
        "node %s: far behind (clock %g, peer %s at %g, more than bootstrap_gap %g ahead); copying its model",
        node.name,
        own,
        ahead.state.name,
        ahead.state.clock,
        gap,
    )
    for p in peers:
        _absorb_mass(node, p.state.extras)
    assert node.params is not None
    _copy(node, node.params, ahead)
    return MixOutcome(1.0, (ahead.state.name,), {"bootstrap": 1.0})
