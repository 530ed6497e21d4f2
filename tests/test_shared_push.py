"""Pushes through shared memory: a co-located receiver reads the pusher's snapshot from its segment.

The pusher offers its co-location identity in every PUSH header; a receiver with the same one (and, with CURVE, a
sender that authenticated as itself) says so in its ACK, and from then on the pusher's PUSH names its segment
instead of carrying the payload. What a node mixes is the same, bit for bit, as over the socket; a PUSH naming a
segment the receiver cannot or will not read is refused ``shared-memory`` and counted, and never touches the
parameters; a pusher refused that way pushes over the socket from then on.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import free_ports, in_threads, wait_until, write_cluster

from dpwa import DpwaConnection
from dpwa.config import load_config
from dpwa.node import wire
from dpwa.node.frames import COPY_BLOCK, copy_payload
from dpwa.node.sharedmem import Segment, host_identity
from dpwa.node.transport.shared import SharedReplies
from dpwa.node.wire import CHUNK_BYTES, Layout, PayloadReader, SharedRef, WireError

pytestmark = pytest.mark.skipif(not host_identity(), reason="no shared memory on this platform")


def _lock_step(tmp_path: Path, mode: str, wire_dtype: str | None, steps: int) -> tuple[list[np.ndarray], list[dict]]:
    """Two push-sum nodes in lock-step (SGP: each round folds exactly the other's push of that round; 30 s
    timeout, so no push of a live node is late), each moving its own parameters before every round; their
    parameters and statistics at the end."""
    settings = {"wire_dtype": wire_dtype} if wire_dtype else {}
    config = write_cluster(
        tmp_path / f"{mode}-{wire_dtype}.yaml",
        free_ports(2),
        interpolation="pushsum",
        timeout_ms=30000,
        transport={"shared_memory": mode},
        **settings,
    )
    cfg = load_config(config)
    rng = np.random.default_rng(5)
    params = [[rng.standard_normal(300_000, dtype=np.float32), rng.standard_normal(33, dtype=np.float32)] for _ in "ab"]
    conns = [DpwaConnection(f"w{i + 1}", cfg, seed=i, params=params[i]) for i in range(2)]
    try:
        for c in conns:
            assert all(c.wait_for_peers(30).values())

        def node(i: int) -> None:
            for k in range(steps):
                params[i][0][:1000] += np.float32(0.01 * (k + 1) * (i + 1))  # the local step: lands on the numerator
                conns[i].update_send(params[i], 1.0)
                conns[i].update_wait(1.0)
                record = conns[i].last_exchange or {}
                assert record["received"] == 1 and record["sources_late"] == 0, (i, k, record)

        in_threads(2, node, 120)
        wait_until(lambda: all(c.stats()["pushes_unsettled"] == 0 for c in conns), 20, message="pushes settled")
        return [x for p in params for x in p], [c.stats() for c in conns]
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16"])
def test_co_located_push_sum_pushes_through_shared_memory_and_mixes_bit_for_bit_as_the_socket(
    tmp_path: Path, wire_dtype: str | None
) -> None:
    """8 lock-step rounds of two push-sum nodes: with shared memory on, every push after each node's first ACK
    names the pusher's segment (the receiver reads it there); the parameters end the same, bit for bit, as with
    shared memory off, where no push does."""
    steps = 8
    shared, shared_stats = _lock_step(tmp_path, "auto", wire_dtype, steps)
    plain, plain_stats = _lock_step(tmp_path, "off", wire_dtype, steps)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(shared, plain))
    for mine, peer in (shared_stats, shared_stats[::-1]):
        assert mine["shm_pushed"] >= steps - 1 and mine["pushes_sent"] >= steps, mine
        assert peer["shm_pushes_taken"] == mine["shm_pushed"], (mine, peer)
        assert mine.get("shm_push_fallbacks", 0) == 0
    assert all(s.get("shm_pushed", 0) == 0 and s.get("shm_pushes_taken", 0) == 0 for s in plain_stats)
    assert not any(math.isnan(float(x.sum())) for x in shared)


# --------------------------------------------------------------------------- the receiver: what it refuses


class RawPusher:
    """A DEALER speaking for member ``w2`` to node ``w1``'s RX thread."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seq = 0

    def push(self, layout: Layout, ref: SharedRef, gen: int, host: str, node: str = "w2") -> wire.Ack | wire.Error:
        """Send a PUSH from ``node`` naming ``ref`` (holding ``gen``); the node's answer (within 10 s)."""
        self.seq += 1
        extras = {"weight": 1.0, "w_given": 1.0}
        head = wire.encode_push(node, self.seq, clock=1.0, loss=1.0, extras=extras, layout=layout, host=host, gen=gen,
                                shm=ref)  # fmt: skip
        self.sock.send(head)
        while True:
            assert self.sock.poll(10_000), "no answer"
            answer = wire.decode_message(self.sock.recv())
            if answer.kind in (wire.Kind.ACK, wire.Kind.ERROR) and answer.req == self.seq:
                return answer  # type: ignore[return-value]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_push_naming_a_bad_segment_is_refused_counted_and_never_mixed(tmp_path: Path) -> None:
    """A member's PUSH names a segment of the wrong size, with the wrong token, holding another generation, one
    that cannot be opened, one from a sender not co-located, and one holding a NaN: each refused (``shared-memory``;
    ``busy`` for the generation, ``bad-request`` for the value), counted under its reason, the inbox and the
    parameters untouched; a PUSH from a name that is no member is refused ``identity`` before anything is looked
    at. Then a good one: ACKed saying the sender may push through shared memory, and mixed."""
    ports = free_ports(2)
    # w2 never runs: its pushes wait out timeout_ms in each update_wait and twice at close (the refusals come
    # back at once whatever it is, and a push taken is held until the next update_wait, not timed out)
    config = write_cluster(tmp_path / "c.yaml", ports, interpolation="pushsum", timeout_ms=500)
    x = [np.zeros(1000, np.float32)]
    layout = Layout.of(x)
    conn = DpwaConnection("w1", str(config), seed=1, params=x)
    pusher = RawPusher(ports[0])
    wrong_size = Segment("fake", layout.total_bytes + 64)
    good = Segment("fake", layout.total_bytes)
    values = good.payload.view(np.float32)
    here = host_identity()
    try:
        wrong_size.set_gen(3)
        good.set_gen(3)
        values[:] = np.nan
        cases = {
            "shm-size": (wrong_size.ref(3, 1e12), 3, here),
            "shm-token": (SharedRef(pid=good.ref(3, 0).pid, fd=good.fd, token="f" * 32, until=1e12), 3, here),
            "shm-gen": (good.ref(3, 1e12), 4, here),
            "shm-open": (SharedRef(pid=good.ref(3, 0).pid, fd=2**30, token="0" * 32, until=1e12), 3, here),
            "shm-unasked": (good.ref(3, 1e12), 3, "f" * 32),
            "non-finite": (good.ref(3, 1e12), 3, here),
        }
        for reason, (ref, gen, host) in cases.items():
            answer = pusher.push(layout, ref, gen, host)
            assert isinstance(answer, wire.Error), reason
            expected = {"non-finite": wire.ErrorCode.BAD_REQUEST, "shm-gen": wire.ErrorCode.BUSY}.get(
                reason, wire.ErrorCode.SHARED_MEMORY
            )  # a segment rewritten since: a passing race, not a reason to give shared memory up
            assert answer.code == expected.value and answer.detail.startswith(reason), (reason, answer)
        stranger = pusher.push(layout, good.ref(3, 1e12), 3, here, node="w9")  # no member: refused before any look
        assert isinstance(stranger, wire.Error) and stranger.code == wire.ErrorCode.BAD_REQUEST.value
        stats = conn.stats()
        assert all(stats["push_rejected_by_reason"].get(reason) == 1 for reason in [*cases, "identity"]), stats
        assert stats["inbox_occupied"] == 0 and stats.get("shm_pushes_taken", 0) == 0
        conn.update_send(x, 1.0)
        conn.update_wait(1.0)
        assert not x[0].any()  # nothing refused was mixed

        values[:] = 4.0
        answer = pusher.push(layout, good.ref(3, 1e12), 3, here)
        assert isinstance(answer, wire.Ack) and answer.shm
        assert conn.stats()["shm_pushes_taken"] == 1
        conn.update_send(x, 1.0)
        conn.update_wait(1.0)
        assert conn.stats()["mixes"] >= 1 and np.all(x[0] > 0) and np.all(np.isfinite(x[0]))
    finally:
        conn.close()
        pusher.close()
        wrong_size.close()
        good.close()


