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
from dpwa.node.core import request_ids
from dpwa.node.inbox import PushReceiver
from dpwa.node.verdicts import Verdicts
from dpwa.node.wire import Layout, SharedRef

ROUND = 7
LAYOUT = Layout.of([np.zeros(40, np.float32)])
GOOD = np.ones(LAYOUT.total_bytes // 4, np.float32).tobytes()
NAN = np.full(LAYOUT.total_bytes // 4, np.nan, np.float32).tobytes()
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

    def chunk(self, inbox: PushReceiver, seq: int, payload: bytes) -> bytes | None:
        """Hand ``inbox`` chunk 0 of push ``seq`` as the RX thread does (its tag read, its payload frame next on the
        socket); the answer."""
        self.out.send_multipart([wire.encode_chunk_tag(seq, 0), payload])
        tag = wire.decode_chunk_tag(self.into.recv())
        assert tag is not None
        return inbox.chunk(b"id", *tag, self.into)

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


def header(seq: int, extras: dict[str, object] | None = None, **kw: object) -> wire.Push:
    """Push ``seq`` of ``w2``'s header (by default of round :data:`ROUND`), as the RX thread decodes it."""
    extras = {"w_given": 0.5, "round": ROUND} if extras is None else extras
    message = wire.decode_message(wire.encode_push("w2", seq, clock=1.0, loss=1.0, extras=extras, layout=LAYOUT, **kw))
    assert isinstance(message, wire.Push)
    return message


def query(inbox: PushReceiver, seq: int) -> wire.Message:
    """``w2``'s SETTLE query about its push ``seq``: the decoded answer."""
    settle = wire.decode_message(wire.encode_settle("w2", seq, "query"))
    assert isinstance(settle, wire.Settle)
    return wire.decode_message(inbox.settle(b"id", settle, None))


def test_a_push_taken_whole_settles_its_round(pipe: Wire) -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects)
    assert inbox.begin(b"id", header(1), None) is None
    assert inbox.latest_round("w2") == -1  # still arriving: no verdict, the round is open
    answer = pipe.chunk(inbox, 1, GOOD)
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ACK
    assert inbox.latest_round("w2") == ROUND and inbox.wait_rounds({"w2": ROUND}, 0.0) == []


def test_a_push_refused_for_a_bad_chunk_settles_its_round(pipe: Wire) -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects)
    assert inbox.begin(b"id", header(1), None) is None
    answer = pipe.chunk(inbox, 1, NAN)
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert sum(rejects.values()) == 1 and inbox.occupied() == 0
    assert inbox.verdict_for("w2") == (1, False)
    assert inbox.latest_round("w2") == ROUND and inbox.wait_rounds({"w2": ROUND}, 0.0) == []


def test_a_push_that_expired_half_arrived_settles_its_round() -> None:
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(1), None) is None
    inbox.expire(time.monotonic() + 60.0)  # past the 30 s a push may take to arrive whole
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_push_closed_by_its_senders_query_settles_its_round() -> None:
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(1), None) is None
    assert query(inbox, 1).kind is wire.Kind.ERROR
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_push_through_shared_memory_refused_settles_its_round() -> None:
    rejects: Counter[str] = Counter()
    inbox = receiver(LAYOUT, rejects, host_id="this-host")
    ref = SharedRef(pid=1, fd=3, token="0" * 32, until=1e12)
    answer = inbox.begin(b"id", header(1, host="another-host", gen=1, shm=ref), None)
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert rejects == Counter({"shm-unasked": 1})
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == ROUND


def test_a_repeated_header_never_moves_a_settled_round(pipe: Wire) -> None:
    """A push's header sent again after its verdict (a stale repeat) gets that verdict and settles nothing new."""
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(1), None) is None
    pipe.chunk(inbox, 1, NAN)
    answer = inbox.begin(b"id", header(1, {"w_given": 0.5, "round": 99}), None)
    assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ERROR
    assert inbox.latest_round("w2") == ROUND


def test_a_push_naming_no_round_settles_nothing(pipe: Wire) -> None:
    """An exchange's push (AD-PSGD names no round) refused for a bad chunk: refused, and no round appears."""
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(1, {}, hold=True), None) is None
    pipe.chunk(inbox, 1, NAN)
    assert inbox.verdict_for("w2") == (1, False) and inbox.latest_round("w2") == -1


def test_a_query_closes_a_held_exchange_so_its_verdict_never_changes(pipe: Wire) -> None:
    """A SETTLE query about an exchange's push held for its FETCH answers not-delivered and frees it: a FETCH (and so
    a commit) after that finds nothing to pair with, and the verdict stays refused."""
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(1, {}, hold=True), None) is None
    assert pipe.chunk(inbox, 1, GOOD) is None
    assert inbox.holds_exchange("w2", 1)
    assert query(inbox, 1).kind is wire.Kind.ERROR
    assert not inbox.holds_exchange("w2", 1) and inbox.occupied() == 0
    assert not inbox.serve_exchange("w2", 1, object()) and inbox.verdict_for("w2") == (1, False)


