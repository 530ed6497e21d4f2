"""Published parameter snapshots: a small pool of flat buffers shared by the trainer and the RX thread.

The trainer copies its parameters into a free buffer and publishes it by
swapping one reference. The RX thread leases the current snapshot, hands its
frames to ZeroMQ without copying, and returns the lease with the send's
tracker. A buffer is reused only when it is not published, not leased and
every send that referenced it has completed, so a slow requester never sees a
half-overwritten model and the trainer never waits for one.

With a ``wire_dtype`` narrower than the parameters, every snapshot also has a
wire buffer. ``publish`` still makes one plain copy (the trainer's cost stays
one memcpy, and the rules keep exact views of the published values). The
rounding into the wire buffer (or, under ``int8``, the blockwise quantization:
a chunk may hold any part of an array's scales and values) is done chunk by
chunk, once per snapshot however many peers fetch it, by whichever thread gets
to a chunk first:

* a converter thread of the pool rounds every newly published snapshot in the
  background, so the rounding overlaps the trainer's step (a peer that fetches
  later finds the wire buffer ready). It yields to the node's own exchange: while
  ``defer()`` is true (the connection says: my fetch is in flight or I am mixing)
  it waits, so it never competes with the trainer's critical path;
* the RX thread rounds any chunk not ready yet just before sending it
  (:meth:`SnapshotPool.prepare`), so a fetch never waits for the whole model.

A pool that keeps its snapshots *in the wire's dtype alone* (``wire_only``: ``transport.memory: low`` with a
narrower ``wire_dtype``, for a rule that never reads the values it published) has no plain copy: ``publish``
rounds the parameters straight into the wire buffer (about one memcpy when torch is loaded), so a snapshot takes
the wire's size, half a float32 model in a 16-bit dtype, and no converter thread runs.

In shared memory (co-located peers read the buffers where they are), a pool whose wire layout is its local one
runs the same thread as a *checker* while it lends snapshots: it reads each new snapshot once and, when every
value is finite, says so in the segment's header (:attr:`Snapshot.attested`), so a reader that mixes straight
from the segment need not read the model again.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dpwa.node.sharedmem import Segment
from dpwa.node.wire import CHUNK_BYTES, FiniteChecker, Layout, PayloadWriter

__all__ = [
    "ATTEST_WHILE_LENT_S",
    "DEFER_S",
    "DRAIN_POLL_S",
    "GEN_START_BOUND",
    "POLL_S",
    "Snapshot",
    "SnapshotPool",
    "Tracker",
    "open_pool",
    "receive_layout",
]

log = logging.getLogger(__name__)

GEN_START_BOUND = 1 << 62
"""A pool's first generation is drawn from [1, this]: far below the wire's limit, 2^64 - 1."""

ATTEST_WHILE_LENT_S = 10.0
"""A pool in shared memory checks (attests) its new snapshots while it lent one this recently; with no co-located
reader it spends nothing on it."""
POLL_S = 0.1
"""Longest the converter thread sleeps before it looks at its stop flag."""
DEFER_S = 0.001
"""How often a deferred converter looks again."""
DRAIN_POLL_S = 0.0005
"""How often a one-buffer pool's publish looks whether the sends of its snapshot have ended."""


class Tracker(Protocol):
    """What a zero-copy send hands back: ``done`` once ZeroMQ has released the memory."""

    @property
    def done(self) -> bool: ...


@dataclass
class Snapshot:
    """One flat buffer with its array views, payload frames and the state published with it.

    ``frames`` are the chunks of the wire buffer (``buffer`` itself when the wire layout is the
    local one); ``ready`` counts the chunks already rounded into it (all of them without
    conversion), advanced under ``convert_lock`` one chunk at a time. A pool that keeps snapshots in the
    wire's dtype alone has no plain copy: ``buffer`` is the wire buffer, ``views`` and ``readonly`` are empty.
    """

    buffer: np.ndarray
    views: list[np.ndarray]
    frames: list[memoryview]
    readonly: list[np.ndarray]
    wire_views: list[np.ndarray] | None = None
    ready: int = 0
    convert_lock: threading.Lock = field(default_factory=threading.Lock)
    clock: float = 0.0
    loss: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    front: int = -1
    """The most steps (``update_send`` calls) the publishing node knew any node to have started, its own
    included; -1: not said."""
    gen: int = 0
    """Which publish of the pool this buffer holds: a counter that starts at a random value per pool (so a node
    restarted under the same name does not repeat the generations its peers saw) and grows by 1 per publish. A
    requester that gets the same ``gen`` twice knows the node published nothing new in between."""
    leases: int = 0
    trackers: list[Tracker] = field(default_factory=list)
    segment: Segment | None = None
    """The shared-memory segment the wire buffer lies in (co-located peers read it there); None: private memory."""
    attested: bool | None = False
    """Whether the pool's checker thread found every value finite (and said so in the segment); None: not yet."""

    def release(self) -> None:
        """Drop every view of the buffers (the pool closed): what is left of them goes with the views held
        elsewhere (a send in flight, a rule that kept the values published)."""
        self.buffer = np.empty(0, self.buffer.dtype)
        self.views, self.frames, self.readonly, self.wire_views, self.trackers = [], [], [], None, []
        self.ready = 0

    def busy(self) -> bool:
        """True while a lease is out or a send still references the buffer."""
        self.trackers = [t for t in self.trackers if not t.done]
        return self.leases > 0 or bool(self.trackers)


