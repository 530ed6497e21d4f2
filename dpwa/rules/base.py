"""The contract every interpolation rule implements, and the data it sees.

A rule answers one question at ``update_wait``: given my parameters ``x``, what
I fetched from peers and the small state each side sends along, what is my new
``x``?  Rules are pure with respect to the network: they never touch a socket,
they only read :class:`NodeState` / :class:`PeerSnapshot` and mutate the
trainer's arrays and state in place.

Whom to fetch is not a rule's business but a schedule's (:mod:`dpwa.rules.schedules`).
How models travel is the rule's :attr:`Rule.transfer`, a :class:`Transfer`: ``pull`` (fetch the peers'
snapshots), ``push`` (send one's own snapshot with :meth:`Rule.push_shares`; mix what arrives in the inbox)
or ``exchange`` (a fetch that carries one's own snapshot: both ends of the pair mix). A rule whose pushes
carry mass names the extras key that holds it (:attr:`Rule.mass_key`), so that the node can account for it.

Which thread calls what (the connection and the simulator guarantee it):

* :meth:`Rule.initial_extras` -- once, when the node starts;
* :meth:`Rule.on_members` -- any thread, under the state lock, when the member table changed;
* :meth:`Rule.hand_off` -- trainer thread, under the state lock, once, when the node leaves cleanly;
* :meth:`Rule.reads_published` -- trainer thread, once, when the node sets up its snapshot pool;
* :meth:`Rule.on_publish` -- trainer thread, at ``update_send``, after the snapshot is published;
* :meth:`Rule.request_extras` -- trainer thread, when a fetch starts (sent with the request);
* :meth:`Rule.push_shares` -- trainer thread, under the state lock, when pushes start (``push`` rules);
* :meth:`Rule.on_request` -- RX thread, under the node's state lock, per request that carried extras;
* :meth:`Rule.on_serve` -- RX thread, under the node's state lock, per reply;
* :meth:`Rule.on_serve_failed` -- RX thread, under the state lock, when that reply could not be sent;
* :meth:`Rule.on_reply_lost` -- trainer thread, under the state lock, for a fetch that failed after
  the peer may have served it (a timeout, or a reply that arrived and was rejected);
* :meth:`Rule.mix` -- trainer thread, under the state lock, at EVERY ``update_wait``
  (``peers`` may be empty: a rule that tracks its own motion, like GEM, still sees the step);
  for ``push`` and ``exchange`` rules ``peers`` also holds what the inbox received, and a
  refused push comes back as a peer named like the node itself, carrying what it gave;
* :meth:`Rule.on_reply_not_mixed` -- trainer thread, under the state lock, for a valid reply that
  recovery took instead of :meth:`Rule.mix` (a bootstrap or a far-behind catch-up);
* :meth:`Rule.on_params_replaced` -- trainer thread, under the state lock, after such a copy;
* :meth:`Rule.state_arrays` / :meth:`Rule.load_state_arrays` -- trainer thread, under the state
  lock, when a checkpoint is written or restored.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from dpwa.rules.mixing import apply_divergence
from dpwa.utils.settings import Settings

__all__ = [
    "ONE_PEER_SCHEDULES",
    "REPEATS",
    "MixOutcome",
    "NodeState",
    "PeerSnapshot",
    "Rule",
    "Transfer",
    "check_repeats",
    "checked_step",
    "fresh_peers",
]

ONE_PEER_SCHEDULES = ("random", "exponential", "ring")
"""The peer schedules that give a node one peer a round: what a rule that mixes one peer at a time works with."""


class Transfer(enum.StrEnum):
    """How a rule's models travel between nodes (the node picks the matching transfer from ``dpwa.node``)."""

    PULL = "pull"
    """Fetch the peers' published snapshots."""
    PUSH = "push"
    """Send one's own snapshot, with a share of the rule's state, to the peers' inboxes; mix what arrives."""
    EXCHANGE = "exchange"
    """A fetch that carries one's own snapshot along: both ends of the pair mix."""