# --------------------------------------------------------------------------- the pusher: when it uses a segment


def test_a_pusher_uses_shared_memory_once_told_and_falls_back_to_the_socket_for_good_once_refused() -> None:
    """The pusher's side (the TX thread's :class:`SharedReplies`): a peer's ACK with ``shm`` set turns shared
    pushes on for it (a push whose snapshot lies in a segment); an ERROR ``shared-memory`` turns them off for the
    rest of the session, counted once, and a later ACK saying ``shm`` does not turn them on again. Other refusals
    (``busy``, which also answers a segment rewritten before it was read) change nothing."""
    counts: dict[str, int] = {}
    shared = SharedReplies("w1", lambda event, n: counts.__setitem__(event, counts.get(event, 0) + n))
    segment = Segment("pusher", 64)
    try:

        class Push:  # what pushes_shared looks at
            peer = "w2"
            snapshot = type("Snap", (), {"segment": segment})()

        push = Push()
        assert not shared.pushes_shared(push)  # type: ignore[arg-type]
        shared.answered("w2", wire.Ack(node="w2", req=1))
        assert not shared.pushes_shared(push)  # type: ignore[arg-type]
        shared.answered("w2", wire.Ack(node="w2", req=2, shm=True))
        assert shared.pushes_shared(push)  # type: ignore[arg-type]
        shared.answered("w2", wire.Error(node="w2", req=3, code=wire.ErrorCode.BUSY.value))
        assert shared.pushes_shared(push)  # type: ignore[arg-type]
        Push.snapshot = type("Snap", (), {"segment": None})()
        assert not shared.pushes_shared(Push())  # type: ignore[arg-type]  # a snapshot in private memory
        Push.snapshot = type("Snap", (), {"segment": segment})()
        for req in (4, 5):
            shared.answered("w2", wire.Error(node="w2", req=req, code="shared-memory", detail="shm-open: gone"))
        assert not shared.pushes_shared(push) and counts == {"shm_push_fallbacks": 1}  # type: ignore[arg-type]
        shared.answered("w2", wire.Ack(node="w2", req=6, shm=True))
        assert not shared.pushes_shared(push)  # type: ignore[arg-type]
    finally:
        segment.close()
        shared.close()


