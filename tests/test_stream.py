"""Streamed replies: the header alone, then one tagged message per chunk (dpwa/node/wire/).

A node asks for the streamed framing in every FETCH; a peer that answers with the
single-message framing (header and chunks in one multipart message) is still understood (tests/test_connection.py,
tests/test_hostile.py). Here: the RX side's framing per request, and every way a
streamed reply can break on the TX side -- each is counted, nothing reaches the
parameters, and the next fetch from the same peer works.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import free_ports, write_cluster
from fakes import FakePeer, Messages

from dpwa import DpwaConnection
from dpwa.node import wire
from dpwa.node.wire import CHUNK_BYTES, Layout

pytestmark = [pytest.mark.integration, pytest.mark.timing]

N = CHUNK_BYTES // 4 + 1000  # float32 elements: a little over one chunk, so two chunks


def model(value: float) -> list[np.ndarray]:
    return [np.full(N, value, np.float32), np.full((3, 4), value, np.float32)]


def payload(arrays: list[np.ndarray]) -> tuple[Layout, np.ndarray]:
    layout = Layout.of(arrays)
    buf = layout.allocate()
    for dst, src in zip(layout.views(buf), arrays):
        dst[...] = src
    return layout, buf


def streamed(header: wire.Message, arrays: list[np.ndarray], node: str = "w2") -> Messages:
    """A well-formed streamed reply to ``header``: [header], then [tag, chunk] per chunk."""
    layout, buf = payload(arrays)
    head = wire.encode_state(node, header.req, clock=1.0, loss=1.0, extras={}, layout=layout, stream=True)
    bounds = layout.frame_bounds()
    chunks = [[wire.encode_chunk_tag(header.req, i), buf[s:e].tobytes()] for i, (s, e) in enumerate(bounds)]
    return [[head], *chunks]


@pytest.fixture
def rig(tmp_path: Path):
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=500)
    peer = FakePeer(ports[1])
    try:
        with DpwaConnection("w1", cfg, seed=0) as node:
            yield node, peer
    finally:
        peer.close()


def exchange(node: DpwaConnection, params: list[np.ndarray]) -> float:
    node.update_send(params, 1.0)
    return node.update_wait(1.0)


def test_a_good_streamed_reply_is_mixed(rig):
    node, peer = rig
    peer.respond = lambda h: streamed(h, model(8.0))
    p = model(0.0)
    assert exchange(node, p) == 0.5
    assert all((x == 4.0).all() for x in p)
    assert peer.requests[0].stream  # the node asked for the streamed framing
    assert node.last_exchange["status"] == "ok"


def broken(kind: str) -> Callable[[wire.Message], Messages]:
    def build(h: wire.Message) -> Messages:
        good = streamed(h, model(8.0))
        head, first, second = good
        if kind == "order":
            return [head, second, first]
        if kind == "size":
            return [head, [first[0], first[1][:-4]], second]
        if kind == "non-finite":
            bad = np.frombuffer(second[1], np.float32).copy()
            bad[3] = np.inf
            return [head, first, [second[0], bad.tobytes()]]
        if kind == "no-payload":
            return [head, [first[0]], second]
        if kind == "two-payloads":
            return [head, [*first, b"x"], second]
        if kind == "header-with-frames":
            return [[head[0], first[1]]]
        if kind == "other-message":
            return [head, first, [b"junk"], second]
        if kind == "missing-chunk":
            return [head, first]
        raise AssertionError(kind)

    return build


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        ("order", "frames"),
        ("size", "size"),
        ("non-finite", "non-finite"),
        ("no-payload", "frames"),
        ("two-payloads", "frames"),
        ("header-with-frames", "frames"),
        ("other-message", "frames"),
        ("missing-chunk", "timeout"),
    ],
)
def test_broken_streams_change_nothing_are_counted_and_the_next_fetch_works(rig, kind: str, outcome: str):
    node, peer = rig
    peer.respond = broken(kind)
    p = model(0.0)
    assert exchange(node, p) == 0.0
    assert all((x == 0).all() for x in p)
    s = node.stats()
    if outcome == "timeout":
        assert s["fetches_timed_out"] == 1 and s["fetches_rejected"] == 0
    else:
        assert s["rejected_by_reason"] == {outcome: 1}, s["rejected_by_reason"]
    node._node.flow.success("w2")  # keep the peer chosen
    peer.respond = lambda h: streamed(h, model(8.0))
    assert exchange(node, p) == 0.5  # the socket was reset: nothing of the broken reply is left over
    assert all((x == 4.0).all() for x in p)


def test_chunks_of_another_request_are_ignored(rig):
    node, peer = rig

    def respond(h: wire.Message) -> Messages:
        old = h.__class__(**{**h.__dict__, "req": h.req - 1})
        stale = streamed(old, model(99.0))
        return [*stale[1:], *streamed(h, model(8.0))]  # an earlier reply's chunks first, then ours

    peer.respond = respond
    p = model(0.0)
    assert exchange(node, p) == 0.5
    assert all((x == 4.0).all() for x in p)


# --------------------------------------------------------------------------- the RX side


def test_the_server_streams_only_when_asked(tmp_path: Path):
    port = free_ports(1)[0]
    cfg = write_cluster(tmp_path / "c.yaml", [port])
    published = model(3.0)
    layout, expected = payload(published)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        with DpwaConnection("w1", cfg) as node:
            node.update_send(published, 1.0)
            # the single-message framing: one multipart message
            sock.send(wire.encode_fetch("w9", 5, layout.fingerprint))
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            assert not wire.decode_message(frames[0]).stream and len(frames) == 3
            assert b"".join(frames[1:]) == expected.tobytes()
            # streamed: the header alone, then [tag, chunk] messages in order
            sock.send(wire.encode_fetch("w9", 6, layout.fingerprint, stream=True))
            assert sock.poll(5000)
            head = sock.recv_multipart()
            assert len(head) == 1 and wire.decode_message(head[0]).stream
            got = []
            for i in range(2):
                assert sock.poll(5000)
                tag, chunk = sock.recv_multipart()
                assert wire.decode_chunk_tag(tag) == (6, i)
                got.append(chunk)
            assert b"".join(got) == expected.tobytes() and not sock.poll(50)
            # a request id no chunk tag can carry: the single-message framing
            sock.send(wire.encode_fetch("w9", -1, layout.fingerprint, stream=True))
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            assert not wire.decode_message(frames[0]).stream and len(frames) == 3
    finally:
        sock.close()
        ctx.term()


def test_chunk_tags_round_trip_and_are_told_apart_from_headers():
    tag = wire.encode_chunk_tag(2**64 - 1, 7)
    assert wire.decode_chunk_tag(tag) == (2**64 - 1, 7)
    assert wire.decode_chunk_tag(wire.encode_fetch("w1", 1, "fp")) is None
    assert wire.decode_chunk_tag(tag[:-1]) is None
    assert wire.can_stream(0) and not wire.can_stream(-1) and not wire.can_stream(2**64)
    with pytest.raises(wire.WireError, match="stream"):
        wire.decode_message(wire.encode_fetch("w1", 1, "fp")[:-1] + b',"stream":1}')
