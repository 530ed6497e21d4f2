"""A push's round is settled at the receiver the moment its verdict is, whatever gives it.

SGP waits at most a timeout for each in-neighbour's push of the round (``PushReceiver.wait_rounds``); a push refused
(its mass stays with the sender) ends that wait as an accepted one does. These tests drive the receiver directly
(the RX thread's calls, with the payload frames on an inproc socket pair): no timing, no training.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from dpwa.node import wire
from dpwa.node.inbox import PushReceiver
from dpwa.node.wire import Layout, SharedRef

ROUND = 7
_pairs = itertools.count()


class Wire:
    """A PAIR of inproc sockets: the test sends a chunk message on ``out``, the receiver reads it from ``into``."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        address = f"inproc://verdicts-{next(_pairs)}"
        self.into = self.ctx.socket(zmq.PAIR)
        self.into.bind(address)
        self.out = self.ctx.socket(zmq.PAIR)
        self.out.connect(address)
        for sock in (self.into, self.out):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)  # 5 s: a frame sent in-process never takes that long

    def deliver(self, frames: list[bytes]) -> bytes:
        """Send ``frames`` as one message and read its first frame on the receiving end (the rest stay there)."""
        self.out.send_multipart(frames)
        return self.into.recv()

    def close(self) -> None:
        self.into.close()
        self.out.close()
        self.ctx.term()


@pytest.fixture
def pipe() -> Iterator[Wire]:
    w = Wire()
    yield w
    w.close()


def receiver(layout: Layout, rejects: Counter[str], *, host_id: str = "") -> PushReceiver:
    inbox = PushReceiver(
        "w1",
        ["w1", "w2"],
        lambda: (layout, layout),
        2,
        30.0,
        lambda key, n: None,
        lambda reason: rejects.update([reason]),
        lambda snapshot: None,
        host_id=host_id,
    )
    inbox.allocate(layout)
    return inbox


def header(layout: Layout, seq: int, **kw: object) -> wire.Push:
    message = wire.decode_message(
        wire.encode_push("w2", seq, clock=1.0, loss=1.0, extras={"w_given": 0.5, "round": ROUND}, layout=layout, **kw)
    )
    assert isinstance(message, wire.Push)
    return message


LAYOUT = Layout.of([np.zeros(40, np.float32)])
GOOD = np.ones(LAYOUT.total_bytes // 4, np.float32).tobytes()
NAN = np.full(LAYOUT.total_bytes // 4, np.nan, np.float32).tobytes()


def test_a_push_taken_whole_settles_its_round(pipe: Wire) -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects)
    assert inbox.begin(b"id", header(LAYOUT, 1), None) is None
    assert inbox.latest_round("w2") == -1  # still arriving: no verdict, the round is open
    tag = pipe.deliver([wire.encode_chunk_tag(1, 0), GOOD])
    answer = inbox.chunk(b"id", *wire.decode_chunk_tag(tag), pipe.into)  # type: ignore[misc]
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ACK
    assert inbox.latest_round("w2") == ROUND and inbox.wait_rounds({"w2": ROUND}, 0.0) == []


def test_a_push_refused_for_a_bad_chunk_settles_its_round(pipe: Wire) -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects)
    assert inbox.begin(b"id", header(LAYOUT, 1), None) is None
    tag = pipe.deliver([wire.encode_chunk_tag(1, 0), NAN])
    answer = inbox.chunk(b"id", *wire.decode_chunk_tag(tag), pipe.into)  # type: ignore[misc]
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert sum(rejects.values()) == 1 and inbox.occupied() == 0
    assert inbox.verdict_for("w2") == (1, False)
    assert inbox.latest_round("w2") == ROUND and inbox.wait_rounds({"w2": ROUND}, 0.0) == []


def test_a_push_that_expired_half_arrived_settles_its_round() -> None:
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(LAYOUT, 1), None) is None
    inbox.expire(time.monotonic() + 60.0)  # past the 30 s a push may take to arrive whole
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_push_closed_by_its_senders_query_settles_its_round() -> None:
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(LAYOUT, 1), None) is None
    answer = inbox.settle(b"id", wire.decode_message(wire.encode_settle("w2", 1, "query")), None)  # type: ignore[arg-type]
    assert wire.decode_message(answer).kind is wire.Kind.ERROR
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_push_through_shared_memory_refused_settles_its_round() -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects, host_id="this-host")
    ref = SharedRef(pid=1, fd=3, token="0" * 32, until=1e12)
    answer = inbox.begin(b"id", header(LAYOUT, 1, host="another-host", gen=1, shm=ref), None)
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert rejects == Counter({"shm-unasked": 1})
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_repeated_header_never_moves_a_settled_round(pipe: Wire) -> None:
    """A push's header sent again after its verdict (a stale repeat) gets that verdict and settles nothing new."""
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(LAYOUT, 1), None) is None
    tag = pipe.deliver([wire.encode_chunk_tag(1, 0), NAN])
    inbox.chunk(b"id", *wire.decode_chunk_tag(tag), pipe.into)  # type: ignore[misc]
    late = wire.decode_message(
        wire.encode_push("w2", 1, clock=1.0, loss=1.0, extras={"w_given": 0.5, "round": 99}, layout=LAYOUT)
    )
    answer = inbox.begin(b"id", late, None)  # type: ignore[arg-type]
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert inbox.latest_round("w2") == ROUND


def test_a_push_naming_no_round_settles_nothing(pipe: Wire) -> None:
    """An exchange's push (AD-PSGD names no round) refused for a bad chunk: refused, and no round appears."""
    inbox = receiver(LAYOUT, Counter())
    plain = wire.decode_message(wire.encode_push("w2", 1, clock=1.0, loss=1.0, extras={}, layout=LAYOUT, hold=True))
    assert inbox.begin(b"id", plain, None) is None  # type: ignore[arg-type]
    tag = pipe.deliver([wire.encode_chunk_tag(1, 0), NAN])
    inbox.chunk(b"id", *wire.decode_chunk_tag(tag), pipe.into)  # type: ignore[misc]
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == -1


def test_a_query_closes_a_held_exchange_so_its_verdict_never_changes(pipe: Wire) -> None:
    """A SETTLE query about an exchange's push held for its FETCH answers not-delivered and frees it: a FETCH (and so
    a commit) after that finds nothing to pair with, and the verdict stays refused."""
    inbox = receiver(LAYOUT, Counter())
    held = wire.decode_message(wire.encode_push("w2", 1, clock=1.0, loss=1.0, extras={}, layout=LAYOUT, hold=True))
    assert inbox.begin(b"id", held, None) is None  # type: ignore[arg-type]
    tag = pipe.deliver([wire.encode_chunk_tag(1, 0), GOOD])
    assert inbox.chunk(b"id", *wire.decode_chunk_tag(tag), pipe.into) is None  # type: ignore[misc]
    assert inbox.holds_exchange("w2", 1)
    answer = inbox.settle(b"id", wire.decode_message(wire.encode_settle("w2", 1, "query")), None)  # type: ignore[arg-type]
    assert wire.decode_message(answer).kind is wire.Kind.ERROR
    assert not inbox.holds_exchange("w2", 1) and inbox.occupied() == 0
    assert not inbox.serve_exchange("w2", 1, object()) and inbox.verdict_for("w2") == (1, False)
