"""The bytes on the wire, recorded: every message kind's header, the chunk tag, the layout's arithmetic, the wire
payload of known values (as they are, float16, bfloat16), and the frames a live node sends for a FETCH
(single-message and streamed framing). These are golden values taken from the code as it is; any change to them
changes the protocol that deployed nodes speak, and must come with a new PROTOCOL_VERSION, not pass silently."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import zmq
from conftest import free_ports, write_cluster

from dpwa.node import wire
from dpwa.node.connection import DpwaConnection
from dpwa.node.members import Member
from dpwa.node.sharedmem import host_identity
from dpwa.utils.bfloat16 import BFLOAT16, from_float32

LAYOUT = wire.Layout(("<f4", "<f2", "bf16", "<f8"), ((3, 2), (5,), (4,), (1,)))
FP = "f1e6390caae0bd8c"
TABLE = (Member("w1", "127.0.0.1", 45000), Member("w2", "10.0.0.2", 45001, "suspected", 3))
NEWS = wire.MemberNews("abcd1234", TABLE)
MEMBERS_JSON = '"md":"abcd1234","members":[["w1","127.0.0.1",45000,"alive",0],["w2","10.0.0.2",45001,"suspected",3]]'


def header(kind: int, body: str) -> bytes:
    return b"DPWA\x02\x00" + bytes([kind]) + body.encode()


GOLDEN = {
    "fetch": (
        wire.encode_fetch("w1", 7, FP, {"weight": 0.5}, stream=True, exchange=3, news=wire.MemberNews("abcd1234")),
        header(1, '{"node":"w1","req":7,"fp":"' + FP + '","extras":{"weight":0.5},"stream":true,"exchange":3,'
                  '"md":"abcd1234"}'),
    ),
    "fetch plain": (wire.encode_fetch("w1", 0, FP), header(1, '{"node":"w1","req":0,"fp":"' + FP + '"}')),
    "state": (
        wire.encode_state("w2", 7, clock=12.5, loss=0.25, extras={"weight": 1.0}, layout=LAYOUT, chunk=16,
                          stream=True, news=NEWS, gen=4, front=13),
        header(2, '{"node":"w2","req":7,"fp":"' + FP + '","clock":12.5,"loss":0.25,"extras":{"weight":1.0},"total":56,'
                  '"chunk":16,"nframes":4,"front":13,"stream":true,"gen":4,' + MEMBERS_JSON + "}"),
    ),
    "state plain": (
        wire.encode_state("w2", 8, clock=1.0, loss=2.0, extras={}, layout=LAYOUT),
        header(2, '{"node":"w2","req":8,"fp":"' + FP + '","clock":1.0,"loss":2.0,"extras":{},"total":56,'
                  '"chunk":4194304,"nframes":1}'),
    ),
    "push": (
        wire.encode_push("w1", 9, clock=3.0, loss=0.5, extras={"w_given": 0.25}, layout=LAYOUT, chunk=16, hold=True,
                         front=4),
        header(4, '{"node":"w1","req":9,"fp":"' + FP + '","clock":3.0,"loss":0.5,"extras":{"w_given":0.25},"total":56,'
                  '"chunk":16,"nframes":4,"front":4,"stream":true,"hold":true}'),
    ),
    "push whole": (
        wire.encode_push("w1", 10, clock=3.0, loss=0.5, extras={"w_given": 0.25}, layout=LAYOUT, whole=True),
        header(4, '{"node":"w1","req":10,"fp":"' + FP + '","clock":3.0,"loss":0.5,"extras":{"w_given":0.25},'
                  '"total":56,"chunk":4194304,"nframes":1}'),
    ),
    "push shared": (
        wire.encode_push("w1", 11, clock=3.0, loss=0.5, extras={}, layout=LAYOUT,
                         host="0123456789abcdef0123456789abcdef", gen=6,
                         shm=wire.SharedRef(pid=4242, fd=18, token="cd" * 16, until=20.0)),
        header(4, '{"node":"w1","req":11,"fp":"' + FP + '","clock":3.0,"loss":0.5,"extras":{},"total":56,'
                  '"chunk":4194304,"nframes":1,"host":"0123456789abcdef0123456789abcdef","gen":6,"shm":{"pid":4242,'
                  '"fd":18,"token":"' + "cd" * 16 + '","until":20.0}}'),
    ),
    "ack": (wire.encode_ack("w2", 9), header(5, '{"node":"w2","req":9}')),
    "ack shared": (wire.encode_ack("w2", 9, shm=True), header(5, '{"node":"w2","req":9,"shm":true}')),
    "settle": (wire.encode_settle("w1", 9, "commit"), header(6, '{"node":"w1","req":9,"op":"commit"}')),
    "error": (
        wire.encode_error("w2", 7, wire.ErrorCode.BUSY, "inbox full"),
        header(3, '{"node":"w2","req":7,"code":"busy","detail":"inbox full"}'),
    ),
    "join": (
        wire.encode_join("j1", 5, "10.0.0.9", 46000),
        header(7, '{"node":"j1","req":5,"host":"10.0.0.9","port":46000}'),
    ),
    "join bipartite": (
        wire.encode_join("j1", 6, "10.0.0.9", 46000, bipartite=True),
        header(7, '{"node":"j1","req":6,"host":"10.0.0.9","port":46000,"bipartite":true}'),
    ),
    "members": (
        wire.encode_members("w1", 5, NEWS, permanent=("w1", "w2"), settled=(9, True), mass=2.0),
        header(8, '{"node":"w1","req":5,"permanent":["w1","w2"],"settled":[9,true],"mass":2.0,' + MEMBERS_JSON + "}"),
    ),
    "members bipartite": (
        wire.encode_members("w1", 6, NEWS, permanent=("w2", "w1"), mass=2.0, bipartite=True),
        header(8, '{"node":"w1","req":6,"permanent":["w2","w1"],"mass":2.0,"bipartite":true,' + MEMBERS_JSON + "}"),
    ),
    "fetch co-located": (
        wire.encode_fetch("w1", 3, FP, host="0123456789abcdef0123456789abcdef"),
        header(1, '{"node":"w1","req":3,"fp":"' + FP + '","host":"0123456789abcdef0123456789abcdef"}'),
    ),
    "state shared": (
        wire.encode_state("w2", 3, clock=1.0, loss=2.0, extras={}, layout=LAYOUT, gen=5,
                          shm=wire.SharedRef(pid=4242, fd=17, token="ab" * 16, until=12.5)),
        header(2, '{"node":"w2","req":3,"fp":"' + FP + '","clock":1.0,"loss":2.0,"extras":{},"total":56,'
                  '"chunk":4194304,"nframes":1,"gen":5,"shm":{"pid":4242,"fd":17,"token":"' + "ab" * 16 + '",'
                  '"until":12.5}}'),
    ),
    "release": (wire.encode_release("w1", 3), header(9, '{"node":"w1","req":3}')),
    "chunk tag": (wire.encode_chunk_tag(7, 2), b"DPWC\x07\x00\x00\x00\x00\x00\x00\x00\x02\x00\x00\x00"),
}  # fmt: skip


def test_every_message_kind_encodes_to_its_recorded_bytes() -> None:
    for name, (encoded, recorded) in GOLDEN.items():
        assert encoded == recorded, name
    kinds = {wire.Kind(encoded[6]).name for name, (encoded, _) in GOLDEN.items() if name != "chunk tag"}
    assert kinds == {kind.name for kind in wire.Kind}  # every kind has its recorded bytes
    assert {code.value for code in wire.ErrorCode} == {
        "not-ready", "layout-mismatch", "bad-request", "busy", "unsupported", "not-delivered", "join-refused", "left",
        "shared-memory", "unknown",  # unknown: never sent, what a receiver reads a code it does not know as
    }  # fmt: skip


def test_the_layout_arithmetic_is_the_recorded_one() -> None:
    assert (LAYOUT.offsets, LAYOUT.total_bytes, LAYOUT.fingerprint) == ((0, 24, 40, 48), 56, FP)
    assert LAYOUT.frame_bounds(16) == [(0, 16), (16, 32), (32, 48), (48, 56)]
    assert LAYOUT.frame_bounds(24) == [(0, 24), (24, 48), (48, 56)]
    assert wire.Layout(("<f4",), ((3,),)).on_wire("bfloat16").fingerprint == "2c24ac5ac8a9e755"


def known_arrays() -> list[np.ndarray]:
    bf16 = from_float32(np.array([1.0, -2.5, 3.25, 1e-3], np.float32), np.empty(4, np.uint16)).view(BFLOAT16)
    return [
        np.arange(6, dtype=np.float32).reshape(3, 2) / 3,
        np.array([0.5, -1.0, 65504.0, 1e-4, 2.0], np.float16),
        bf16,
        np.array([np.pi]),
    ]


def wire_bytes(arrays: list[np.ndarray], wire_dtype: str | None) -> bytes:
    local = wire.Layout.of(arrays)
    on_wire = local.on_wire(wire_dtype)
    buffer = on_wire.allocate()
    wire.PayloadWriter(local, on_wire).write(arrays, on_wire.views(buffer), 0, on_wire.total_bytes)
    return bytes(buffer)


def test_the_payload_of_known_values_is_the_recorded_bytes() -> None:
    digests = {dtype: hashlib.sha256(wire_bytes(known_arrays(), dtype)).hexdigest()[:16] for dtype in
               (None, "float16", "bfloat16")}  # fmt: skip
    assert digests == {None: "d65c57e3018de470", "float16": "78875161a7014a6c", "bfloat16": "c41b9fb842330a02"}


def test_a_live_node_answers_a_fetch_with_the_recorded_frames(tmp_path: Path) -> None:
    """Single-message and streamed STATE replies of a live node: the header's fields in their order, and the
    payload frames exactly the wire buffer cut at the chunk bounds."""
    port, peer_port = free_ports(2)
    cfg = write_cluster(tmp_path / "c.yaml", [port, peer_port], timeout_ms=500)
    params = known_arrays()
    expected = wire_bytes(params, None)
    conn = DpwaConnection("w1", cfg, seed=0, params=params)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        conn.update_send(params, 0.75)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for req, stream in ((1, False), (2, True)):
            sock.send(wire.encode_fetch("w2", req, wire.Layout.of(params).fingerprint, stream=stream))
            assert sock.poll(5000), "no reply"
            frames = sock.recv_multipart()
            raw = frames[0]
            assert raw[:7] == b"DPWA\x02\x00\x02"
            body = json.loads(raw[7:])
            keys = ["node", "req", "fp", "clock", "loss", "extras", "total", "chunk", "nframes", "front"]
            keys += ["stream"] if stream else []
            keys += ["gen", "md"]
            assert list(body)[: len(keys)] == keys and set(body) <= {*keys, "members"}, body
            assert (body["node"], body["req"], body["clock"], body["loss"], body["total"]) == (
                "w1", req, 1.0, 0.75, len(expected),
            )  # fmt: skip
            assert (body["chunk"], body["nframes"], body["front"]) == (wire.CHUNK_BYTES, 1, 1)
            assert isinstance(body["gen"], int) and body["gen"] >= 1  # the snapshot's generation: not a constant
            if stream:
                assert len(frames) == 1 and sock.poll(5000)
                tag, chunk = sock.recv_multipart()
                assert tag == wire.encode_chunk_tag(req, 0) and chunk == expected
            else:
                assert frames[1:] == [expected]
    finally:
        sock.close()
        ctx.term()
        conn.close()


def test_a_live_push_sum_node_pushes_with_the_recorded_frames(tmp_path: Path) -> None:
    """A push-sum node's push of a model that fits one chunk: one message, the PUSH header (fields in order) and the
    wire buffer, received by a bare ROUTER standing in for its one peer."""
    port, peer_port = free_ports(2)
    # the bare ROUTER never answers: the push waits out timeout_ms at close, twice (the frames do not depend on it)
    cfg = write_cluster(tmp_path / "c.yaml", [port, peer_port], timeout_ms=500, interpolation="pushsum")
    params = known_arrays()
    expected = wire_bytes(params, None)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.bind(f"tcp://127.0.0.1:{peer_port}")
    conn = DpwaConnection("w1", cfg, seed=0, params=params)
    try:
        conn.update_send(params, 0.5)
        for _ in range(50):  # messages: the node may greet its peer first (a MEMBERS table) before it pushes
            assert peer.poll(5000), "nothing pushed"
            _, raw, *payload = peer.recv_multipart()
            if raw[6] == wire.Kind.PUSH:
                break
        body = json.loads(raw[7:])
        keys = ["node", "req", "fp", "clock", "loss", "extras", "total", "chunk", "nframes", "front"]
        assert list(body)[: len(keys)] == keys and set(body) <= {*keys, "host", "md", "members"}, body
        assert body["host"] == host_identity()  # offered: a co-located receiver may take pushes in shared memory
        assert (body["node"], body["clock"], body["loss"], body["total"], body["nframes"]) == (
            "w1", 1.0, 0.5, len(expected), 1,
        )  # fmt: skip
        assert list(body["extras"]) == ["weight", "w_given", "round"] and payload == [expected]
    finally:
        conn.close()
        peer.close()
        ctx.term()
