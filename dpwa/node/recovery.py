"""Recovering a node: its gossip state to and from a checkpoint, and catching up by copying a peer.

The policy only, as functions of the node's :class:`~dpwa.rules.base.NodeState`, its rule and
arrays, and :class:`Recovery`, which remembers whether the node has caught up; the node
(:class:`dpwa.node.core.Node`) calls them on the trainer's thread, holds the state lock where
they change state, and owns the sockets (it passes a ``fetch`` callable in).

* :func:`export_state` / :func:`restore_state`: the node's :class:`~dpwa.checkpoint.DpwaState`
  (clock, step, loss, the rule's scalar extras such as push-sum's weight, and the rule's arrays
  through :meth:`~dpwa.rules.base.Rule.state_arrays`, e.g. GEM's momentum proxy). A rule that counts steps
  (:meth:`~dpwa.rules.base.Rule.follow`: an outer optimizer's boundaries, a group's sync steps) follows the step
  restored; an outer optimizer counts a catch-up's step.
* :func:`ask_peers` -- bootstrap, before the first local step: ask one peer at a time (each
  attempt bounded by the caller's ``fetch``) until one answers or ``timeout_s`` passes; the node
  then copies that peer outright if :func:`is_ahead`.
* :func:`far_ahead` -- "far behind": at the FIRST successful reply a node gets (once per process,
  unless a bootstrap already copied a peer), a peer whose clock exceeds the node's by more than
  ``bootstrap_gap`` (clock units = batches; 0 disables it) is copied outright instead of mixed.

:func:`copy_peer` is the copy itself: ``x <- x_peer``, ``clock <- peer clock``. A reply taken
this way (copied or not) goes to :meth:`~dpwa.rules.base.Rule.on_reply_not_mixed`, so push-sum
absorbs the weight it carried and the cluster's total weight is conserved.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from dpwa.checkpoint import CheckpointError, DpwaState, scalar_extras
from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import copy_widened
from dpwa.rules.outer import OuterRule

__all__ = [
    "RETRY_PAUSE_S",
    "Recovery",
    "ask_peers",
    "copy_peer",
    "export_state",
    "far_ahead",
    "is_ahead",
    "restore_state",
]

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.05
"""Pause before asking again after a quick refusal (a peer not ready yet), so a bootstrap never spins."""


# --------------------------------------------------------------------------- checkpoint state


def export_state(own: NodeState, step: int, rule: Rule) -> DpwaState:
    """The node's gossip state now, as copies: clock, step, loss, the rule's scalar extras and arrays."""
    return DpwaState(
        clock=float(own.clock),
        step=int(step),
        loss=float(own.loss),
        rule=rule.name,
        extras=scalar_extras(own.extras),
        arrays=rule.state_arrays(),
    )


def restore_state(own: NodeState, rule: Rule, saved: DpwaState, params: Sequence[np.ndarray] | None) -> int:
    """Set ``own``'s clock and loss from ``saved`` -- the rule's numeric extras and arrays too if ``saved``
    was taken with the same rule -- and return the step to go on from.

    Only extras the rule already has as numbers are restored (push-sum's ``weight``); the rule's arrays
    (GEM's proxy, CHOCO's public copies) only when ``params`` is given and they fit it, else they start afresh
    (with a warning), and so do the extras that go with them.
    CheckpointError, and nothing changed, when ``saved`` holds values the node cannot take.
    """
    if not (math.isfinite(saved.clock) and math.isfinite(saved.loss)) or saved.step < 0:
        raise CheckpointError(f"bad dpwa state: clock {saved.clock}, step {saved.step}, loss {saved.loss}")
    if saved.rule != rule.name:
        log.warning(
            "node %s: checkpoint was taken with rule %r, now %r: restoring clock and step only",
            own.name,
            saved.rule,
            rule.name,
        )
    else:
        numeric = scalar_extras(own.extras)
        restored = {key: float(value) for key, value in saved.extras.items() if key in numeric}
        loaded = params is not None and rule.load_state_arrays(saved.arrays, params)
        if params is not None and not loaded:
            log.warning(
                "node %s: the checkpoint's %s arrays do not fit the parameters; starting afresh", own.name, rule.name
            )
        if not loaded:
            # the extras that describe the arrays (CHOCO's epoch and number) go with them: a fresh copy's first
            # message would otherwise go out under the checkpoint's number
            restored = {k: v for k, v in restored.items() if k not in rule.array_extras}
        own.extras.update(restored)
    own.clock = float(saved.clock)
    own.loss = float(saved.loss)
    rule.follow(int(saved.step))  # a rule that counts steps (outer boundaries, a group's sync steps) agrees again
    log.info("node %s: restored clock %g, step %d", own.name, saved.clock, saved.step)
    return int(saved.step)


# --------------------------------------------------------------------------- catching up


def ask_peers(
    peers: Sequence[str], fetch: Callable[[str, float], PeerSnapshot | None], timeout_s: float
) -> PeerSnapshot | None:
    """``fetch(peer, deadline)`` for each of ``peers`` in turn, round and round, until one returns a snapshot
    or ``timeout_s`` seconds pass (None then). ``fetch`` must return by ``deadline`` (time.monotonic)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not peers:
        return None
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while time.monotonic() < deadline:
        peer = peers[attempt % len(peers)]
        attempt += 1
        started = time.monotonic()
        snapshot = fetch(peer, deadline)
        if snapshot is not None:
            return snapshot
        if time.monotonic() - started < RETRY_PAUSE_S:
            time.sleep(RETRY_PAUSE_S)  # a quick refusal (not ready yet): do not spin
    return None


def is_ahead(peer: PeerSnapshot, own: NodeState) -> bool:
    """Whether a bootstrap copies ``peer``: its clock is ahead of the node's."""
    return peer.state.clock > own.clock


def far_ahead(peers: Sequence[PeerSnapshot], own: NodeState, gap: float) -> PeerSnapshot | None:
    """The most advanced of ``peers`` if its clock exceeds ``own``'s by more than ``gap`` (> 0); else None."""
    if gap <= 0 or not peers:
        return None
    ahead = max(peers, key=lambda p: p.state.clock)
    if not math.isfinite(ahead.state.clock) or not ahead.state.clock - own.clock > gap:
        return None
    return ahead


def copy_peer(own: NodeState, rule: Rule, params: Sequence[np.ndarray], peer: PeerSnapshot) -> None:
    """``x <- x_peer``, ``clock <- peer clock``, and tell the rule its published snapshot no longer stands for
    the parameters (caller holds the state lock)."""
    theirs = rule.params_of(peer.arrays)
    assert theirs is not None, "copy_peer of a snapshot that holds no parameters"
    for dst, src in zip(params, theirs):
        copy_widened(dst, src)  # a receive buffer in a narrower wire dtype is widened
    own.clock = float(peer.state.clock)
    rule.on_params_replaced(own)


class Recovery:
    """One node's catching up: at its first successful reply, and in a bootstrap. ``caught_up``: a peer was
    copied, or the first reply was checked for "far behind" (it is checked once per process).

    Every method runs on the trainer's thread, with the node's state lock held but :meth:`bootstrap`;
    ``count(event)`` adds one to the node's counter ``event`` (a copy counts in ``bootstraps``)."""

    def __init__(self, name: str, rule: Rule, gap: float, count: Callable[[str], None]) -> None:
        self.name = name
        self.rule = rule
        self.gap = gap
        """``bootstrap_gap``: how far ahead (clock units) a peer must be to be copied at the first reply."""
        self._count = count
        self.caught_up = False

    def catch_up(
        self, own: NodeState, params: Sequence[np.ndarray], peers: Sequence[PeerSnapshot]
    ) -> MixOutcome | None:
        """At the node's first successful reply: copy the most advanced of ``peers`` if it is more than ``gap``
        ahead and return the outcome (factor 1); else None (the caller runs the rule)."""
        self.caught_up = True
        ahead = far_ahead(peers, own, self.gap)
        if ahead is None or self.rule.params_of(ahead.arrays) is None:  # a rule that publishes no parameters
            return None
        log.warning(
            "node %s: far behind (clock %g, peer %s at %g, more than bootstrap_gap %g ahead); copying its model",
            self.name,
            own.clock,
            ahead.state.name,
            ahead.state.clock,
            self.gap,
        )
        for peer in peers:
            self.rule.on_reply_not_mixed(own, peer.state.extras)
        self.copy(own, params, ahead)
        if isinstance(self.rule, OuterRule):  # the copy took the place of this step's mix: the step still counts
            self.rule.step_without_mix()
        return MixOutcome(1.0, (ahead.state.name,), {**self.rule.state_metrics(own), "bootstrap": 1.0})

    def bootstrap(
        self,
        own: NodeState,
        lock: threading.Lock,
        params: Sequence[np.ndarray],
        peers: Sequence[str],
        fetch: Callable[[str, float], PeerSnapshot | None],
        timeout_s: float,
    ) -> str | None:
        """Ask ``peers`` in turn (:func:`ask_peers`) and adopt the first answer (:meth:`adopt`, under ``lock``,
        the lock of ``own``); the name of the peer copied, or None. Called without the lock held."""
        peer = ask_peers(peers, fetch, timeout_s) if peers else None
        if peer is None:
            if peers:
                log.warning(
                    "node %s: no peer answered within %.1f s; training from its own state (not bootstrapped)",
                    self.name,
                    timeout_s,
                )
            return None
        with lock:
            before = own.clock
            if not self.adopt(own, params, peer):
                return None
        log.info("node %s: bootstrapped from %s (clock %g -> %g)", self.name, peer.state.name, before, peer.state.clock)
        return peer.state.name

    def adopt(self, own: NodeState, params: Sequence[np.ndarray], peer: PeerSnapshot) -> bool:
        """A bootstrap's answer ``peer``: the rule takes back what it carried, and ``peer`` is copied if it is
        ahead (:func:`is_ahead`); True when it was."""
        before = own.clock
        self.rule.on_reply_not_mixed(own, peer.state.extras)
        if self.rule.params_of(peer.arrays) is None:
            log.info("node %s: rule %s publishes no parameters; nothing to copy", self.name, self.rule.name)
            return False
        if not is_ahead(peer, own):
            log.info(
                "node %s: peer %s is not ahead (clock %g, own %g); keeping its own state",
                self.name,
                peer.state.name,
                peer.state.clock,
                before,
            )
            return False
        self.copy(own, params, peer)
        return True

    def copy(self, own: NodeState, params: Sequence[np.ndarray], peer: PeerSnapshot) -> None:
        """:func:`copy_peer`, counted in ``bootstraps``; the node has caught up."""
        copy_peer(own, self.rule, params, peer)
        self.caught_up = True
        self._count("bootstraps")
