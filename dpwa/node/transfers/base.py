"""The interface every transfer pattern implements, and what it needs of its node.

A rule's :attr:`~dpwa.rules.Rule.transfer` says how its models travel (pull, push, exchange); the node holds one
:class:`TransferPattern` for it (:func:`dpwa.node.transfers.make_transfer` picks it) and calls it at fixed
points of the step, never asking which pattern it is:

* set-up, trainer thread, at the first publish: :meth:`~TransferPattern.held_snapshots` (sizing the snapshot
  pool), :meth:`~TransferPattern.allocate` (receive buffers, inbox slots);
* ``update_send``, right after the publish: :meth:`~TransferPattern.start` (a fetch, or pushes);
* ``update_wait``: :meth:`~TransferPattern.wait_sources` (a synchronous push rule's in-neighbours), then
  :meth:`~TransferPattern.wait` (the bounded wait for this step's verdicts), then, once the node has checked its
  threads, :meth:`~TransferPattern.collect` (what arrived, as peers for the rule), and after the mix
  :meth:`~TransferPattern.fields` (this pattern's fields of the exchange record);
* ``bootstrap``: :meth:`~TransferPattern.fetch_one`;
* the TX thread: :meth:`~TransferPattern.fetch_done`, :meth:`~TransferPattern.push_settled`,
  :meth:`~TransferPattern.push_unanswered` (verdicts);
* the RX thread: :meth:`~TransferPattern.pair_exchange` (a FETCH that completes an exchange),
  :meth:`~TransferPattern.settle_with_leaver` (a leaving member said which of this node's pushes it took);
* membership changes, any thread: :meth:`~TransferPattern.set_senders`, :meth:`~TransferPattern.forget`;
* leaving, trainer thread: :meth:`~TransferPattern.linger_starts`, :meth:`~TransferPattern.verdict_for` (what
  the leave announcement says of each member's pushes), :meth:`~TransferPattern.hand_off`;
* ``stats()``, any thread: :meth:`~TransferPattern.stats`.

The defaults are those of a pattern without an inbox or pushes of its own; every pattern fetches through its
:class:`~dpwa.node.transfers.fetcher.Fetcher` (at least :meth:`~TransferPattern.fetch_one`, for a bootstrap).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dpwa.metrics import fetch_reason
from dpwa.node.inbox import PushReceiver
from dpwa.node.pushes import Push
from dpwa.node.snapshots import Snapshot
from dpwa.node.states import FetchStatus, PushStatus
from dpwa.node.transfers.fetcher import Fetcher
from dpwa.node.transfers.host import Host
from dpwa.node.transport import FetchJob, FetchTarget
from dpwa.node.wire import ErrorCode, Layout
from dpwa.rules import PeerSnapshot
from dpwa.rules.base import Transfer

__all__ = ["Arrival", "Refusal", "TransferPattern"]

Refusal = tuple[ErrorCode, str]
"""An ERROR code and its detail: why the RX thread refuses a request."""


def _nothing() -> None:
    return None


@dataclass
class Arrival:
    """What one ``update_wait`` found, for the rule: the fetch job's targets with their verdicts and the peers
    made of them, what the inbox received, and the refused pushes that came back (each named like the node)."""

    targets: Sequence[FetchTarget] = ()
    fetched: list[PeerSnapshot] = field(default_factory=list)
    received: list[PeerSnapshot] = field(default_factory=list)
    returned: list[PeerSnapshot] = field(default_factory=list)
    release: Callable[[], None] = _nothing
    """Give back what the peers' arrays live in (inbox slots, returned snapshots) once the rule is done."""

    @property
    def peers(self) -> list[PeerSnapshot]:
        """The rule's peers, in order: fetched, received, returned."""
        return [*self.fetched, *self.received, *self.returned]

    def summary(self) -> dict[str, Any]:
        """The exchange record's fields of what arrived: ``peer``, ``status``, ``reasons``, ``bytes``, ``fetch_ms``."""
        targets = self.targets
        names = [t.peer for t in targets] + [m.state.name for m in self.received]
        statuses = [str(t.status) for t in targets] + ["pushed"] * len(self.received)
        return {
            "peer": ",".join(names) or None,
            "status": ",".join(statuses) or None,
            "reasons": [
                fetch_reason(t.status, t.code, t.late) or str(t.status) for t in targets if t.status != FetchStatus.OK
            ],
            "bytes": sum(t.nbytes for t in targets),
            "fetch_ms": max((t.ms for t in targets), default=0.0),
        }


