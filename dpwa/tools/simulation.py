"""Gossip without sockets: N nodes in one process, in synchronous rounds, running the network path's code.

Each round does what every node's ``update_send`` / ``update_wait`` does, in the
same order and through the same objects (:class:`~dpwa.rules.base.Rule`,
:class:`~dpwa.rules.schedules.Schedule`, :class:`~dpwa.node.peers.FlowControl`), except
that replies are handed over in memory:

1. every node: ``clock += 1``, remember the loss, publish a copy of the rule's public arrays for its arrays
   (``rule.public_arrays``: the arrays themselves, or what the rule publishes instead), ``rule.on_publish``;
2. optionally a local training step changes a node's arrays (between send and wait);
3. every node picks its peers (schedule, else flow control; down peers filtered);
4. every fetch is served from the peer's published copy: the request's ``rule.request_extras``
   go to the server's ``rule.on_request``, then ``rule.on_serve`` runs on the server's state
   (so within a round everybody serves from its round-start model, then everybody mixes);
   a ``push`` rule instead takes its shares (``rule.push_shares``) and each push lands in the
   target's inbox; an ``exchange`` rule's fetch also leaves the fetcher's published copy in the
   server's inbox, with the server's published copy as its reference -- one exchange per server a
   round (a published snapshot pairs with one exchange; a later fetcher is refused ``busy``, as on
   the network: no reply, no flow-control penalty; which fetch comes first is drawn each round);
5. every node: ``rule.mix`` with the replies and inbox messages that arrived (possibly none).

A lost reply (or a refused push, which comes back to its sender as the node does on the
network) can be injected per (fetcher or sender, peer) pair to test mass accounting and
staleness, and a push can be delayed by whole rounds (``delay``): it lands in the target's inbox
that many rounds later, and is mixed then (its mass is in flight meanwhile:
:meth:`Simulation.mass_in_flight`). Flow control runs on a virtual clock: round ``k`` happens at
``k * round_s`` seconds, so a peer marked down after a lost reply is probed again after its
backoff, as on the network.
Numpy only; deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from dpwa.node.peers import FlowControl
from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.schedules import Round, Schedule

__all__ = ["SimNode", "Simulation", "spread"]

LossKind = Literal["timeout", "rejected"]


@dataclass
class SimNode:
    """One simulated node: its rule, schedule, flow control, arrays and state."""

    name: str
    rule: Rule
    schedule: Schedule
    flow: FlowControl
    arrays: list[np.ndarray]
    state: NodeState
    published: list[np.ndarray] = field(default_factory=list)
    published_state: NodeState | None = None
    step: int = 0

    def flat(self) -> np.ndarray:
        """All arrays as one float64 vector."""
        return np.concatenate([a.astype(np.float64).ravel() for a in self.arrays])


def spread(vectors: Sequence[np.ndarray]) -> float:
    """Largest Euclidean distance of a vector to the vectors' mean."""
    mean = np.mean(vectors, axis=0)
    return max(float(np.linalg.norm(v - mean)) for v in vectors)


