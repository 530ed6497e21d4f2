"""The gossip node itself: its state, its snapshots, the step, and what its threads call.

:class:`Node` is everything :class:`~dpwa.node.connection.DpwaConnection` is, minus the public
facade. Around each batch the trainer's thread calls :meth:`Node.update_send` (clock += 1, publish a
snapshot, start this round's transfer) and :meth:`Node.update_wait` (wait, bounded, for what the transfer
brings, run the rule, record the exchange). How models travel -- pull, push or exchange -- is the node's
:class:`~dpwa.node.transfers.TransferPattern`, chosen once from the rule (:mod:`dpwa.node.transfers`); the
node never asks which one it has. The RX thread calls :meth:`Node.serve` and :meth:`Node.answer_membership`
(:mod:`dpwa.node.serving`); the TX thread reports each verdict through :meth:`Node.fetch_done`,
:meth:`Node.push_settled` and :meth:`Node.push_unanswered`. Only the trainer's thread ever writes the
trainer's arrays; a rejected reply is counted and never reaches them.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpwa.checkpoint import DpwaState
from dpwa.config import ClusterConfig, JoinAddress
from dpwa.node import contact, following, recovery, report, serving, wire
from dpwa.node.allocator import give_back_freed, set_up_allocator
from dpwa.node.loans import Loans
from dpwa.node.members import Member
from dpwa.node.membership import Membership
from dpwa.node.peers import FlowControl
from dpwa.node.pushes import Push
from dpwa.node.sharedmem import host_identity
from dpwa.node.snapshots import Snapshot, SnapshotPool, open_pool, receive_layout
from dpwa.node.states import FetchStatus, FlowEffect, PushStatus
from dpwa.node.stats import NodeStats, OnceLog
from dpwa.node.timeouts import Timeouts
from dpwa.node.transfers import Arrival, TransferPattern, make_transfer
from dpwa.node.transport import (
    REPLY_QUEUE_MESSAGES,
    FetchJob,
    FetchTarget,
    Reply,
    Transport,
    TransportFactory,
)
from dpwa.node.wire import FLOAT_CODES, Layout
from dpwa.node.wiring import open_transport, raise_if_dead
from dpwa.rules import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import relative_distance
from dpwa.rules.schedules import Schedule
from dpwa.rules.workers import MixWorkers
from dpwa.security.curve import NodeSecurity
from dpwa.utils.cores import mix_thread_count

__all__ = ["Node", "request_ids"]

log = logging.getLogger(__name__)

DISTANCE_EVERY = 10
"""How often the record's ``distance`` (``||x - x_peer|| / ||x||``, with the first peer mixed in, before the mix) is
measured: at the first update_wait with a peer, then at the first with a peer once this many have passed (one
extra read of both models, so not at every step)."""


def _as_loss(loss: Any) -> float:
    value = float(loss)
    if not math.isfinite(value):
        raise ValueError(f"loss must be a finite number, got {value}")
    return value


def lost_extras(header: wire.Message | None) -> dict[str, Any] | None:
    """What a lost reply told the rule: a STATE's extras, ``{}`` for another answer (an ERROR that came after the
    target timed out), None when nothing came."""
    if header is None:
        return None
    return dict(header.extras) if isinstance(header, wire.State) else {}


def request_ids(now_ns: int | None = None) -> itertools.count[int]:
    """A node's request ids and push sequence numbers: one counter, from the wall clock's microseconds at start
    (``now_ns``: ``time.time_ns()``). Receivers take a sender's pushes only with growing sequence numbers, per
    name; a node restarted under the same name (a crash, then ``dpwa run``'s restart) thus goes on above what its
    former process used, unless it made over a million requests a second or the clock went back. Counting from 1
    again, its pushes were refused as stale repeats until it caught up."""
    return itertools.count((time.time_ns() if now_ns is None else now_ns) // 1000)


class Node:
    """Everything a node is, minus the public facade; the threads hold only this object.

    Which thread calls what: the trainer calls :meth:`update_send`, :meth:`update_wait`, :meth:`bootstrap`,
    :meth:`export_state`, :meth:`restore_state` and :meth:`close`; the RX thread :meth:`serve` and
    :meth:`answer_membership`; the TX thread :meth:`fetch_done`, :meth:`push_settled` and
    :meth:`push_unanswered`; the ZAP thread :meth:`auth_denied`. ``state`` and the rule change only under
    ``state_lock``, flow control only under ``flow_lock``; only the trainer's thread writes ``params``.

    ``transport`` builds the node's sockets and threads (:class:`~dpwa.node.transport.Transport`, which reaches
    the node through a :class:`~dpwa.node.wiring.TransportLink`); tests and tools may pass a wrapping transport.
    """

    def __init__(
        self,
        name: str,
        config: ClusterConfig,
        rule: Rule,
        schedule: Schedule,
        seed: int | None,
        params: Sequence[np.ndarray] | None = None,
        transport: TransportFactory = Transport,
    ) -> None:
        self.name = name
        self.config = config
        me = config.node(name)
        joining = config.join_address
        self.synced = False
        self.membership = Membership(
            me,
            () if joining is not None else config.nodes,
            config.max_members,
            config.forget_after_s,
            self.sync_members,
        )
        self.sync_lock = threading.Lock()
        self.endpoints: dict[str, str] = {}
        self.departed: set[str] = set()
        peers = [m.spec() for m in self.membership.peers()]
        self.names = self.membership.order()
        self._init_step(rule, schedule, seed, [p.name for p in peers])
        if params is not None:  # buffers and inbox ready before the server answers anyone: no "not ready" pushes
            self.take_params(params)
        try:
            self.transport = open_transport(self, transport, me, peers)  # bound; started below
        except BaseException:  # the port is taken, say: the pool's buffers and converter thread go too
            if self.pool is not None:
                self.pool.close(timeout=self.timeouts.thread_join_s)
            raise
        self.security: NodeSecurity | None = self.transport.security
        self.endpoints = {p.name: p.endpoint for p in peers}
        self.synced = True  # from here on a table change (the RX thread may see one at once) is applied
        self.transport.start()
        if joining is not None:
            try:
                self.join(joining, config.join_timeout_s)
            except BaseException:
                self.close(announce=False)
                raise
        log.info(
            "node %s listening on %s with %d peers, rule %s, schedule %s",
            name,
            self.transport.endpoint,
            len(peers),
            rule.name,
            schedule.name,
        )

    def _init_step(self, rule: Rule, schedule: Schedule, seed: int | None, peers: list[str]) -> None:
        """Everything the step works with, before the threads start: the rule and schedule, the node's gossip
        state and its lock, flow control over ``peers`` and its lock, and the transfer the rule's models use."""
        self.rule = rule
        self.schedule = schedule
        self.rng = random.Random(seed)
        self.stats = NodeStats()
        self.once = OnceLog(log)
        self.state = NodeState(self.name, extras=rule.initial_extras(self.name, self.names))
        self.state_lock = threading.Lock()
        self.flow = FlowControl(peers, self.rng)
        self.flow_lock = threading.Lock()
        self.param_layout: Layout | None = None  # the trainer's arrays; `layout`: what replies are received in
        self.layout: Layout | None = None
        self.wire_layout: Layout | None = None
        self.pool: SnapshotPool | None = None
        self.params: list[np.ndarray] | None = None
        self.timeouts = Timeouts.of(self.config)
        self.host_id = host_identity() if self.config.transport.shared_memory == "auto" else ""  # "": off
        self.loans = Loans(self.release_snapshot, self.stats.add)
        self.requests = request_ids()  # request ids and push sequence numbers: one counter, never repeated
        self.step = 0  # update_send calls so far: the schedules' round index
        self.front = 0  # the most update_send calls heard of: this node's, or a peer's (gossiped as a maximum)
        self.in_round = False  # an update_send started a round that its update_wait has not ended yet
        self.started_with: set[str] = set()  # the peers that answered wait_for_peers: in-neighbours from round 0
        self.recovery = recovery.Recovery(self.name, rule, self.config.bootstrap_gap, self.stats.add)
        threads = mix_thread_count(self.config.transport.mix_threads)
        self.mix_workers = MixWorkers(threads, name=f"dpwa-mix-{self.name}")
        self.mixing = False
        self.last_exchange: dict[str, Any] | None = None
        self.distance_due = 1  # the first mix measures the distance, then every DISTANCE_EVERY-th
        self.params_moved = False
        """Whether the latest update_wait wrote to the parameters (a mix, or push-sum's step scaling)."""
        self.closed = False
        self.transfer: TransferPattern = make_transfer(self)
        self.inbox = self.transfer.inbox  # where the RX thread puts pushes (None: it answers them unsupported)

    # ------------------------------------------------------------ trainer thread

    def exchanging(self) -> bool:
        """True while this node's own fetch is in flight or update_wait is mixing (any thread may ask)."""
        return self.mixing or self.transfer.in_flight()

    def layouts(self) -> tuple[Layout, Layout] | None:
        """(wire layout, receive layout) once the first update_send set them up, else None."""
        layout, wire_layout = self.layout, self.wire_layout
        return None if layout is None or wire_layout is None else (wire_layout, layout)

    def setup_layout(self, params: Sequence[np.ndarray]) -> None:
        """The first arrays: the snapshot pool for their layout (:func:`~dpwa.node.snapshots.open_pool`), then the
        transfer's buffers; the layouts are set last (until then the RX thread answers "not ready")."""
        set_up_allocator(self.config.transport.memory)  # freed message blocks reused (normal) or unmapped (low)
        self.pool = pool = open_pool(
            self.rule.public_arrays(params),
            self.config.wire_dtype,
            bounds=self.rule.public_bounds(),
            name=self.name,
            held=self.transfer.held_snapshots(),  # kept leased by the transfer: unsettled pushes, exchanges
            defer=self.exchanging,
            max_messages=REPLY_QUEUE_MESSAGES,
            shared=bool(self.host_id),
            single=self.config.transport.memory == "low",  # one buffer: waits up to the timeout for its sends
            drain_s=self.timeouts.exchange_s,
            unpair=self.transfer.unpair,
            wire_only=self.config.transport.memory == "low" and not self.rule.reads_published(),
        )
        self.transfer.allocate(receiving := receive_layout(pool, self.rule.mixes_narrower_peers()))
        self.wire_layout, self.layout = pool.wire, receiving

    def check_threads(self) -> None:
        """RuntimeError when the node is closed, or its RX or TX thread died of a bug
        (:func:`~dpwa.node.wiring.raise_if_dead`)."""
        if self.closed:
            raise RuntimeError(f"node {self.name} is closed")
        raise_if_dead(self.transport, self.name, self.timeouts.thread_join_s)

    def take_params(self, params: Sequence[np.ndarray]) -> None:
        """Set the layouts up from the first ``params``, check later ones against them; keep them as the node's."""
        if self.param_layout is None:
            layout = Layout.of(params)
            for i, code in enumerate(layout.dtypes):
                if code not in FLOAT_CODES:  # integer arrays are what rules publish (indices), never parameters
                    kinds = "float16, float32, float64 or bfloat16"
                    raise ValueError(f"params[{i}] has dtype {params[i].dtype}; parameters must be {kinds}")
            self.setup_layout(params)
            self.param_layout = layout
        elif not self.param_layout.matches(params):
            raise ValueError("params changed layout (count, dtype or shape) since the first update_send")
        self.params = list(params)

    def publish(self, *, tick: bool) -> Snapshot | None:
        """Publish a snapshot of the rule's public arrays for ``params`` (``tick``: ``clock += 1`` first, as in
        ``update_send``), hand the rule the values published; the snapshot, or None when every buffer was busy."""
        assert self.pool is not None and self.params is not None
        with self.state_lock:
            if tick:
                self.state.clock += 1
            clock, loss, extras = self.state.clock, self.state.loss, dict(self.state.extras)
            public = self.rule.public_arrays(self.params)
        self.front = max(self.front, self.step + 1 if tick else self.step)  # step counts update_send after this
        snapshot = self.pool.publish(public, clock, loss, extras, self.front)
        published = snapshot.readonly if snapshot is not None else self.pool.copy_of(public)
        if snapshot is None:  # rare: peers get the previous snapshot; the rule may need x as of now (copy_of)
            self.stats.add("snapshots_skipped")
            self.once.warning(("pool",), "node %s: every snapshot buffer is busy; peers get the prior one", self.name)
        with self.state_lock:
            self.rule.on_publish(self.state, published)
        return snapshot

    def update_send(self, params: Sequence[np.ndarray], loss: Any) -> None:
        """Trainer thread, before a batch: ``clock += 1``, publish a snapshot of ``params``, start this round's
        transfer (a fetch, or pushes). ValueError for a loss that is not finite or arrays of another layout."""
        value = _as_loss(loss)
        self.check_threads()
        self.take_params(params)
        with self.state_lock:
            self.state.loss = value
        self.membership.expire()
        self.transfer.start(self.publish(tick=True))
        self.step += 1
        self.in_round = True

    def release_snapshot(self, snapshot: Snapshot, tracker: Any = None) -> None:
        """End a lease on ``snapshot`` (``tracker``: ZeroMQ may still be sending from it)."""
        assert self.pool is not None
        self.pool.release(snapshot, tracker)

    def note_front(self, front: int) -> None:
        """A peer says it has made ``front`` update_send calls: this node's front is at least that."""
        self.front = max(self.front, front)

    def flow_outcome(self, peer: str, effect: FlowEffect) -> None:
        """Feed flow control with what an outcome does to ``peer`` (any thread; the table is
        :mod:`dpwa.node.states`); a peer that a failure leaves down is suspected in the member table."""
        with self.flow_lock:
            down = self.flow.record(peer, effect)
        if down:
            self.membership.suspect(peer)

    def update_wait(self, loss: Any) -> float:
        """Trainer thread, after a batch: wait (bounded) for what this round's transfer brings, mix it into the
        arrays given to :meth:`update_send`, record the exchange in :attr:`last_exchange`; the mix factor."""
        value = _as_loss(loss)
        self.check_threads()
        with self.state_lock:
            self.state.loss = value
        self.mixing = True  # the snapshot converter defers while the step waits and mixes
        try:
            if self.params is None:
                self.last_exchange = {"step": self.state.clock, "factor": 0.0, "peer": None, "reasons": []}
                self.params_moved = False
                return 0.0
            in_round, self.in_round = self.in_round, False
            upto = self.step - 1 if in_round else None  # no update_send before it: fold whatever is there
            self.transfer.wait_sources(upto)
            return self.wait_and_mix(upto)
        finally:
            self.mixing = False

    def wait_and_mix(self, upto: int | None = None) -> float:
        """update_wait's work: wait for this step's verdicts (bounded), run the rule on what arrived, record it.

        ``upto``: the round just started; a push of a later round may stay in the inbox for its own round (None:
        take everything, as a leaving node does). Returns the factor."""
        waited = time.perf_counter()
        self.transfer.wait()
        self.check_threads()  # the TX thread may have died while we waited
        mixing = time.perf_counter()
        arrival = self.transfer.collect(upto)
        try:
            clock_before, distance, outcome = self.mix(arrival)
        finally:
            arrival.release()
        if self.config.transport.memory == "low":
            give_back_freed()  # what the allocator kept of this step's messages (libzmq's chunks over TCP)
        mixed = time.perf_counter()
        peers = arrival.peers
        self.last_exchange = {
            "step": clock_before,
            "factor": outcome.factor,
            **arrival.summary(),
            "clock_gap": (sum(p.state.clock for p in peers) / len(peers) - clock_before) if peers else None,
            "wait_ms": (mixing - waited) * 1000.0,
            "mix_ms": (mixed - mixing) * 1000.0,
            "distance": distance,
            **self.transfer.fields(arrival),
            **outcome.metrics,
        }
        self.params_moved = outcome.changed
        return outcome.factor

    def mix(self, arrival: Arrival) -> tuple[float, float | None, MixOutcome]:
        """Under the state lock: tell the rule of the replies lost, measure the distance when due, then copy a peer
        far ahead (the first reply only) or run the rule on every peer that arrived, counting a mix. The clock
        before, the distance (None when not measured) and the outcome."""
        assert self.params is not None
        peers = arrival.peers
        others = [p for p in peers if p.state.name != self.name]  # a returned push is not a peer
        with self.state_lock:
            clock_before = self.state.clock
            for t in arrival.targets:
                if t.status in (FetchStatus.TIMEOUT, FetchStatus.REJECTED):
                    self.rule.on_reply_lost(self.state, lost_extras(t.header))
            distance = self.measure_distance(others)
            outcome = None
            with self.mix_workers.active():  # a large array's blocks split over the node's share of the cores
                if others and not self.recovery.caught_up:
                    outcome = self.recovery.catch_up(self.state, self.params, peers)
                if outcome is None:
                    outcome = self.rule.mix(self.state, self.params, peers)  # every step: some rules track motion
        if others and (outcome.peers or any(not p.repeat for p in others)):  # not only a skipped repeat
            self.stats.add("mixes")
        return clock_before, distance, outcome

    def measure_distance(self, others: Sequence[PeerSnapshot]) -> float | None:
        """``||x - x_peer|| / ||x||`` with the first of ``others``, when due (every :data:`DISTANCE_EVERY`-th
        update_wait with a peer); before the rule, which may use the peers' arrays as scratch."""
        assert self.params is not None
        self.distance_due -= 1
        if not others or self.distance_due > 0:
            return None
        self.distance_due = DISTANCE_EVERY
        theirs = self.rule.params_of(others[0].arrays)
        return None if theirs is None else relative_distance(self.params, theirs)

    # ------------------------------------------------------------ trainer thread: recovery, checkpoints

    def bootstrap(self, params: Sequence[np.ndarray], timeout_s: float) -> str | None:
        """Before the first local step: serve ``params`` as they are, then copy the first peer that answers
        within ``timeout_s`` if its clock is ahead (factor 1); its name, or None (see :mod:`dpwa.node.recovery`)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.check_threads()
        if self.transfer.in_flight():
            raise RuntimeError("bootstrap() while a fetch is in flight: call it before the first update_send")
        self.take_params(params)
        # Serve the current parameters (clock unchanged) while bootstrapping, so that peers bootstrapping at
        # the same time (dpwa run --resume) get an answer instead of "not ready".
        self.publish(tick=False)
        peers = [n for n in self.names if n != self.name]
        self.rng.shuffle(peers)
        fetch = self.transfer.fetch_one
        return self.recovery.bootstrap(self.state, self.state_lock, params, peers, fetch, timeout_s)

    def export_state(self) -> DpwaState:
        """The node's gossip state for a checkpoint (copies)."""
        with self.state_lock:
            return recovery.export_state(self.state, self.step, self.rule)

    def restore_state(self, saved: DpwaState, params: Sequence[np.ndarray] | None) -> None:
        """Take back an :meth:`export_state` (trainer thread, before training goes on)."""
        with self.state_lock:
            self.step = recovery.restore_state(self.state, self.rule, saved, params)

    # ------------------------------------------------------------ the transport's threads: verdicts, requests

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None:
        """A fetch target has its verdict (the TX thread; the trainer's for one it timed out): count it, feed
        flow control (the transfer's :meth:`~dpwa.node.transfers.TransferPattern.fetch_done`)."""
        self.transfer.fetch_done(job, target)

    def push_settled(self, push: Push, status: PushStatus, code: str) -> None:
        """The TX thread settled ``push``: ``delivered`` (ACK) or ``refused`` (ERROR, ``code``)."""
        self.transfer.push_settled(push, status, code)

    def push_unanswered(self, push: Push) -> None:
        """A push had no answer by its deadline, or a SETTLE query about it went unanswered (TX thread)."""
        self.transfer.push_unanswered(push)

    def serve(self, request: wire.Fetch, user: str | None = None) -> Reply:
        """RX thread: the reply to a FETCH from CURVE identity ``user`` (:func:`dpwa.node.serving.serve`)."""
        return serving.serve(self, request, user)

    def give_back(self, release: wire.Release, user: str | None) -> None:
        """RX thread: a RELEASE ends the loan of the snapshot lent to that request (:func:`~.serving.give_back`)."""
        serving.give_back(self, release, user)

    def answer_membership(self, header: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
        """RX thread: a PUSH's member news, a JOIN or a MEMBERS (:func:`dpwa.node.serving.answer_membership`)."""
        return serving.answer_membership(self, header, user)

    # ------------------------------------------------------------ ZAP thread

    def auth_denied(self, address: str) -> None:
        """A connection to the RX socket refused by CURVE authentication: count it, warn once."""
        self.stats.add("auth_denied")
        self.once.warning(
            ("auth_denied",),
            "node %s: refused a connection from %s: its CURVE key is not one of the cluster's nodes",
            self.name,
            address,
        )

    # ------------------------------------------------------------ membership (docs/membership.md)

    def sync_members(self) -> None:
        """The member table changed (any thread): follow it (:func:`dpwa.node.following.sync_members`)."""
        following.sync_members(self)

    def join(self, address: JoinAddress, timeout_s: float) -> Member:
        """Trainer thread, before the first step: join the cluster through the member at ``address``
        (:func:`dpwa.node.contact.join`: JoinRefused, or TimeoutError after ``timeout_s``); this node's entry."""
        return contact.join(self, address, timeout_s)

    def leave(self, timeout_s: float, final_mix: bool = False) -> None:
        """Trainer thread, at a clean close: hand off, then announce, within ``timeout_s`` (:func:`contact.leave`)."""
        contact.leave(self, timeout_s, final_mix)

    def wait_for_peers(self, timeout_s: float) -> dict[str, bool]:
        """Trainer thread, before training: wait until every member's server answers, at most ``timeout_s``
        seconds (:func:`dpwa.node.contact.wait_for_peers`). Member name -> answered."""
        return contact.wait_for_peers(self, timeout_s)

    # ------------------------------------------------------------ any thread

    def snapshot_stats(self) -> dict[str, Any]:
        """The node's statistics (``DpwaConnection.stats()``; :func:`dpwa.node.report.node_stats`)."""
        return report.node_stats(self)

    def linger(self, seconds: float, idle_s: float = 1.0) -> float:
        """Keep serving the last snapshot for up to ``seconds``, less once no peer fetched for ``idle_s``
        (:func:`dpwa.node.serving.linger`); the seconds spent."""
        return serving.linger(self, seconds, idle_s)

    def close(self, announce: bool = True, final_mix: bool = False) -> None:
        """Leave cleanly (``announce``: :meth:`leave`, bounded by ``timeouts.leave_s`` (``2 * timeout_ms``) + 1 s;
        ``final_mix``: see there), then stop every thread (each within ``timeouts.thread_join_s``) and free the port.
        A node whose threads died leaves without announcing."""
        if self.closed:
            return
        if self.transport.owns(threading.current_thread()):  # pragma: no cover - misuse
            raise RuntimeError("close() called from a dpwa thread")
        try:
            if announce and not self.transport.failures() and not self.membership.leaving:
                try:
                    self.leave(self.timeouts.leave_s, final_mix)
                except Exception:  # leaving is a courtesy: the node still closes
                    log.exception("node %s: leaving the cluster failed", self.name)
        finally:  # a Ctrl-C during the leave still stops the threads and frees the port, then propagates
            _stop(self)


def _stop(node: Node) -> None:
    """:meth:`Node.close`'s second half: stop every thread, close the sockets, then free the pool's memory and the
    maps of peers' segments -- only once no thread of the node runs any more (a stuck one, a bug, is logged there;
    an interrupt during the joins still closes the pool's descriptors)."""
    node.closed = True
    node.transport.stop()
    node.loans.close()
    stopped = False
    try:
        stopped = node.transport.close()
    finally:
        node.mix_workers.close()
        if node.pool is not None:
            node.pool.close(timeout=node.timeouts.thread_join_s, release=stopped)
    if stopped:
        node.transfer.closed()
        log.info("node %s closed", node.name)
