"""An event-driven simulation of an asynchronous dpwa cluster: every node's loop on simulated time.

Each node does what a trainer with a dpwa connection does, through the same objects: ``update_send`` (``clock +=
1``, publish a copy of ``rule.public_arrays``, ``rule.on_publish``, pick the round's peers with
:func:`~dpwa.node.transfers.fetcher.round_peers` -- the schedule, or flow control -- and start the rule's
transfer), its local step (``step_times``), then ``update_wait``: wait for the round's fetches (each one ends by
its reply, a refusal, or the deadline ``timeout_s`` after it was sent), for all but ``rule.overlap`` of its
pushes' verdicts, and on a fixed push schedule for the in-neighbours' pushes of the round (at most ``timeout_s``);
then ``rule.mix`` on what arrived, and straight on to the next ``update_send``.

Messages travel on a :class:`~dpwa.tools.sim.links.Network`: a request and a refusal or an ACK are a header
(:data:`HEADER_BYTES`), a reply or a push a header plus the snapshot. A server answers with the snapshot it
published last (``rule.on_request``, ``rule.on_serve`` at the moment the request lands). A push lands in the
receiver's inbox unless it holds ``inbox_slots`` models, or ``inbox_per_sender`` from that sender (then it is
refused ``busy`` and comes back to its sender, mass and all); the sender's :class:`~dpwa.node.pushes.PushLedger`
settles it, and a push with no answer by its deadline is settled by a query one round trip later, as the TX thread
does. An exchange (AD-PSGD) holds the fetcher's snapshot in the server's inbox until the fetcher's commit lands
(it sends it when the reply arrives in time; an abort when it does not). Flow control sees every outcome on
simulated time. Deterministic: one seed, one result, bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpwa.node.inbox import HOLD_TIMEOUTS
from dpwa.node.peers import FlowControl
from dpwa.node.pushes import Push
from dpwa.node.states import PUSH_FLOW_EFFECT, FetchStatus, PushStatus, SlotState
from dpwa.node.transfers.exchange import pairs_exchange
from dpwa.node.transfers.fetcher import round_peers
from dpwa.node.transfers.push import in_step, source_window
from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, Transfer
from dpwa.rules.schedules import Round, Schedule
from dpwa.tools.sim.links import HEADER_BYTES, Network
from dpwa.tools.sim.members import Fetch, InboxEntry, Member, Phase
from dpwa.tools.sim.membership import ChurnActions

__all__ = ["HEADER_BYTES", "ClusterSettings", "EventSimulation", "StepRecord"]


@dataclass(frozen=True)
class ClusterSettings:
    """The cluster file's settings the simulation acts on."""

    timeout_s: float = 2.5
    fetch_probability: float = 1.0
    inbox_slots: int = 4
    inbox_per_sender: int = 2
    wire_itemsize: int = 0
    """Bytes per element on the wire (``wire_dtype``); 0: each array's own."""


@dataclass(frozen=True)
class StepRecord:
    """One ``update_wait``: what the node's metrics line says of it."""

    member: Member
    time: float
    wait_s: float
    outcome: MixOutcome
    peers: tuple[str, ...]
    status: str
    pushes: dict[str, float]
    """Push rules: ``pushed`` (this step), ``delivered`` and ``returned`` (verdicts since the last step), ``push_ms``
    (the slowest delivered one, send to ACK); empty for the others."""


Train = Callable[[Sequence[Member]], Sequence[float]]
"""The local steps of members whose steps end at one simulated time (their ``arrays`` in place, in one batch where
the model allows it; each member's step depends on its own arrays and data stream alone); their batches' losses."""


