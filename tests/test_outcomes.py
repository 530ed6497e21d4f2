"""Every fetch that does not end ok says why, and only failures count as failed (docs/metrics.md).

* Against a fake peer (tests/fakes.py) answering each FETCH as a test says: each refusal, rejection and
  timeout is named in the exchange record's ``reasons`` and counted in ``fetches_by_reason``; "not ready"
  and "busy" are declined (``fetches_not_ready``, ``fetches_busy``), not failed, and cost the peer no score;
  the PyTorch adapter's records and the run summary say the same.
* Two real AD-PSGD nodes: a peer that has published nothing yet answers "not ready", and one whose inbox
  still holds this node's unmixed exchange answers "busy" -- the contention every AD-PSGD run shows.
* Two real push-sum nodes: each record says how many pushes were ACKed since the last one and the latency
  of the slowest (``delivered``, ``push_ms``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import free_ports, in_threads, wait_until, write_cluster
from fakes import FakePeer, Messages

from dpwa import DpwaConnection
from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.launcher.rundir import NodeMetrics
from dpwa.metrics import DECLINED_CODES, fetch_reason, is_failure, read_metrics
from dpwa.node import wire
from dpwa.node.transport import NOT_A_MEMBER
from dpwa.node.wire import ErrorCode, Layout, MemberNews

pytestmark = [pytest.mark.integration]

TIMEOUT_MS = 1500
"""Long enough that an answer of the fake peer (a thread of this process) is never late on a loaded machine."""


def model(value: float) -> list[np.ndarray]:
    return [np.full(50, value, np.float32), np.full((3, 4), value, np.float32)]


def state_reply(header: wire.Message, arrays: list[np.ndarray], fingerprint: str | None = None) -> Messages:
    """w2's reply to ``header`` carrying ``arrays`` in one message (``fingerprint``: claim another layout)."""
    layout = Layout.of(arrays)
    buffer = layout.allocate()
    for view, array in zip(layout.views(buffer), arrays):
        view[...] = array
    head = wire.encode_state("w2", header.req, clock=1.0, loss=1.0, extras={}, layout=layout)
    if fingerprint is not None:
        head = head.replace(layout.fingerprint.encode(), fingerprint.encode())
    return [[head, *(buffer[start:end].tobytes() for start, end in layout.frame_bounds())]]