def test_two_curve_push_sum_nodes_that_authenticated_each_other_push_through_shared_memory(tmp_path: Path) -> None:
    """With CURVE on, the receiver takes a sender's pushes through shared memory only once the sender authenticated
    as the node it names: two such push-sum nodes step until each has taken 3 pushes from the other's segment."""
    from test_security import secure_cluster

    path = secure_cluster(tmp_path / "c.yaml", free_ports(2))
    path.write_text(path.read_text() + "interpolation: pushsum\n")
    conns = [DpwaConnection(f"w{i + 1}", str(path), seed=i) for i in range(2)]
    xs = [np.full(1000, float(i), np.float32) for i in range(2)]

    def taken() -> bool:
        return all(c.stats().get("shm_pushes_taken", 0) >= 3 for c in conns)

    def train(i: int) -> None:
        deadline = time.monotonic() + 30.0
        while not taken():
            assert time.monotonic() < deadline, [c.stats().get("shm_pushes_taken") for c in conns]
            conns[i].update_send([xs[i]], 1.0)
            conns[i].update_wait(1.0)

    try:
        in_threads(2, train, timeout=60)
        assert all(c.stats().get("shm_push_fallbacks", 0) == 0 for c in conns)
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("where", [0, 262_143, 262_144, 1_310_719])
def test_copying_out_of_a_segment_checks_every_block(where: int) -> None:
    """:func:`copy_payload` copies a 5 MiB payload (two 4 MiB chunks) in 1 MiB blocks: every byte arrives, and a
    NaN anywhere -- the first element, the last of a block, the first of the next, the very last -- is found."""
    arrays = [np.arange(1_310_720, dtype=np.float32)]
    layout = Layout.of(arrays)
    source = layout.allocate()
    np.copyto(layout.views(source)[0], arrays[0])
    target = layout.allocate()
    views = layout.views(target)
    reader = PayloadReader(layout, layout)
    bounds = layout.frame_bounds(CHUNK_BYTES)
    assert len(bounds) == 2 and COPY_BLOCK < CHUNK_BYTES
    copy_payload(source, reader, target, views, bounds)
    assert target.tobytes() == source.tobytes()
    layout.views(source)[0][where] = np.nan
    with pytest.raises(WireError) as info:
        copy_payload(source, reader, target, views, bounds)
    assert info.value.reason == "non-finite"
