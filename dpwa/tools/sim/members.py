"""One simulated node: what the network path's node holds, on simulated time.

A :class:`Member` carries the objects a real node runs -- its :class:`~dpwa.rules.base.Rule`,
:class:`~dpwa.rules.schedules.Schedule`, :class:`~dpwa.node.peers.FlowControl` and
:class:`~dpwa.node.pushes.PushLedger` -- and is the ``host`` that :func:`dpwa.node.transfers.fetcher.round_peers`
chooses a round's peers for, as on the network. Its :class:`Phase` moves only along :data:`PHASE_MOVES`.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import threading
from typing import Any

import numpy as np

from dpwa.node.peers import FlowControl
from dpwa.node.pushes import Push, PushLedger
from dpwa.node.states import FETCH_MOVES, SLOT_MOVES, FetchStatus, FlowEffect, SlotState, fetch_effect, moves
from dpwa.rules.base import NodeState, PeerSnapshot, Rule
from dpwa.rules.schedules import Schedule

__all__ = ["PHASE_MOVES", "Fetch", "InboxEntry", "Member", "Phase"]


class Phase(enum.Enum):
    """Where a simulated node is in its loop."""

    IDLE = "idle"
    """Created, not started yet (a member that joins later)."""
    COMPUTING = "computing"
    """Between ``update_send`` and the end of its local step."""
    WAITING = "waiting"
    """In ``update_wait``: its step is done, it waits (bounded) for this round's transfers."""
    FINISHED = "finished"
    """Trained all its steps; still serves its last snapshot, as a node that lingers."""
    DOWN = "down"
    """Crashed: answers nothing until it restarts."""
    LEFT = "left"
    """Left cleanly; a member no more."""


PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.COMPUTING, Phase.DOWN, Phase.LEFT}),
    Phase.COMPUTING: frozenset({Phase.WAITING, Phase.DOWN, Phase.LEFT}),
    Phase.WAITING: frozenset({Phase.COMPUTING, Phase.FINISHED, Phase.DOWN, Phase.LEFT}),
    Phase.FINISHED: frozenset({Phase.DOWN, Phase.LEFT}),
    Phase.DOWN: frozenset({Phase.COMPUTING, Phase.FINISHED, Phase.LEFT}),
    Phase.LEFT: frozenset(),
}
"""The moves a phase may make; any other is a bug in the simulator (it raises)."""


@dataclasses.dataclass(eq=False)
class Fetch:
    """One peer fetched this round (a pull, or an exchange's request carrying the fetcher's snapshot)."""

    peer: str
    sent: float
    status: FetchStatus = FetchStatus.PENDING
    reply: PeerSnapshot | None = None
    code: str = ""
    arrived: float = 0.0
    held: InboxEntry | None = None
    """An exchange: the server's inbox entry holding this fetcher's snapshot until the commit."""
    settled: bool = False
    """An exchange: its one SETTLE (commit or abort) was sent."""

    def end(self, status: FetchStatus, code: str = "") -> FlowEffect:
        """The fetch's one verdict (the node's :data:`~dpwa.node.states.FETCH_MOVES`); what it does to the peer's
        flow-control score (:func:`~dpwa.node.states.fetch_effect`, the node's table)."""
        if not moves(FETCH_MOVES, self.status, status):
            raise RuntimeError(f"fetch of {self.peer}: no move from {self.status.value} to {status.value}")
        self.status, self.code = status, code
        return fetch_effect(status, code)


@dataclasses.dataclass(eq=False)
class InboxEntry:
    """A model this node did not ask for, in one slot of its inbox, whose :class:`~dpwa.node.states.SlotState`
    moves along the node's :data:`~dpwa.node.states.SLOT_MOVES`: a push ``receiving -> full``, an exchange's
    ``receiving -> held -> served -> committed``; ``mixing`` at ``update_wait``, then ``free`` (gone)."""

    sender: str
    message: PeerSnapshot
    round: int
    seq: int = 0
    """The push's sequence number (the inbox drains a sender's pushes in its order); 0 for an exchange's."""
    state: SlotState = SlotState.RECEIVING

    def move(self, *states: SlotState) -> InboxEntry:
        """Go through ``states`` in turn; RuntimeError for a move the node's table does not list."""
        for state in states:
            if not moves(SLOT_MOVES, self.state, state):
                raise RuntimeError(f"inbox slot of {self.sender}: no move from {self.state.value} to {state.value}")
            self.state = state
        return self

    @property
    def ready(self) -> bool:
        """Mixable at the next ``update_wait``: a push arrived whole, or an exchange both sides committed."""
        return self.state in (SlotState.FULL, SlotState.COMMITTED)


