"""What the RX thread answers, decided for the node: a FETCH (:func:`serve`) and a membership message
(:func:`answer_membership`); and a node that only serves before it closes (:func:`linger`).

:func:`serve` answers a FETCH with the current snapshot, zero-copy, or an ERROR saying why not (the node left,
it has published nothing yet, a different layout, an exchange whose push is not here). It leases the snapshot
for the reply; the lease ends exactly once: when ZeroMQ is done sending (the reply's ``sent`` hook), or at once
when no reply with the snapshot goes out. Both kinds of answer carry member news.

:func:`answer_membership` takes a PUSH's member news, admits a joining node (or says why not), and answers a
MEMBERS announcement with this node's table (a leaving member's also settles this node's push to it).
Both run on the RX thread and return promptly.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Protocol

from dpwa.node import wire
from dpwa.node.loans import Loans
from dpwa.node.members import JoinRefused
from dpwa.node.membership import Membership
from dpwa.node.snapshots import Snapshot, SnapshotPool
from dpwa.node.stats import NodeStats, OnceLog
from dpwa.node.timeouts import Timeouts
from dpwa.node.transfers import TransferPattern
from dpwa.node.transport import Reply
from dpwa.node.wire import ErrorCode, Kind, Layout, MemberNews
from dpwa.rules import NodeState, Rule
from dpwa.rules.schedules import Schedule
from dpwa.security.curve import NodeSecurity
from dpwa.utils.settings import clipped

__all__ = ["Served", "answer_membership", "give_back", "linger", "serve"]

log = logging.getLogger(__name__)


class Served(Protocol):
    """What serving reads of the node (:class:`dpwa.node.core.Node` is one)."""

    name: str
    membership: Membership
    stats: NodeStats
    once: OnceLog
    rule: Rule
    schedule: Schedule
    """Whether the nodes take roles (a JOIN must agree)."""
    state: NodeState
    state_lock: threading.Lock
    """Guards ``state`` and the rule."""
    wire_layout: Layout | None
    pool: SnapshotPool | None
    transfer: TransferPattern
    security: NodeSecurity | None
    closed: bool
    host_id: str
    """This node's co-location identity; "": shared memory off."""
    loans: Loans
    timeouts: Timeouts


def _error(node: Served, req: int, code: ErrorCode, detail: str, news: MemberNews | None = None) -> Reply:
    return Reply(wire.encode_error(node.name, req, code, detail, news))


def serve(node: Served, request: wire.Fetch, user: str | None = None) -> Reply:
    """Answer a FETCH with the current snapshot, or an error naming why not; both carry member news.

    A co-located requester (:func:`lends_to`) gets the snapshot lent in shared memory instead of sent."""
    node.membership.observe(request)
    if node.membership.leaving:
        node.stats.add("left_answers")
        return _error(node, request.req, ErrorCode.LEFT, "this node has left the cluster", node.membership.full_news())
    news = node.membership.reply_news(request)
    layout, pool = node.wire_layout, node.pool
    if layout is None or pool is None:
        return _error(node, request.req, ErrorCode.NOT_READY, "no snapshot published yet", news)
    if request.fingerprint != layout.fingerprint:
        detail = (
            f"{node.name} has layout {layout.fingerprint} ({len(layout.shapes)} arrays, "
            f"{layout.total_bytes} bytes), {request.node} asked for {request.fingerprint}"
        )
        asker = request.node if node.membership.get(request.node) is not None else "(not a member)"
        node.once.warning(  # once per member; once for all others (a stranger's names must not fill the log)
            (asker, "layout"), "node %s: refusing %s: layout mismatch: %s", node.name, request.node, detail
        )
        return _error(node, request.req, ErrorCode.LAYOUT, detail)
    snapshot = pool.lease()
    if snapshot is None:
        why = "rewriting its one snapshot buffer" if pool.rewriting else "no snapshot published yet"
        return _error(node, request.req, ErrorCode.NOT_READY, why, news)
    reply = None
    try:
        refusal = None
        if request.exchange >= 0:  # AD-PSGD: the push that came just before keeps this snapshot as its pair
            refusal = node.transfer.pair_exchange(request.node, request.exchange, snapshot)
        if refusal is not None:
            return _error(node, request.req, *refusal)
        if lends_to(node, request, user, snapshot):
            reply = _lent_reply(node, request, snapshot, layout, pool, news)
        if reply is None:
            reply = _state_reply(node, request, snapshot, layout, pool, news)
        return reply
    finally:
        if reply is None:  # no reply with the snapshot goes out: the lease ends here
            pool.release(snapshot)