def refusal(code: ErrorCode) -> Callable[[wire.Message], Messages]:
    """A FakePeer answer: ERROR ``code`` to every FETCH."""
    return lambda header: [[wire.encode_error("w2", header.req, code, f"the test says {code.value}")]]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[DpwaConnection, FakePeer]]:
    """Node w1 whose only peer, w2, is a FakePeer (answering nothing until a test says what)."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=TIMEOUT_MS)
    peer = FakePeer(ports[1], thread_name="fake-w2")
    try:
        with DpwaConnection("w1", cfg, seed=0) as node:
            yield node, peer
    finally:
        peer.close()


def test_the_reasons_name_the_wire_codes_and_only_routine_refusals_are_declined() -> None:
    assert DECLINED_CODES == {ErrorCode.NOT_READY.value, ErrorCode.BUSY.value, ErrorCode.LEFT.value, NOT_A_MEMBER}
    assert fetch_reason("ok", "") is None
    assert fetch_reason("timeout", "timeout") == "timeout"
    assert fetch_reason("timeout", "timeout", late=True) == "timeout: late"
    assert fetch_reason("timeout", "send-queue-full") == "timeout: send-queue-full"
    assert fetch_reason("refused", "busy") == "refused: busy"
    assert fetch_reason("rejected", "non-finite") == "rejected: non-finite"
    assert [is_failure(f"refused: {code}") for code in sorted(DECLINED_CODES)] == [False] * 4
    failures = ["refused: layout-mismatch", "refused: bad-request", "rejected: layout", "timeout", "timeout: late"]
    assert all(is_failure(r) for r in failures)
    assert not is_failure("pushed") and is_failure("refused")  # a bare status (an older record): a failure


def test_each_outcome_is_recorded_under_its_reason_and_declined_ones_are_not_failures(rig) -> None:
    node, peer = rig
    params = model(0.0)

    def step(respond: Callable[[wire.Message], Messages]) -> dict:
        peer.respond = respond
        node.update_send(params, 1.0)
        node.update_wait(1.0)
        return dict(node.last_exchange or {})

    for code in (ErrorCode.NOT_READY, ErrorCode.BUSY):
        record = step(refusal(code))
        assert (record["status"], record["reasons"], record["factor"]) == ("refused", [f"refused: {code.value}"], 0)
    stats = node.stats()
    assert (stats["fetches_refused"], stats["fetches_declined"], stats["fetches_failed"]) == (2, 2, 0)
    assert stats["fetches_not_ready"] == 1 and stats["fetches_busy"] == 1
    assert stats["scores"]["w2"] == 1000 and stats["peers_up"] == ["w2"]  # declined: no penalty

    record = step(lambda h: state_reply(h, model(8.0)))
    assert (record["status"], record["reasons"], record["factor"]) == ("ok", [], 0.5)

    assert step(refusal(ErrorCode.LAYOUT))["reasons"] == ["refused: layout-mismatch"]
    assert step(lambda h: state_reply(h, model(8.0), fingerprint="0" * 16))["reasons"] == ["rejected: layout"]
    # no answer at all: the TX thread's verdict at the deadline, or update_wait's own when that thread was more
    # than VERDICT_SLACK_S late (a loaded machine)
    (timed_out,) = step(lambda h: [])["reasons"]
    assert timed_out in ("timeout", "timeout: late")
    stats = node.stats()
    assert stats["fetches_failed"] == 3 and stats["fetches_declined"] == 2
    assert stats["fetches_by_reason"] == {
        "refused: not-ready": 1,
        "refused: busy": 1,
        "refused: layout-mismatch": 1,
        "rejected: layout": 1,
        timed_out: 1,
    }
    assert stats["refused_by_reason"] == {"not-ready": 1, "busy": 1, "layout-mismatch": 1}
    assert stats["scores"]["w2"] < 1000  # the failures cost their score


def test_a_peer_that_answers_it_left_is_left_on_its_own_word(rig) -> None:
    """w2 left and this node missed its announcement: w2's own ERROR ``left`` (its table saying so) is its word,
    as the announcement would be, so w2 is left at once. Before, it was taken as a relayed leave, ignored until
    this node suspected w2 -- after three timeouts once w2 closed."""
    node, peer = rig
    params = model(0.0)
    w2 = node._node.membership.get("w2")
    assert w2 is not None and w2.state == "alive"
    gone = MemberNews("left", (dataclasses.replace(w2, state="left", version=w2.version + 1),))
    peer.respond = lambda h: [[wire.encode_error("w2", h.req, ErrorCode.LEFT, "gone", news=gone)]]
    node.update_send(params, 1.0)
    node.update_wait(1.0)
    assert node.last_exchange["reasons"] == ["refused: left"]
    assert node._node.membership.get("w2").state == "left" and "w2" not in node._node.membership.order()


def test_a_late_reply_that_lent_a_snapshot_is_given_back_at_once(rig) -> None:
    """w2 answers w1's first FETCH only with its second one's answer: a shared-memory STATE for the first request,
    which w1 gave up on (timed out). w1 sends RELEASE for it at once, so a one-buffer w2 need not wait out the
    loan (10 s) before it publishes again. Before, the late reply was dropped and the loan held to its end."""
    node, peer = rig
    params = model(0.0)
    layout = Layout.of(params)
    lent = wire.SharedRef(pid=1, fd=3, token="0" * 32, until=time.monotonic() + 10.0)
    asked: list[int] = []

    def respond(header: wire.Message) -> Messages:
        if header.kind is not wire.Kind.FETCH:
            return []
        asked.append(header.req)
        if len(asked) == 1:
            return []  # no answer in time
        late = wire.encode_state("w2", asked[0], clock=1.0, loss=1.0, extras={}, layout=layout, gen=1, shm=lent)
        return [[late], [wire.encode_error("w2", header.req, ErrorCode.NOT_READY, "later")]]

    peer.respond = respond
    for _ in range(2):
        node.update_send(params, 1.0)
        node.update_wait(1.0)
    assert node.stats()["stale_replies"] >= 1
    wait_until(lambda: any(r.kind is wire.Kind.RELEASE and r.req == asked[0] for r in peer.requests), 5,
               message="the late loan given back")  # fmt: skip


def test_the_adapters_records_and_the_summary_keep_declined_fetches_out_of_failed(tmp_path: Path) -> None:
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, timeout_ms=TIMEOUT_MS)
    answers = iter([ErrorCode.NOT_READY, ErrorCode.BUSY, ErrorCode.BUSY, ErrorCode.LAYOUT])

    def respond(header: wire.Message) -> Messages:  # the FETCHes; nothing to the leave's MEMBERS at close
        return refusal(next(answers))(header) if header.kind is wire.Kind.FETCH else []

    peer = FakePeer(ports[1], respond, thread_name="fake-w2")
    try:
        net = torch.nn.Linear(3, 2)
        with DpwaPyTorchAdapter(net, "w1", cfg, seed=0, run_dir=tmp_path / "run") as adapter:
            for _ in range(4):
                adapter.update_send(1.0)
                adapter.update_wait(1.0)
    finally:
        peer.close()
    records = [r for r in read_metrics(tmp_path / "run" / "w1.metrics.jsonl") if r.get("event") is None]
    assert [r["reasons"] for r in records] == [
        ["refused: not-ready"],
        ["refused: busy"],
        ["refused: busy"],
        ["refused: layout-mismatch"],
    ]
    assert [r["failed"] for r in records] == [0, 0, 0, 1]
    summary = NodeMetrics.of(records).summary()
    assert summary["failed_fetches"] == 1 and summary["failed_by_reason"] == {"refused: layout-mismatch": 1}
    assert summary["declined_fetches"] == 3
    assert summary["declined_by_reason"] == {"refused: busy": 2, "refused: not-ready": 1}


def test_adpsgd_a_peer_starting_answers_not_ready_and_one_holding_our_exchange_answers_busy(tmp_path: Path) -> None:
    """One inbox slot per sender: w2 holds w1's committed exchange until w2's next update_wait (which never
    comes here), so w1's next exchange is refused busy: AD-PSGD's contention, declined, not a failure."""
    ports = free_ports(2)
    cfg = write_cluster(
        tmp_path / "c.yaml", ports, interpolation="adpsgd", timeout_ms=2000, inbox_slots=1, inbox_per_sender=1
    )
    p1, p2 = model(0.0), model(8.0)
    with DpwaConnection("w1", cfg, seed=0, params=p1) as w1, DpwaConnection("w2", cfg, seed=1, params=p2) as w2:
        w1.update_send(p1, 1.0)  # w2 has published nothing yet
        w1.update_wait(1.0)
        assert w1.last_exchange is not None and w1.last_exchange["reasons"] == ["refused: not-ready"]
        w2.update_send(p2, 1.0)  # w2 publishes (and exchanges with w1)
        w2.update_wait(1.0)
        w1.update_send(p1, 1.0)
        w1.update_wait(1.0)
        assert w1.last_exchange["status"].split(",")[0] == "ok" and w1.last_exchange["reasons"] == []
        w1.update_send(p1, 1.0)  # w2's one slot for w1 still holds the exchange just made
        w1.update_wait(1.0)
        assert w1.last_exchange["reasons"] == ["refused: busy"]
        stats = w1.stats()
        assert (stats["fetches_not_ready"], stats["fetches_busy"], stats["fetches_failed"]) == (1, 1, 0)
        assert w2.stats()["pushes_busy"] == 1


def test_adpsgd_a_lingering_node_refuses_an_exchange_whose_push_it_held_before(tmp_path: Path) -> None:
    """w2 holds w1's exchange push (a raw DEALER speaking as w1), then trains no more and lingers; the FETCH that
    completes the exchange is refused busy (w2 would never mix its half, and the pair's sum would drift), and its
    push is withdrawn by the abort. Before, only pushes arriving after the lingering began were refused."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, interpolation="adpsgd", timeout_ms=2000)
    p2 = model(8.0)
    layout = Layout.of(p2)
    with DpwaConnection("w2", cfg, seed=1, params=p2) as w2:
        w2.update_send(p2, 1.0)  # w2 publishes 8 (its own exchange finds w1 down)
        w2.update_wait(1.0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(w2.endpoint)
        try:
            payload = np.zeros(layout.total_bytes // 4, np.float32).tobytes()
            push = wire.encode_push("w1", 1, clock=0.0, loss=1.0, extras={}, layout=layout, hold=True, whole=True)
            sock.send_multipart([push, payload])
            deadline = time.monotonic() + 10.0
            while not w2._node.transfer.inbox.holds_exchange("w1", 1):
                assert time.monotonic() < deadline, w2.stats()
                time.sleep(0.01)
            w2._node.transfer.linger_starts()  # what close(linger=...) does first
            sock.send(wire.encode_fetch("w1", 2, layout.fingerprint, exchange=1))
            assert sock.poll(5000), "w2 did not answer"
            answer = wire.decode_message(sock.recv_multipart()[0])
            assert isinstance(answer, wire.Error) and answer.code == ErrorCode.BUSY.value, answer
            sock.send(wire.encode_settle("w1", 1, "abort"))
            assert sock.poll(5000), "w2 did not answer the abort"
            assert wire.decode_message(sock.recv_multipart()[0]).kind is wire.Kind.ACK
        finally:
            sock.close(linger=0)
        stats = w2.stats()
        assert stats["exchanges_declined"] == 1 and stats["exchanges_aborted"] == 1, stats
        assert stats["exchanges_committed"] == 0 and w2._node.transfer.inbox.occupied() == 0


def test_adpsgd_a_leaving_node_waits_for_the_commit_of_the_exchange_it_served_and_mixes_it(tmp_path: Path) -> None:
    """w2 served w1's exchange (a raw DEALER speaking as w1: push 0, FETCH answered with 8) and closes before w1's
    SETTLE came: it waits for the commit, then mixes its half with final_mix (8 -> 4: the pair's sum is kept)."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, interpolation="adpsgd", timeout_ms=2000)
    p2 = model(8.0)
    layout = Layout.of(p2)
    w2 = DpwaConnection("w2", cfg, seed=1, params=p2)
    closer = threading.Thread(target=lambda: w2.close(final_mix=True))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(w2.endpoint)
    try:
        w2.update_send(p2, 1.0)  # w2 publishes 8 (its own exchange finds w1 down)
        w2.update_wait(1.0)
        payload = np.zeros(layout.total_bytes // 4, np.float32).tobytes()
        sock.send_multipart([wire.encode_push("w1", 1, clock=0.0, loss=1.0, extras={}, layout=layout, hold=True,
                                              whole=True), payload])  # fmt: skip
        wait_until(lambda: w2._node.transfer.inbox.holds_exchange("w1", 1), 10, message="the push held")
        sock.send(wire.encode_fetch("w1", 2, layout.fingerprint, exchange=1))
        assert sock.poll(5000), "w2 did not answer"
        assert wire.decode_message(sock.recv_multipart()[0]).kind is wire.Kind.STATE
        closer.start()
        wait_until(lambda: w2._node.transfer.inbox.closing, 10, message="w2 leaving")
        sock.send(wire.encode_settle("w1", 1, "commit"))
        closer.join(timeout=30)
        assert not closer.is_alive()
        assert all(np.all(a == 4.0) for a in p2), p2
        assert w2.stats()["exchanges_committed"] == 1 and w2.stats()["exchanges_unmixed"] == 0
    finally:
        sock.close(linger=0)
        w2.close()


def test_adpsgd_a_snapshot_pairs_with_one_exchange_and_a_second_is_refused_busy(tmp_path: Path) -> None:
    """w2 publishes once; w1's first exchange pairs with that snapshot, its second (the inbox has room: two per
    sender) is refused busy -- two peers averaging with one snapshot would each take half of it -- and w1
    withdraws it. After w2's next publish an exchange pairs again; w2 moved half-way toward w1 once."""
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, interpolation="adpsgd", timeout_ms=2000)
    p1, p2 = model(0.0), model(8.0)
    with DpwaConnection("w1", cfg, seed=0, params=p1) as w1, DpwaConnection("w2", cfg, seed=1, params=p2) as w2:
        w2.update_send(p2, 1.0)  # w2 publishes 8 (its own exchange finds w1 not ready)
        w2.update_wait(1.0)
        reasons = []
        for _ in range(2):
            w1.update_send(p1, 1.0)
            w1.update_wait(1.0)
            reasons.append(w1.last_exchange["reasons"])
        assert reasons == [[], ["refused: busy"]]
        assert w2.stats()["exchanges_declined"] == 1
        # an exchange FETCH whose push never came is refused not-delivered, even against the paired snapshot
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(w2.endpoint)
        try:
            sock.send(wire.encode_fetch("w1", 999, Layout.of(p2).fingerprint, exchange=999))
            assert sock.poll(5000), "w2 did not answer"
            answer = wire.decode_message(sock.recv_multipart()[0])
        finally:
            sock.close(linger=0)
        assert isinstance(answer, wire.Error) and answer.code == ErrorCode.NOT_DELIVERED.value, answer
        assert w2.stats()["exchanges_declined"] == 1
        deadline = time.monotonic() + 10.0
        while w2.stats()["exchanges_aborted"] < 1:  # the second exchange's push, withdrawn by w1's SETTLE abort
            assert time.monotonic() < deadline, w2.stats()
            time.sleep(0.01)
        w2.update_send(p2, 1.0)
        w2.update_wait(1.0)  # mixes the one committed exchange: x <- x + (0 - 8)/2 (and its own, with w1)
        assert w2.stats()["exchanges_committed"] == 1
        w1.update_send(p1, 1.0)  # w2's new snapshot pairs again
        w1.update_wait(1.0)
        assert w1.last_exchange["reasons"] == []
        assert w1.stats()["fetches_busy"] == 1 and w1.stats()["fetches_failed"] == 0


def test_push_sum_records_say_how_many_pushes_were_acknowledged_and_how_long_the_slowest_took(
    tmp_path: Path,
) -> None:
    ports = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", ports, interpolation="pushsum", timeout_ms=2000)
    params = [model(0.0), model(8.0)]
    records: list[list[dict]] = [[], []]
    with DpwaConnection("w1", cfg, seed=0, params=params[0]) as w1, DpwaConnection("w2", cfg, seed=1) as w2:
        conns = [w1, w2]

        def train(i: int) -> None:
            # 5 steps, and on until one push was delivered: w2 takes none before its first update_send (no params
            # at construction), and how many of w1's first steps come before it depends on how the threads run
            deadline = time.monotonic() + 30.0
            while len(records[i]) < 5 or not any(r["delivered"] for r in records[i]):
                assert time.monotonic() < deadline, records[i]
                conns[i].update_send(params[i], 1.0)
                conns[i].update_wait(1.0)  # SGP (overlap 0): returns once its push has its verdict
                records[i].append(dict(conns[i].last_exchange or {}))

        in_threads(2, train, timeout=60)
    for node in records:
        assert all(r["fetch_ms"] == 0.0 and r["reasons"] == [] for r in node)  # a push rule fetches nothing
        assert all(r["delivered"] + r["returned"] == r["pushed"] == 1 for r in node), node
        assert all(r["push_ms"] > 0 for r in node if r["delivered"]) and any(r["delivered"] for r in node)
        assert NodeMetrics.of(node).mean_push_ms == pytest.approx(
            np.mean([r["push_ms"] for r in node if r["delivered"]])
        )
