"""DpwaConnection: one gossip node, framework-free (numpy arrays in, numpy arrays mixed in place).

Around each batch::

    conn.update_send(params, loss)   # clock += 1, publish a snapshot, maybe start a fetch
    loss = train(batch)              # the trainer changes params in place
    f = conn.update_wait(loss)       # wait <= timeout_ms after the fetch started, mix, return f

Only the trainer's thread ever writes the trainer's arrays. The RX thread serves
published snapshots; the TX thread fills preallocated receive buffers and
validates them; a rejected reply is counted and never reaches the arrays.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from . import recovery, wire
from .checkpoint import DpwaState
from .config import ClusterConfig, resolve_config
from .peers import FlowControl
from .rules import NodeState, PeerSnapshot, Rule, make_rule
from .schedules import Round, Schedule, make_schedule
from .security import NodeSecurity, warn_if_exposed
from .snapshots import SnapshotPool
from .stats import NodeStats, OnceLog
from .transport import FetchJob, FetchTarget, Reply, RxServer, TxFetcher
from .wire import ErrorCode, Header, Layout

log = logging.getLogger(__name__)

WAIT_SLACK_S = 0.05
"""How long update_wait waits past a fetch's deadline for the TX thread's verdict."""


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


class _Node:
    """Everything a node is, minus the public facade; the threads hold only this object."""

    def __init__(self, name: str, config: ClusterConfig, rule: Rule, schedule: Schedule, seed: int | None) -> None:
        self.name = name
        self.config = config
        me = config.node(name)
        peers = config.peers_of(name)
        self.names = tuple(n.name for n in config.nodes)
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
        self.alone = False
        self.caught_up = False  # recovery: a peer was copied, or the first reply was checked for "far behind"
        self.mixing = False
        self.last_exchange: dict[str, Any] | None = None
        self.closed = False
        self.ctx = zmq.Context(io_threads=1)
        self.security: NodeSecurity | None = None
        try:
            if config.security.curve:  # reads the keys and starts the ZAP handler: before the ROUTER binds
                self.security = NodeSecurity(config, name, self.ctx, self.on_auth_denied)
            self.rx = RxServer(
                self.ctx,
                bind_endpoint(me.host, me.port),
                self.serve,
                self.stats.add,
                name=f"dpwa-rx-{name}",
                setup=self.security.server if self.security is not None else None,
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
        )
        self.rx.start()
        self.tx.start()
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
        self.pool = SnapshotPool(layout, wire=wire_layout, name=self.name, defer=self.exchanging)
        for _ in range(max(1, self.schedule.max_fanout(len(self.names)))):
            buffer = layout.allocate()
            self.receive_slots.append((buffer, layout.views(buffer)))
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
        """Raise RuntimeError, the original exception chained, when the RX or TX thread died of a bug."""
        for role, thread, lost in (("TX", self.tx, "fetch from"), ("RX", self.rx, "serve")):
            if thread.failure is not None:
                raise RuntimeError(
                    f"node {self.name}: the {role} thread died of {thread.failure!r}, so the node can no longer "
                    f"{lost} its peers (traceback in the log); close the connection"
                ) from thread.failure

    def update_send(self, params: Sequence[np.ndarray], loss: Any) -> None:
        value = _as_loss(loss)
        self.check_threads()
        if self.layout is None:
            self.setup_layout(params)
        elif not self.layout.matches(params):
            raise ValueError("params changed layout (count, dtype or shape) since the first update_send")
        assert self.pool is not None
        self.params = list(params)
        with self.state_lock:
            self.state.clock += 1
            self.state.loss = value
            clock, extras = self.state.clock, dict(self.state.extras)
        snapshot = self.pool.publish(self.params, clock, value, extras)
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
        self.start_fetch()
        self.step += 1

    def start_fetch(self) -> None:
        if self.pending is not None and not self.pending.done.is_set():
            self.stats.add("fetches_skipped")  # update_wait was not called for the previous fetch
            return
        self.pending = None
        if self.rng.random() >= self.config.fetch_probability:
            return
        with self.state_lock:
            wanted = self.schedule.targets(Round(self.name, self.names, self.step, self.state))
            request_extras = self.rule.request_extras(self.state)
        with self.flow_lock:
            if wanted is None:
                chosen = self.flow.choose(self.schedule.fanout)
            else:
                chosen = self.flow.admit([p for p in wanted if p != self.name])
        chosen = chosen[: len(self.receive_slots)]
        if not chosen:
            self.stats.add("fetches_skipped")
            if not self.alone and len(self.names) > 1 and (wanted is None or wanted):
                log.warning("node %s: no peer is up; training alone (factor 0) until one answers", self.name)
            self.alone = True
            return
        targets = [FetchTarget(peer, buf, views) for peer, (buf, views) in zip(chosen, self.receive_slots)]
        deadline = time.monotonic() + self.config.timeout_ms / 1000.0
        self.pending = FetchJob(next(self.requests), targets, deadline, request_extras)
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
                self.last_exchange = {"step": self.state.clock, "factor": 0.0, "peer": None}
                return 0.0
            return self.wait_and_mix(job)
        finally:
            self.mixing = False

    def wait_and_mix(self, job: FetchJob | None) -> float:
        """update_wait's work: wait for the TX thread's verdict (bounded), run the rule, record the exchange."""
        assert self.params is not None
        waited = time.perf_counter()
        if job is not None and not job.done.wait(max(0.0, job.deadline - time.monotonic()) + WAIT_SLACK_S):
            for target in job.expire():  # a busy or stalled TX thread: time its targets out here, ignore it later
                self.on_target(job, target)
        self.check_threads()  # the TX thread may have died while we waited
        mixing = time.perf_counter()
        targets = job.targets if job is not None else []
        peers = [
            PeerSnapshot(NodeState(t.peer, t.header.clock, t.header.loss, dict(t.header.extras)), t.views)
            for t in targets
            if t.status == "ok" and t.header is not None
        ]
        with self.state_lock:
            clock_before = self.state.clock
            for t in targets:
                if t.status in ("timeout", "rejected"):
                    self.rule.on_reply_lost(self.state, dict(t.header.extras) if t.header is not None else None)
            outcome = recovery.take_over_if_far_behind(self, peers) if peers and not self.caught_up else None
            if outcome is None:
                outcome = self.rule.mix(self.state, self.params, peers)  # every step: some rules track their motion
        mixed = time.perf_counter()
        if peers:
            self.stats.add("mixes")
        record: dict[str, Any] = {
            "step": clock_before,
            "factor": outcome.factor,
            "peer": ",".join(t.peer for t in targets) or None,
            "status": ",".join(t.status for t in targets) or None,
            "bytes": sum(t.nbytes for t in targets),
            "fetch_ms": max((t.ms for t in targets), default=0.0),
            "clock_gap": (sum(p.state.clock for p in peers) / len(peers) - clock_before) if peers else None,
            "wait_ms": (mixing - waited) * 1000.0,
            "mix_ms": (mixed - mixing) * 1000.0,
        }
        record.update(outcome.metrics)
        self.last_exchange = record
        return outcome.factor

    # ------------------------------------------------------------ TX thread

    def on_target(self, job: FetchJob, target: FetchTarget) -> None:
        """Count a finished fetch and feed flow control."""
        peer = target.peer
        self.stats.peer_outcome(peer, target.status)
        not_ready = target.status == "refused" and target.code == wire.ErrorCode.NOT_READY.value
        if target.status == "ok":
            self.stats.fetch_done(target.ms, target.nbytes)
            with self.flow_lock:
                self.flow.success(peer)
            if self.alone:
                log.info("node %s: peer %s answers; mixing again", self.name, peer)
                self.alone = False
            return
        if not not_ready:  # a peer still starting up is alive: no penalty, ask again next time
            with self.flow_lock:
                self.flow.failure(peer)
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
            self.stats.add("fetches_refused")
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

    def serve(self, request: Header) -> Reply:
        """Answer a FETCH with the current snapshot, or an error naming why not."""
        layout, pool = self.wire_layout, self.pool
        if layout is None or pool is None:
            return Reply(wire.encode_error(self.name, request.req, ErrorCode.NOT_READY, "no snapshot published yet"))
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
            return Reply(wire.encode_error(self.name, request.req, ErrorCode.NOT_READY, "no snapshot published yet"))
        try:
            with self.state_lock:
                if request.extras:
                    self.rule.on_request(self.state, request.extras)
                given = self.rule.on_serve(self.state)
            stream = request.stream and wire.can_stream(request.req)
            header = wire.encode_state(
                self.name,
                request.req,
                clock=snapshot.clock,
                loss=snapshot.loss,
                extras={**snapshot.extras, **given},
                layout=layout,
                stream=stream,
            )
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

        return Reply(header, snapshot.frames, sent, prepare, stream, request.req)

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
        out["rule"] = self.rule.name
        out["schedule"] = self.schedule.name
        out["snapshot_buffers"] = len(self.pool) if self.pool is not None else 0
        out["rx_alive"], out["tx_alive"] = self.rx.is_alive(), self.tx.is_alive()
        out["thread_errors"] = {
            role: repr(thread.failure) for role, thread in (("rx", self.rx), ("tx", self.tx)) if thread.failure
        }
        return out

    def linger(self, seconds: float, idle_s: float = 1.0) -> float:
        """Keep serving the last snapshot for up to ``seconds``, less once no peer fetched for ``idle_s``.

        A node that finished training and closed at once would cost every peer still training
        a timeout or three before flow control marks it down. Returns the seconds spent.
        """
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

    def close(self) -> None:
        """Stop both threads (within about a second) and free the port."""
        if self.closed:
            return
        self.closed = True
        if threading.current_thread() in (self.rx, self.tx):  # pragma: no cover - misuse
            raise RuntimeError("close() called from a dpwa thread")
        self.rx.stop()
        self.tx.stop()
        if self.pool is not None:
            self.pool.close(timeout=1.0)
        self.rx.join(timeout=1.0)
        self.tx.join(timeout=1.0)
        self.tx.close_waker()
        if self.rx.is_alive() or self.tx.is_alive():  # pragma: no cover - a stuck thread is a bug
            log.error("node %s: a dpwa thread did not stop; leaving its context open", self.name)
            return
        if self.security is not None and not self.security.stop():  # only now: the ROUTER is closed
            log.error("node %s: the ZAP thread did not stop; leaving its context open", self.name)  # pragma: no cover
            return
        self.ctx.term()
        log.info("node %s closed", self.name)


class DpwaConnection:
    """A dpwa node: serves its parameters to peers and mixes theirs into its own.

    ``DpwaConnection(name, config)`` where ``config`` is a cluster file path or a
    loaded :class:`~dpwa.config.ClusterConfig`. ``seed`` makes peer choice and
    fetch coin-flips reproducible; ``rule`` overrides the configured rule.
    """

    def __init__(
        self,
        name: str,
        config: ClusterConfig | str | os.PathLike[str],
        *,
        seed: int | None = None,
        rule: Rule | None = None,
    ) -> None:
        cfg = resolve_config(config)
        cfg.node(name)  # a clear ConfigError before anything starts
        if rule is None:
            rule = make_rule(cfg.interpolation, cfg.settings, cfg.divergence_threshold)
        schedule = make_schedule(cfg.schedule, cfg.settings)
        self._node = _Node(name, cfg, rule, schedule, seed)
        self._finalizer = weakref.finalize(self, _Node.close, self._node)

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def config(self) -> ClusterConfig:
        return self._node.config

    @property
    def endpoint(self) -> str:
        """The tcp:// endpoint the RX thread is bound to."""
        return self._node.rx.endpoint

    @property
    def clock(self) -> float:
        """Batches trained, fractional after clock-mixing."""
        return self._node.state.clock

    @property
    def last_exchange(self) -> dict[str, Any] | None:
        """The last update_wait as a metrics record.

        Keys: step, factor, peer, status, bytes, fetch_ms, clock_gap, wait_ms (how long update_wait
        blocked waiting for the fetch), mix_ms (the rule's mix), and the rule's own metrics.
        """
        return self._node.last_exchange

    def update_send(self, params: Sequence[np.ndarray], loss: Any) -> None:
        """clock += 1; publish a copy of ``params`` (same list every call); maybe start a fetch.

        A fetch starts with probability ``fetch_probability``; its deadline is ``timeout_ms`` from now.
        """
        self._node.update_send(params, loss)

    def update_wait(self, loss: Any) -> float:
        """Wait at most until the fetch's deadline, mix into params in place; return the factor (0.0 = no mix).

        Never waits past the deadline plus 50 ms: a verdict the TX thread has not given by then is a
        timeout (``fetches_late``), and the reply, should it come later, is dropped. Raises RuntimeError
        (the cause chained) once the RX or TX thread has died of a bug, as does update_send.
        """
        return self._node.update_wait(loss)

    def bootstrap(self, params: Sequence[np.ndarray], timeout_s: float | None = None) -> str | None:
        """Before the first ``update_send``: copy one peer's model into ``params`` (factor 1) if that peer's
        clock is ahead; return its name, or None when no peer answered within ``timeout_s`` (default: the
        cluster's ``bootstrap_timeout_s``) or the one that answered was not ahead.  See :mod:`dpwa.recovery`.
        """
        timeout = self.config.bootstrap_timeout_s if timeout_s is None else timeout_s
        return recovery.bootstrap(self._node, params, timeout)

    def dpwa_state(self) -> DpwaState:
        """The node's gossip state for a checkpoint: clock, step, loss, the rule's scalar extras and arrays."""
        return recovery.export_state(self._node)

    def restore_state(self, state: DpwaState, params: Sequence[np.ndarray] | None = None) -> None:
        """Take back a :meth:`dpwa_state` (trainer thread, before training goes on); ``params`` lets the rule's
        arrays (GEM's proxy) be checked against the parameters and restored."""
        recovery.restore_state(self._node, state, params)

    def wait_published(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until the last ``update_send``'s snapshot can be served whole; True if so.

        Only a 16-bit ``wire_dtype`` makes this wait (the snapshot is rounded in the background); False also
        before the first ``update_send``.
        """
        pool = self._node.pool
        return pool is not None and pool.wait_ready(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters (fetches ok / timed out / refused / rejected, bytes, mean fetch ms, ...) and flow-control scores.

        Also ``rx_alive`` / ``tx_alive`` (the threads run) and ``thread_errors`` (role -> repr of what killed it).
        """
        return self._node.snapshot_stats()

    def close(self, linger: float = 0.0, idle: float = 1.0) -> None:
        """Stop the RX/TX threads and free the port; idempotent.

        ``linger`` > 0: first keep serving peers that still fetch, for at most that many seconds,
        returning early once nobody fetched for ``idle`` seconds (set it above a peer's step time).
        """
        if linger > 0 and not self.closed:
            spent = self._node.linger(linger, idle)
            log.info("node %s served its peers %.1fs after training", self.name, spent)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._node.closed

    def __enter__(self) -> DpwaConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DpwaConnection({self.name!r}, {self.endpoint!r}, rule={self._node.rule.name!r})"
