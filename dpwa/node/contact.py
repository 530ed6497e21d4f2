"""A node's direct contact with its members, outside the exchange: JOIN one member, tell every member its table.

* :func:`join` -- a node started with ``join: [NAME@]HOST:PORT`` asks that member to admit it (a JOIN, repeated
  every ``timeouts.exchange_s`` seconds) and takes the cluster's table from the MEMBERS answer
  (:func:`join_answer`), or is refused (JoinRefused) or times out (TimeoutError);
* :func:`wait_for_peers` -- before training, a MEMBERS message to every member, waiting (bounded) until each has
  answered: nodes started together start training together;
* :func:`announce` -- a leaving node's table (which says it left) to every member that is up, waiting (bounded)
  for their answers; a member whose connection is refused is not waited for.

The decisions are the node's (what to send, what an answer means for the member table); the sockets are the
transport's control plane (:class:`~dpwa.node.transport.ControlPlane`). Trainer's thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Protocol

from dpwa.config import ConfigError, JoinAddress, NodeSpec
from dpwa.node import wire
from dpwa.node.members import JoinRefused, Member
from dpwa.node.membership import Membership
from dpwa.node.stats import NodeStats
from dpwa.node.timeouts import Timeouts
from dpwa.node.transfers import TransferPattern
from dpwa.node.transport import Transport
from dpwa.node.wire import Kind
from dpwa.rules.schedules import Schedule
from dpwa.security.curve import NodeSecurity

__all__ = ["Contacting", "announce", "ask_members", "file_roster", "join", "join_answer", "leave", "wait_for_peers"]

log = logging.getLogger(__name__)


class Contacting(Protocol):
    """What contacting the members uses of the node (:class:`dpwa.node.core.Node` is one)."""

    name: str
    membership: Membership
    requests: Iterator[int]
    """Request ids: one counter for every request the node sends."""
    stats: NodeStats
    timeouts: Timeouts
    transport: Transport
    security: NodeSecurity | None
    schedule: Schedule
    """Sent the cluster file's nodes once a JOIN is answered (AD-PSGD's roles come from their order)."""
    transfer: TransferPattern
    """What the leave announcement says of each member's latest push here (its ``verdict_for``)."""
    started_with: set[str]
    """The peers that answered :func:`wait_for_peers`."""


def join(node: Contacting, address: JoinAddress, timeout_s: float) -> Member:
    """Ask the member at ``address`` to admit ``node`` (a JOIN, repeated every ``timeouts.exchange_s`` seconds until
    ``timeout_s``), then take the cluster's table from its answer (:func:`join_answer`); ``node``'s own entry.

    JoinRefused (the member's reason: a name clash, a file node's name) or TimeoutError (no answer; with
    CURVE, an unlisted key looks the same)."""
    me = node.membership.me
    sent: set[int] = set()  # an answer to any of them will do: a slow one comes after the next JOIN went out

    def request() -> tuple[int, bytes]:
        req = next(node.requests)
        sent.add(req)
        return req, wire.encode_join(node.name, req, me.host, me.port, bipartite=node.schedule.splits_roles())

    own = node.transport.control.join(
        address.name,
        f"tcp://{address.host}:{address.port}",
        request,
        lambda frames, _latest: join_answer(node, frames, sent, address),
        retry_s=node.timeouts.exchange_s,
        timeout_s=timeout_s,
    )
    if own is None:
        hint = (
            f"; with security.curve on, is {node.name}.key in every member's key directory?"
            if node.security is not None
            else ""
        )
        raise TimeoutError(
            f"node {node.name}: no answer to its JOIN from {address} in {timeout_s:g} s"
            f" (is a member listening there?){hint}"
        )
    return own


def join_answer(node: Contacting, frames: list[bytes], reqs: Container[int], address: JoinAddress) -> Member | None:
    """The answer to one of the JOINs ``reqs``: ``node``'s entry once the table is taken; None for an unrelated
    message (counted ``stale_replies``); JoinRefused for an ERROR."""
    try:
        header = wire.decode_message(frames[0]) if len(frames) == 1 else None
    except wire.WireError:
        header = None
    if header is None or header.req not in reqs:
        node.stats.add("stale_replies")
        return None
    if header.kind is Kind.ERROR:
        raise JoinRefused(f"node {node.name}: the member at {address} refused to admit it: {header.detail}")
    if header.kind is not Kind.MEMBERS or header.members is None:
        node.stats.add("stale_replies")
        return None
    fixed = file_roster(header, node.name, address)
    if node.schedule.splits_roles() and not header.bipartite:
        raise JoinRefused(
            f"node {node.name}: the member at {address} admitted it without saying that its nodes are active or "
            "passive (adpsgd: {bipartite: true}): its file does not say so, or it runs an older dpwa"
        )
    own = node.membership.adopt(fixed, header.members, mass=header.mass)
    node.schedule.adopt_roster(node.membership.permanent())
    log.info(
        "node %s: joined the cluster through %s (%s) as version %d; %d members",
        node.name,
        header.node,
        address,
        own.version,
        len(node.membership.order()),
    )
    return own