class TransferPattern(ABC):
    """How one rule's models travel; see the module doc-string for who calls what, and when."""

    kind: ClassVar[Transfer]
    """The rule's transfer this pattern implements."""
    inbox: PushReceiver | None = None
    """Where the RX thread puts the pushes that come; None: it answers them ``unsupported``."""

    def __init__(self, host: Host, fetcher: Fetcher) -> None:
        self.host = host
        self.fetcher = fetcher

    # ------------------------------------------------------------ set-up (trainer thread)

    def held_snapshots(self) -> int:
        """How many snapshots this pattern may keep leased besides the pool's own (pushes, exchanges)."""
        return 0

    def receive_buffers(self) -> int:
        """How many peers one fetch of this pattern may ask (one receive buffer each); at least 1, to bootstrap."""
        return 1

    def unpair(self, snapshot: Snapshot) -> None:  # noqa: B027 - optional step
        """Before a one-buffer pool rewrites ``snapshot`` (any thread that publishes): let go of it."""

    def allocate(self, layout: Layout) -> None:
        """The first publish: allocate the buffers replies (and pushes) land in: at least one, none for a node
        whose schedule never has it fetch (AD-PSGD's passive nodes; a bootstrap allocates its one then)."""
        host = self.host
        fetches = host.schedule.fetches(host.name, host.names)
        self.fetcher.allocate(layout, max(1, self.receive_buffers()) if fetches else 0)

    # ------------------------------------------------------------ the step (trainer thread)

    @abstractmethod
    def start(self, snapshot: Snapshot | None) -> None:
        """``update_send``, right after ``snapshot`` was published (None: every buffer was busy): start this
        round's fetch or pushes, or count why none starts."""

    def wait_sources(self, upto: int | None) -> None:  # noqa: B027 - optional step
        """``update_wait``, before its clock starts: wait for the pushes this round is owed (``upto``: the round
        just started; None: no round)."""

    def wait(self) -> None:
        """``update_wait``: wait, bounded, for this step's fetch verdicts (a late target is timed out here)."""
        self.fetcher.wait()

    @abstractmethod
    def collect(self, upto: int | None) -> Arrival:
        """``update_wait``, after :meth:`wait`: what arrived, for the rule (``upto``: the round just pushed;
        a push of a later round may wait for its own; None: take everything). The caller calls
        :attr:`Arrival.release` once the rule is done with the peers' arrays."""

    def fields(self, arrival: Arrival) -> dict[str, Any]:
        """The exchange record's fields of this pattern, after the mix of ``arrival`` (in their record order)."""
        return {}

    def in_flight(self) -> bool:
        """True while a fetch this pattern started has no verdict on every target (any thread)."""
        return self.fetcher.in_flight()

    def fetch_one(self, peer: str, deadline: float) -> PeerSnapshot | None:
        """Bootstrap: fetch ``peer``'s snapshot (see :meth:`Fetcher.fetch_one`)."""
        return self.fetcher.fetch_one(peer, deadline)

    # ------------------------------------------------------------ TX thread

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None:
        """``target`` of ``job`` has its verdict (the TX thread; the trainer's for a target it timed out)."""
        self.fetcher.fetch_done(job, target)

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None:  # noqa: B027 - no pushes
        """``push`` was answered ``delivered`` or ``refused`` (``code``: the ERROR's)."""

    def push_unanswered(self, push: Push) -> None:  # noqa: B027 - no pushes
        """``push`` had no answer by its deadline, or a SETTLE query about it went unanswered."""

    # ------------------------------------------------------------ RX thread

    def pair_exchange(self, sender: str, seq: int, snapshot: Snapshot) -> Refusal | None:
        """A FETCH that completes ``sender``'s exchange ``seq`` is about to be served ``snapshot`` (leased by the
        caller, who releases its own lease whatever this answers): keep it as the pair of the exchange's push
        (None), or say why the request is refused."""
        return ErrorCode.UNSUPPORTED, "no exchanges here"

    # ------------------------------------------------------------ membership

    def set_senders(self, names: Sequence[str]) -> None:  # noqa: B027 - no inbox
        """The members now (any thread, under the node's sync lock): pushes are taken from them only."""

    def forget(self, peer: str) -> None:
        """``peer`` was forgotten (the node holds its sync lock): drop what is kept of it."""
        self.fetcher.forget(peer)

    def member_back(self, peer: str) -> None:  # noqa: B027 - nothing kept per incarnation
        """``peer`` went (left, or dropped from the peers) and is a peer again (the node holds its sync lock): what
        was open with its former incarnation will never be answered (the TX thread stopped asking)."""

    def settle_with_leaver(self, peer: str, last: int, verdict: bool | None) -> None:  # noqa: B027 - no pushes
        """``peer`` left, and says the latest push of this node it saw was ``last``, taken (True) or not."""

    def verdict_for(self, peer: str) -> tuple[int, bool | None] | None:
        """Leaving: ``peer``'s latest push here and whether it was taken (None: this pattern takes no pushes)."""
        return None

    # ------------------------------------------------------------ leaving (trainer thread)

    def linger_starts(self) -> None:  # noqa: B027 - nothing to refuse
        """The node trains no more and only serves, for a while, before it closes."""

    def hand_off(self, deadline: float, *, final_mix: bool) -> None:  # noqa: B027 - nothing to hand
        """The node leaves cleanly: hand what the rule holds to a member, by ``deadline``; ``final_mix`` False
        puts the trainer's arrays back as they were before the hand-off's last folds."""

    def closed(self) -> None:
        """The node's threads stopped: unmap what this pattern still maps of its peers' memory."""
        self.fetcher.closed()

    # ------------------------------------------------------------ any thread

    def stats(self) -> dict[str, Any]:
        """This pattern's entries of the node's ``stats()`` (in their order)."""
        return {}
