"""The gossip node itself: its state, its snapshots, one exchange, and what its threads call.

:class:`Node` is everything :class:`~dpwa.node.connection.DpwaConnection` is, minus the public
facade. Around each batch the trainer's thread calls :meth:`Node.update_send` (clock += 1, publish a
snapshot, maybe start a fetch job) and :meth:`Node.update_wait` (wait for the TX thread's verdicts
until the job's deadline plus :data:`~dpwa.node.transport.VERDICT_SLACK_S`, run the rule, record the
exchange). The RX thread (:class:`~dpwa.node.transport.RxServer`) calls :meth:`Node.serve`; the TX
thread (:class:`~dpwa.node.transport.TxFetcher`) reports each fetched peer through
:meth:`Node.on_target`. Only the trainer's thread ever writes the trainer's arrays; a rejected reply
is counted and never reaches them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from dpwa.checkpoint import DpwaState
from dpwa.config import ClusterConfig, JoinAddress
from dpwa.metrics import DECLINED_CODES, fetch_reason
from dpwa.node import recovery, wire
from dpwa.node.inbox import InboxSlot, PushReceiver
from dpwa.node.members import JoinRefused, Member
from dpwa.node.membership import Membership
from dpwa.node.peers import FlowControl
from dpwa.node.pushes import Push, PushLedger
from dpwa.node.snapshots import Snapshot, SnapshotPool
from dpwa.node.stats import NodeStats, OnceLog
from dpwa.node.transport import (
    REPLY_QUEUE_MESSAGES,
    VERDICT_SLACK_S,
    FetchJob,
    FetchTarget,
    Reply,
    RxServer,
    TxFetcher,
    _common_options,
    connect_address,
    is_own_echo,
)
from dpwa.node.wire import ErrorCode, Kind, Layout
from dpwa.rules import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.mixing import relative_distance
from dpwa.rules.schedules import Round, Schedule
from dpwa.security.curve import NodeSecurity, warn_if_exposed

__all__ = ["ANNOUNCE_S", "CONTROL_RECONNECT_MS", "JOIN_S", "Node", "bind_endpoint"]

log = logging.getLogger(__name__)

JOIN_S = 1.0
"""How long :meth:`Node.close` waits for each dpwa thread to end, and the trainer for a dead one to close."""
ANNOUNCE_S = 0.5
DISTANCE_EVERY = 10
"""How often the record's ``distance`` (``||x - x_peer|| / ||x||``, with the first peer mixed in, before the mix) is
measured: at the first update_wait with a peer, then at the first with a peer once this many have passed (one
extra read of both models, so not at every step)."""
CONTROL_RECONNECT_MS = 10
"""How often a control socket (JOIN, MEMBERS) retries connecting to a member that is not listening yet, in ms."""
UNREACHABLE_EVENTS = zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
"""Socket monitor events that say a member cannot be told (refused, or not letting this node in)."""
"""How long a leaving node waits for its members' answers to its leave announcement (live ones answer at once)."""


def _as_loss(loss: Any) -> float:
    value = float(loss)
    if not math.isfinite(value):
        raise ValueError(f"loss must be a finite number, got {value}")
    return value


