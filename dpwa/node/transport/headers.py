"""The request headers the TX thread sends, each with its fallbacks when it does not encode whole.

A FETCH carries the rule's extras and the member news for its peer; a PUSH header carries the snapshot's
state, the rule's given extras and the member news. Extras that are not JSON, or a header that would exceed
:data:`~dpwa.node.wire.MAX_HEADER_BYTES`, are dropped in that order (the member table's digest always goes),
so a request always goes out. Pure functions: no sockets, no threads.
"""

from __future__ import annotations

import functools
import logging

from dpwa.node import wire
from dpwa.node.pushes import Push
from dpwa.node.transport.fetch import FetchJob
from dpwa.node.wire import Layout, MemberNews

__all__ = ["fetch_request", "push_header"]

log = logging.getLogger(__name__)


def fetch_request(node: str, job: FetchJob, wire_layout: Layout, news: MemberNews | None, host: str = "") -> bytes:
    """The FETCH ``node`` sends for ``job`` (streamed; naming the exchange's push, if any; ``host``: the
    co-location identity that may get a shared-memory reply); without the rule's extras when they do not encode,
    without the member table when it does not fit a header (the digest still goes)."""
    exchange = job.push.seq if job.push is not None else -1
    fingerprint = wire_layout.fingerprint
    for extras, sent in ((job.extras, news), (None, news), (None, MemberNews(news.digest) if news else None)):
        try:
            return wire.encode_fetch(
                node, job.req, fingerprint, extras, stream=True, exchange=exchange, news=sent, host=host
            )
        except (TypeError, ValueError) as exc:  # too big, or extras not JSON: try with less
            log.warning("request extras or member table dropped: %s", exc)
    return wire.encode_fetch(node, job.req, fingerprint, stream=True, exchange=exchange, host=host)


def push_header(
    node: str,
    push: Push,
    wire_layout: Layout,
    chunk: int,
    news: MemberNews | None,
    *,
    hold: bool,
    host: str = "",
    shared: bool = False,
) -> bytes:
    """The PUSH header of ``push`` from ``node``: the snapshot's clock, loss and extras with what the push gives,
    whole when the snapshot is one chunk; with only the member table's digest when the table does not fit.
    ``hold``: an exchange's push, kept by the receiver until the sender's SETTLE. ``host``: the co-location
    identity offered; ``shared``: the payload stays in the snapshot's segment (the header names it)."""
    snap = push.snapshot
    shm = snap.segment.ref(snap.gen, push.deadline) if shared else None
    encode = functools.partial(
        wire.encode_push,
        node,
        push.seq,
        clock=snap.clock,
        loss=snap.loss,
        extras={**snap.extras, **push.given},
        layout=wire_layout,
        chunk=chunk,
        hold=hold,
        whole=len(snap.frames) == 1,
        front=snap.front,
        host=host,
        gen=snap.gen,
        shm=shm,
    )
    try:
        return encode(news=news)
    except ValueError:  # the member table does not fit a header: its digest goes alone
        return encode(news=MemberNews(news.digest) if news is not None else None)
