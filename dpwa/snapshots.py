"""Published parameter snapshots: a small pool of flat buffers shared by the trainer and the RX thread.

The trainer copies its parameters into a free buffer and publishes it by
swapping one reference. The RX thread leases the current snapshot, hands its
frames to ZeroMQ without copying, and returns the lease with the send's
tracker. A buffer is reused only when it is not published, not leased and
every send that referenced it has completed, so a slow requester never sees a
half-overwritten model and the trainer never waits for one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .wire import CHUNK_BYTES, Layout

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """What a zero-copy send hands back: ``done`` once ZeroMQ has released the memory."""

    @property
    def done(self) -> bool: ...


@dataclass
class Snapshot:
    """One flat buffer with its array views, payload frames and the state published with it."""

    buffer: np.ndarray
    views: list[np.ndarray]
    frames: list[memoryview]
    readonly: list[np.ndarray]
    clock: float = 0.0
    loss: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    leases: int = 0
    trackers: list[Tracker] = field(default_factory=list)

    def busy(self) -> bool:
        """True while a lease is out or a send still references the buffer."""
        self.trackers = [t for t in self.trackers if not t.done]
        return self.leases > 0 or bool(self.trackers)


class SnapshotPool:
    """``size`` buffers allocated up front, growing to ``max_size`` only when all are busy."""

    def __init__(self, layout: Layout, size: int = 3, max_size: int = 6, chunk: int = CHUNK_BYTES) -> None:
        self.layout = layout
        self._chunk = chunk
        self._max_size = max_size
        self._lock = threading.Lock()
        self._all: list[Snapshot] = [self._new() for _ in range(size)]
        self._current: Snapshot | None = None
        self.skipped = 0

    def _new(self) -> Snapshot:
        buffer = self.layout.allocate()
        frames = [memoryview(buffer[s:e]) for s, e in self.layout.frame_bounds(self._chunk)]
        views = self.layout.views(buffer)
        readonly = [v.view() for v in views]
        for v in readonly:
            v.flags.writeable = False
        return Snapshot(buffer, views, frames, readonly)

    def __len__(self) -> int:
        return len(self._all)

    def publish(
        self, arrays: Sequence[np.ndarray], clock: float, loss: float, extras: dict[str, Any]
    ) -> Snapshot | None:
        """Copy ``arrays`` into a free buffer and make it current; None (counted) if every buffer is busy."""
        with self._lock:
            free = next((s for s in self._all if s is not self._current and not s.busy()), None)
            if free is None and len(self._all) < self._max_size:
                free = self._new()
                self._all.append(free)
                log.debug("snapshot pool grew to %d buffers", len(self._all))
            if free is None:
                self.skipped += 1
                return None
            free.leases += 1  # keep it ours while copying outside the lock
        for dst, src in zip(free.views, arrays):
            np.copyto(dst, src, casting="no")
        with self._lock:
            free.leases -= 1
            free.clock, free.loss, free.extras = clock, loss, dict(extras)
            self._current = free
        return free

    def lease(self) -> Snapshot | None:
        """The current snapshot, leased until ``release``; None before the first publish."""
        with self._lock:
            if self._current is not None:
                self._current.leases += 1
            return self._current

    def release(self, snapshot: Snapshot, tracker: Tracker | None = None) -> None:
        """End a lease; ``tracker`` keeps the buffer busy until ZeroMQ is done with it."""
        with self._lock:
            snapshot.leases -= 1
            if tracker is not None and not tracker.done:
                snapshot.trackers.append(tracker)
