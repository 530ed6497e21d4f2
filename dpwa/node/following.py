"""The node follows its member table: whom it fetches from, pushes to and takes pushes from.

:func:`sync_members` is the member table's change callback (:class:`~dpwa.node.membership.Membership` calls it
from any thread, after a join, a leave, or a member forgotten). Under the node's sync lock it brings the rest of
the node in line with the table: flow control scores exactly the members, the TX thread connects to each at its
current address, the transfer takes pushes from the members only, the schedule's order is the table's, and the
rule hears of the change (:meth:`~dpwa.rules.Rule.on_members`). A member forgotten (not merely left) has
everything the node kept of it dropped (:func:`forget_member`), so the node's memory follows the table -- also
one that left long before it was forgotten (``departed``), whose open push no settlement closed.
"""

from __future__ import annotations

import threading
from typing import Protocol

from dpwa.node.membership import Membership
from dpwa.node.peers import FlowControl
from dpwa.node.stats import NodeStats, OnceLog
from dpwa.node.transfers import TransferPattern
from dpwa.rules import NodeState, Rule
from dpwa.security.curve import NodeSecurity

__all__ = ["Follower", "PeerLinks", "forget_member", "sync_members"]


class PeerLinks(Protocol):
    """The transport, as the member table steers its TX thread."""

    def set_peer(self, peer: str, endpoint: str | None) -> None:
        """Reach ``peer`` at ``endpoint`` from now on; None: it is gone."""
        ...


class Follower(Protocol):
    """What following the table changes of the node (:class:`dpwa.node.core.Node` is one)."""

    name: str
    membership: Membership
    synced: bool
    """False until the node's threads exist: a change before that is taken when they start."""
    sync_lock: threading.Lock
    """Serializes the changes, and guards ``endpoints``."""
    endpoints: dict[str, str]
    """The address the TX thread has for each member."""
    departed: set[str]
    """Members taken out of the peers (``left``) but still in the table: cleaned up once it forgets them."""
    names: list[str]
    flow: FlowControl
    flow_lock: threading.Lock

    @property
    def transport(self) -> PeerLinks:
        """The node's transport: its TX thread reaches the members."""
        ...

    transfer: TransferPattern
    stats: NodeStats
    once: OnceLog
    security: NodeSecurity | None
    rule: Rule
    state: NodeState
    state_lock: threading.Lock


def sync_members(node: Follower) -> None:
    """The member table changed (any thread): fetch from, push to and take pushes from its members now."""
    if not node.synced:
        return
    with node.sync_lock:
        peers = {m.name: m for m in node.membership.peers()}
        order = node.membership.order()
        with node.flow_lock:
            known = set(node.flow.scores())
            for name in known - peers.keys():
                node.flow.remove(name)
            for name in peers.keys() - known:
                node.flow.add(name)
        for name, member in peers.items():
            endpoint = member.spec().endpoint
            if node.endpoints.get(name) != endpoint:
                node.endpoints[name] = endpoint
                node.transport.set_peer(name, endpoint)
        for name in set(node.endpoints) - peers.keys():
            del node.endpoints[name]
            node.transport.set_peer(name, None)
            node.departed.add(name)
        for name in list(node.departed):  # also those gone before this change: a leave learned from gossip
            if name in peers:  # back (it rejoined): a push open with its former incarnation is never answered
                node.departed.discard(name)
                node.transfer.member_back(name)
            elif node.membership.get(name) is None:  # forgotten: nobody will answer, nothing is kept of it
                node.departed.discard(name)
                forget_member(node, name)
        node.transfer.set_senders(list(peers))
        node.names = order
        with node.state_lock:
            node.rule.on_members(node.name, order, float(node.membership.incarnations()))


def forget_member(node: Follower, name: str) -> None:
    """A member forgotten (caller holds the sync lock): the transfer drops what it keeps of it (an unanswerable
    push, the generation last fetched), and the node what it keeps per peer (outcome counts, logged-once keys, a
    cached key)."""
    node.transfer.forget(name)
    node.stats.forget_peer(name)
    node.once.forget(name)
    if node.security is not None:
        node.security.forget(name)
