"""Robustness of the TX path: strays counted, frames bounded by the layout, threads that die or stall.

* A chunk message of no fetch in flight (another request, before its header, past the last
  chunk) is dropped and counted in ``stale_replies``; a rejected streamed header takes its
  chunks with it (the socket is reset), so they are not counted as strays.
* The TX DEALER refuses, through ZMQ_MAXMSGSIZE, a frame larger than a valid reply's: the
  layout's *wire* bytes (a 16-bit wire dtype halves them), up to a chunk.
* A TX thread that dies makes the trainer's next call raise (the cause chained) instead of
  hanging; an RX thread that dies is logged with its traceback, shown in stats() and raised.
* A stalled TX thread never holds the trainer past timeout + slack: update_wait times the
  fetch out itself, and the verdict that comes later is dropped, never mixed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import free_ports, wait_until, write_cluster
from fakes import FakePeer, Faults, Messages

from dpwa import DpwaConnection
from dpwa.node import wire
from dpwa.node.wire import Layout

pytestmark = [pytest.mark.integration, pytest.mark.timing]

TIMEOUT_MS = 500
BOUND_S = TIMEOUT_MS / 1000 + 0.25
"""Longest update_wait may block: the fetch's timeout plus slack."""


class Injected(Exception):
    """The failure a test injects into a dpwa thread."""


def model(value: float, n: int = 100) -> list[np.ndarray]:
    return [np.full(n, value, np.float32), np.full((4, 5), value, np.float32)]


def streamed(header: wire.Message, arrays: list[np.ndarray], *, fp: str | None = None) -> Messages:
    """A streamed reply of w2 to ``header`` carrying ``arrays``: [header], then one [tag, chunk] per chunk."""
    layout = Layout.of(arrays)
    buf = layout.allocate()
    for dst, src in zip(layout.views(buf), arrays):
        dst[...] = src
    head = wire.encode_state("w2", header.req, clock=1.0, loss=1.0, extras={}, layout=layout, stream=True)
    if fp is not None:
        head = head.replace(layout.fingerprint.encode(), fp.encode())
    bounds = layout.frame_bounds()
    return [[head], *([wire.encode_chunk_tag(header.req, i), buf[s:e].tobytes()] for i, (s, e) in enumerate(bounds))]


def single(header: wire.Message, arrays: list[np.ndarray]) -> Messages:
    """The same reply in the single-message framing: the header and every payload frame in one message."""
    head, *chunks = streamed(header, arrays)
    layout = Layout.of(arrays)
    plain = wire.encode_state("w2", header.req, clock=1.0, loss=1.0, extras={}, layout=layout)
    return [[plain, *(chunk[1] for chunk in chunks)]]


