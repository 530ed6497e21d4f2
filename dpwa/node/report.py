"""What a node's ``stats()`` shows (:meth:`dpwa.node.connection.DpwaConnection.stats`): one dict, assembled from
the node's parts, each read under its own lock.

In this order: the counters (:meth:`~dpwa.node.stats.NodeStats.snapshot`), flow control's ``scores`` and
``peers_up``, the gossip ``clock`` and ``extras``, the ``node``'s name, the member table's entries, the ``rule``
and ``schedule``, the ``snapshot_buffers`` of the pool, the transfer's own entries
(:meth:`~dpwa.node.transfers.TransferPattern.stats`: pushes in flight, the inbox), and whether the RX and TX
threads are alive, with the exception that ended each one that died (``thread_errors``).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from dpwa.node.membership import Membership
from dpwa.node.peers import FlowControl
from dpwa.node.snapshots import SnapshotPool
from dpwa.node.stats import NodeStats
from dpwa.node.transfers import TransferPattern
from dpwa.rules import NodeState, Rule
from dpwa.rules.schedules import Schedule

__all__ = ["Reported", "Thread", "Threads", "node_stats"]


class Thread(Protocol):
    """One of the transport's threads, as reported."""

    failure: BaseException | None

    def is_alive(self) -> bool:
        """Whether the thread still runs."""
        ...


class Threads(Protocol):
    """The transport, as reported: its two threads."""

    @property
    def rx(self) -> Thread: ...

    @property
    def tx(self) -> Thread: ...


class Reported(Protocol):
    """What the report reads of the node (:class:`dpwa.node.core.Node` is one)."""

    name: str
    stats: NodeStats
    flow: FlowControl
    flow_lock: threading.Lock
    state: NodeState
    state_lock: threading.Lock
    membership: Membership
    rule: Rule
    schedule: Schedule
    pool: SnapshotPool | None
    transfer: TransferPattern

    @property
    def transport(self) -> Threads:
        """The node's transport, whose threads are reported."""
        ...


def node_stats(node: Reported) -> dict[str, Any]:
    """The node's statistics now (any thread; see the module doc-string for the entries)."""
    out = node.stats.snapshot()
    with node.flow_lock:
        out["scores"] = node.flow.scores()
        out["peers_up"] = node.flow.up_peers()
    with node.state_lock:
        out["clock"] = node.state.clock
        out["extras"] = dict(node.state.extras)
    out["node"] = node.name
    out.update(node.membership.snapshot())
    out["rule"] = node.rule.name
    out["schedule"] = node.schedule.name
    out["snapshot_buffers"] = len(node.pool) if node.pool is not None else 0
    out.update(node.transfer.stats())
    rx, tx = node.transport.rx, node.transport.tx
    out["rx_alive"], out["tx_alive"] = rx.is_alive(), tx.is_alive()
    out["thread_errors"] = {role: repr(thread.failure) for role, thread in (("rx", rx), ("tx", tx)) if thread.failure}
    return out
