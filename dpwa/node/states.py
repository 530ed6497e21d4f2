"""Every state the node's objects move through, as Enums, with their transitions and effects written once.

* :class:`FetchStatus` -- one target of a fetch job: ``pending`` until exactly one verdict.
* :class:`PushStatus` -- one push in the sender's ledger, from ``sending`` to its final verdict.
* :class:`SlotState` -- one slot of the receiver's inbox, from ``free`` back to ``free``.
* :class:`FlowEffect` and :func:`fetch_effect` / :data:`PUSH_FLOW_EFFECT` -- what each outcome does to flow control
  (the peer's score): the one table that says which outcomes penalise a peer.

The Enums are ``StrEnum``: a status compares equal to, prints as and serialises to its value (``"ok"``,
``"delivered"``), so metrics records and logs read the same words. :func:`moves` answers whether a transition is
allowed; the objects that hold a state call it before they change it and refuse a move the table does not list.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from dpwa.metrics import DECLINED_CODES

__all__ = [
    "DECLINED_CODES",
    "FETCH_MOVES",
    "PUSH_FLOW_EFFECT",
    "PUSH_MOVES",
    "SLOT_MOVES",
    "FetchStatus",
    "FlowEffect",
    "PushStatus",
    "SlotState",
    "fetch_effect",
    "moves",
]


class FetchStatus(enum.StrEnum):
    """One peer of one fetch job."""

    PENDING = "pending"
    """No verdict yet."""
    OK = "ok"
    """The reply came whole and valid before the deadline; it is in the target's buffer."""
    TIMEOUT = "timeout"
    """No whole reply before the deadline (or the TX thread gave no verdict by then: ``late``)."""
    REFUSED = "refused"
    """The peer answered ERROR with a code (``busy``, ``not-ready``, ``layout-mismatch`` ...)."""
    REJECTED = "rejected"
    """A reply came but failed validation (layout, sizes, order, finiteness); nothing of it was used."""


class PushStatus(enum.StrEnum):
    """One push, as the sender's ledger sees it."""

    SENDING = "sending"
    """Queued or on the wire; no answer yet and the deadline has not passed."""
    UNKNOWN = "unknown"
    """The deadline passed without an answer: the TX thread asks the receiver (SETTLE query) until it answers."""
    DELIVERED = "delivered"
    """The receiver answered ACK: what the push carried is the receiver's."""
    REFUSED = "refused"
    """The receiver answered ERROR (or never got it whole): what the push carried comes back to the sender."""
    LOST = "lost"
    """The receiver was forgotten from the member table with the push unresolved: nobody can answer for it."""
    DONE = "done"
    """An exchange's push (AD-PSGD) whose fetch job ended: its fate is the job's, no ledger keeps it."""


class SlotState(enum.StrEnum):
    """One slot of a receiver's inbox."""

    FREE = "free"
    RECEIVING = "receiving"
    """A push is arriving chunk by chunk."""
    FULL = "full"
    """A push arrived whole and was ACKed; it waits for the trainer's update_wait."""
    HELD = "held"
    """An exchange's push arrived whole; it waits for the sender's FETCH of this node's snapshot."""
    SERVED = "served"
    """An exchange's push whose pair (this node's snapshot) was served; it waits for the sender's SETTLE commit."""
    COMMITTED = "committed"
    """An exchange both sides hold: mixed at the next update_wait."""
    MIXING = "mixing"
    """The trainer's update_wait is reading it."""


def _moves(table: Mapping[enum.Enum, frozenset[enum.Enum]]) -> Mapping[enum.Enum, frozenset[enum.Enum]]:
    return MappingProxyType(dict(table))


_FETCH_FINAL = frozenset({FetchStatus.OK, FetchStatus.TIMEOUT, FetchStatus.REFUSED, FetchStatus.REJECTED})
FETCH_MOVES = _moves({FetchStatus.PENDING: _FETCH_FINAL, **{s: frozenset() for s in _FETCH_FINAL}})
"""A fetch target gets exactly one verdict."""

