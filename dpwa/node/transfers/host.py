"""What a transfer pattern needs of its node, and of the TX thread: two protocols, so that the transfers never
import the node (:class:`dpwa.node.core.Node` is a :class:`Host`)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from dpwa.config import ClusterConfig
from dpwa.node.membership import Membership
from dpwa.node.peers import FlowControl
from dpwa.node.pushes import Push
from dpwa.node.snapshots import Snapshot, SnapshotPool
from dpwa.node.states import FlowEffect
from dpwa.node.stats import NodeStats, OnceLog
from dpwa.node.timeouts import Timeouts
from dpwa.node.transport import FetchJob
from dpwa.node.wire import Layout
from dpwa.rules import NodeState, Rule
from dpwa.rules.schedules import Schedule

__all__ = ["Host", "Sender"]


class Sender(Protocol):
    """The transport, as a transfer hands its TX thread work."""

    def submit(self, job: FetchJob) -> None:
        """Run ``job`` (one at a time, in order)."""
        ...

    def submit_push(self, push: Push) -> None:
        """Send ``push`` (already in the ledger) and follow it until it is answered."""
        ...


class Host(Protocol):
    """What a transfer uses of its node (:class:`dpwa.node.core.Node`): its settings, its locks and what they
    guard, its threads, and the few steps of its own a transfer calls back."""

    name: str
    config: ClusterConfig
    timeouts: Timeouts
    rule: Rule
    schedule: Schedule
    rng: random.Random
    stats: NodeStats
    once: OnceLog
    membership: Membership
    state: NodeState
    state_lock: threading.Lock
    """Guards ``state`` and the rule."""
    flow: FlowControl
    flow_lock: threading.Lock
    """Guards ``flow``."""
    pool: SnapshotPool | None
    host_id: str
    """The node's co-location identity ("": shared memory off)."""

    @property
    def transport(self) -> Sender:
        """The node's transport: its TX thread takes the work."""
        ...

    requests: Iterator[int]
    """Request and push sequence numbers, one counter for both."""
    names: list[str]
    """The members, in schedule order."""
    step: int
    """``update_send`` calls so far: the schedules' round."""
    started_with: set[str]
    params: list[np.ndarray] | None

    def layouts(self) -> tuple[Layout, Layout] | None:
        """(wire layout, the layout replies are received in) once the first publish set them up, else None."""
        ...

    def publish(self, *, tick: bool) -> Snapshot | None:
        """Publish a snapshot of ``params``; None when every buffer was busy."""
        ...

    def release_snapshot(self, snapshot: Snapshot, tracker: Any = None) -> None:
        """End one lease on ``snapshot``."""
        ...

    def note_front(self, front: int) -> None:
        """A peer says it has made ``front`` update_send calls: the node's front is at least that."""
        ...

    def flow_outcome(self, peer: str, effect: FlowEffect) -> None:
        """Feed flow control with what an outcome does to ``peer`` (any thread)."""
        ...

    def wait_and_mix(self, upto: int | None = None) -> float:
        """Wait for what this step waits for, mix what arrived, record it; the factor."""
        ...