def lends_to(node: Served, request: wire.Fetch, user: str | None, snapshot: Snapshot) -> bool:
    """Whether ``request`` gets ``snapshot`` lent in shared memory: shared memory on here, the requester
    co-located (the same identity), and with CURVE on, a requester that authenticated as the node it names. An
    exchange's reply is lent too (its pair, the push, still travels over the socket)."""
    return (
        bool(node.host_id)
        and request.host == node.host_id
        and snapshot.segment is not None
        and (node.security is None or user == request.node)
    )


def _served_header(
    node: Served, request: wire.Fetch, snapshot: Snapshot, layout: Layout, news: MemberNews, **fields: Any
) -> tuple[bytes, dict[str, Any]]:
    """The STATE header of ``snapshot`` for ``request`` (``fields``: how it travels, ``stream`` or ``shm``) and the
    extras the rule's ``on_serve`` handed out with it (``on_request`` first, if the request carried extras)."""
    with node.state_lock:
        if request.extras:
            node.rule.on_request(node.state, request.extras)
        given = node.rule.on_serve(node.state)
    encode = functools.partial(
        wire.encode_state,
        node.name,
        request.req,
        clock=snapshot.clock,
        loss=snapshot.loss,
        extras={**snapshot.extras, **given},
        layout=layout,
        gen=snapshot.gen,
        front=snapshot.front,
        **fields,
    )
    try:
        return encode(news=news), given
    except ValueError:  # the member table does not fit a header: its digest goes alone
        return encode(news=MemberNews(news.digest)), given


def _lent_reply(
    node: Served, request: wire.Fetch, snapshot: Snapshot, layout: Layout, pool: SnapshotPool, news: MemberNews
) -> Reply | None:
    """The STATE reply naming ``snapshot``'s segment (leased; the loan keeps it until RELEASE or its deadline), or
    None when no loan can be made (the caller sends the snapshot)."""
    assert snapshot.segment is not None
    pool.complete(snapshot)  # a narrower wire dtype: every chunk rounded before the reader looks
    pool.lent()
    until = time.monotonic() + node.timeouts.lend_s
    if not node.loans.lend(request.node, request.req, snapshot, until):
        return None
    try:
        header, given = _served_header(
            node, request, snapshot, layout, news, shm=snapshot.segment.ref(snapshot.gen, until)
        )
    except BaseException:  # no reply went out: the loan is void, and serve's lease ends once, in serve
        node.loans.cancel(request.node, request.req)
        raise

    def lent(went: bool) -> None:
        if not went:  # never sent: the loan ends now, and the rule gets back what on_serve handed out
            node.loans.give_back(request.node, request.req)
            if given:
                with node.state_lock:
                    node.rule.on_serve_failed(node.state, given)

    return Reply(header, (), lent=lent, req=request.req)


def give_back(node: Served, release: wire.Release, user: str | None) -> None:
    """A RELEASE: end the loan of ``release.node``'s request (counted ``shm_released``); with CURVE on, only the
    authenticated requester itself may (else counted ``releases_rejected``); one of no loan held (it expired first)
    is counted ``releases_unmatched``."""
    if node.security is not None and user != release.node:
        node.stats.add("releases_rejected")
        return
    node.stats.add("shm_released" if node.loans.give_back(release.node, release.req) else "releases_unmatched")


def _state_reply(
    node: Served, request: wire.Fetch, snapshot: Snapshot, layout: Layout, pool: SnapshotPool, news: MemberNews
) -> Reply:
    """The STATE reply of ``snapshot`` (leased): the rule's ``on_serve`` extras ride along, given back by
    ``on_serve_failed`` when the reply is never sent; the lease ends when the send has."""
    stream = request.stream and wire.can_stream(request.req)
    header, given = _served_header(node, request, snapshot, layout, news, stream=stream)

    def sent(tracker: Any) -> None:
        pool.release(snapshot, tracker)
        if tracker is None and given:  # never sent: give back what on_serve handed out
            with node.state_lock:
                node.rule.on_serve_failed(node.state, given)

    def prepare(index: int) -> None:
        pool.prepare(snapshot, index)

    return Reply(header, snapshot.frames, sent, prepare, stream, request.req)


