"""Churn on simulated time: what a crash, a restart, a clean leave and a join do to the cluster
(:class:`ChurnActions`, the part of :class:`~dpwa.tools.sim.engine.EventSimulation` that changes its members;
the options are :mod:`dpwa.tools.sim.churn`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpwa.node.states import PushStatus, SlotState
from dpwa.rules.base import NodeState, PeerSnapshot
from dpwa.tools.sim.links import HEADER_BYTES
from dpwa.tools.sim.members import InboxEntry, Member, Phase

if TYPE_CHECKING:
    from dpwa.tools.sim.links import Network

__all__ = ["ChurnActions"]


class ChurnActions:
    """Crash, restart, leave and join for the event simulation that inherits them (it provides the members, the
    clock, the network and the message helpers)."""

    members: dict[str, Member]
    names: tuple[str, ...]
    admitted: int
    now: float
    steps: int
    network: Network
    settings: Any

    if TYPE_CHECKING:

        def at(self, time: float, action: Any, *args: Any) -> None: ...
        def _send(self, m: Member, epoch: int) -> None: ...
        def _drain(self, m: Member, everything: bool = False) -> list[PeerSnapshot]: ...
        def _fold_finished(self, m: Member) -> None: ...
        def _add(self, name: str, params: list[np.ndarray]) -> Member: ...
        def _publish(self, m: Member) -> None: ...
        def _cut_short(self, m: Member) -> None: ...
        def snapshot_bytes(self, arrays: Any) -> int: ...

    def crash(self, name: str) -> None:
        """``name`` stops at once: it answers nothing; its inbox is lost, and the verdicts of its pushes (which still
        land). A step still computing is lost (trained again after a restart); one that waited for its exchange had
        its local update applied: its ``update_wait`` ends with nothing arrived (:meth:`_cut_short`), and the step
        counts (its batch is never trained twice)."""
        m = self.members[name]
        if not m.alive and m.phase is not Phase.IDLE:
            return
        m.redo = m.phase is Phase.COMPUTING
        if m.redo:  # the step under way is lost: redone
            m.step -= 1
            m.state.clock -= 1
            m.rule.follow(m.step)  # a rule that counted the step's publish (a group's) counts it again
        elif m.phase is Phase.WAITING:
            self._cut_short(m)
        m.move(Phase.DOWN)
        m.epoch += 1
        m.inbox.clear()
        for push in m.ledger.unresolved():
            m.ledger.abandon(push.peer)
        m.ledger.collect()
        m.published = m.published_state = None
        m.fetches = []

    def restart(self, name: str) -> None:
        """``name`` comes back with the parameters and rule state it had at the crash (a step it was computing not
        counted: it trains it again), and trains on."""
        m = self.members[name]
        if m.phase is Phase.DOWN and (m.step >= self.steps or (m.leaving and not m.redo)):
            m.move(Phase.FINISHED)  # its steps trained, or its current step when told to leave: it lingers again,
            self._publish(m)  # serving its model (a publish, not a step: a rule that counts them counts it back)
            m.rule.follow(m.step)
            if m.leaving:  # told to leave before it crashed: it leaves now
                self._hand_off(m, self.now)
        elif m.phase is Phase.DOWN:
            self.at(self.now, self._send, m, m.epoch)

    def leave(self, name: str) -> None:
        """``name`` leaves cleanly, between two steps: it settles its pushes (at most two timeouts), folds in what
        arrived, hands what its rule holds (``rule.hand_off``; push-sum: its whole weight) to one member in a last
        push, and every member forgets it. From then on it refuses requests and pushes (``left``)."""
        m = self.members[name]
        if m.phase is Phase.LEFT or m.leaving:
            return
        m.leaving = True
        if m.phase not in (Phase.COMPUTING, Phase.WAITING):  # else: after this step's update_wait
            self._hand_off(m, self.now)

    def _hand_off(self, m: Member, since: float, epoch: int | None = None) -> None:
        """``m`` leaves: once its pushes are settled and the exchanges it served committed or aborted (at most two
        timeouts), it folds in what arrived and hands its rule's share to a member. ``epoch``: a retry scheduled
        then, dropped if ``m`` crashed since (a restart hands off anew)."""
        if epoch is not None and epoch != m.epoch:
            return
        served = any(e.state is SlotState.SERVED for e in m.inbox)
        if m.alive and (m.ledger.unresolved() or served) and self.now < since + 2 * self.settings.timeout_s:
            self.at(self.now + self.settings.timeout_s, self._hand_off, m, since, m.epoch)
            return
        given = None
        if m.alive:
            back = [m.push_of(p) for p in m.ledger.collect() if p.status is PushStatus.REFUSED]
            peers = self._drain(m, everything=True) + back
            if peers:
                m.rule.mix(m.state, m.arrays, peers)
            given = m.rule.hand_off(m.state)
        heir = [p for p in m.flow.up_peers() if self.members[p].alive and not self.members[p].closing]
        m.rng.shuffle(heir)  # an up member that still trains, as the node tries them (one, here: it is known alive)
        if heir and given is not None:
            extras = {**m.state.extras, **given}
            message = PeerSnapshot(
                NodeState(m.name, m.state.clock, m.state.loss, extras), [np.array(a) for a in m.arrays]
            )
            # no round: taken at the heir's next step, whatever round that is (a real hand-off names none)
            self._deliver(m, self.members[heir[0]], InboxEntry(m.name, message, -1).move(SlotState.FULL))
        m.move(Phase.LEFT)
        self.names = tuple(n for n in self.names if n != m.name)
        for other in self.members.values():
            if other is not m and other.phase is not Phase.LEFT:
                other.flow.remove(m.name)
                self._members_changed(other)

    def _deliver(self, m: Member, target: Member, entry: InboxEntry) -> None:
        """The hand-off push, sent again every ``timeout_s`` until it lands (the ledger would ask until it knows)."""
        arrival = self.network.send(
            m.index, target.index, HEADER_BYTES + self.snapshot_bytes(entry.message.arrays), self.now
        )
        if arrival is not None:
            self.at(arrival, self._handed, target, entry)
        else:
            self.at(self.now + self.settings.timeout_s, self._deliver, m, target, entry)

    def _handed(self, target: Member, entry: InboxEntry) -> None:
        if target.alive:  # one that crashed meanwhile loses it, as any push-sum loses a dead member's mass
            target.inbox.append(entry)
            if target.phase is Phase.FINISHED:  # it trains no more: folded at once, as its close would
                self._fold_finished(target)

    def join(self, name: str, params: list[np.ndarray]) -> Member:
        """A new member ``name`` with ``params`` (the caller copies a live node's: a bootstrap) starts training now;
        every member adds it."""
        if name in self.members:
            raise ValueError(f"{name} is a member already")
        self.names = (*self.names, name)
        self.admitted += 1
        member = self._add(name, params)
        for other in self.members.values():
            if other.phase is not Phase.LEFT:
                if other is not member:
                    other.flow.add(name)
                self._members_changed(other)
        self.at(self.now, self._send, member, member.epoch)
        return member

    def _members_changed(self, m: Member) -> None:
        m.names = self.names
        m.rule.on_members(m.name, self.names, float(self.admitted))