@pytest.mark.parametrize("held", ["held", "served"])
def test_a_repeated_header_naming_a_segment_for_a_held_exchange_is_stale_and_changes_nothing(
    pipe: Wire, held: str
) -> None:
    """An exchange's push held for its FETCH (or its SETTLE), then a header with the same sequence number naming a
    segment (a forged or repeated PUSH): no answer yet (the exchange's verdict comes with its SETTLE), counted stale,
    nothing read from the segment, and the held exchange is untouched. (The receiver used to look for the slot the
    header had not reserved, and its StopIteration ended the RX thread.)"""
    events: Counter[str] = Counter()
    inbox = PushReceiver(
        "w1",
        ["w1", "w2"],
        lambda: (LAYOUT, LAYOUT),
        2,
        30.0,
        lambda k, n: events.update({k: n}),
        print,
        lambda snapshot: None,
        host_id="this-host",
    )
    inbox.allocate(LAYOUT)
    assert inbox.begin(b"id", header(1, {}, hold=True), None) is None
    assert pipe.chunk(inbox, 1, GOOD) is None
    if held == "served":
        assert inbox.serve_exchange("w2", 1, object())
    ref = SharedRef(pid=1, fd=3, token="0" * 32, until=1e12)
    assert inbox.begin(b"id", header(1, {}, hold=True, host="this-host", gen=1, shm=ref), None) is None
    assert events["pushes_stale"] == 1 and events["shm_pushes_taken"] == 0
    assert inbox.occupied() == 1 and inbox.verdict_for("w2") == (1, None)
    assert inbox.holds_exchange("w2", 1) == (held == "held")


def test_a_sender_restarted_under_its_name_has_its_first_push_taken(pipe: Wire) -> None:
    """A receiver takes a sender's pushes only with growing sequence numbers. w2 made 5,000 requests in its first
    process (its last push taken here), crashed and restarted 2 s later under its name: its new process's first
    push is taken, not refused as a stale repeat (the counter used to start at 1 in every process, so a restarted
    node's pushes were refused until it had made as many requests again)."""
    start_ns = 1_790_000_000 * 10**9
    first = request_ids(start_ns)
    for _ in range(5_000):
        seq = next(first)
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(seq), None) is None
    assert wire.decode_message(pipe.chunk(inbox, seq, GOOD)).kind is wire.Kind.ACK
    inbox.release(inbox.drain(every=True))
    restarted = next(request_ids(start_ns + 2 * 10**9))
    assert restarted > seq
    assert inbox.begin(b"id", header(restarted), None) is None  # reserved: not a stale repeat
    assert wire.decode_message(pipe.chunk(inbox, restarted, GOOD)).kind is wire.Kind.ACK
    assert inbox.verdict_for("w2") == (restarted, True)


def test_a_verdict_outlives_the_member_table_forgetting_its_sender(pipe: Wire) -> None:
    """w2's push is taken, its ACK lost; a partition long enough that w1 forgets w2 (a joined member), then w2's
    SETTLE query: still ACK, not a refusal (w2 would take back the mass w1 already has: counted twice), whether w1
    has w2 in its table again or not yet; a push w2 made after it was forgotten, refused then, stays refused."""
    inbox = receiver(LAYOUT, Counter())
    assert inbox.begin(b"id", header(5), None) is None
    assert wire.decode_message(pipe.chunk(inbox, 5, GOOD)).kind is wire.Kind.ACK  # the ACK that is lost
    inbox.release(inbox.drain(every=True))
    inbox.set_senders(["w1"])  # w2 forgotten
    assert inbox.verdict_for("w2") == (-1, None)
    assert query(inbox, 5).kind is wire.Kind.ACK
    assert query(inbox, 6).kind is wire.Kind.ERROR  # never taken
    assert inbox.begin(b"id", header(7), None) is not None  # a push now: not a member, refused
    inbox.set_senders(["w1", "w2"])  # w2 back (it rejoined)
    assert inbox.verdict_for("w2") == (5, True)
    assert query(inbox, 5).kind is wire.Kind.ACK
    assert inbox.begin(b"id", header(4), None) is not None  # an old push repeated: the verdict of record