@dataclass
class NodeState:
    """What a node tells its peers with every reply; the rules' inputs."""

    name: str
    clock: float = 0.0  # batches trained (fractional after mixing)
    loss: float = 0.0
    # JSON-safe rule extras (push-sum weight, leader table, group info).
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerSnapshot:
    """One fetched peer: its state as received and its parameters.

    ``arrays`` has the same layout (dtypes, shapes, order) as the node's own
    parameters, except that a rule whose :meth:`Rule.mixes_narrower_peers` is
    True may get a float32 array in the 16-bit wire dtype it travelled in.  A rule
    MAY overwrite them (they are scratch, discarded after mixing).
    """

    state: NodeState
    arrays: Sequence[np.ndarray]
    reference: Sequence[np.ndarray] | None = None
    """An exchange (AD-PSGD) received in the inbox: this node's own snapshot that the peer got in return,
    the model the difference is taken against. None for a fetched reply or a push."""
    difference: bool = False
    """An exchange whose ``arrays`` already hold ``peer - reference`` (taken when a node with one snapshot buffer
    rewrote the snapshot it had served: ``transport.memory: low``); ``reference`` is then None."""
    repeat: bool = False
    """A fetched reply that holds the same snapshot this node fetched from the peer last time (the peer has
    published nothing since): mixing it again would count the same model twice. Rules with a ``repeats``
    setting skip it (see :func:`fresh_peers`)."""


REPEATS = ("skip", "mix")
"""A pull rule's ``repeats`` setting: ``skip`` a reply that repeats the peer's last snapshot, or ``mix`` it again."""


def check_repeats(value: str) -> str:
    """``value`` if it is one of :data:`REPEATS`; else ValueError."""
    if value not in REPEATS:
        raise ValueError(f"repeats must be one of {', '.join(REPEATS)}, got {value!r}")
    return value