@dataclasses.dataclass(eq=False)
class Member:
    """A simulated node (module doc-string); ``names`` are the members it knows, itself included."""

    index: int
    name: str
    rule: Rule
    schedule: Schedule
    flow: FlowControl
    state: NodeState
    arrays: list[np.ndarray]
    rng: random.Random
    names: tuple[str, ...]
    phase: Phase = Phase.IDLE
    step: int = 0
    """``update_send`` calls so far (the round a schedule sees is the one before the increment)."""
    leaving: bool = False
    """Asked to leave: it does after its current step (:meth:`EventSimulation.leave`)."""
    redo: bool = False
    """Its latest crash undid a step it was computing: a restart trains that step again."""
    epoch: int = 0
    """Raised at a crash: events scheduled before it are ignored."""
    published: list[np.ndarray] | None = None
    published_state: NodeState | None = None
    gen: int = 0
    """Snapshots published; a fetcher that gets the same ``gen`` twice marks the reply a repeat."""
    paired_gen: int | None = None
    """The ``gen`` of the last snapshot paired with an exchange (one per snapshot: ``pairs_exchange``)."""
    ledger: PushLedger = dataclasses.field(default_factory=PushLedger)
    inbox: list[InboxEntry] = dataclasses.field(default_factory=list)
    fetches: list[Fetch] = dataclasses.field(default_factory=list)
    pushed: int = 0
    """Pushes the latest ``update_send`` started."""
    waiting_since: float = 0.0
    last_gen: dict[str, int] = dataclasses.field(default_factory=dict)
    owed: dict[str, int] = dataclasses.field(default_factory=dict)
    """This ``update_wait``'s in-neighbours still owing their push of a round (SGP's wait), decided once."""
    latest_round: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per sender, the latest round one of its pushes named (SGP's wait for the in-neighbours)."""
    accepted: set[int] = dataclasses.field(default_factory=set)
    """Sequence numbers of the pushes this node took (a SETTLE query about one is answered delivered)."""
    closed: set[int] = dataclasses.field(default_factory=set)
    """Sequence numbers of pushes a query closed before they arrived (answered refused: dropped if they come)."""
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_recorded: int = 0
    state_lock: Any = dataclasses.field(default_factory=threading.Lock)
    flow_lock: Any = dataclasses.field(default_factory=threading.Lock)

    def move(self, phase: Phase) -> None:
        """Go to ``phase``; RuntimeError for a move :data:`PHASE_MOVES` does not list."""
        if phase is not self.phase and phase not in PHASE_MOVES[self.phase]:
            raise RuntimeError(f"{self.name}: no move from {self.phase.value} to {phase.value}")
        self.phase = phase

    @property
    def closing(self) -> bool:
        """No heir for a leaving member's hand-off: finished and lingering, or leaving."""
        return self.phase is Phase.FINISHED or self.leaving

    @property
    def inbox_open(self) -> bool:
        """Takes pushes and exchanges (else refused ``busy``): not finished, and -- leaving -- only during its last
        step, as a node closes its inbox when it closes, after that step's ``update_wait`` (the hand-off then waits
        for the exchanges it served to be committed and folds what came)."""
        if self.phase is Phase.FINISHED:
            return False
        return not self.leaving or self.phase in (Phase.COMPUTING, Phase.WAITING)

    @property
    def alive(self) -> bool:
        """Answers requests: started, not crashed, not gone."""
        return self.phase in (Phase.COMPUTING, Phase.WAITING, Phase.FINISHED)

    def count(self, key: str, n: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + n

    def push_of(self, push: Push) -> PeerSnapshot:
        """A refused push coming back: a peer named like this node carrying what it gave (as the node folds it)."""
        clock, loss, arrays = push.snapshot
        return PeerSnapshot(NodeState(self.name, clock, loss, dict(push.given)), arrays)  # read-only, shared