def test_retired_verdicts_are_bounded() -> None:
    verdicts = Verdicts(keep_retired=3)
    for i in range(10):
        verdicts.set(f"s{i}", i, True)
    assert verdicts.follow(["s0"], held=["s9"]) == [f"s{i}" for i in range(1, 9)]
    assert [verdicts.retired(f"s{i}") for i in range(10)] == [None] * 6 + [(6, True), (7, True), (8, True), None]
    assert verdicts.get("s9") == (9, True) and verdicts.get("s0") == (0, True)
    assert verdicts.follow(["s0", "s7"], held=[]) == ["s9"]
    assert verdicts.get("s7") == (7, True) and verdicts.retired("s7") is None and verdicts.retired("s9") == (9, True)


def test_a_push_from_a_member_that_went_is_refused_as_a_departure_not_as_a_stranger() -> None:
    """w2 leaves while its push is in flight: the push is refused (bad-request) but counted ``pushes_from_departed``,
    not as a validation rejection (``identity``); a name never a member still is, and so is a member that went
    whose connection authenticated as another node (CURVE). w2 back: its pushes are taken again."""
    rejects: Counter[str] = Counter()
    events: Counter[str] = Counter()

    def inbox_of(check_identity: bool) -> PushReceiver:
        inbox = PushReceiver(
            "w1",
            ["w1", "w2", "w3"],
            lambda: (LAYOUT, LAYOUT),
            2,
            30.0,
            lambda key, n: events.update({key: n}),
            lambda reason: rejects.update([reason]),
            lambda snapshot: None,
            check_identity=check_identity,
        )
        inbox.allocate(LAYOUT)
        return inbox

    def stranger(name: str) -> wire.Push:
        message = wire.decode_message(wire.encode_push(name, 1, clock=1.0, loss=1.0, extras={}, layout=LAYOUT))
        assert isinstance(message, wire.Push)
        return message

    inbox = inbox_of(check_identity=False)
    inbox.set_senders(["w1", "w3"])  # w2 left (or was forgotten); it never pushed here
    answer = wire.decode_message(inbox.begin(b"id", header(9), None))
    assert isinstance(answer, wire.Error) and answer.code == wire.ErrorCode.BAD_REQUEST
    settle = wire.decode_message(wire.encode_settle("w2", 9, "commit"))
    assert isinstance(settle, wire.Settle)
    assert wire.decode_message(inbox.settle(b"id", settle, None)).kind is wire.Kind.ERROR
    assert events["pushes_from_departed"] == 2 and not rejects
    assert inbox.begin(b"id", stranger("w9"), None) is not None  # never a member
    assert rejects == Counter({"identity": 1}) and events["pushes_from_departed"] == 2
    inbox.set_senders(["w1", "w2", "w3"])  # w2 back
    assert inbox.begin(b"id", header(10), None) is None  # reserved: taken
    inbox.set_senders(["w1", "w3"])
    inbox.set_senders(["w1"])  # w3 went too; w2 is still remembered as gone
    assert inbox.begin(b"id", stranger("w3"), None) is not None and events["pushes_from_departed"] == 3

    curve = inbox_of(check_identity=True)
    curve.set_senders(["w1", "w3"])
    assert curve.begin(b"id", header(9), "w3") is not None  # w3's key speaking as w2, which went
    assert rejects == Counter({"identity": 2}) and events["pushes_from_departed"] == 3
    assert curve.begin(b"id", header(9), "w2") is not None
    assert events["pushes_from_departed"] == 4


def test_the_members_that_went_are_bounded() -> None:
    verdicts = Verdicts(keep_retired=3)
    verdicts.follow(["s0"], held=[], went=[f"s{i}" for i in range(9, 0, -1)])
    assert [verdicts.went(f"s{i}") for i in range(10)] == [False] + [False] * 6 + [True] * 3
    verdicts.follow(["s0", "s8"], held=[])
    assert verdicts.went("s9") and not verdicts.went("s8") and not verdicts.went("s0")


def test_a_push_before_the_first_publish_is_refused_not_ready_and_counted() -> None:
    """No layout yet (the node has published nothing): the push is refused ``not-ready`` (its sender keeps its mass),
    counted ``pushes_not_ready``, and its round is settled."""
    events: Counter[str] = Counter()
    inbox = PushReceiver(
        "w1",
        ["w1", "w2"],
        lambda: None,
        2,
        30.0,
        lambda key, n: events.update({key: n}),
        lambda reason: events.update([f"rejected:{reason}"]),
        lambda snapshot: None,
    )
    answer = inbox.begin(b"id", header(1), None)
    assert answer is not None
    refusal = wire.decode_message(answer)
    assert isinstance(refusal, wire.Error) and refusal.code == wire.ErrorCode.NOT_READY
    assert events == Counter({"pushes_not_ready": 1})
    assert inbox.wait_rounds({"w2": ROUND}, 0.0) == []  # settled: nothing left to wait for