class Simulation:
    """N nodes named ``names`` (default w1..wN), each with its own rule and schedule from the factories;
    ``round_s``: the virtual seconds one round takes (flow control's probe backoffs count in them)."""

    def __init__(
        self,
        arrays: Sequence[Sequence[np.ndarray]],
        rule: Callable[[], Rule],
        schedule: Callable[[], Schedule],
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        round_s: float = 0.05,
    ) -> None:
        names = list(names) if names is not None else [f"w{i + 1}" for i in range(len(arrays))]
        if len(names) != len(arrays):
            raise ValueError("one array list per node")
        self.names = tuple(names)
        self.round_s = float(round_s)
        self.rounds = 0
        self.in_flight: list[tuple[int, str, PeerSnapshot]] = []
        """Delayed pushes: (the round they land in, target, message)."""
        self._arrivals = random.Random(f"exchange-arrivals-{seed}")
        """The order an exchange rule's fetches reach their peers in, drawn each round (the first one pairs)."""
        self.nodes: dict[str, SimNode] = {}
        for i, (name, arrs) in enumerate(zip(names, arrays)):
            r = rule()
            state = NodeState(name, extras=r.initial_extras(name, self.names))
            flow = FlowControl([n for n in names if n != name], random.Random(seed * 7919 + i), now=self.now)
            self.nodes[name] = SimNode(name, r, schedule(), flow, [np.array(a, copy=True) for a in arrs], state)

    def now(self) -> float:
        """The virtual time flow control sees: ``rounds * round_s`` seconds."""
        return self.rounds * self.round_s

    def __getitem__(self, name: str) -> SimNode:
        return self.nodes[name]

    def flats(self) -> list[np.ndarray]:
        """Every node's arrays as one float64 vector, in node order."""
        return [n.flat() for n in self.nodes.values()]

    def spread(self) -> float:
        """Largest distance of a node's parameters to the nodes' mean."""
        return spread(self.flats())

    def run_round(
        self,
        losses: Mapping[str, float] | float = 1.0,
        *,
        train: Callable[[SimNode], float | None] | None = None,
        lose: Callable[[str, str], LossKind | None] | None = None,
        skip: Sequence[str] = (),
        delay: Callable[[str, str], int] | None = None,
    ) -> dict[str, MixOutcome]:
        """One synchronous round; returns each node's MixOutcome.

        ``losses``: the loss every node (or each, by name) passes to update_send.
        ``train(node)``: a local step between send and wait; its return value, if any, is the new loss.
        ``lose(fetcher, server)``: "timeout" (reply lost in flight) or "rejected" (arrived, failed
        validation) drops that reply; None delivers it. ``skip``: nodes that sit this round out.
        ``delay(sender, target)``: rounds a push of this round spends in flight (0: mixed this round).
        """
        active = [n for n in self.nodes.values() if n.name not in skip]
        for node in active:  # 1. update_send
            self._publish(node, losses[node.name] if isinstance(losses, Mapping) else float(losses))
        for node in active:  # 2. local training
            if train is not None:
                new_loss = train(node)
                if new_loss is not None:
                    node.state.loss = float(new_loss)
        plan = {node.name: self._choose(node) for node in active}  # 3. choose peers
        replies: dict[str, list[PeerSnapshot]] = {n.name: [] for n in active}
        live = {n.name for n in active}
        paired: set[str] = set()  # servers whose snapshot paired with an exchange this round
        order = list(active)
        if any(n.rule.transfer == "exchange" for n in active):
            self._arrivals.shuffle(order)  # who reaches a peer two picked first: by chance, as on the network
        for node in order:  # 4. serve from round-start copies (or push, or exchange)
            if node.rule.transfer == "push":
                self._push(node, plan[node.name], live, replies, lose, delay)
            else:
                self._fetch(node, plan[node.name], live, replies, lose, paired)
        self._land_delayed(replies)
        outcomes = {}
        for name in list(replies):  # the inbox is mixed in arrival order; keep it deterministic
            replies[name].sort(key=lambda p: (p.state.name != name, self.names.index(p.state.name)))
        for node in active:  # 5. update_wait
            outcomes[node.name] = node.rule.mix(node.state, node.arrays, replies[node.name])
            node.step += 1
        self.rounds += 1
        return outcomes

    def _publish(self, node: SimNode, loss: float) -> None:
        """Step 1 for one node: ``clock += 1``, remember ``loss``, publish a read-only copy of the rule's public
        arrays and its state, ``rule.on_publish``."""
        node.state.clock += 1
        node.state.loss = loss
        node.published = [np.array(a, copy=True) for a in node.rule.public_arrays(node.arrays)]
        for a in node.published:
            a.flags.writeable = False
        node.published_state = NodeState(node.name, node.state.clock, loss, dict(node.state.extras))
        node.rule.on_publish(node.state, node.published)

    def _choose(self, node: SimNode) -> list[str]:
        """Step 3 for one node: the schedule's targets (admitted by flow control, never itself), or flow
        control's choice of ``fanout`` peers (among the schedule's candidates) when the schedule names none."""
        rnd = Round(node.name, self.names, node.step, node.state)
        wanted = node.schedule.targets(rnd)
        if wanted is None:
            return node.flow.choose(node.schedule.fanout, node.schedule.candidates(rnd))
        return node.flow.admit([p for p in wanted if p != node.name])

    def _fetch(
        self,
        node: SimNode,
        targets: Sequence[str],
        live: set[str],
        replies: dict[str, list[PeerSnapshot]],
        lose: Callable[[str, str], LossKind | None] | None,
        paired: set[str],
    ) -> None:
        """Step 4 for a fetching rule: each live target serves its published copy (after ``on_request`` and
        ``on_serve``) into ``node``'s replies unless ``lose`` drops it; an ``exchange`` rule's fetch also leaves
        ``node``'s published copy in the target's inbox, referenced to the target's, unless the target is in
        ``paired`` already (then refused ``busy``)."""
        exchange = node.rule.transfer == "exchange"
        for peer in targets:
            server = self.nodes[peer]
            if peer not in live or server.published_state is None:
                node.flow.failure(peer)
                node.rule.on_reply_lost(node.state, None)
                continue
            if exchange and peer in paired:
                continue  # refused busy: declined, no penalty
            request = node.rule.request_extras(node.state)
            if request:
                server.rule.on_request(server.state, request)
            given = server.rule.on_serve(server.state)
            if exchange:
                paired.add(peer)  # paired when served: a reply lost now aborts it, the snapshot stays paired
            extras = {**server.published_state.extras, **given}
            kind = lose(node.name, peer) if lose is not None else None
            if kind is not None:
                node.flow.failure(peer)
                node.rule.on_reply_lost(node.state, extras if kind == "rejected" else None)
                continue
            node.flow.success(peer)
            st = server.published_state
            arrays = [np.array(a, copy=True) for a in server.published]
            replies[node.name].append(PeerSnapshot(NodeState(peer, st.clock, st.loss, extras), arrays))
            if exchange and node.published_state is not None:
                mine = node.published_state
                replies[peer].append(
                    PeerSnapshot(
                        NodeState(node.name, mine.clock, mine.loss, dict(mine.extras)),
                        [np.array(a, copy=True) for a in node.published],
                        reference=server.published,
                    )
                )

    def _land_delayed(self, inboxes: dict[str, list[PeerSnapshot]]) -> None:
        """The delayed pushes due this round land in their targets' inboxes; one whose target sits this round
        out (no inbox) stays in flight one round more."""
        due = [m for m in self.in_flight if m[0] <= self.rounds]
        self.in_flight = [m for m in self.in_flight if m[0] > self.rounds]
        for _, target, message in due:
            if target in inboxes:
                inboxes[target].append(message)
            else:
                self.in_flight.append((self.rounds + 1, target, message))

    def _push(
        self,
        node: SimNode,
        targets: Sequence[str],
        live: set[str],
        inboxes: dict[str, list[PeerSnapshot]],
        lose: Callable[[str, str], LossKind | None] | None,
        delay: Callable[[str, str], int] | None = None,
    ) -> None:
        """Step 4 for a ``push`` rule: each target gets ``(x_published, share)`` in its inbox; a refused push
        (target down, or ``lose`` says so) comes back to the sender, named like it, as on the network."""
        if not targets or node.published_state is None:
            return
        shares = node.rule.push_shares(node.state, len(targets))
        st = node.published_state
        for peer, given in zip(targets, shares):
            arrays = [np.array(a, copy=True) for a in node.published]
            down = peer not in live
            if down or (lose is not None and lose(node.name, peer) is not None):
                if down:  # a refused push (busy) comes from a live peer: no flow-control penalty
                    node.flow.failure(peer)
                inboxes[node.name].append(PeerSnapshot(NodeState(node.name, st.clock, st.loss, dict(given)), arrays))
                continue
            node.flow.success(peer)
            extras = {**st.extras, **given}
            message = PeerSnapshot(NodeState(node.name, st.clock, st.loss, extras), arrays)
            late = int(delay(node.name, peer)) if delay is not None else 0
            if late > 0:
                self.in_flight.append((self.rounds + late, peer, message))
            else:
                inboxes[peer].append(message)

    def mass_in_flight(self, key: str = "w_given") -> float:
        """The push-sum mass of the delayed pushes not landed yet."""
        return float(sum(float(m.state.extras.get(key, 0.0)) for _, _, m in self.in_flight))