def checked_step(step: object) -> int:
    """``step`` when it is a node's step (an int >= 0, not a bool), for :meth:`Rule.follow`; else ValueError."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return step


def fresh_peers(peers: Sequence[PeerSnapshot], repeats: str) -> tuple[list[PeerSnapshot], int]:
    """The peers to mix and how many were left out: with ``repeats="skip"`` every :attr:`PeerSnapshot.repeat`
    is left out (a peer that published nothing new since this node last fetched it: a stalled, finished or
    slower peer would otherwise pull the node back to the same model at every step); ``"mix"`` keeps all."""
    if repeats == "mix":
        return list(peers), 0
    kept = [p for p in peers if not p.repeat]
    return kept, len(peers) - len(kept)


@dataclass(frozen=True)
class MixOutcome:
    """What one :meth:`Rule.mix` call did.

    ``factor`` is the representative factor actually applied (the mean
    effective factor for element-wise rules); 0.0 means nothing was mixed.
    ``peers`` names the peers mixed in; ``metrics`` carries rule-specific
    figures for the metrics log.
    """

    factor: float
    peers: tuple[str, ...]
    metrics: Mapping[str, float] = field(default_factory=dict)
    moved: bool | None = None
    """Whether the arrays changed; None: ``factor > 0`` says (push-sum also moves them with factor 0, when it
    scales the local step into the numerator)."""

    @property
    def changed(self) -> bool:
        """True when :meth:`Rule.mix` wrote to the arrays."""
        return self.moved if self.moved is not None else self.factor != 0.0


class Rule(ABC):
    """An interpolation rule: ``x <- x + sum_j a_j * (x_j - x)``, ``a_j >= 0``, ``sum_j a_j <= 1``.

    Every rule accepts ``divergence_threshold`` ``t >= 0`` (0 = off); single
    factors pass through :meth:`diverge` (``f <- f * loss / t`` when
    ``loss < t``) after the rule computed them.
    """

    name: ClassVar[str]
    """The rule's name: the cluster file's ``interpolation`` value and the key of its settings."""
    settings_class: ClassVar[type[Settings]]
    """The rule's settings dataclass, declared beside the rule: the fields the cluster file's ``<name>:`` map
    may set, which are also the constructor's keyword arguments (besides ``divergence_threshold``)."""
    allowed_schedules: ClassVar[tuple[str, ...]] = ONE_PEER_SCHEDULES
    """The peer schedules (:mod:`dpwa.rules.schedules`) this rule works with: the values its ``peers`` key allows."""
    default_schedule: ClassVar[str] = "random"
    """The schedule that ``peers: auto`` (the default) stands for; one of :attr:`allowed_schedules`."""
    transfer: ClassVar[Transfer] = Transfer.PULL
    """How this rule's models travel (module doc-string)."""
    mass_key: ClassVar[str | None] = None
    """The extras key of the mass a push carries (push-sum: ``"w_given"``), which the node sums over the pushes
    in flight and in its inbox for its statistics; None: the rule's pushes carry no mass."""
    wire_exact: ClassVar[str] = ""
    """Why this rule's snapshots must travel exactly as published (running sums, public copies): the cluster
    file then refuses a narrowing ``wire_dtype``; empty: any wire dtype will do."""
    overlap: int = 0
    """``push`` rules: how many pushes may still await their ACK when ``update_wait`` returns (OSGP's tau)."""
    array_extras: ClassVar[frozenset[str]] = frozenset()
    """The extras that describe :meth:`state_arrays` (CHOCO's epoch and message number): a restore takes them
    only with the arrays, both or neither."""

    def __init__(self, divergence_threshold: float = 0.0) -> None:
        t = float(divergence_threshold)
        if not (math.isfinite(t) and t >= 0.0):
            raise ValueError(f"divergence_threshold must be a finite number >= 0, got {divergence_threshold!r}")
        self.divergence_threshold = t

    def diverge(self, f: float, loss: float) -> float:
        """``apply_divergence(f, loss, self.divergence_threshold)``."""
        return apply_divergence(f, loss, self.divergence_threshold)

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        """Called once when node ``me`` of the cluster ``names`` (file order) starts.

        Returns the rule's part of the node's state (push-sum: ``{"weight": 1.0}``); default ``{}``.
        """
        return {}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:  # noqa: B027 - optional hook
        """Under the state lock, when the members changed (a join, a leave, a member forgotten): ``names`` are the
        members now (schedule order, ``me`` included), ``mass`` a bound on the cluster's push-sum mass (one unit
        per member ever admitted). Rules that keep per-member state (groups, leader tables) follow; default no-op.
        """

    def hand_off(self, own: NodeState) -> dict[str, Any] | None:
        """Under the state lock, when the node leaves cleanly: the extras of one last push that hands what the
        node holds to a member (push-sum: its whole weight, ``w <- 0``), or None when leaving loses nothing.
        A refused hand-off comes back as a returned push, like any other."""
        return None

    def reads_published(self) -> bool:
        """Whether the node must keep what it published in the parameters' dtype: the rule reads it back (it
        overrides :meth:`on_publish`), or its pushes and exchanges do (returned mass, the pair's reference). A node
        whose rule does not keeps its snapshot in a narrower wire dtype alone under ``transport.memory: low``."""
        return self.transfer is not Transfer.PULL or type(self).on_publish is not Rule.on_publish

    def mixes_narrower_peers(self) -> bool:
        """Whether :meth:`mix` reads its peers' arrays only through kernels that take a narrower peer (a float16
        or bfloat16 array beside float32 parameters, widened block by block as it is read: ``interpolate_``;
        :mod:`dpwa.rules.mixing`), so that a node keeping its snapshot in a 16-bit wire dtype
        alone may receive in it too. Default False: peers come in the parameters' dtypes."""
        return False

    def follow(self, step: int) -> None:  # noqa: B027 - optional hook
        """The node's step is ``step`` now (``update_send`` calls so far: a checkpoint restored it, or a simulated
        crash undid a step): a rule that counts steps itself to agree with the schedule (an outer optimizer's
        boundaries, a group's sync steps) takes it. Default no-op."""

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:  # noqa: B027 - optional hook
        """At ``update_send``: ``published`` are read-only views of the parameters just published (empty for a
        rule whose :meth:`reads_published` is False, when the node keeps its snapshot in the wire's dtype alone).

        They hold ``x`` as of this ``update_send`` until the next one (GEM's
        ``x_at_update_send``, a group's own published model).  Default no-op.
        """

    def request_extras(self, own: NodeState) -> dict[str, Any]:
        """Trainer thread, when a fetch starts: small JSON-safe state sent WITH the request; default ``{}``.

        Push-pull gossip: the leader rule sends its best-known table, so the node it pulls from
        learns what the puller knows without fetching it.
        """
        return {}

    def push_shares(self, own: NodeState, targets: int) -> list[dict[str, Any]]:
        """``push`` rules, at ``update_send``: what each of ``targets`` pushes carries (JSON-safe extras), taken
        from ``own`` now (push-sum gives each ``w/(targets+1)``). Default: nothing (``{}`` each)."""
        return [{} for _ in range(targets)]

    def on_request(self, own: NodeState, extras: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """RX thread, under the state lock, before :meth:`on_serve`: a request's (untrusted) extras."""

    def on_serve(self, own: NodeState) -> dict[str, Any]:
        """RX thread, under the state lock, once per reply served.

        Returns JSON-safe extras attached to THIS reply only; may change
        ``own`` (push-sum halves its weight here).  Default: ``{}``.
        """
        return {}

    def on_serve_failed(self, own: NodeState, given: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """The reply that carried ``given`` (what :meth:`on_serve` returned) was never sent: undo it."""

    def on_reply_lost(self, own: NodeState, peer_extras: dict[str, Any] | None) -> None:  # noqa: B027
        """A fetch failed after the peer may have served it.

        ``peer_extras`` are the extras of a reply that arrived but was rejected,
        or None after a timeout (whether the peer served is then unknown).
        Push-sum counts lost mass here.  Default no-op.
        """

    def on_params_replaced(self, own: NodeState) -> None:  # noqa: B027 - optional hook
        """The node's parameters were replaced outside :meth:`mix` (a bootstrap copy of a peer), so the
        published snapshot no longer stands for them until the next ``update_send``.  Default no-op."""

    def on_reply_not_mixed(self, own: NodeState, peer_extras: Mapping[str, Any]) -> None:  # noqa: B027
        """A valid reply that recovery took instead of :meth:`mix`: copied outright (bootstrap, far-behind
        catch-up) or looked at and not copied.  Keep what it carried that must not be lost (push-sum adds the
        weight it carried).  Default no-op."""

    def public_arrays(self, params: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """Trainer thread, at every publish (and once when the node sets its buffers up): the arrays a snapshot
        publishes for ``params``, copied into the snapshot right after this returns; by default the parameters
        themselves. Gradient tracking appends its tracker; CHOCO publishes its compressed difference instead.
        Their count, dtypes and shapes must stay those of the first call (``pull`` rules only)."""
        return params

    def public_bounds(self) -> tuple[int, ...] | None:
        """The exclusive upper bound of every index array (``uint16`` or ``uint32``) among :meth:`public_arrays`, 0
        for the others, which the wire checks every received index against; None: no index arrays (the default)."""
        return None

    def params_of(self, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray] | None:
        """The parameters within a peer's published arrays (a catch-up copies them, the distance is measured on
        them); None when they do not hold them (CHOCO publishes differences). Default: all of them."""
        return arrays

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """Figures of the rule's own state (push-sum's weight and mass counters) that the metrics file shows at
        every step, whether or not :meth:`mix` ran (a catch-up copy replaces it); default ``{}``.  A rule
        puts them into each :meth:`mix` outcome's metrics too."""
        return {}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Model-sized state the rule keeps (GEM's momentum proxy) as copies, keyed by name, for a
        checkpoint; default ``{}``."""
        return {}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], params: Sequence[np.ndarray]) -> bool:
        """Take back what :meth:`state_arrays` returned, checked against ``params``; False (nothing changed)
        when the arrays do not fit them.  Default: nothing to take, True."""
        return True

    @abstractmethod
    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Mix ``peers`` into ``arrays`` in place and update ``own`` (clock, extras).

        ``own.loss`` already holds the loss passed to ``update_wait``.  With no
        peers nothing changes and the outcome's factor is 0.0.
        """

    def _params(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"