def bind_endpoint(host: str, port: int) -> str:
    """The tcp:// endpoint to bind for ``host``: its resolved IPv4 address."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise OSError(f"cannot resolve host {host!r} to bind: {exc}") from exc
    return f"tcp://{address}:{port}"


class Node:
    """Everything a node is, minus the public facade; the threads hold only this object.

    Which thread calls what: the trainer calls :meth:`update_send`, :meth:`update_wait`, :meth:`bootstrap`,
    :meth:`export_state`, :meth:`restore_state` and :meth:`close`; the RX thread :meth:`serve`; the TX thread
    :meth:`on_target`; the ZAP thread :meth:`on_auth_denied`. ``state`` and the rule change only under
    ``state_lock``, flow control only under ``flow_lock``; only the trainer's thread writes ``params``.
    """

    def __init__(
        self,
        name: str,
        config: ClusterConfig,
        rule: Rule,
        schedule: Schedule,
        seed: int | None,
        params: Sequence[np.ndarray] | None = None,
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
        peers = [m.spec() for m in self.membership.peers()]
        self.names = self.membership.order()
        self.rule = rule
        self.schedule = schedule
        self.rng = random.Random(seed)
        self.stats = NodeStats()
        self.once = OnceLog(log)
        self.state = NodeState(name, extras=rule.initial_extras(name, self.names))
        self.state_lock = threading.Lock()
        self.flow = FlowControl([p.name for p in peers], self.rng)
        self.flow_lock = threading.Lock()
        self.layout: Layout | None = None
        self.wire_layout: Layout | None = None
        self.pool: SnapshotPool | None = None
        self.params: list[np.ndarray] | None = None
        self.receive_slots: list[tuple[np.ndarray, list[np.ndarray]]] = []
        self.pending: FetchJob | None = None
        self.requests = itertools.count(1)
        self.step = 0  # update_send calls so far: the schedules' round index
        self.front = 0  # the most update_send calls heard of: this node's, or a peer's (gossiped as a maximum)
        self.in_round = False  # an update_send started a round that its update_wait has not ended yet
        self.started_with: set[str] = set()  # the peers that answered wait_for_peers: in-neighbours from round 0
        self.alone = False
        self.caught_up = False  # recovery: a peer was copied, or the first reply was checked for "far behind"
        self.mixing = False
        self.last_exchange: dict[str, Any] | None = None
        self.distance_due = 1  # the first mix measures the distance, then every DISTANCE_EVERY-th
        self.params_moved = False
        """Whether the latest update_wait wrote to the parameters (a mix, or push-sum's step scaling)."""
        self.fetched_gens: dict[str, int] = {}  # per peer: the generation of the snapshot last fetched from it
        self.closed = False
        self.ledger = PushLedger() if rule.transfer == "push" else None
        self.inbox: PushReceiver | None = None
        if rule.transfer in ("push", "exchange"):
            self.inbox = PushReceiver(
                name,
                self.names,
                self.layouts,
                config.inbox_slots,
                config.timeout_ms / 1000.0,
                self.stats.add,
                self.stats.reject_push,
                self.release_snapshot,
                check_identity=config.security.curve,
                per_sender=config.inbox_per_sender,
            )
        if params is not None:  # buffers and inbox ready before the server answers anyone: no "not ready" pushes
            self.take_params(params)
        self.pushed_this_step = 0
        self.push_ms = 0.0  # the slowest push delivered (send to ACK) found by the last update_wait
        self.delivered = 0  # pushes delivered (ACK) found by the last update_wait: push_ms is theirs
        self.sources_late: list[str] = []  # in-neighbours whose push of the awaited round did not come in time
        self.sources_wait_ms = 0.0  # how long the latest update_wait waited for them
        self.ctx = zmq.Context(io_threads=1)
        self.security: NodeSecurity | None = None
        try:
            if config.security.curve:  # reads the keys and starts the ZAP handler: before the ROUTER binds
                self.security = NodeSecurity(
                    name,
                    config.check_secret_key(name),
                    config.public_key_files(),
                    self.ctx,
                    self.on_auth_denied,
                    keys_dir=config.security.keys,
                )
            self.rx = RxServer(
                self.ctx,
                bind_endpoint(me.host, me.port),
                self.serve,
                self.stats.add,
                name=f"dpwa-rx-{name}",
                setup=self.security.server if self.security is not None else None,
                pushes=self.inbox,
                node=name,
                membership=self.on_membership_message,
            )
        except BaseException:  # a busy port, a missing key: stop what started, then raise
            if self.security is not None:
                self.security.stop()
            self.ctx.term()
            raise
        warn_if_exposed(name, self.rx.endpoint, curve=self.security is not None)
        self.tx = TxFetcher(
            self.ctx,
            name,
            {p.name: p.endpoint for p in peers},
            self.layouts,
            self.on_target,
            self.stats.add,
            name=f"dpwa-tx-{name}",
            setup=self.security.client if self.security is not None else None,
            on_push=self.on_push if self.inbox is not None else None,
            on_push_unknown=self.on_push_unknown,
            retry_s=config.timeout_ms / 1000.0,
            news=self.membership.news_for,
        )
        self.endpoints = {p.name: p.endpoint for p in peers}
        self.synced = True  # from here on a table change (the RX thread may see one at once) is applied
        self.rx.start()
        self.tx.start()
        if joining is not None:
            try:
                self.join(joining, config.join_timeout_s)
            except BaseException:
                self.close(announce=False)
                raise
        log.info(
            "node %s listening on %s with %d peers, rule %s, schedule %s",
            name,
            self.rx.endpoint,
            len(peers),
            rule.name,
            schedule.name,
        )

    # ------------------------------------------------------------ trainer thread

    def exchanging(self) -> bool:
        """True while this node's own fetch is in flight or update_wait is mixing (any thread may ask)."""
        job = self.pending
        return self.mixing or (job is not None and not job.done.is_set())

    def layouts(self) -> tuple[Layout, Layout] | None:
        """(wire layout, local layout) once the first update_send set them up, else None."""
        layout, wire_layout = self.layout, self.wire_layout
        return None if layout is None or wire_layout is None else (wire_layout, layout)

    def setup_layout(self, params: Sequence[np.ndarray]) -> None:
        layout = Layout.of(params)
        wire_layout = layout.on_wire(self.config.wire_dtype)
        if len(wire_layout.frame_bounds()) + 1 > REPLY_QUEUE_MESSAGES:
            raise ValueError(
                f"a model of {wire_layout.total_bytes / 2**30:.1f} GiB on the wire needs more messages per reply "
                f"than a node queues ({REPLY_QUEUE_MESSAGES}); exchange a part of it, or a narrower wire_dtype"
            )
        held = 0  # snapshots a push rule keeps leased: one per unsettled push, one per exchange in the inbox
        if self.inbox is not None:
            held = self.config.inbox_slots + max(1, self.schedule.max_fanout(len(self.names))) * (self.rule.overlap + 2)
        self.pool = SnapshotPool(layout, max_size=6 + held, wire=wire_layout, name=self.name, defer=self.exchanging)
        fetched = (
            1 if self.rule.transfer == "push" else self.schedule.max_fanout(len(self.names))
        )  # push: bootstrap only
        for _ in range(max(1, fetched)):
            buffer = layout.allocate()
            self.receive_slots.append((buffer, layout.views(buffer)))
        if self.inbox is not None:
            self.inbox.allocate(layout)
        self.wire_layout = wire_layout
        self.layout = layout
        log.info(
            "node %s: %d arrays, %.1f MB per snapshot, %.1f MB on the wire (wire_dtype %s)",
            self.name,
            len(params),
            layout.total_bytes / 1e6,
            wire_layout.total_bytes / 1e6,
            self.config.wire_dtype,
        )

    def check_threads(self) -> None:
        """Raise RuntimeError, the original exception chained, when the RX or TX thread died of a bug.

        The dead thread is joined first (it is only closing its sockets; at most ``JOIN_S``), so once the
        trainer has seen the death, ``stats()`` reports the thread as ended too.
        """
        for role, thread, lost in (("TX", self.tx, "fetch from"), ("RX", self.rx, "serve")):
            if thread.failure is not None:
                thread.join(timeout=JOIN_S)
                raise RuntimeError(
                    f"node {self.name}: the {role} thread died of {thread.failure!r}, so the node can no longer "
                    f"{lost} its peers (traceback in the log); close the connection"
                ) from thread.failure

    def take_params(self, params: Sequence[np.ndarray]) -> None:
        """Set the layout up from the first ``params``, check later ones against it; keep them as the node's."""
        if self.layout is None:
            self.setup_layout(params)
        elif not self.layout.matches(params):
            raise ValueError("params changed layout (count, dtype or shape) since the first update_send")
        self.params = list(params)

    def publish(self, *, tick: bool) -> Snapshot | None:
        """Publish a snapshot of ``params`` (``tick``: ``clock += 1`` first, as ``update_send`` does) and hand
        the rule the values published; the snapshot, or None when every buffer was busy."""
        assert self.pool is not None and self.params is not None
        with self.state_lock:
            if tick:
                self.state.clock += 1
            clock, loss, extras = self.state.clock, self.state.loss, dict(self.state.extras)
        self.front = max(self.front, self.step + 1 if tick else self.step)  # step counts update_send after this
        snapshot = self.pool.publish(self.params, clock, loss, extras, self.front)
        if snapshot is None:
            self.stats.add("snapshots_skipped")
            self.once.warning(
                ("pool",), "node %s: every snapshot buffer is busy; peers get the previous one", self.name
            )
            published = [np.array(a, copy=True) for a in self.params]  # rare: the rule still needs x as of now
        else:
            published = snapshot.readonly
        with self.state_lock:
            self.rule.on_publish(self.state, published)
        return snapshot

    def update_send(self, params: Sequence[np.ndarray], loss: Any) -> None:
        value = _as_loss(loss)
        self.check_threads()
        self.take_params(params)
        with self.state_lock:
            self.state.loss = value
        self.membership.expire()
        snapshot = self.publish(tick=True)
        if self.rule.transfer == "push":
            self.start_push(snapshot)
        else:
            self.start_fetch(snapshot)
        self.step += 1
        self.in_round = True

    def choose_peers(self) -> tuple[list[str], bool]:
        """This round's peers (schedule, else flow control; down peers left out), and whether any was wanted."""
        with self.state_lock:
            wanted = self.schedule.targets(Round(self.name, self.names, self.step, self.state))
        with self.flow_lock:
            if wanted is None:
                chosen = self.flow.choose(self.schedule.fanout)
            else:
                chosen = self.flow.admit([p for p in wanted if p != self.name])
        return chosen, wanted is None or bool(wanted)

    def release_snapshot(self, snapshot: Snapshot, tracker: Any = None) -> None:
        """End a lease on ``snapshot`` (``tracker``: ZeroMQ may still be sending from it)."""
        assert self.pool is not None
        self.pool.release(snapshot, tracker)

    def start_push(self, snapshot: Snapshot | None) -> None:
        """Push the snapshot just published to this round's peers (``push`` rules), giving each its share.

        A receiver whose previous push from this node has no verdict yet (OSGP runs on before the ACK) is waited
        for until that push's deadline, so that each round's push goes out (its receiver waits for it); one still
        unanswered then (the TX thread asks about it) is skipped, its share kept."""
        assert self.ledger is not None and self.pool is not None
        self.pushed_this_step = 0
        if self.rng.random() >= self.config.fetch_probability:
            return
        chosen, _ = self.choose_peers()
        for peer in chosen:  # the previous push to a receiver still on its way: wait for its verdict (bounded)
            previous = self.ledger.open_push(peer)
            if previous is not None and previous.status == "sending":
                self.ledger.wait_for(previous, max(0.0, previous.deadline + VERDICT_SLACK_S - time.monotonic()))
        ready = [p for p in chosen if not self.ledger.busy(p) and p not in self.ledger.unsupported]
        if snapshot is None or not ready:
            self.stats.add("pushes_skipped")
            return
        with self.state_lock:
            shares = self.rule.push_shares(self.state, len(ready))
        deadline = time.monotonic() + self.config.timeout_ms / 1000.0
        prepare = functools.partial(self.pool.prepare_push, snapshot)
        for peer, given in zip(ready, shares):
            self.pool.retain(snapshot)
            given = {**given, "round": self.step}  # the receiver's in-neighbour wait looks for it
            push = Push(peer, next(self.requests), given, snapshot, deadline, prepare=prepare)
            self.ledger.open(push)
            self.tx.submit_push(push)
        self.pushed_this_step = len(ready)

    def start_fetch(self, snapshot: Snapshot | None = None) -> None:
        if self.pending is not None and not self.pending.done.is_set():
            self.stats.add("fetches_skipped")  # update_wait was not called for the previous fetch
            return
        self.pending = None
        if self.rng.random() >= self.config.fetch_probability:
            return
        with self.state_lock:
            request_extras = self.rule.request_extras(self.state)
        chosen, wanted = self.choose_peers()
        chosen = chosen[: len(self.receive_slots)]
        if not chosen:
            self.stats.add("fetches_skipped")
            if not self.alone and len(self.names) > 1 and wanted:
                log.warning("node %s: no peer is up; training alone (factor 0) until one answers", self.name)
            self.alone = True
            return
        targets = [FetchTarget(peer, buf, views) for peer, (buf, views) in zip(chosen, self.receive_slots)]
        deadline = time.monotonic() + self.config.timeout_ms / 1000.0
        req = next(self.requests)
        push = None
        if self.rule.transfer == "exchange":  # AD-PSGD: the fetch carries this node's snapshot to the one peer
            if snapshot is None:
                self.stats.add("fetches_skipped")
                return
            assert self.pool is not None
            targets = targets[:1]
            self.pool.retain(snapshot)
            push = Push(
                targets[0].peer,
                req,
                {},
                snapshot,
                deadline,
                prepare=functools.partial(self.pool.prepare_push, snapshot),
                release=functools.partial(self.release_snapshot, snapshot),
            )
        self.pending = FetchJob(req, targets, deadline, request_extras, push=push)
        self.tx.submit(self.pending)

    def update_wait(self, loss: Any) -> float:
        value = _as_loss(loss)
        self.check_threads()
        with self.state_lock:
            self.state.loss = value
        self.mixing = True  # set before pending is cleared: the snapshot converter keeps deferring
        try:
            job, self.pending = self.pending, None
            if self.params is None:
                self.last_exchange = {"step": self.state.clock, "factor": 0.0, "peer": None, "reasons": []}
                self.params_moved = False
                return 0.0
            in_round, self.in_round = self.in_round, False
            self.sources_late, self.sources_wait_ms = [], 0.0
            if not in_round:  # an update_wait with no update_send before it: fold whatever is there
                return self.wait_and_mix(job)
            self.wait_for_sources()
            return self.wait_and_mix(job, self.step - 1)
        finally:
            self.mixing = False

    def source_window(self) -> int:
        """How many rounds behind the awaited one an in-neighbour may be and still be waited for: a node in
        lock-step is at most a graph's diameter (``ceil(log2 N)`` on the exponential graph) plus the overlap
        away; one further behind (it restarted, or it is not synchronous) is not waited for."""
        return 2 * max(1, math.ceil(math.log2(max(2, len(self.names))))) + self.rule.overlap + 2

    def wait_for_sources(self) -> None:
        """``push`` rules on a fixed schedule (SGP, OSGP): wait, at most ``timeout_ms``, until every in-neighbour
        of round ``k - overlap`` (``k`` the round just pushed) has a push of that round settled in the inbox.

        Not waited for: a source that is down, that never sent a push naming its round (it is starting, or not
        a synchronous node; in the first :meth:`source_window` rounds a peer that answered :meth:`wait_for_peers`
        is waited for all the same), or that is more than :meth:`source_window` rounds behind. A push that comes late is
        folded at the next update_wait (:meth:`PushReceiver.drain` takes every one there)."""
        self.sources_late, self.sources_wait_ms = [], 0.0
        if self.ledger is None or self.inbox is None or self.step < 1:
            return
        awaited = self.step - 1 - self.rule.overlap
        if awaited < 0:
            return
        with self.state_lock:
            sources = self.schedule.sources(Round(self.name, tuple(self.names), awaited, self.state))
        if not sources:
            return
        with self.flow_lock:
            up = set(self.flow.up_peers())
        window = self.source_window()
        floor = awaited - window

        def in_step(source: str) -> bool:  # heard naming a recent round; or, in the first rounds, started with us
            latest = self.inbox.latest_round(source)
            return latest >= max(0, floor) or (latest < 0 and awaited < window and source in self.started_with)

        wanted = {s: awaited for s in sources if s != self.name and s in up and in_step(s)}
        if not wanted:
            return
        started = time.perf_counter()
        self.sources_late = self.inbox.wait_rounds(wanted, self.config.timeout_ms / 1000.0)
        self.sources_wait_ms = (time.perf_counter() - started) * 1000.0
        if self.sources_late:
            self.stats.add("sources_late", len(self.sources_late))

    def wait_and_mix(self, job: FetchJob | None, upto: int | None = None) -> float:
        """update_wait's work: wait for the TX thread's verdict (bounded), run the rule, record the exchange.

        ``upto``: the round just pushed; a push rule leaves the pushes of a later round within
        :meth:`source_window` in the inbox for that round (None: fold everything, as a leaving node does)."""
        assert self.params is not None
        waited = time.perf_counter()
        for target in job.wait() if job is not None else ():  # a busy or stalled TX thread: timed out here
            self.on_target(job, target)
        returned = self.wait_pushes()
        self.check_threads()  # the TX thread may have died while we waited
        mixing = time.perf_counter()
        targets = job.targets if job is not None else []
        peers = [self.fetched(t) for t in targets if t.status == "ok" and t.header is not None]
        slots = []
        if self.inbox is not None:
            every = self.ledger is not None
            slots = self.inbox.drain(every=every, upto=upto if every else None, window=self.source_window())
        try:
            received = [self.slot_message(s) for s in slots]
            peers += received
            peers += [
                PeerSnapshot(
                    NodeState(self.name, p.snapshot.clock, p.snapshot.loss, dict(p.given)), p.snapshot.readonly
                )
                for p in returned
            ]
            with self.state_lock:
                clock_before = self.state.clock
                for t in targets:
                    if t.status in ("timeout", "rejected"):
                        self.rule.on_reply_lost(self.state, dict(t.header.extras) if t.header is not None else None)
                others = [p for p in peers if p.state.name != self.name]  # a returned push is not a peer
                distance = None
                self.distance_due -= 1
                if others and self.distance_due <= 0:  # before the rule: it may use the peers' arrays as scratch
                    distance = relative_distance(self.params, others[0].arrays)
                    self.distance_due = DISTANCE_EVERY
                outcome = self.catch_up(peers) if others and not self.caught_up else None
                if outcome is None:
                    outcome = self.rule.mix(self.state, self.params, peers)  # every step: some rules track motion
        finally:
            if self.inbox is not None:
                self.inbox.release(slots)
            for p in returned:
                self.release_snapshot(p.snapshot, p.tracker)
        mixed = time.perf_counter()
        if others and (outcome.peers or any(not p.repeat for p in others)):  # not only a skipped repeat
            self.stats.add("mixes")
        names = [t.peer for t in targets] + [m.state.name for m in received]
        record: dict[str, Any] = {
            "step": clock_before,
            "factor": outcome.factor,
            "peer": ",".join(names) or None,
            "status": ",".join([t.status for t in targets] + ["pushed"] * len(received)) or None,
            "reasons": [fetch_reason(t.status, t.code, t.late) or t.status for t in targets if t.status != "ok"],
            "bytes": sum(t.nbytes for t in targets),
            "fetch_ms": max((t.ms for t in targets), default=0.0),
            "clock_gap": (sum(p.state.clock for p in peers) / len(peers) - clock_before) if peers else None,
            "wait_ms": (mixing - waited) * 1000.0,
            "mix_ms": (mixed - mixing) * 1000.0,
            "distance": distance,
        }
        if self.inbox is not None:
            record["received"] = len(received)
        if self.ledger is not None:
            record["pushed"] = self.pushed_this_step
            record["push_ms"] = self.push_ms
            record["delivered"] = self.delivered
            record["returned"] = len(returned)
            record["unacked"] = len(self.ledger.unresolved())
            record["sources_late"] = len(self.sources_late)
            record["sources_wait_ms"] = self.sources_wait_ms
        record.update(outcome.metrics)
        self.last_exchange = record
        self.params_moved = outcome.changed
        return outcome.factor

    def fetched(self, target: FetchTarget) -> PeerSnapshot:
        """A fetched reply as a peer for the rule, marked ``repeat`` when it holds the very snapshot (same
        generation) this node fetched from that peer last time: the peer has published nothing since."""
        header = target.header
        assert header is not None
        with self.sync_lock:  # forget_member drops the peer's entry from another thread
            repeat = header.gen >= 1 and self.fetched_gens.get(target.peer) == header.gen
            self.fetched_gens[target.peer] = header.gen
        self.front = max(self.front, header.front)
        return PeerSnapshot(
            NodeState(target.peer, header.clock, header.loss, dict(header.extras)), target.views, repeat=repeat
        )

    def wait_pushes(self) -> list[Push]:
        """``push`` rules: wait (bounded by the pushes' deadlines) until at most ``rule.overlap`` pushes await an
        answer; release the delivered ones' snapshots and return the refused ones (their mass comes back)."""
        if self.ledger is None:
            return []
        self.ledger.wait_until(self.rule.overlap, VERDICT_SLACK_S)
        returned = []
        self.push_ms = 0.0
        self.delivered = 0
        for push in self.ledger.collect():
            if push.status == "delivered":
                self.push_ms = max(self.push_ms, push.ms)
                self.delivered += 1
                self.stats.add("pushes_delivered")
                self.release_snapshot(push.snapshot, push.tracker)
            else:
                self.stats.add("pushes_returned")
                returned.append(push)
        return returned

    def slot_message(self, slot: InboxSlot) -> PeerSnapshot:
        """What an inbox slot holds, as a peer for the rule (an exchange with the snapshot served as reference)."""
        header = slot.header
        assert header is not None
        self.front = max(self.front, header.front)
        reference = slot.served.readonly if slot.served is not None else None
        return PeerSnapshot(
            NodeState(slot.sender, header.clock, header.loss, dict(header.extras)), slot.views, reference
        )

    # ------------------------------------------------------------ trainer thread: recovery

    def catch_up(self, peers: Sequence[PeerSnapshot]) -> MixOutcome | None:
        """At the node's first successful reply (caller holds the state lock): copy the most advanced peer if
        it is more than ``bootstrap_gap`` ahead and return the outcome (factor 1); else None (run the rule)."""
        self.caught_up = True
        ahead = recovery.far_ahead(peers, self.state, self.config.bootstrap_gap)
        if ahead is None:
            return None
        log.warning(
            "node %s: far behind (clock %g, peer %s at %g, more than bootstrap_gap %g ahead); copying its model",
            self.name,
            self.state.clock,
            ahead.state.name,
            ahead.state.clock,
            self.config.bootstrap_gap,
        )
        for peer in peers:
            self.rule.on_reply_not_mixed(self.state, peer.state.extras)
        assert self.params is not None
        self.copy_peer(self.params, ahead)
        return MixOutcome(1.0, (ahead.state.name,), {**self.rule.state_metrics(self.state), "bootstrap": 1.0})

    def copy_peer(self, params: Sequence[np.ndarray], peer: PeerSnapshot) -> None:
        """``x <- x_peer``, ``clock <- peer clock`` (caller holds the state lock); counted in ``bootstraps``."""
        recovery.copy_peer(self.state, self.rule, params, peer)
        self.caught_up = True
        self.stats.add("bootstraps")

    def fetch_one(self, peer: str, deadline: float) -> PeerSnapshot | None:
        """Fetch ``peer``'s snapshot into the first receive slot, waiting at most until ``timeout_ms`` from now
        (or ``deadline``, if sooner) plus the verdict slack; the snapshot, or None when it did not come."""
        buffer, views = self.receive_slots[0]
        target = FetchTarget(peer, buffer, views)
        job = FetchJob(next(self.requests), [target], min(deadline, time.monotonic() + self.config.timeout_ms / 1000))
        self.tx.submit(job)
        for late in job.wait():  # the TX thread is late: time the fetch out here, as update_wait does
            self.on_target(job, late)
        if target.status != "ok" or target.header is None:
            return None
        return self.fetched(target)  # its generation is recorded: a copied snapshot is not mixed again

    def bootstrap(self, params: Sequence[np.ndarray], timeout_s: float) -> str | None:
        """Before the first local step: serve ``params`` as they are, then copy the first peer that answers
        within ``timeout_s`` if its clock is ahead (factor 1); its name, or None (see :mod:`dpwa.node.recovery`)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if self.pending is not None and not self.pending.done.is_set():
            raise RuntimeError("bootstrap() while a fetch is in flight: call it before the first update_send")
        self.take_params(params)
        # Serve the current parameters (clock unchanged) while bootstrapping, so that peers bootstrapping at
        # the same time (dpwa run --resume) get an answer instead of "not ready".
        self.publish(tick=False)
        peers = [n for n in self.names if n != self.name]
        self.rng.shuffle(peers)
        peer = recovery.ask_peers(peers, self.fetch_one, timeout_s) if peers else None
        if peer is None:
            if peers:
                log.warning(
                    "node %s: no peer answered within %.1f s; training from its own state (not bootstrapped)",
                    self.name,
                    timeout_s,
                )
            return None
        with self.state_lock:
            own = self.state.clock
            self.rule.on_reply_not_mixed(self.state, peer.state.extras)
            if not recovery.is_ahead(peer, self.state):
                log.info(
                    "node %s: peer %s is not ahead (clock %g, own %g); keeping its own state",
                    self.name,
                    peer.state.name,
                    peer.state.clock,
                    own,
                )
                return None
            self.copy_peer(params, peer)
        log.info("node %s: bootstrapped from %s (clock %g -> %g)", self.name, peer.state.name, own, peer.state.clock)
        return peer.state.name

    def export_state(self) -> DpwaState:
        """The node's gossip state for a checkpoint (copies)."""
        with self.state_lock:
            return recovery.export_state(self.state, self.step, self.rule)

    def restore_state(self, saved: DpwaState, params: Sequence[np.ndarray] | None) -> None:
        """Take back an :meth:`export_state` (trainer thread, before training goes on)."""
        with self.state_lock:
            self.step = recovery.restore_state(self.state, self.rule, saved, params)

    # ------------------------------------------------------------ TX thread

    def on_target(self, job: FetchJob, target: FetchTarget) -> None:
        """Count a finished fetch and feed flow control."""
        peer = target.peer
        self.stats.peer_outcome(peer, target.status)
        if target.header is not None and target.status in ("ok", "refused"):
            self.membership.observe(target.header)
        # a peer starting up, or whose inbox is full, is alive: no penalty, ask again next time; one that left
        # has said so (its table, just merged, removes it): no penalty either. Nor are they failures (stats).
        not_ready = target.status == "refused" and target.code in DECLINED_CODES
        if target.status == "ok":
            self.stats.fetch_done(target.ms, target.nbytes)
            with self.flow_lock:
                self.flow.success(peer)
            if self.alone:
                log.info("node %s: peer %s answers; mixing again", self.name, peer)
                self.alone = False
            return
        self.stats.outcome(fetch_reason(target.status, target.code, target.late) or target.status)
        if not not_ready:
            with self.flow_lock:
                self.flow.failure(peer)
                down = not self.flow.is_up(peer)
            if down:
                self.membership.suspect(peer)
        if target.status == "timeout" and target.late:
            self.stats.add("fetches_timed_out")
            self.stats.add("fetches_late")
            self.once.warning(
                (peer, "late"), "node %s: no verdict on %s by the deadline: the TX thread is late", self.name, peer
            )
        elif target.status == "timeout":
            self.stats.add("fetches_timed_out")
            self.once.warning((peer, "timeout"), "node %s: peer %s did not answer in time", self.name, peer)
        elif target.status == "refused":
            self.stats.refuse(target.code)
            self.once.warning(
                (peer, target.code),
                "node %s: peer %s refused: %s (%s)",
                self.name,
                peer,
                target.code,
                target.detail,
                level=logging.INFO if not_ready else logging.WARNING,
            )
        else:
            self.stats.reject(target.code, target.nbytes)
            self.once.warning(
                (peer, target.code),
                "node %s: dropped a reply from %s (%s%s)",
                self.name,
                peer,
                target.code,
                f": {target.detail}" if target.detail else "",
            )

    def on_push(self, push: Push, status: str, code: str) -> None:
        """The TX thread settled ``push``: delivered (ACK) or refused (ERROR); a peer that takes no pushes is
        never pushed to again in this session."""
        if self.ledger is None:  # pragma: no cover - only push rules open pushes
            return
        self.push_outcome(push.peer, ok=True)  # any answer: the peer is there
        if status == "refused" and code == ErrorCode.UNSUPPORTED.value and push.peer not in self.ledger.unsupported:
            self.ledger.unsupported.add(push.peer)
            log.warning(
                "node %s: peer %s takes no pushes (its rule is pull-only); not pushing to it again",
                self.name,
                push.peer,
            )
        elif status == "refused":
            self.once.warning(
                (push.peer, "push", code),
                "node %s: peer %s refused a push: %s",
                self.name,
                push.peer,
                code,
                # busy, or not ready (a peer that has published nothing yet, as at start-up): routine
                level=logging.INFO if code in (ErrorCode.BUSY.value, ErrorCode.NOT_READY.value) else logging.WARNING,
            )
        self.ledger.settle(push, status, code)

    def on_push_unknown(self, push: Push) -> None:
        """A push is past its deadline without an answer (or a SETTLE query about it went unanswered): the ledger
        marks it unknown (queries follow), and flow control counts a failure, so a peer that died is marked
        down and suspected as a peer that stopped answering fetches is."""
        if self.ledger is not None:
            self.ledger.mark_unknown(push)
        self.push_outcome(push.peer, ok=False)

    def push_outcome(self, peer: str, ok: bool) -> None:
        """Feed flow control with a push's fate (any thread): answered, or not answered in time."""
        with self.flow_lock:
            if ok:
                self.flow.success(peer)
                return
            self.flow.failure(peer)
            down = not self.flow.is_up(peer)
        if down:
            self.membership.suspect(peer)

    # ------------------------------------------------------------ ZAP thread

    def on_auth_denied(self, address: str) -> None:
        """A connection to the RX socket refused by CURVE authentication: count it, warn once."""
        self.stats.add("auth_denied")
        self.once.warning(
            ("auth_denied",),
            "node %s: refused a connection from %s: its CURVE key is not one of the cluster's nodes",
            self.name,
            address,
        )

    # ------------------------------------------------------------ RX thread

    def serve(self, request: wire.Fetch) -> Reply:
        """Answer a FETCH with the current snapshot, or an error naming why not; both carry member news."""
        self.membership.observe(request)
        if self.membership.leaving:
            self.stats.add("left_answers")
            detail = "this node has left the cluster"
            return Reply(wire.encode_error(self.name, request.req, ErrorCode.LEFT, detail, self.membership.full_news()))
        news = self.membership.reply_news(request)
        layout, pool = self.wire_layout, self.pool
        if layout is None or pool is None:
            return Reply(
                wire.encode_error(self.name, request.req, ErrorCode.NOT_READY, "no snapshot published yet", news)
            )
        if request.fingerprint != layout.fingerprint:
            detail = (
                f"{self.name} has layout {layout.fingerprint} ({len(layout.shapes)} arrays, "
                f"{layout.total_bytes} bytes), {request.node} asked for {request.fingerprint}"
            )
            self.once.warning(
                (request.node, "layout"), "node %s: refusing %s: layout mismatch: %s", self.name, request.node, detail
            )
            return Reply(wire.encode_error(self.name, request.req, ErrorCode.LAYOUT, detail))
        snapshot = pool.lease()
        if snapshot is None:
            return Reply(
                wire.encode_error(self.name, request.req, ErrorCode.NOT_READY, "no snapshot published yet", news)
            )
        if request.exchange >= 0:  # AD-PSGD: the push that came just before keeps this snapshot as its pair
            if self.inbox is None:
                pool.release(snapshot)
                return Reply(wire.encode_error(self.name, request.req, ErrorCode.UNSUPPORTED, "no exchanges here"))
            pool.retain(snapshot)
            if not self.inbox.serve_exchange(request.node, request.exchange, snapshot):
                pool.release(snapshot)  # the lease taken for the exchange
                pool.release(snapshot)  # and the one taken for the reply
                return Reply(
                    wire.encode_error(
                        self.name, request.req, ErrorCode.NOT_DELIVERED, "the exchange's push is not here"
                    )
                )
        try:
            with self.state_lock:
                if request.extras:
                    self.rule.on_request(self.state, request.extras)
                given = self.rule.on_serve(self.state)
            stream = request.stream and wire.can_stream(request.req)
            encode = functools.partial(
                wire.encode_state,
                self.name,
                request.req,
                clock=snapshot.clock,
                loss=snapshot.loss,
                extras={**snapshot.extras, **given},
                layout=layout,
                stream=stream,
                gen=snapshot.gen,
                front=snapshot.front,
            )
            try:
                header = encode(news=news)
            except ValueError:  # the member table does not fit a header: its digest goes alone
                header = encode(news=wire.MemberNews(news.digest))
        except BaseException:
            pool.release(snapshot)
            raise

        def sent(tracker: Any) -> None:
            pool.release(snapshot, tracker)
            if tracker is None and given:  # never sent: give back what on_serve handed out
                with self.state_lock:
                    self.rule.on_serve_failed(self.state, given)

        def prepare(index: int) -> None:
            pool.prepare(snapshot, index)

        return Reply(
            header, snapshot.frames, sent, prepare, request.stream and wire.can_stream(request.req), request.req
        )

    # ------------------------------------------------------------ membership (docs/membership.md)

    def sync_members(self) -> None:
        """The member table changed (any thread): fetch from, push to and take pushes from its members now."""
        if not self.synced:
            return
        with self.sync_lock:
            peers = {m.name: m for m in self.membership.peers()}
            order = self.membership.order()
            with self.flow_lock:
                known = set(self.flow.scores())
                for name in known - peers.keys():
                    self.flow.remove(name)
                for name in peers.keys() - known:
                    self.flow.add(name)
            for name, member in peers.items():
                endpoint = member.spec().endpoint
                if self.endpoints.get(name) != endpoint:
                    self.endpoints[name] = endpoint
                    self.tx.set_peer(name, endpoint)
            for name in set(self.endpoints) - peers.keys():
                del self.endpoints[name]
                self.tx.set_peer(name, None)
                if self.membership.get(name) is None:  # forgotten: nobody will answer, nothing is kept of it
                    self.forget_member(name)
            if self.inbox is not None:
                self.inbox.set_senders(list(peers))
            self.names = order
            with self.state_lock:
                self.rule.on_members(self.name, order, float(self.membership.incarnations()))

    def forget_member(self, name: str) -> None:
        """A member forgotten (caller holds the sync lock): abandon an unanswerable push to it, drop what the
        node keeps per peer (outcome counts, logged-once keys, a cached key), so memory follows the table."""
        if self.ledger is not None:
            push = self.ledger.abandon(name)
            if push is not None:
                self.stats.add("pushes_lost")
                self.release_snapshot(push.snapshot, push.tracker)
        self.stats.forget_peer(name)
        self.once.forget(name)
        self.fetched_gens.pop(name, None)
        if self.security is not None:
            self.security.forget(name)

    def on_membership_message(self, header: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
        """RX thread: a PUSH's member news (no answer), a JOIN (answered MEMBERS or ERROR join-refused), or a
        MEMBERS announcement (answered with this node's table)."""
        if header.kind is Kind.PUSH:
            self.membership.observe(header)
            return None
        if header.kind is Kind.MEMBERS:
            trusted = self.security is None or user == header.node  # with CURVE, the sender is its key's name
            self.membership.observe(header, authenticated=trusted)
            leaver = self.membership.get(header.node)
            if header.settled is not None and trusted and leaver is not None and leaver.state == "left":
                self.settle_with_leaver(header.node, *header.settled)
            return wire.encode_members(self.name, header.req, self.membership.full_news())
        refused = None
        if self.membership.leaving:
            refused = f"{self.name} is leaving the cluster; join through another member"
        elif self.security is not None and user != header.node:
            refused = f"the joining node calls itself {header.node!r} but its CURVE key is {user!r}'s"
        else:
            try:
                entry = self.membership.admit(header.node, header.host, header.port)
            except JoinRefused as err:
                refused = str(err)
        if refused is not None:
            self.stats.add("joins_refused")
            log.warning("node %s: refused a join of %s: %s", self.name, header.node, refused)
            return wire.encode_error(self.name, header.req, ErrorCode.JOIN_REFUSED, refused)
        self.stats.add("joins_admitted")
        log.info(
            "node %s: %s joined from %s:%d (version %d)", self.name, entry.name, entry.host, entry.port, entry.version
        )
        return wire.encode_members(
            self.name,
            header.req,
            self.membership.full_news(),
            permanent=self.membership.permanent(),
            mass=float(self.membership.incarnations()),
        )

    def settle_with_leaver(self, peer: str, last: int, verdict: bool | None) -> None:
        """(RX thread; only for a MEMBERS from ``peer`` itself, with CURVE, that says it is ``left``.) ``peer`` left
        and says the latest push of this node it saw was ``last``, taken (True) or not: settle an
        open push to it (taken: delivered; refused, never arrived, or still arriving when it left: the mass
        comes back)."""
        push = self.ledger.open_push(peer) if self.ledger is not None else None
        if push is None:
            return
        delivered = last == push.seq and verdict is True
        self.ledger.settle(push, "delivered" if delivered else "refused", "left")  # type: ignore[union-attr]

    def control_socket(self) -> zmq.Socket:
        """A DEALER for membership messages (JOIN, MEMBERS) to one member: the data sockets' options, and frames
        no larger than a header (the answer is one), and a retry every CONTROL_RECONNECT_MS while the member is
        not listening yet (ZeroMQ's default, 100 ms, would start nodes that wait for each other that far apart).
        Not connected; the caller closes it."""
        sock = self.ctx.socket(zmq.DEALER)
        _common_options(sock)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, CONTROL_RECONNECT_MS)
        return sock

    def join(self, address: JoinAddress, timeout_s: float) -> Member:
        """Trainer thread, before the first step: ask the member at ``address`` to admit this node (a JOIN,
        repeated every ``timeout_ms`` until ``timeout_s``), then take the cluster's table from its answer.

        JoinRefused (the member's reason: a name clash, a file node's name) or TimeoutError (no answer; with
        CURVE, an unlisted key looks the same)."""
        me = self.membership.me
        sock = self.control_socket()
        deadline = time.monotonic() + timeout_s
        retry_s = self.config.timeout_ms / 1000.0
        try:
            if self.security is not None:
                self.security.client(sock, address.name)
            sock.connect(connect_address(f"tcp://{address.host}:{address.port}"))
            while True:
                req = next(self.requests)
                try:
                    sock.send(wire.encode_join(self.name, req, me.host, me.port), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet: ask again after retry_s
                until = min(deadline, time.monotonic() + retry_s)
                while (left := until - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    answer = self.join_answer(sock.recv_multipart(zmq.NOBLOCK), req, address)
                    if answer is not None:
                        return answer
                if time.monotonic() >= deadline:
                    hint = (
                        f"; with security.curve on, is {self.name}.key in every member's key directory?"
                        if self.security is not None
                        else ""
                    )
                    raise TimeoutError(
                        f"node {self.name}: no answer to its JOIN from {address} in {timeout_s:g} s"
                        f" (is a member listening there?){hint}"
                    )
        finally:
            sock.close(linger=0)

    def join_answer(self, frames: list[bytes], req: int, address: JoinAddress) -> Member | None:
        """The answer to JOIN ``req``: this node's entry once the table is taken; None for an unrelated message."""
        try:
            header = wire.decode_message(frames[0]) if len(frames) == 1 else None
        except wire.WireError:
            header = None
        if header is None or header.req != req:
            self.stats.add("stale_replies")
            return None
        if header.kind is Kind.ERROR:
            raise JoinRefused(f"node {self.name}: the member at {address} refused to admit it: {header.detail}")
        if header.kind is not Kind.MEMBERS or header.members is None:
            self.stats.add("stale_replies")
            return None
        fixed = [m.spec() for m in header.members if m.name in header.permanent]
        own = self.membership.adopt(fixed, header.members, mass=header.mass)
        log.info(
            "node %s: joined the cluster through %s (%s) as version %d; %d members",
            self.name,
            header.node,
            address,
            own.version,
            len(self.membership.order()),
        )
        return own

    def leave(self, timeout_s: float, final_mix: bool = False) -> None:
        """Trainer thread, at a clean close: hand what the rule holds to a member (push-sum: its mass), mark this
        node ``left`` and tell every member (waiting at most ``ANNOUNCE_S`` for their answers); from then on
        every request is answered ``left``, with the table. Bounded by ``timeout_s`` in all.

        The hand-off folds in what arrived before it hands the mass over; ``final_mix`` False (the default) puts
        the trainer's arrays back as they were before, so the model the user saves after closing is the one they
        last trained and evaluated; True leaves the fold in them."""
        deadline = time.monotonic() + timeout_s
        if self.ledger is not None and self.params is not None:
            kept = None if final_mix else [np.array(a, copy=True) for a in self.params]
            try:
                self.hand_off(deadline)
            finally:
                for array, before in zip(self.params, kept or ()):
                    np.copyto(array, before)
        self.membership.leave()
        self.announce(min(deadline, time.monotonic() + ANNOUNCE_S))

    def hand_off(self, deadline: float) -> None:
        """Push rules, leaving: settle the pushes to members that are up, take no more, fold in everything that
        arrived, then push the rule's hand-off (push-sum: the whole ``(x, w)``) to one up member after another
        until one takes it. Bounded by ``deadline``."""
        assert self.ledger is not None and self.inbox is not None and self.pool is not None
        self.inbox.closing = True  # from now on every push is refused busy: the senders keep their mass
        with self.flow_lock:
            up = set(self.flow.up_peers())
        self.ledger.wait_settled(max(0.0, deadline - time.monotonic()), waited=lambda peer: peer in up)
        while self.inbox.receiving() and time.monotonic() < deadline:
            time.sleep(0.01)  # a push already arriving completes or expires within timeout_ms
        for _ in range(self.config.inbox_slots + 1):  # one push per sender per fold: fold until empty
            self.wait_and_mix(None)  # the inbox, and the pushes that came back
            if not self.inbox.occupied():
                break
        with self.flow_lock:
            candidates = [p for p in self.flow.up_peers() if not self.ledger.busy(p)]
        self.rng.shuffle(candidates)
        for peer in candidates:
            if time.monotonic() >= deadline:
                break
            snapshot = self.publish(tick=False)
            if snapshot is None:
                break
            with self.state_lock:
                given = self.rule.hand_off(self.state)
            if given is None:
                return
            self.pool.retain(snapshot)  # the push's lease (publish leaves none)
            due = min(deadline, time.monotonic() + self.config.timeout_ms / 1000.0)
            prepare = functools.partial(self.pool.prepare_push, snapshot)
            push = Push(peer, next(self.requests), given, snapshot, due, prepare=prepare)
            self.ledger.open(push)
            self.tx.submit_push(push)
            self.ledger.wait_for(push, max(0.0, deadline - time.monotonic()))
            if push.status == "delivered":
                log.info("node %s: handed its mass %s to %s", self.name, given, peer)
                self.wait_pushes()
                self.stats.add("hand_offs")
                return
            if push.status != "refused":  # no answer in time: the mass is with the peer or on the way
                log.warning("node %s: its hand-off to %s was not answered before it left", self.name, peer)
                return
            self.wait_and_mix(None)  # refused: the mass came back; try the next member
        if candidates:
            log.warning("node %s: no member took its mass before it left; it leaves with it", self.name)
        else:
            log.info("node %s: no member is up to take its mass; it leaves with it", self.name)

    def announce(self, deadline: float) -> None:
        """Send this node's table (which says it left) to every member flow control thinks up, and wait until
        ``deadline`` for their answers; a member whose connection is refused (a socket monitor says so: a dead
        node on a live host) is not waited for."""
        news = self.membership.full_news()
        with self.flow_lock:
            members = [m for m in self.membership.peers() if self.flow.is_up(m.name)]

        def message(member: Member) -> bytes:
            settled = self.inbox.verdict_for(member.name) if self.inbox is not None else None
            return wire.encode_members(self.name, next(self.requests), news, settled=settled)

        answered = self.ask_members(members, message, deadline, refused_ends=True)
        self.stats.add("leave_acknowledged", len(answered))

    def wait_for_peers(self, timeout_s: float) -> dict[str, bool]:
        """Trainer thread, before training: send every member this node's table (a MEMBERS message, which a
        node's server answers as soon as it listens) and wait until each has answered or ``timeout_s`` passed.
        A member not listening yet is waited for (ZeroMQ delivers once it binds). Member name -> answered."""
        news = self.membership.full_news()
        members = list(self.membership.peers())
        deadline = time.monotonic() + timeout_s

        def message(member: Member) -> bytes:
            return wire.encode_members(self.name, next(self.requests), news)

        answered = self.ask_members(members, message, deadline, refused_ends=False)
        self.started_with |= answered
        return {m.name: m.name in answered for m in members}

    def ask_members(
        self, members: Sequence[Member], message: Callable[[Member], bytes], deadline: float, *, refused_ends: bool
    ) -> set[str]:
        """Send each member ``message(member)`` on a control socket of its own and wait until ``deadline`` for
        their answers (answers are not read further); ``refused_ends``: a member whose connection is refused
        (a socket monitor says so) is not waited for. The names that answered."""
        socks: dict[zmq.Socket, str] = {}
        members_by_name = {m.name: m for m in members}
        monitors: dict[zmq.Socket, zmq.Socket] = {}  # monitor -> its DEALER
        answered: set[str] = set()
        unreachable: set[zmq.Socket] = set()  # not even sent to: not waited for
        try:
            for m in members:
                try:
                    sock = self.control_socket()
                except zmq.ZMQError as exc:  # out of sockets (a very large table): the rest learn by gossip
                    log.warning("node %s: reached %d of %d members: %s", self.name, len(socks), len(members), exc)
                    break
                socks[sock] = m.name
                if refused_ends:
                    try:
                        monitors[sock.get_monitor_socket(UNREACHABLE_EVENTS)] = sock
                    except zmq.ZMQError:
                        pass  # unmonitored: waited for until the deadline
                try:
                    if self.security is not None:
                        self.security.client(sock, m.name)
                    sock.connect(connect_address(m.spec().endpoint))
                    sock.send(message(m), zmq.NOBLOCK)
                except (zmq.ZMQError, KeyError, OSError, ValueError):
                    unreachable.add(sock)
                    continue
            poller = zmq.Poller()
            for sock in [*socks, *monitors]:
                poller.register(sock, zmq.POLLIN)
            waiting = set(socks) - unreachable
            while waiting and (left := deadline - time.monotonic()) > 0:
                for sock, _ in poller.poll(int(min(left, 0.1) * 1000) + 1):
                    if sock in monitors:  # the member's address refused the connection: nobody there
                        recv_monitor_message(sock, zmq.NOBLOCK)
                        waiting.discard(monitors[sock])
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    if frames and is_own_echo(frames[0], self.name):  # connected to itself: not an answer
                        self.stats.add("self_connections")
                        member = members_by_name[socks[sock]]
                        sock.disconnect(connect_address(member.spec().endpoint))  # then try again
                        sock.connect(connect_address(member.spec().endpoint))
                        sock.send(message(member), zmq.NOBLOCK)
                        continue
                    if sock in waiting:
                        waiting.discard(sock)
                        answered.add(socks[sock])
        finally:
            for sock in socks:
                if refused_ends:
                    sock.disable_monitor()
                sock.close(linger=0)
            for monitor in monitors:
                monitor.close(linger=0)
        return answered

    # ------------------------------------------------------------ any thread

    def snapshot_stats(self) -> dict[str, Any]:
        out = self.stats.snapshot()
        with self.flow_lock:
            out["scores"] = self.flow.scores()
            out["peers_up"] = self.flow.up_peers()
        with self.state_lock:
            out["clock"] = self.state.clock
            out["extras"] = dict(self.state.extras)
        out["node"] = self.name
        out.update(self.membership.snapshot())
        out["rule"] = self.rule.name
        out["schedule"] = self.schedule.name
        out["snapshot_buffers"] = len(self.pool) if self.pool is not None else 0
        if self.ledger is not None:
            out["push_in_flight"] = self.ledger.in_flight("w_given")
            out["pushes_unsettled"] = len(self.ledger.unresolved())
        if self.inbox is not None:
            out["inbox_mass"] = self.inbox.pending_mass("w_given")
            out["inbox_occupied"] = self.inbox.occupied()
        out["rx_alive"], out["tx_alive"] = self.rx.is_alive(), self.tx.is_alive()
        out["thread_errors"] = {
            role: repr(thread.failure) for role, thread in (("rx", self.rx), ("tx", self.tx)) if thread.failure
        }
        return out

    def linger(self, seconds: float, idle_s: float = 1.0) -> float:
        """Keep serving the last snapshot for up to ``seconds``, less once no peer fetched for ``idle_s``.

        A node that finished training and closed at once would cost every peer still training
        a timeout or three before flow control marks it down. Returns the seconds spent.

        An exchange rule's node (AD-PSGD) refuses new exchanges ``busy`` while it lingers: it trains no more, so it
        would never apply its half of them while the peer applied its own, and the pair's sum (the cluster's mean)
        would drift. Pulls are still served, and a push rule's node still takes pushes: its hand-off folds them.
        """
        if self.inbox is not None and self.ledger is None:
            self.inbox.closing = True
        start = last = time.monotonic()
        served = self.stats.snapshot()["served"]
        while not self.closed:
            now = time.monotonic()
            if now - start >= seconds or now - last >= idle_s:
                break
            time.sleep(min(0.05, idle_s / 4))
            current = self.stats.snapshot()["served"]
            if current != served:
                served, last = current, time.monotonic()
        return time.monotonic() - start

    def close(self, announce: bool = True, final_mix: bool = False) -> None:
        """Leave cleanly (``announce``: :meth:`leave`, bounded by ``2 * timeout_ms`` + 1 s; ``final_mix``: see there),
        then stop both threads (within about a second) and free the port. A node whose threads died leaves without
        announcing."""
        if self.closed:
            return
        if threading.current_thread() in (self.rx, self.tx):  # pragma: no cover - misuse
            raise RuntimeError("close() called from a dpwa thread")
        if announce and self.tx.failure is None and self.rx.failure is None and not self.membership.leaving:
            try:
                self.leave(2 * self.config.timeout_ms / 1000.0, final_mix)
            except Exception:  # leaving is a courtesy: the node still closes
                log.exception("node %s: leaving the cluster failed", self.name)
        self.closed = True
        self.rx.stop()
        self.tx.stop()
        if self.pool is not None:
            self.pool.close(timeout=1.0)
        self.rx.join(timeout=JOIN_S)
        self.tx.join(timeout=JOIN_S)
        self.tx.close_waker()
        if self.rx.is_alive() or self.tx.is_alive():  # pragma: no cover - a stuck thread is a bug
            log.error("node %s: a dpwa thread did not stop; leaving its context open", self.name)
            return
        if self.security is not None and not self.security.stop():  # only now: the ROUTER is closed
            log.error("node %s: the ZAP thread did not stop; leaving its context open", self.name)  # pragma: no cover
            return
        self.ctx.term()
        log.info("node %s closed", self.name)