_ANSWERED = frozenset({PushStatus.DELIVERED, PushStatus.REFUSED})
PUSH_MOVES = _moves(
    {
        PushStatus.SENDING: _ANSWERED | {PushStatus.UNKNOWN, PushStatus.LOST, PushStatus.DONE},
        PushStatus.UNKNOWN: _ANSWERED | {PushStatus.LOST},
        PushStatus.DELIVERED: frozenset(),
        PushStatus.REFUSED: frozenset(),
        PushStatus.LOST: frozenset(),
        PushStatus.DONE: frozenset(),
    }
)
"""A push is answered once; one unanswered by its deadline becomes ``unknown`` until the receiver answers a query."""

_RELEASED = frozenset({SlotState.FREE})
SLOT_MOVES = _moves(
    {
        SlotState.FREE: frozenset({SlotState.RECEIVING}),
        SlotState.RECEIVING: frozenset({SlotState.FULL, SlotState.HELD}) | _RELEASED,
        SlotState.FULL: frozenset({SlotState.MIXING}) | _RELEASED,
        SlotState.HELD: frozenset({SlotState.SERVED}) | _RELEASED,
        SlotState.SERVED: frozenset({SlotState.COMMITTED}) | _RELEASED,
        SlotState.COMMITTED: frozenset({SlotState.MIXING}) | _RELEASED,
        SlotState.MIXING: _RELEASED,
    }
)
"""``free -> receiving -> full -> mixing -> free`` (a push); ``free -> receiving -> held -> served -> committed ->
mixing -> free`` (an exchange's push); any state but ``mixing`` may go back to ``free`` (refused, expired, aborted)."""


def moves(table: Mapping[enum.Enum, frozenset[enum.Enum]], old: enum.Enum, new: enum.Enum) -> bool:
    """Whether ``old -> new`` is a transition ``table`` allows."""
    return new in table[old]


class FlowEffect(enum.Enum):
    """What an outcome does to the peer's flow-control score."""

    SUCCESS = "success"
    """The peer is there and took part: its score recovers."""
    NONE = "none"
    """The peer is there but declined this time (an ERROR code of :data:`~dpwa.metrics.DECLINED_CODES`: starting,
    busy, left): no penalty, ask again next time."""
    FAILURE = "failure"
    """The peer did not answer in time or sent something invalid: its score drops, and a peer whose score falls
    below the threshold is marked down and suspected."""


_FETCH_FLOW_EFFECT: Mapping[FetchStatus, FlowEffect] = MappingProxyType(
    {
        FetchStatus.OK: FlowEffect.SUCCESS,
        FetchStatus.REFUSED: FlowEffect.FAILURE,  # unless its code is declined: see fetch_effect
        FetchStatus.TIMEOUT: FlowEffect.FAILURE,
        FetchStatus.REJECTED: FlowEffect.FAILURE,
    }
)

PUSH_FLOW_EFFECT: Mapping[PushStatus, FlowEffect] = MappingProxyType(
    {
        PushStatus.DELIVERED: FlowEffect.SUCCESS,
        PushStatus.REFUSED: FlowEffect.SUCCESS,  # any answer: the peer is there
        PushStatus.UNKNOWN: FlowEffect.FAILURE,  # no answer by the deadline
        PushStatus.LOST: FlowEffect.NONE,  # the peer is gone from the table: no score to keep
        PushStatus.DONE: FlowEffect.NONE,  # an exchange's push: its fetch's outcome counts
    }
)
"""What a push's verdict does to the receiver's score."""


def fetch_effect(status: FetchStatus | str, code: str = "") -> FlowEffect:
    """What a fetch's verdict does to the peer's score: a refusal with a :data:`DECLINED_CODES` code is no failure.

    ``status`` may be the member or its value (``"ok"``); ``pending`` has no effect yet (KeyError)."""
    if status == FetchStatus.REFUSED and code in DECLINED_CODES:
        return FlowEffect.NONE
    return _FETCH_FLOW_EFFECT[FetchStatus(status)]