class EventSimulation(ChurnActions):
    """The cluster (module doc-string). ``arrays[i]``: node ``i``'s parameters (used in place); ``rule()`` and
    ``schedule()`` make one of each per node; ``step_time(member)``: its next step's seconds; ``train``: its local
    step; ``on_step``: called after every ``update_wait``; a node stops after ``steps`` steps."""

    def __init__(
        self,
        names: Sequence[str],
        arrays: Sequence[list[np.ndarray]],
        rule: Callable[[], Rule],
        schedule: Callable[[], Schedule],
        *,
        network: Network,
        step_time: Callable[[Member], float],
        train: Train,
        steps: int,
        settings: ClusterSettings = ClusterSettings(),
        seed: int = 0,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.now = 0.0
        self.network = network
        self.settings = settings
        self.steps = int(steps)
        self.seed = seed
        self._rule, self._schedule = rule, schedule
        self._step_time, self._train, self._on_step = step_time, train, on_step
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._seq = itertools.count(1)
        self.members: dict[str, Member] = {}
        self.names: tuple[str, ...] = tuple(names)
        self.admitted = len(self.names)
        """Members ever admitted: push-sum's bound on the cluster's mass (one unit each)."""
        for name, params in zip(names, arrays):
            self._add(name, params)

    # ------------------------------------------------------------ the loop

    def at(self, time: float, action: Callable[..., None], *args: Any) -> None:
        """Run ``action(*args)`` at simulated ``time`` (events at one time run in the order they were planned)."""
        heapq.heappush(self._queue, (time, next(self._order), action, args))

    def start(self, offsets: Sequence[float] = ()) -> None:
        """Every member calls its first ``update_send``: member ``i`` at ``offsets[i]`` seconds (0 if none given)."""
        for i, member in enumerate(list(self.members.values())):
            if member.phase is Phase.IDLE:
                self.at(float(offsets[i]) if i < len(offsets) else 0.0, self._send, member, member.epoch)

    def run(self, until: float = float("inf")) -> bool:
        """Process events up to simulated time ``until``; True when none is left (every node finished)."""
        queue = self._queue
        while queue:
            if queue[0][0] > until:
                return False
            time, _, action, args = heapq.heappop(queue)
            self.now = time
            if action == self._computed:  # the steps that end now, trained in one batch, then mixed in order
                batch = [args]
                while queue and queue[0][0] == time and queue[0][2] == self._computed:
                    batch.append(heapq.heappop(queue)[3])
                self._computed_batch(batch)
            else:
                action(*args)
        return True

    def rounds_done(self) -> int:
        """The least step among the members still training (``steps`` once all are done)."""
        live = [m.step for m in self.members.values() if m.phase in (Phase.COMPUTING, Phase.WAITING)]
        return min(live) if live else self.steps

    # ------------------------------------------------------------ members

    def _add(self, name: str, params: list[np.ndarray]) -> Member:
        index = len(self.members)
        rule = self._rule()
        rng = random.Random(self.seed * 7919 + index)
        peers = [n for n in self.names if n != name]
        member = Member(
            index=index,
            name=name,
            rule=rule,
            schedule=self._schedule(),
            flow=FlowControl(peers, rng, now=lambda: self.now),
            state=NodeState(name, extras=rule.initial_extras(name, self.names)),
            arrays=params,
            rng=rng,
            names=self.names,
        )
        self.members[name] = member
        self.network.grow(index + 1)
        return member

    def live(self) -> list[Member]:
        """The members that answer (training, or finished and lingering)."""
        return [m for m in self.members.values() if m.alive]

    # ------------------------------------------------------------ update_send

    def _send(self, m: Member, epoch: int) -> None:
        if epoch != m.epoch or m.phase not in (Phase.IDLE, Phase.WAITING, Phase.DOWN):
            return
        m.move(Phase.COMPUTING)
        m.state.clock += 1
        self._publish(m)
        m.fetches, m.pushed = [], 0
        if m.rng.random() < self.settings.fetch_probability:
            chosen, _ = round_peers(m)
            if m.rule.transfer is Transfer.PUSH:
                self._push(m, chosen)
            else:
                self._fetch(m, chosen)
        m.step += 1
        self.at(self.now + self._step_time(m), self._computed, m, m.epoch)
        if m.fetches:
            self.at(self.now + self.settings.timeout_s, self._fetch_deadline, m, m.step, m.epoch)

    def _publish(self, m: Member) -> None:
        """``m``'s snapshot of its arrays now: what it serves and pushes until the next one."""
        public = m.rule.public_arrays(m.arrays)
        m.published = [np.array(a, copy=True) for a in public]
        for a in m.published:  # read-only: every reply, push and exchange of this snapshot shares these arrays (a rule
            a.flags.writeable = False  # uses scratch for read-only peers), as the node lends one snapshot to all
        m.published_state = NodeState(m.name, m.state.clock, m.state.loss, dict(m.state.extras))
        m.gen += 1
        m.rule.on_publish(m.state, m.published)

    def _cut_short(self, m: Member) -> None:
        """``m`` crashes while it waits for its step's exchange: its ``update_wait`` ends at once with nothing
        arrived -- the rule finishes the step (push-sum scales the local step, an outer optimizer counts it) and the
        step is recorded (status ``crashed``) -- and the node stops (the caller's part)."""
        outcome = m.rule.mix(m.state, m.arrays, [])
        self._record(m, outcome, (), "crashed", self._push_counts(m))

    @staticmethod
    def _push_counts(m: Member) -> dict[str, float]:
        """A step's push figures before its verdicts are counted: ``pushed`` this step, none delivered or returned."""
        return {"pushed": float(m.pushed), "delivered": 0.0, "returned": 0.0, "push_ms": 0.0}

    def _record(
        self, m: Member, outcome: MixOutcome, peers: tuple[str, ...], status: str, pushes: dict[str, float]
    ) -> None:
        """``m``'s ``update_wait`` ended now: its metrics line (``pushes`` kept for a push rule only)."""
        if self._on_step is not None:
            push = pushes if m.rule.transfer is Transfer.PUSH else {}
            self._on_step(StepRecord(m, self.now, self.now - m.waiting_since, outcome, peers, status, push))

    def snapshot_bytes(self, arrays: Sequence[np.ndarray]) -> int:
        """Bytes of ``arrays`` on the wire (the wire dtype's itemsize for floating arrays, when one is set)."""
        size = self.settings.wire_itemsize
        return sum(a.size * (min(size, a.itemsize) if size and a.dtype.kind == "f" else a.itemsize) for a in arrays)

    def _fetch(self, m: Member, chosen: Sequence[str]) -> None:
        exchange = m.rule.transfer is Transfer.EXCHANGE
        extras = m.rule.request_extras(m.state)
        size = HEADER_BYTES + (self.snapshot_bytes(m.published or []) if exchange else 0)
        for peer in chosen:
            fetch = Fetch(peer, self.now)
            m.fetches.append(fetch)
            server = self.members[peer]
            arrival = self.network.send(m.index, server.index, size, self.now)
            if arrival is not None:
                self.at(arrival, self._request, server, m, fetch, extras, m.epoch)

    def _push(self, m: Member, chosen: Sequence[str]) -> None:
        ready = [p for p in chosen if not m.ledger.busy(p)]
        if not ready or m.published_state is None or m.published is None:
            m.count("pushes_skipped")
            return
        shares = m.rule.push_shares(m.state, len(ready))
        m.pushed = len(ready)
        st = m.published_state
        size = HEADER_BYTES + self.snapshot_bytes(m.published)
        for peer, given in zip(ready, shares):
            push = Push(peer, next(self._seq), {**given, "round": m.step}, (st.clock, st.loss, m.published),
                        self.now + self.settings.timeout_s, started=self.now)  # fmt: skip
            m.ledger.open(push)
            message = PeerSnapshot(NodeState(m.name, st.clock, st.loss, {**st.extras, **push.given}), m.published)
            target = self.members[peer]
            arrival = self.network.send(m.index, target.index, size, self.now)
            if arrival is not None:
                self.at(arrival, self._push_lands, target, m, push, message, m.epoch)
            self.at(push.deadline, self._push_deadline, m, push, m.epoch)

    # ------------------------------------------------------------ the server's side

    def _answer(self, server: Member, m: Member, action: Callable[..., None], *args: Any) -> None:
        """A header-only message from ``server`` to ``m`` that runs ``action(*args)`` when it lands."""
        arrival = self.network.send(server.index, m.index, HEADER_BYTES, self.now)
        if arrival is not None:
            self.at(arrival, action, *args)

    def _request(self, s: Member, m: Member, fetch: Fetch, extras: dict[str, Any], epoch: int) -> None:
        if s.phase is Phase.LEFT:
            self._answer(s, m, self._refused, m, fetch, "left", epoch)
            return
        if not s.alive:
            return  # no answer: the fetcher times out
        if s.published is None or s.published_state is None:
            self._answer(s, m, self._refused, m, fetch, "not-ready", epoch)
            return
        exchange = m.rule.transfer is Transfer.EXCHANGE
        if exchange and (not s.inbox_open or not self._admits(s, m.name)):
            self._answer(s, m, self._refused, m, fetch, "busy", epoch)
            return
        if exchange and not pairs_exchange(s.gen, s.paired_gen):  # one exchange per published snapshot
            s.count("exchanges_declined")
            self._answer(s, m, self._refused, m, fetch, "busy", epoch)
            return
        if extras:
            s.rule.on_request(s.state, extras)
        given = s.rule.on_serve(s.state)
        st = s.published_state
        reply = PeerSnapshot(NodeState(s.name, st.clock, st.loss, {**st.extras, **given}), s.published)
        if exchange and m.published is not None and m.published_state is not None:
            mine = m.published_state
            message = PeerSnapshot(NodeState(m.name, mine.clock, mine.loss, dict(mine.extras)), m.published,
                                   reference=s.published)  # fmt: skip
            fetch.held = InboxEntry(m.name, message, m.step).move(SlotState.HELD, SlotState.SERVED)
            s.paired_gen = s.gen
            s.inbox.append(fetch.held)
            self.at(self.now + HOLD_TIMEOUTS * self.settings.timeout_s, self._aborted, s, fetch.held, s.epoch)
        arrival = self.network.send(s.index, m.index, HEADER_BYTES + self.snapshot_bytes(s.published), self.now)
        if arrival is not None:
            self.at(arrival, self._replied, m, fetch, reply, s.gen, epoch)

    def _admits(self, s: Member, sender: str) -> bool:
        """Whether ``s``'s inbox has room for one more model from ``sender``."""
        mine = sum(1 for e in s.inbox if e.sender == sender)
        return len(s.inbox) < self.settings.inbox_slots and mine < self.settings.inbox_per_sender

    def _push_lands(self, s: Member, m: Member, push: Push, message: PeerSnapshot, epoch: int) -> None:
        if s.phase is Phase.LEFT:
            self._answer(s, m, self._verdict, m, push, PushStatus.REFUSED, "left", epoch)
            return
        if not s.alive or push.seq in s.closed:
            return  # no answer (the sender settles it by a query), or a push its query already closed: stale
        s.latest_round[m.name] = max(s.latest_round.get(m.name, -1), int(push.given["round"]))
        if not s.inbox_open or not self._admits(s, m.name):
            self._answer(s, m, self._verdict, m, push, PushStatus.REFUSED, "busy", epoch)
        else:
            s.inbox.append(InboxEntry(m.name, message, int(push.given["round"]), push.seq).move(SlotState.FULL))
            s.accepted.add(push.seq)
            self._answer(s, m, self._verdict, m, push, PushStatus.DELIVERED, "", epoch)
        self._try_mix(s)  # a node waiting for its in-neighbours' pushes

    def _settle_exchange(self, m: Member, s: Member, entry: InboxEntry, commit: bool) -> None:
        """The fetcher's word on an exchange (a SETTLE: commit, or abort), sent again every ``timeout_s`` until one
        lands, as the TX thread asks until it has an answer; a server that crashed meanwhile lost the exchange."""
        arrival = self.network.send(m.index, s.index, HEADER_BYTES, self.now)
        if arrival is not None:
            self.at(arrival, self._committed if commit else self._aborted, s, entry, s.epoch)
        elif s.alive:
            self.at(self.now + self.settings.timeout_s, self._settle_exchange, m, s, entry, commit)

    def _committed(self, s: Member, entry: InboxEntry, epoch: int) -> None:
        if epoch == s.epoch and entry in s.inbox and entry.state is SlotState.SERVED:
            entry.move(SlotState.COMMITTED)

    def _aborted(self, s: Member, entry: InboxEntry, epoch: int) -> None:
        if epoch == s.epoch and entry in s.inbox and entry.state is SlotState.SERVED:
            s.inbox.remove(entry.move(SlotState.FREE))
            s.count("exchanges_aborted")

    # ------------------------------------------------------------ the fetcher's side

    def _replied(self, m: Member, fetch: Fetch, reply: PeerSnapshot, gen: int, epoch: int) -> None:
        server = self.members[fetch.peer]
        if epoch == m.epoch and fetch.status is FetchStatus.TIMEOUT and fetch.held is not None and not fetch.settled:
            fetch.settled = True  # its request landed after the deadline: the late reply's verdict is an abort,
            self._settle_exchange(m, server, fetch.held, commit=False)  # as the TX thread's, freeing the slot
        if epoch != m.epoch or fetch.status is not FetchStatus.PENDING:
            return  # too late: the fetcher gave up (and aborted an exchange at its deadline), or it crashed
        fetch.arrived = self.now
        m.flow.record(fetch.peer, fetch.end(FetchStatus.OK))
        repeat = m.last_gen.get(fetch.peer) == gen
        m.last_gen[fetch.peer] = gen
        st = reply.state
        fetch.reply = PeerSnapshot(NodeState(st.name, st.clock, st.loss, dict(st.extras)), reply.arrays, repeat=repeat)
        if fetch.held is not None:
            fetch.settled = True
            self._settle_exchange(m, server, fetch.held, commit=True)
        self._try_mix(m)

    def _refused(self, m: Member, fetch: Fetch, code: str, epoch: int) -> None:
        if epoch != m.epoch or fetch.status is not FetchStatus.PENDING:
            return
        m.flow.record(fetch.peer, fetch.end(FetchStatus.REFUSED, code))
        m.count(f"refused_{code}")
        self._try_mix(m)

    def _fetch_deadline(self, m: Member, step: int, epoch: int) -> None:
        if epoch != m.epoch or step != m.step:
            return
        for fetch in m.fetches:
            if fetch.status is FetchStatus.PENDING:
                m.flow.record(fetch.peer, fetch.end(FetchStatus.TIMEOUT))
                m.count("timeouts")
                if fetch.held is not None:
                    server = self.members[fetch.peer]
                    fetch.settled = True
                    self._settle_exchange(m, server, fetch.held, commit=False)
        self._try_mix(m)

    def _verdict(self, m: Member, push: Push, status: PushStatus, code: str, epoch: int) -> None:
        if epoch != m.epoch:
            return
        if m.ledger.settle(push, status, code):
            push.ms = (self.now - push.started) * 1000.0
            effect = PUSH_FLOW_EFFECT[status]
            m.flow.record(push.peer, effect)
        if m.phase is Phase.FINISHED:  # trains no more: what comes back is folded in, as a node does at its close
            self._fold_finished(m)
        self._try_mix(m)

    def _fold_finished(self, m: Member) -> None:
        """A member that trains no more folds what it still holds -- the pushes in its inbox (those of rounds it
        never reached too) and the refused pushes that came back -- as a real node's close folds them before it
        hands its mass on: else that mass would sit there, counted nowhere, when the run ends."""
        held = self._drain(m, everything=True) + [
            m.push_of(p) for p in m.ledger.collect() if p.status is PushStatus.REFUSED
        ]
        if held:
            m.rule.mix(m.state, m.arrays, held)

    def _push_deadline(self, m: Member, push: Push, epoch: int) -> None:
        """No verdict by the deadline: unknown; the receiver is asked (a query, answered where it lands) every
        ``timeout_s`` until an answer comes; each query left unanswered counts a flow-control failure, as the TX
        thread's. A receiver that stays down is given up (the push ``lost``, its mass with it) once nobody trains
        any more: a real node forgets a dead member after ``forget_after_s``."""
        if epoch != m.epoch or m.ledger.open_push(push.peer) is not push:
            return
        if push.status is PushStatus.SENDING:
            m.ledger.mark_unknown(push)
        m.flow.failure(push.peer)
        target = self.members[push.peer]
        if target.alive or target.phase is Phase.LEFT:  # one that left still answers: refused, it never took it
            there = self.network.send(m.index, target.index, HEADER_BYTES, self.now)
            if there is not None:
                self.at(there, self._query_lands, target, m, push, epoch)
        elif not any(o.phase in (Phase.COMPUTING, Phase.WAITING) for o in self.members.values()):
            m.ledger.abandon(push.peer)
            m.count("pushes_lost")
            return
        self.at(self.now + self.settings.timeout_s, self._push_deadline, m, push, epoch)  # asked again if need be
        self._try_mix(m)

    def _query_lands(self, target: Member, m: Member, push: Push, epoch: int) -> None:
        """The receiver answers a query about ``push`` now: delivered if it took it; else refused, and the push is
        closed there (a late arrival of it is dropped as stale), so the answer is final."""
        if not (target.alive or target.phase is Phase.LEFT):
            return
        if push.seq in target.accepted:
            self._answer(target, m, self._verdict, m, push, PushStatus.DELIVERED, "", epoch)
        else:
            target.closed.add(push.seq)
            self._answer(target, m, self._verdict, m, push, PushStatus.REFUSED, "settle", epoch)

    # ------------------------------------------------------------ update_wait

    def _computed(self, m: Member, epoch: int) -> None:
        """The end of ``m``'s local step (run by :meth:`run` through :meth:`_computed_batch`)."""
        self._computed_batch([(m, epoch)])

    def _computed_batch(self, batch: Sequence[tuple[Member, int]]) -> None:
        """Train every member of ``batch`` whose step ends now (one call of ``train``), then each one's
        ``update_wait`` in the order its step was planned: a step touches only its own member's arrays, so this is
        the order of events one by one."""
        members = [m for m, epoch in batch if epoch == m.epoch and m.phase is Phase.COMPUTING]
        if not members:
            return
        for m, loss in zip(members, self._train(members)):
            m.state.loss = float(loss)
        for m in members:
            self._wait(m)

    def _wait(self, m: Member) -> None:
        m.move(Phase.WAITING)
        m.waiting_since = self.now
        m.owed = self._owed(m)  # decided once, as the node's wait_sources does; waited for at most timeout_s
        if m.owed:
            self.at(self.now + self.settings.timeout_s, self._sources_deadline, m, m.step, m.epoch)
        self._try_mix(m)

    def _window(self, m: Member) -> int:
        """The node's :func:`~dpwa.node.transfers.push.source_window` for ``m``."""
        return source_window(len(m.names), m.rule.overlap, m.schedule.period)

    def _owed(self, m: Member) -> dict[str, int]:
        """On a fixed push schedule: the in-neighbours whose push of round ``step - 1 - overlap`` has not come."""
        if m.rule.transfer is not Transfer.PUSH:
            return {}
        awaited = m.step - 1 - m.rule.overlap
        if awaited < 0:
            return {}
        sources = m.schedule.sources(Round(m.name, m.names, awaited, m.state))
        if not sources:
            return {}
        window = self._window(m)
        owed = {}
        for s in sources:  # every simulated member starts with the others (started_together)
            latest = m.latest_round.get(s, -1)
            if s != m.name and m.flow.is_up(s) and in_step(latest, awaited, window, True) and latest < awaited:
                owed[s] = awaited
        return owed

    def _sources_deadline(self, m: Member, step: int, epoch: int) -> None:
        if epoch == m.epoch and step == m.step and m.phase is Phase.WAITING:
            late = [s for s, r in m.owed.items() if m.latest_round.get(s, -1) < r]
            m.count("sources_late", len(late))
            m.owed = {}
            self._try_mix(m)

    def _try_mix(self, m: Member) -> None:
        """``update_wait`` returns once its fetches ended, at most ``overlap`` pushes await their verdict (or their
        deadlines passed) and the owed in-neighbours' pushes came (or the wait for them timed out)."""
        if m.phase is not Phase.WAITING:
            return
        if any(f.status is FetchStatus.PENDING for f in m.fetches):
            return
        sending = sum(1 for p in m.ledger.unresolved() if p.status is PushStatus.SENDING)
        if sending > m.rule.overlap or any(m.latest_round.get(s, -1) < r for s, r in m.owed.items()):
            return
        self._mix(m)

    def _mix(self, m: Member) -> None:
        peers = [f.reply for f in m.fetches if f.reply is not None]
        for f in m.fetches:
            if f.status is FetchStatus.TIMEOUT:
                m.rule.on_reply_lost(m.state, None)
        peers += self._drain(m)
        pushes = self._push_counts(m)
        for push in m.ledger.collect():
            if push.status is PushStatus.REFUSED:
                peers.append(m.push_of(push))
                m.count("pushes_returned")
                pushes["returned"] += 1
            elif push.status is PushStatus.DELIVERED:
                pushes["delivered"] += 1
                pushes["push_ms"] = max(pushes["push_ms"], push.ms)
        outcome = m.rule.mix(m.state, m.arrays, peers)
        others = [p for p in peers if p.state.name != m.name]  # a returned push is not a peer
        if others and (outcome.peers or any(not p.repeat for p in others)):
            m.count("mixes")
        statuses = [f.status.value for f in m.fetches] or (["pushed"] if m.rule.transfer is Transfer.PUSH else [])
        self._record(m, outcome, tuple(p.state.name for p in others), ",".join(statuses), pushes)
        if m.leaving:  # closing: it takes nothing more, settles its pushes and hands off
            m.move(Phase.FINISHED)
            self._hand_off(m, self.now)
        elif m.step >= self.steps:
            m.move(Phase.FINISHED)
            if m.rule.transfer is Transfer.PUSH:
                self._fold_finished(m)
        else:
            self._send(m, m.epoch)

    def _drain(self, m: Member, everything: bool = False) -> list[PeerSnapshot]:
        """The inbox's models to mix now: a push rule's every push but those of a round still to come (within the
        source window: kept for their own round; ``everything``: those too, as a leaving node takes them), by
        sender and sequence number; an exchange rule's committed ones, one per sender (its oldest)."""
        if m.rule.transfer is Transfer.PUSH:
            upto, window = m.step - 1, self._window(m)
            taken = sorted((e for e in m.inbox if e.ready and (everything or not upto < e.round <= upto + window)),
                           key=lambda e: (e.sender, e.seq))  # fmt: skip
        else:
            seen: set[str] = set()
            taken = []
            for e in m.inbox:
                if e.ready and e.sender not in seen:
                    seen.add(e.sender)
                    taken.append(e)
        for e in taken:
            m.inbox.remove(e.move(SlotState.MIXING, SlotState.FREE))
        return [e.message for e in taken]