@contextlib.contextmanager
def make_rig(
    tmp_path: Path, faults: Faults | None = None, **settings: object
) -> Iterator[tuple[DpwaConnection, FakePeer]]:
    """Node w1 (timeout TIMEOUT_MS) whose only peer w2 is a :class:`FakePeer`, by default answering every FETCH
    with a streamed reply of ``model(8.0)``; with ``faults``, w1 runs a transport doing what they say."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=TIMEOUT_MS, **settings)
    peer = FakePeer(ports[1], lambda header: streamed(header, model(8.0)), thread_name="fake-w2")
    transport = {} if faults is None else {"transport": faults.factory}
    try:
        with DpwaConnection("w1", cfg, seed=0, **transport) as node:
            yield node, peer
    finally:
        peer.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[DpwaConnection, FakePeer]]:
    with make_rig(tmp_path) as pair:
        yield pair


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[DpwaConnection, FakePeer, Faults]]:
    """The rig, w1 on a :class:`~fakes.FaultyTransport` (no fault until a test sets one)."""
    faults = Faults()
    with make_rig(tmp_path, faults) as (node, peer):
        yield node, peer, faults


def exchange(node: DpwaConnection, params: list[np.ndarray]) -> tuple[float, float]:
    """(factor, seconds update_wait blocked)."""
    node.update_send(params, 1.0)
    t0 = time.monotonic()
    factor = node.update_wait(1.0)
    return factor, time.monotonic() - t0


# --------------------------------------------------------------------------- strays


def test_stray_chunks_are_dropped_and_counted(rig):
    node, peer = rig

    def respond(h: wire.Message) -> Messages:
        head, chunk = streamed(h, model(8.0))
        other = [wire.encode_chunk_tag(h.req - 1, 0), chunk[1]]  # a chunk of an earlier request
        early = [wire.encode_chunk_tag(h.req, 0), bytes(len(chunk[1]))]  # ours, before its header
        past = [wire.encode_chunk_tag(h.req, 1), b"junk"]  # after the last chunk (the reply has one)
        return [other, early, head, chunk, past]

    peer.respond = respond
    p = model(0.0)
    assert exchange(node, p)[0] == 0.5
    assert all((x == 4.0).all() for x in p)
    wait_until(lambda: node.stats()["stale_replies"] == 3, 5, message="three stray chunks counted")
    s = node.stats()
    assert s["fetches_rejected"] == 0 and s["by_peer"] == {"w2": {"ok": 1}}, s


def test_a_rejected_streamed_header_takes_its_chunks_with_it(rig):
    """Its chunks are not strays: the socket is reset; the next reply from the same peer is mixed."""
    node, peer = rig

    def respond(h: wire.Message) -> Messages:
        head, chunk = streamed(h, model(8.0), fp="0" * 16)  # another layout: rejected on its header
        more = [[wire.encode_chunk_tag(h.req, i), chunk[1]] for i in (1, 2)]  # as if it had three chunks
        return [head, chunk, *more]

    peer.respond = respond
    p = model(0.0)
    assert exchange(node, p)[0] == 0.0
    peer.respond = lambda h: streamed(h, model(8.0))
    assert exchange(node, p)[0] == 0.5  # after the reset: nothing of the rejected reply is left over
    s = node.stats()
    assert s["rejected_by_reason"] == {"layout": 1} and s["stale_replies"] == 0, s
    assert all((x == 4.0).all() for x in p)


# --------------------------------------------------------------------------- frame size from the layout


def test_frame_limit_follows_the_wire_layout(tmp_path: Path):
    """Under wire_dtype float16 a valid frame is at most the float16 bytes: a frame of the float32 size is refused
    by ZeroMQ (the connection drops, the fetch times out: nothing rejected, nothing buffered), a valid one mixes."""
    n = 100_000  # 400 KB of float32, 200 KB on the wire: both above a header's 64 KiB, below a chunk
    with make_rig(tmp_path, wire_dtype="float16") as (node, peer):
        wire_arrays = [a.astype(np.float16) for a in model(8.0, n)]
        wire_bytes = Layout.of(wire_arrays).total_bytes
        assert wire.MAX_HEADER_BYTES < wire_bytes < Layout.of(model(0.0, n)).total_bytes <= wire.CHUNK_BYTES

        def oversized(h: wire.Message) -> Messages:
            head, (tag, _chunk) = streamed(h, wire_arrays)
            return [head, [tag, bytes(wire_bytes + 4096)]]  # within the float32 size, above the wire size

        peer.respond = oversized
        p = model(0.0, n)
        assert exchange(node, p)[0] == 0.0
        s = node.stats()
        assert s["fetches_timed_out"] == 1 and s["fetches_rejected"] == 0, (s["by_peer"], s["rejected_by_reason"])
        assert all((x == 0.0).all() for x in p)
        peer.respond = lambda h: streamed(h, wire_arrays)
        node._node.flow.success("w2")  # keep the peer chosen
        assert exchange(node, p)[0] == 0.5
        assert all((x == 4.0).all() for x in p)


# --------------------------------------------------------------------------- thread death


@pytest.mark.parametrize("point", ["tx.start", "tx.receive"])
def test_tx_thread_death_raises_in_the_trainer(faulty, caplog, point: str):
    """``tx.start``: the thread dies taking the job; ``tx.receive``: while the trainer waits for the reply."""
    node, peer, faults = faulty
    p = model(0.0)
    assert exchange(node, p)[0] == 0.5

    def boom(*args: object) -> None:
        raise Injected("injected into the TX thread")

    faults.before[point] = boom
    node.update_send(p, 1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="TX thread died") as info:
        node.update_wait(1.0)
    assert time.monotonic() - t0 <= BOUND_S
    assert isinstance(info.value.__cause__, Injected)
    s = node.stats()
    assert not s["tx_alive"] and s["rx_alive"] and "Injected" in s["thread_errors"]["tx"], s
    with pytest.raises(RuntimeError, match="TX thread died"):  # and every later call
        node.update_send(p, 1.0)
    assert any(r.exc_info and "TX thread failed" in r.getMessage() for r in caplog.records)
    assert all((x == 4.0).all() for x in p)


CLOSE_S = 0.3
"""How long the dying TX thread takes to close its sockets (its last act) in the race below."""


def test_the_trainer_sees_the_dead_tx_thread_ended(faulty):
    """The race behind a flake: the job's waiter is woken before the dying thread has closed its sockets.
    Once update_wait has raised, stats() must already say the thread ended (it is joined, bounded)."""
    node, peer, faults = faulty
    p = model(0.0)
    assert exchange(node, p)[0] == 0.5
    assert faults.transport is not None
    tx = faults.transport.tx

    def boom(*args: object) -> None:
        raise Injected("injected into the TX thread")

    faults.before["tx.close"] = lambda: time.sleep(CLOSE_S)
    faults.before["tx.start"] = boom
    node.update_send(p, 1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="TX thread died"):
        node.update_wait(1.0)
    assert time.monotonic() - t0 <= BOUND_S
    assert not node.stats()["tx_alive"] and not tx.is_alive()


def test_rx_thread_death_is_logged_shown_and_raised(tmp_path: Path, caplog):
    port = free_ports(1)[0]
    cfg = write_cluster(tmp_path / "c.yaml", [port], timeout_ms=TIMEOUT_MS)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    faults = Faults()
    try:
        with DpwaConnection("w1", cfg, transport=faults.factory) as node:
            p = model(0.0)
            node.update_send(p, 1.0)
            assert node.update_wait(1.0) == 0.0

            def boom(*args: object) -> None:
                raise Injected("injected into the RX thread")

            faults.before["rx.handle"] = boom
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(wire.encode_fetch("w9", 1, Layout.of(p).fingerprint))
            wait_until(lambda: not node.stats()["rx_alive"], 5, message="the RX thread ended")
            s = node.stats()
            assert s["tx_alive"] and "Injected" in s["thread_errors"]["rx"], s
            assert any(r.exc_info and "RX thread failed" in r.getMessage() for r in caplog.records)
            with pytest.raises(RuntimeError, match="RX thread died") as info:
                node.update_send(p, 1.0)
            assert isinstance(info.value.__cause__, Injected)
    finally:
        sock.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- a stalled TX thread


@pytest.mark.parametrize("framing", ["single", "streamed"])
def test_a_stalled_tx_thread_never_holds_the_trainer(faulty, framing: str):
    """The late verdict: an accepted reply (single framing) or the chunks after its header (streamed), dropped."""
    node, peer, faults = faulty
    peer.respond = lambda h: (single if framing == "single" else streamed)(h, model(8.0))
    p = model(0.0)
    assert exchange(node, p)[0] == 0.5  # p is 4.0 now
    entered, release = threading.Event(), threading.Event()

    def stalled(*args: object) -> None:  # the TX thread blocks on the reply's header, then goes on as usual
        entered.set()
        release.wait(30)

    faults.before["tx.header"] = stalled
    before, jobs = [a.copy() for a in p], []
    try:
        node.update_send(p, 1.0)
        jobs.append(node._node.transfer.fetcher.pending)
        t0 = time.monotonic()
        factor, waited = node.update_wait(1.0), time.monotonic() - t0
        assert factor == 0.0 and waited <= BOUND_S, waited
        assert entered.is_set()  # the reply did arrive: the TX thread sits on it
        assert node.last_exchange["status"] == "timeout"
        node.update_send(p, 1.0)  # a second fetch, queued behind the stalled one
        jobs.append(node._node.transfer.fetcher.pending)
        t0 = time.monotonic()
        factor, waited = node.update_wait(1.0), time.monotonic() - t0
        assert factor == 0.0 and waited <= BOUND_S, waited
        s = node.stats()
        assert s["fetches_late"] == 2 and s["fetches_timed_out"] == 2 and s["by_peer"]["w2"]["timeout"] == 2, s
        clock = node.clock
    finally:
        release.set()
    # the stalled verdict (a valid reply) comes now: dropped as stale, never counted ok, never mixed
    assert all(job is not None and job.done.wait(5) for job in jobs), "the TX thread never finished both fetches"
    s = node.stats()
    assert s["stale_replies"] == 1, s  # the late verdict, dropped
    assert s["fetches_ok"] == 1 and s["mixes"] == 1 and s["fetches_started"] == 2, s  # the queued one never sent
    assert all(a.tobytes() == b.tobytes() for a, b in zip(p, before)) and node.clock == clock
    faults.before.clear()
    assert exchange(node, p)[0] == 0.5  # the peer is still up; the TX thread serves the next fetch
    assert all((x == 6.0).all() for x in p)


def test_an_exchange_that_update_wait_gave_up_on_is_aborted_at_once_when_its_reply_comes_late(tmp_path: Path):
    """AD-PSGD between two real nodes, w1's TX thread stalled on w2's reply until w1's update_wait has timed the
    exchange out (w1 mixes nothing). When the reply is then taken, late, w1 sends SETTLE abort, so w2 frees the
    push it holds at once (``exchanges_aborted``) and never mixes its half. Before, no SETTLE went: w2 held the
    push, the snapshot paired with it and an inbox slot until the hold expired (8 timeouts), counted expired."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, interpolation="adpsgd", timeout_ms=500)
    faults = Faults()
    p1, p2 = model(0.0), model(8.0)
    entered, release = threading.Event(), threading.Event()

    def stalled(*args: object) -> None:  # the TX thread blocks on the reply's header, then goes on as usual
        entered.set()
        release.wait(30)

    with (
        DpwaConnection("w1", cfg, seed=0, params=p1, transport=faults.factory) as w1,
        DpwaConnection("w2", cfg, seed=1, params=p2) as w2,
    ):
        w2.update_send(p2, 1.0)  # w2 publishes 8 (its own exchange may find w1 not ready)
        w2.update_wait(1.0)
        before = w2.stats()
        faults.before["tx.header"] = stalled
        try:
            w1.update_send(p1, 1.0)
            job = w1._node.transfer.fetcher.pending
            assert w1.update_wait(1.0) == 0.0 and entered.is_set()  # timed out, the reply sitting in the TX thread
            assert w1.last_exchange["status"] == "timeout"
        finally:
            release.set()
        assert job is not None and job.done.wait(5), "the TX thread never finished the exchange"
        wait_until(lambda: w2.stats()["exchanges_aborted"] > before["exchanges_aborted"], 4.0)  # the hold: 8 x 0.5 s
        after = w2.stats()
        assert after["exchanges_committed"] == before["exchanges_committed"], after
        assert after["exchanges_expired"] == before["exchanges_expired"], after
        assert all((x == 0.0).all() for x in p1)