def file_roster(answer: wire.Members, me: str, address: JoinAddress) -> list[NodeSpec]:
    """The cluster file's nodes a JOIN's ``answer`` lists, in file order (schedules and AD-PSGD's roles place the
    nodes by it); JoinRefused when that list names a node twice, a node the table lacks, the joiner ``me``, or an
    entry that is no valid node."""
    listed = {m.name: m for m in answer.members or ()}
    wrong = [name for name in answer.permanent if name not in listed or name == me]
    if wrong or len(set(answer.permanent)) != len(answer.permanent):
        raise JoinRefused(
            f"node {me}: the member at {address} answered with a list of the cluster file's nodes that repeats a "
            f"name, names one missing from its table or names the joiner ({', '.join(answer.permanent)[:300]})"
        )
    try:
        return [listed[name].spec() for name in answer.permanent]
    except ConfigError as err:  # an entry shaped right that is no node (its name or address refused)
        invalid = f"node {me}: the member at {address} answered with an invalid cluster-file node: {err}"
        raise JoinRefused(invalid) from None


def leave(node: Contacting, timeout_s: float, final_mix: bool = False) -> None:
    """A clean close's leave, within ``timeout_s``: the transfer hands what the rule holds to a member
    (:meth:`~dpwa.node.transfers.TransferPattern.hand_off`, ``final_mix`` there), then ``node`` is marked ``left``
    and tells every member (:func:`announce`); from then on every request is answered ``left``. The announcement
    keeps its own ``timeouts.announce_s`` (at most half of ``timeout_s``) out of the budget: a hand-off that waits
    out its deadline on a silent member must not leave it none (its sockets would close before a message went
    out, and no member would learn of the leave)."""
    announce_s = min(node.timeouts.announce_s, timeout_s / 2)
    node.transfer.hand_off(time.monotonic() + timeout_s - announce_s, final_mix=final_mix)
    node.membership.leave()
    announce(node, time.monotonic() + announce_s)


def announce(node: Contacting, deadline: float) -> None:
    """Send ``node``'s table (which says it left) to every member, and wait until ``deadline`` (time.monotonic
    seconds) for their answers (counted ``leave_acknowledged``); a member whose connection is refused (a dead node
    on a live host) is not waited for. Also the members flow control holds down: one that is only slow, left out,
    would list this node alive until it found it down itself -- never, when its schedule never fetches it (a ring),
    and its table and order would differ from everyone else's for good. Each message carries the verdict on that
    member's latest push here."""
    news = node.membership.full_news()
    members = list(node.membership.peers())

    def message(member: Member) -> bytes:
        return wire.encode_members(node.name, next(node.requests), news, settled=node.transfer.verdict_for(member.name))

    answered = ask_members(node, members, message, deadline, refused_ends=True)
    node.stats.add("leave_acknowledged", len(answered))


def wait_for_peers(node: Contacting, timeout_s: float) -> dict[str, bool]:
    """Send every member ``node``'s table (a MEMBERS message, which a node's server answers as soon as it listens)
    and wait until each has answered or ``timeout_s`` seconds passed. A member not listening yet is waited for
    (ZeroMQ delivers once it binds). Member name -> answered; those that did join ``node.started_with``."""
    news = node.membership.full_news()
    members = list(node.membership.peers())
    deadline = time.monotonic() + timeout_s

    def message(member: Member) -> bytes:
        return wire.encode_members(node.name, next(node.requests), news)

    answered = ask_members(node, members, message, deadline, refused_ends=False)
    node.started_with |= answered
    return {m.name: m.name in answered for m in members}


def ask_members(
    node: Contacting,
    members: Sequence[Member],
    message: Callable[[Member], bytes],
    deadline: float,
    *,
    refused_ends: bool,
) -> set[str]:
    """Send each member ``message(member)`` on a control socket of its own and wait until ``deadline`` for
    their answers (:meth:`~dpwa.node.transport.ControlPlane.ask`; ``refused_ends``: a member whose connection
    is refused is not waited for). The names that answered."""
    by_name = {m.name: m for m in members}
    return node.transport.control.ask(
        [(m.name, endpoint) for m in members if (endpoint := reachable_at(m)) is not None],
        lambda name: message(by_name[name]),
        deadline,
        refused_ends=refused_ends,
    )


def reachable_at(member: Member) -> str | None:
    """The endpoint ``member``'s table entry names, or None when the entry names no valid address (it is skipped,
    as a member that cannot be sent to)."""
    try:
        return member.spec().endpoint
    except (KeyError, ValueError):
        return None