class SnapshotPool:
    """``size`` buffers allocated up front, growing to ``max_size`` only when all are busy.

    A pool of one buffer (``max_size`` 1: ``transport.memory: low``) rewrites it in place: :meth:`publish` refuses
    new leases (:meth:`lease` returns None: a requester is told "not ready"), waits at most ``drain_s`` seconds for
    the sends and loans of the current snapshot to end, then copies; when they do not end in time it keeps the
    current snapshot (counted in ``skipped``) and leases resume.

    ``wire``: the layout snapshots travel in, when it differs from ``layout`` (a narrower
    ``wire_dtype``); the pool then runs a converter thread named ``dpwa-wire-<name>`` (none with ``wire_only``)
    until :meth:`close`, which waits between chunks while ``defer()`` returns True. ``shared``: every wire buffer
    lies in a shared-memory segment of its own (:class:`~dpwa.node.sharedmem.Segment`), which says the
    generation it holds (0 while being written); :meth:`close` closes them. ``wire_only`` (with a ``wire``
    layout of its own): a snapshot is its wire buffer alone, which :meth:`publish` rounds the arrays into.
    """

    def __init__(
        self,
        layout: Layout,
        size: int = 3,
        max_size: int = 6,
        chunk: int = CHUNK_BYTES,
        wire: Layout | None = None,
        name: str = "node",
        defer: Callable[[], bool] | None = None,
        shared: bool = False,
        drain_s: float = 1.0,
        unpair: Callable[[Snapshot], None] | None = None,
        wire_only: bool = False,
    ) -> None:
        self.layout = layout
        self._drain_s = drain_s
        self._unpair = unpair
        self._rewriting = False
        """A one-buffer pool is rewriting its current snapshot: no new lease until it is published again."""
        self.shared = shared
        self._name = name
        self.wire = layout if wire is None else wire
        if wire_only and self.wire is layout:
            raise ValueError("a pool keeps snapshots in the wire's dtype alone only when that is not the local one")
        self.wire_only = wire_only
        """Snapshots are their wire buffers alone (no plain copy; :attr:`Snapshot.readonly` is empty)."""
        # a shared pool whose wire layout is the local one and holds no index array attests its snapshots
        direct = self.wire is layout  # as _new decides: the snapshot buffer is the wire buffer
        self._attest = FiniteChecker(layout) if shared and direct and not any(layout.bounds) else None
        self._lent_at = -math.inf  # the last time a snapshot was lent through shared memory (monotonic s)
        self._bounds = self.wire.frame_bounds(chunk)
        self._chunk = chunk
        self._max_size = max_size
        self._lock = threading.Lock()
        self._all: list[Snapshot] = self._allocate(min(size, max_size))
        self._current: Snapshot | None = None
        self._published = secrets.randbelow(GEN_START_BOUND)  # the first publish is 1 more: see Snapshot.gen
        self.skipped = 0
        self._stop = threading.Event()
        self._work = threading.Event()
        self._defer = defer
        self._converter: threading.Thread | None = None
        self._rx_writer: PayloadWriter | None = None
        self._tx_writer: PayloadWriter | None = None
        self._bg_writer: PayloadWriter | None = None
        self._publish_writer = PayloadWriter(layout, self.wire) if wire_only else None
        converts = self.wire is not layout and not wire_only  # rounds each snapshot after its publish
        if converts:
            self._rx_writer = PayloadWriter(layout, self.wire)
            self._tx_writer = PayloadWriter(layout, self.wire)
            self._bg_writer = PayloadWriter(layout, self.wire)
        if converts or self._attest is not None:
            role = "wire" if converts else "check"
            self._converter = threading.Thread(target=self._convert_loop, name=f"dpwa-{role}-{name}", daemon=True)
            self._converter.start()

    def _allocate(self, count: int) -> list[Snapshot]:
        """``count`` new snapshots; when one cannot be made (EMFILE, ENOMEM), the segments of those made so far are
        unmapped at once (not left to the garbage collector, their descriptors open meanwhile) and it raises."""
        made: list[Snapshot] = []
        try:
            for _ in range(count):
                made.append(self._new())
        except BaseException:
            for snapshot in made:
                if snapshot.segment is not None:
                    snapshot.segment.unmap()
            raise
        return made

    def _new(self) -> Snapshot:
        segment = Segment(self._name, self.wire.total_bytes) if self.shared else None
        try:
            return self._around(segment)
        except BaseException:  # ENOMEM allocating its plain buffer: the segment made for it goes now
            if segment is not None:
                segment.unmap()
            raise

    def _around(self, segment: Segment | None) -> Snapshot:
        """A snapshot around ``segment`` (its wire or plain buffer; None: buffers of this process's memory)."""
        direct = self.wire is self.layout
        if self.wire_only:  # the wire buffer alone, always whole once published
            wire = segment.payload if segment is not None else self.wire.allocate()
            frames = [memoryview(wire[s:e]) for s, e in self._bounds]
            return Snapshot(wire, [], frames, [], self.wire.views(wire), len(frames), segment=segment)
        buffer = segment.payload if segment is not None and direct else self.layout.allocate()
        views = self.layout.views(buffer)
        readonly = [v.view() for v in views]
        for v in readonly:
            v.flags.writeable = False
        if direct:
            frames = [memoryview(buffer[s:e]) for s, e in self._bounds]
            return Snapshot(buffer, views, frames, readonly, None, len(frames), segment=segment)
        wire = segment.payload if segment is not None else self.wire.allocate()
        frames = [memoryview(wire[s:e]) for s, e in self._bounds]
        return Snapshot(buffer, views, frames, readonly, self.wire.views(wire), 0, segment=segment)

    @property
    def rewriting(self) -> bool:
        """A one-buffer pool is rewriting its snapshot: :meth:`lease` answers None until it is published."""
        return self._rewriting

    def __len__(self) -> int:
        return len(self._all)

    def publish(
        self, arrays: Sequence[np.ndarray], clock: float, loss: float, extras: dict[str, Any], front: int = -1
    ) -> Snapshot | None:
        """Copy ``arrays`` into a free buffer (a wire-only pool: round them into it) and make it current; None
        (counted) if every buffer is busy."""
        with self._lock:
            free = next((s for s in self._all if s is not self._current and not s.busy()), None)
            if free is None and len(self._all) < self._max_size:
                free = self._new()
                self._all.append(free)
                log.debug("snapshot pool grew to %d buffers", len(self._all))
            if free is None and self._max_size == 1:
                self._rewriting = True  # lease() answers None from here
                free = self._current
            elif free is None:
                self.skipped += 1
                return None
            else:
                free.leases += 1  # keep it ours while copying outside the lock
        if self._rewriting and not self._drained(free):
            return None
        if free.segment is not None:
            free.segment.set_gen(0)  # being written
        if self._publish_writer is not None:  # wire-only: no plain copy
            assert free.wire_views is not None
            self._publish_writer.write(arrays, free.wire_views, 0, self.wire.total_bytes)
        else:
            for dst, src in zip(free.views, arrays):
                np.copyto(dst, src, casting="no")
        with self._lock:
            if free.wire_views is not None and not self.wire_only:
                free.ready = 0  # no other thread touches a buffer that is neither current nor leased
            free.leases -= 1
            self._rewriting = False
            free.clock, free.loss, free.extras, free.front = clock, loss, dict(extras), front
            self._published += 1
            free.gen = self._published
            lending = time.monotonic() - self._lent_at < ATTEST_WHILE_LENT_S
            free.attested = None if self._attest is not None and lending else False
            if free.segment is not None:
                free.segment.set_gen(free.gen)
            self._current = free
        if self._converter is not None:
            self._work.set()
        return free

    def copy_of(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """What the rule is handed as published when :meth:`publish` found every buffer busy: a copy of ``arrays``
        (a wire-only pool: nothing, its rule reads none)."""
        return [] if self.wire_only else [np.array(a, copy=True) for a in arrays]

    def _drained(self, snapshot: Snapshot | None) -> bool:
        """A one-buffer pool's :meth:`publish`: wait at most ``drain_s`` seconds until no send or loan holds the
        current ``snapshot``, then lease it to the writer (True); or give up (counted in ``skipped``), leases
        allowed again."""
        assert snapshot is not None
        deadline = time.monotonic() + self._drain_s
        while True:
            if self._unpair is not None:  # the exchanges that hold it let go (new ones wait: no lease now)
                self._unpair(snapshot)
            with self._lock:
                if not snapshot.busy():
                    snapshot.leases += 1
                    return True
                if time.monotonic() >= deadline:
                    self._rewriting = False
                    self.skipped += 1
                    return False
            time.sleep(DRAIN_POLL_S)

    def lease(self) -> Snapshot | None:
        """The current snapshot, leased until ``release``; None before the first publish and while a one-buffer
        pool rewrites it."""
        with self._lock:
            if self._current is None or self._rewriting:
                return None
            self._current.leases += 1
            return self._current

    def prepare(self, snapshot: Snapshot, upto: int) -> None:
        """Make wire chunks [0, upto] of a leased ``snapshot`` ready to send (RX thread only).

        Rounds the chunks not rounded yet, one at a time; a no-op without conversion.
        """
        if self._rx_writer is not None:
            self._round(snapshot, upto, self._rx_writer)

    def prepare_push(self, snapshot: Snapshot, upto: int) -> None:
        """:meth:`prepare` for the TX thread, which pushes a leased snapshot (its own scratch)."""
        if self._tx_writer is not None:
            self._round(snapshot, upto, self._tx_writer)

    def retain(self, snapshot: Snapshot) -> None:
        """One more lease on ``snapshot`` (already leased or published by the caller); ``release`` ends it."""
        with self._lock:
            snapshot.leases += 1

    def _round(self, snapshot: Snapshot, upto: int, writer: PayloadWriter) -> None:
        assert snapshot.wire_views is not None
        upto = min(upto, len(self._bounds) - 1)
        while snapshot.ready <= upto:
            with snapshot.convert_lock:  # one chunk per hold: the other thread takes turns
                index = snapshot.ready
                if index > upto:
                    return
                start, end = self._bounds[index]
                writer.write(snapshot.views, snapshot.wire_views, start, end)
                snapshot.ready = index + 1

    def wait_ready(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until the current snapshot's wire buffer is complete (and, in a pool
        that attests, checked)."""
        deadline = time.monotonic() + timeout
        while True:
            current = self._current
            if current is None or (current.ready >= len(self._bounds) and current.attested is not None):
                return current is not None
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)

    def _convert_loop(self) -> None:
        """Round every newly published snapshot into its wire buffer, or (a pool that attests) check its values and
        say in its segment that all are finite; give up on one that is no longer current."""
        try:
            while not self._stop.is_set():
                if not self._work.wait(POLL_S):
                    continue
                self._work.clear()
                snapshot = self.lease()
                if snapshot is None:
                    continue
                try:
                    for index in range(len(self._bounds)):
                        while self._defer is not None and self._defer() and not self._stop.is_set():
                            time.sleep(DEFER_S)
                        if self._stop.is_set() or snapshot is not self._current or self._rewriting:
                            break
                        if self._bg_writer is not None:
                            self._round(snapshot, index, self._bg_writer)
                        elif snapshot.attested is False or not self._check(snapshot, index):
                            break  # nobody co-located borrows lately, or a value is not finite
                    else:
                        self._attested(snapshot)
                finally:
                    self.release(snapshot)
        except Exception:  # pragma: no cover - a bug: the RX thread still rounds on demand
            log.exception("snapshot converter failed")

    def _check(self, snapshot: Snapshot, index: int) -> bool:
        """Chunk ``index`` of ``snapshot`` holds only finite values (else the snapshot is not attested)."""
        assert self._attest is not None
        start, end = self._bounds[index]
        if self._attest.all_finite(snapshot.views, start, end):
            return True
        snapshot.attested = False
        return False

    def _attested(self, snapshot: Snapshot) -> None:
        """Every chunk of the leased ``snapshot`` was checked finite: say so in its segment (attesting pools)."""
        if self._attest is not None and snapshot.segment is not None:
            snapshot.segment.set_checked(snapshot.gen)
            snapshot.attested = True

    def release(self, snapshot: Snapshot, tracker: Tracker | None = None) -> None:
        """End a lease; ``tracker`` keeps the buffer busy until ZeroMQ is done with it."""
        with self._lock:
            snapshot.leases -= 1
            if tracker is not None and not tracker.done:
                snapshot.trackers.append(tracker)

    def close(self, timeout: float = 1.0, release: bool = True) -> None:
        """Stop the converter thread (if any) within ``timeout`` seconds and close the segments' descriptors. With
        ``release`` (no other thread uses the snapshots any more) and the converter stopped, also drop every
        snapshot's buffers and unmap the segments: the memory goes at once unless a view is still held elsewhere
        (a send in flight, values a rule kept), then with that view. Idempotent."""
        self._stop.set()
        self._work.set()
        stopped = self._converter is None
        if self._converter is not None and self._converter is not threading.current_thread():  # (else it runs on)
            self._converter.join(timeout)
            stopped = not self._converter.is_alive()
            if not stopped:  # pragma: no cover - a stuck thread is a bug
                log.error("the snapshot thread %s did not stop within %.1fs", self._converter.name, timeout)
        free = release and stopped
        with self._lock:
            for snapshot in self._all:
                if free:
                    snapshot.release()
                if snapshot.segment is not None and free:
                    snapshot.segment.unmap()
                elif snapshot.segment is not None:
                    snapshot.segment.close()

    def lent(self) -> None:
        """A snapshot was just lent through shared memory: attest the next ones (RX thread)."""
        self._lent_at = time.monotonic()

    def complete(self, snapshot: Snapshot) -> None:
        """Make every wire chunk of a leased ``snapshot`` ready (RX thread, before lending it whole)."""
        self.prepare(snapshot, len(self._bounds) - 1)


_WIDENED = frozenset({"<f2", "bf16"})
"""The wire codes a float32 array may be received in and mixed from (each block widened as it is read)."""


def receive_layout(pool: SnapshotPool, narrower: bool) -> Layout:
    """The layout a node with ``pool`` receives replies in: the wire's when the pool keeps its snapshots in it
    alone (``wire_only``), the rule mixes ``narrower`` peers (:meth:`~dpwa.rules.Rule.mixes_narrower_peers`:
    its kernels widen a 16-bit peer block by block as they read it) and every array travels as itself or as a
    float32 one narrowed to 16 bits: half the receive buffer of a float32 model. Else the local layout."""
    wire, local = pool.wire, pool.layout
    if not (pool.wire_only and narrower) or len(wire.dtypes) != len(local.dtypes):  # int8 adds its scales
        return local
    narrowed = all(w == own or (own == "<f4" and w in _WIDENED) for w, own in zip(wire.dtypes, local.dtypes))
    return wire if narrowed else local


def open_pool(
    params: Sequence[np.ndarray],
    wire_dtype: str | None,
    *,
    name: str,
    held: int,
    defer: Callable[[], bool],
    max_messages: int,
    bounds: tuple[int, ...] | None = None,
    shared: bool = False,
    single: bool = False,
    drain_s: float = 1.0,
    unpair: Callable[[Snapshot], None] | None = None,
    wire_only: bool = False,
) -> SnapshotPool:
    """The pool a node publishes ``params`` through: their layout (``bounds``: of their index arrays), travelling
    as ``wire_dtype`` says (:meth:`~dpwa.node.wire.Layout.on_wire`), with room for ``held`` snapshots kept
    leased beyond the pool's own six (pushes, exchanges); ``shared``: in shared-memory segments. ``single``: one
    buffer, rewritten in place once its sends end (waiting at most ``drain_s`` seconds; ``transport.memory: low``),
    after ``unpair`` let the exchanges paired with it go. ``wire_only``: where the wire's dtype is not the
    arrays', snapshots are kept in it alone (no plain copy: the rule must not read what was published).

    ValueError when one reply of that layout would take more than ``max_messages`` messages (a node's reply
    queue)."""
    layout = Layout.of(params, bounds)
    wire = layout.on_wire(wire_dtype)
    if len(wire.frame_bounds()) + 1 > max_messages:
        raise ValueError(
            f"a model of {wire.total_bytes / 2**30:.1f} GiB on the wire needs more messages per reply "
            f"than a node queues ({max_messages}); exchange a part of it, or a narrower wire_dtype"
        )
    size, most = (1, 1) if single else (3, 6 + held)
    only = wire_only and wire is not layout
    pool = SnapshotPool(
        layout,
        size,
        most,
        wire=wire,
        name=name,
        defer=defer,
        shared=shared,
        drain_s=drain_s,
        unpair=unpair,
        wire_only=only,
    )
    log.info(
        "node %s: %d arrays, %.1f MB per snapshot, %.1f MB on the wire (wire_dtype %s%s)",
        name,
        len(params),
        layout.total_bytes / 1e6,
        wire.total_bytes / 1e6,
        wire_dtype,
        ", snapshots kept in it alone: no plain copy" if only else "",
    )
    return pool