def answer_membership(node: Served, header: wire.Push | wire.Join | wire.Members, user: str | None) -> bytes | None:
    """A PUSH's member news (no answer), a JOIN (answered MEMBERS or ERROR join-refused), or a MEMBERS
    announcement (answered with this node's table). ``user``: the sender's CURVE identity (None without CURVE)."""
    membership = node.membership
    if header.kind is Kind.PUSH:
        membership.observe(header)
        return None
    if header.kind is Kind.MEMBERS:
        trusted = node.security is None or user == header.node  # with CURVE, the sender is its key's name
        membership.observe(header, authenticated=trusted)
        leaver = membership.get(header.node)
        if header.settled is not None and trusted and leaver is not None and leaver.state == "left":
            node.transfer.settle_with_leaver(header.node, *header.settled)
        return wire.encode_members(node.name, header.req, membership.full_news())
    return _answer_join(node, header, user)


def _answer_join(node: Served, header: wire.Join, user: str | None) -> bytes:
    """Admit the node that asks to join, or refuse it (ERROR join-refused, with the reason)."""
    membership = node.membership
    refused, why = None, ""
    if membership.leaving:
        refused, why = f"{node.name} is leaving the cluster; join through another member", "leaving"
    elif node.security is not None and user != header.node:
        refused, why = f"the joining node calls itself {header.node!r} but its CURVE key is {user!r}'s", "identity"
    elif header.bipartite != node.schedule.splits_roles():
        refused, why = _roles_differ(header.bipartite), "roles"
    else:
        try:
            entry = membership.admit(header.node, header.host, header.port)
        except JoinRefused as err:
            refused, why = str(err), "table"
    if refused is not None:
        node.stats.add("joins_refused")  # said once per kind of refusal: a flood of JOINs must not fill the log
        node.once.warning(("(join refused)", why), "node %s: refused a join of %s: %s", node.name,
                          clipped(header.node), clipped(refused))  # fmt: skip
        return wire.encode_error(node.name, header.req, ErrorCode.JOIN_REFUSED, refused)
    node.stats.add("joins_admitted")
    log.info("node %s: %s joined from %s:%d (version %d)", node.name, entry.name, entry.host, entry.port, entry.version)
    return wire.encode_members(
        node.name,
        header.req,
        membership.full_news(),
        permanent=membership.permanent(),
        mass=float(membership.incarnations()),
        bipartite=node.schedule.splits_roles(),
    )


def _roles_differ(joiner_splits: bool) -> str:
    """Why a JOIN whose file splits AD-PSGD's nodes into roles (or does not) is refused by a member whose does not
    (or does): a node that takes no role would exchange with either kind, and an active node refuses exchanges."""
    if joiner_splits:
        return "the joining file says adpsgd: {bipartite: true}, the cluster's nodes take no active/passive roles"
    return (
        "the cluster's AD-PSGD nodes are active or passive (adpsgd: {bipartite: true}); "
        "the joining file must say bipartite: true too (it then takes the role its name gives it)"
    )


def linger(node: Served, seconds: float, idle_s: float = 1.0) -> float:
    """Trainer thread, after training: keep serving the last snapshot for up to ``seconds``, less once no peer
    fetched for ``idle_s``; the seconds spent.

    A node that finished training and closed at once would cost every peer still training a timeout or three
    before flow control marks it down. The transfer is told first (:meth:`TransferPattern.linger_starts`): an
    exchange rule's node refuses new exchanges while it lingers; pulls are still served, and a push rule's node
    still takes pushes (its hand-off folds them)."""
    node.transfer.linger_starts()
    start = last = time.monotonic()
    served = node.stats.snapshot()["served"]
    while not node.closed:
        now = time.monotonic()
        if now - start >= seconds or now - last >= idle_s:
            break
        time.sleep(min(0.05, idle_s / 4))
        current = node.stats.snapshot()["served"]
        if current != served:
            served, last = current, time.monotonic()
    return time.monotonic() - start
