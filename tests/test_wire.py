"""Wire format: layouts, header round trips, and every rejection."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from dpwa.node import wire
from dpwa.node.members import Member
from dpwa.node.wire import ErrorCode, Kind, Layout, WireError
from dpwa.node.wire.fields import extras_sum


def arrays(*specs):
    return [np.zeros(shape, dtype=dt) for dt, shape in specs]


def test_layout_offsets_are_aligned_and_views_alias_buffer():
    layout = Layout.of(arrays(("f4", (3, 5)), ("f2", (7,)), ("f8", (2, 2, 2))))
    assert layout.offsets == (0, 64, 80) and layout.total_bytes == 144  # 60 -> 64, 14 -> 16: packed to 8 bytes
    assert all(off % wire.ARRAY_ALIGN == 0 for off in layout.offsets)
    buf = layout.allocate()
    assert all(v.flags.aligned for v in layout.views(buf))
    assert buf.ctypes.data % wire.ALIGN == 0
    assert buf.nbytes == layout.total_bytes
    views = layout.views(buf)
    assert [v.shape for v in views] == [(3, 5), (7,), (2, 2, 2)]
    assert [v.dtype for v in views] == [np.float32, np.float16, np.float64]
    views[1][:] = 3
    start = layout.offsets[1]
    assert np.frombuffer(buf[start : start + 14].tobytes(), dtype=np.float16).tolist() == [3.0] * 7


def test_fingerprint_changes_with_shape_and_dtype():
    a = Layout.of(arrays(("f4", (3, 5))))
    assert a.fingerprint == Layout.of(arrays(("f4", (3, 5)))).fingerprint
    assert a.fingerprint != Layout.of(arrays(("f4", (5, 3)))).fingerprint
    assert a.fingerprint != Layout.of(arrays(("f8", (3, 5)))).fingerprint
    assert a.fingerprint != Layout.of(arrays(("f4", (3, 5)), ("f4", (1,)))).fingerprint


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "non-empty"),
        ([np.zeros(3, dtype=np.int32)], "dtype"),
        ([np.zeros((4, 4), dtype=np.float32)[:, ::2]], "contiguous"),
        ([[1.0, 2.0]], "numpy array"),
    ],
)
def test_layout_refuses_what_cannot_be_exchanged(bad, message):
    with pytest.raises(ValueError, match=message):
        Layout.of(bad)


def test_layout_matches_detects_changes():
    params = arrays(("f4", (3,)), ("f4", (2, 2)))
    layout = Layout.of(params)
    assert layout.matches(params)
    assert not layout.matches(params[:1])
    assert not layout.matches([params[0], np.zeros((4,), np.float32)])
    assert not layout.matches([params[0], np.zeros((2, 2), np.float64)])


def test_frame_bounds_and_segments_cover_every_element():
    layout = Layout.of(arrays(("f4", (1000,)), ("f2", (333,)), ("f8", (77,))))
    chunk = 256
    bounds = layout.frame_bounds(chunk)
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.total_bytes
    assert all(e - s == chunk for s, e in bounds[:-1])
    covered = [np.zeros(n, bool) for n in layout.sizes]
    for s, e in bounds:
        for i, lo, hi in layout.segments(s, e):
            covered[i][lo:hi] = True
    assert all(c.all() for c in covered)


def test_fetch_state_error_round_trip():
    layout = Layout.of(arrays(("f4", (10,))))
    h = wire.decode_message(wire.encode_fetch("w1", 7, layout.fingerprint))
    assert (h.kind, h.node, h.req, h.fingerprint) == (Kind.FETCH, "w1", 7, layout.fingerprint)

    raw = wire.encode_state("w2", 7, clock=3.5, loss=0.25, extras={"weight": 0.5}, layout=layout)
    h = wire.decode_message(raw)
    assert h.kind is Kind.STATE and h.node == "w2" and h.clock == 3.5 and h.loss == 0.25
    assert h.extras == {"weight": 0.5} and h.total == layout.total_bytes and h.nframes == 1
    h.check_against(layout, peer="w2", req=7)

    assert h.gen == -1  # a reply that names no generation (a server older than the field)
    h = wire.decode_message(wire.encode_state("w2", 7, clock=1, loss=1, extras={}, layout=layout, gen=12))
    assert h.gen == 12
    assert h.front == -1  # a sender that does not say how far the cluster is
    h = wire.decode_message(wire.encode_state("w2", 7, clock=1, loss=1, extras={}, layout=layout, front=0))
    assert h.front == 0
    h = wire.decode_message(wire.encode_push("w2", 7, clock=1, loss=1, extras={}, layout=layout, front=2999))
    assert h.kind is Kind.PUSH and h.front == 2999

    h = wire.decode_message(wire.encode_error("w2", 7, ErrorCode.LAYOUT, "mine differs"))
    assert h.kind is Kind.ERROR and h.code == "layout-mismatch" and h.detail == "mine differs"


def test_an_error_code_a_node_does_not_know_is_decoded_as_unknown_with_the_code_in_its_detail():
    """Refusals are counted and logged by code: a peer answering every request with a code of its own making must
    not grow those tables. Every code this node sends decodes as itself."""
    for code in ErrorCode:
        assert wire.decode_message(wire.encode_error("w2", 7, code, "why")).code == code.value
    made_up = [
        wire.decode_message(_raw(Kind.ERROR.value, {"node": "w2", "req": i, "code": f"c{i}"})) for i in range(50)
    ]
    assert {h.code for h in made_up} == {"unknown"}
    h = wire.decode_message(_raw(Kind.ERROR.value, {"node": "w2", "req": 1, "code": "x" * 5000, "detail": "d" * 5000}))
    assert h.code == "unknown" and h.detail.startswith("code 'xxx") and len(h.detail) == wire.MAX_DETAIL_CHARS


def _raw(kind: int, body, version: int = wire.PROTOCOL_VERSION, magic: bytes = wire.MAGIC) -> bytes:
    text = body if isinstance(body, (bytes, str)) else json.dumps(body)
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<4sHB", magic, version, kind) + data


SHM = {"pid": 4242, "fd": 17, "token": "ab" * 16, "until": 12.5}
GOOD_STATE = {
    "node": "w2",
    "req": 1,
    "fp": "x",
    "clock": 1.0,
    "loss": 1.0,
    "extras": {},
    "total": 64,
    "chunk": 1,
    "nframes": 1,
}


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"", "header"),
        (b"DPW", "header"),
        (_raw(2, GOOD_STATE, magic=b"NOPE"), "magic"),
        (_raw(2, GOOD_STATE, version=99), "version"),
        (_raw(200, GOOD_STATE), "header"),
        (_raw(2, b"{not json"), "header"),
        (_raw(2, b"\xff\xfe"), "header"),
        (_raw(2, [1, 2]), "header"),
        (_raw(2, {**GOOD_STATE, "node": 5}), "header"),
        (_raw(2, {**GOOD_STATE, "node": ""}), "header"),
        (_raw(2, {**GOOD_STATE, "req": "1"}), "header"),
        (_raw(2, {**GOOD_STATE, "req": True}), "header"),
        (_raw(2, {**GOOD_STATE, "clock": "NaN"}), "header"),
        (
            _raw(2, '{"node":"w2","req":1,"fp":"x","clock":NaN,"loss":1,"extras":{},"total":1,"chunk":1,"nframes":1}'),
            "header",
        ),
        (_raw(2, {**GOOD_STATE, "loss": 1e400}), "header"),
        (_raw(2, {**GOOD_STATE, "extras": []}), "header"),
        (_raw(2, {k: v for k, v in GOOD_STATE.items() if k != "total"}), "header"),
        (_raw(1, {"node": "w1", "req": 1}), "header"),
        (_raw(2, "[" * 100000), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 0}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": -2}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": -1}), "header"),  # -1 means "none" only inside the node: absent on the wire
        (_raw(2, {**GOOD_STATE, "gen": None}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": True}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": "3"}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2**64}), "header"),
        (_raw(2, {**GOOD_STATE, "front": -1}), "header"),  # -1 means "not said" only inside the node
        (_raw(2, {**GOOD_STATE, "front": None}), "header"),
        (_raw(2, {**GOOD_STATE, "front": False}), "header"),
        (_raw(2, {**GOOD_STATE, "front": 1.5}), "header"),
        (_raw(2, {**GOOD_STATE, "front": "3"}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": []}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "pid": 0}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "fd": -1}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "fd": True}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "token": "AB" * 16}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "token": "ab" * 15}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "until": "1"}}), "header"),
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "until": 1e400}}), "header"),  # JSON Infinity
        (_raw(2, {**GOOD_STATE, "gen": 2, "shm": {**SHM, "until": 10**400}}), "non-finite"),  # float() overflows
        (_raw(2, {**GOOD_STATE, "clock": -(10**400)}), "non-finite"),
        (_raw(2, {**GOOD_STATE, "shm": SHM}), "header"),  # a shared-memory reply names its generation
        (_raw(2, {**GOOD_STATE, "gen": 2, "stream": True, "shm": SHM}), "header"),  # and is never streamed
        (_raw(1, {"node": "w1", "req": 1, "fp": "x", "host": 5}), "header"),
        (_raw(1, {"node": "w1", "req": 1, "fp": "x", "host": "h" * 65}), "header"),
        (_raw(2, {**GOOD_STATE, "front": 2**64}), "header"),
    ],
)
def test_decode_rejects(frame, reason):
    with pytest.raises(WireError) as err:
        wire.decode_message(frame)
    assert err.value.reason == reason


def test_a_sum_over_peers_extras_skips_numbers_beyond_float_range():
    """A push's ``w_given`` of 400 digits counts as nothing in the inbox's pending mass (``stats()`` reads it)."""
    extras = [{"w": 0.5}, {"w": 10**400}, {"w": -(10**400)}, {"w": True}, {"w": "1"}, {"w": 2}]
    assert extras_sum(extras, "w") == 2.5


def test_state_check_against_rejections():
    layout = Layout.of(arrays(("f4", (10,))))
    other = Layout.of(arrays(("f4", (11,))))

    def state(**kw):
        base = dict(clock=1.0, loss=1.0, extras={}, layout=layout)
        node, req = kw.pop("node", "w2"), kw.pop("req", 3)
        base.update(kw)
        return wire.decode_message(wire.encode_state(node, req, **base))

    cases = [
        (state(node="w3"), "identity"),
        (state(req=2), "stale"),
        (state(layout=other), "layout"),
        (state(chunk=32), "size"),
    ]
    for header, reason in cases:
        with pytest.raises(WireError) as err:
            header.check_against(layout, peer="w2", req=3)
        assert err.value.reason == reason
    forged = wire.State(
        node="w2", req=3, fingerprint=layout.fingerprint, clock=0.0, loss=0.0, extras={}, total=layout.total_bytes,
        chunk=wire.CHUNK_BYTES, nframes=2,
    )  # fmt: skip
    with pytest.raises(WireError, match="frames"):
        forged.check_against(layout, peer="w2", req=3)


@pytest.mark.parametrize("dtype", ["f2", "f4", "f8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_finite_checker_finds_every_bad_element(dtype, bad):
    layout = Layout.of(arrays((dtype, (1000,)), ("f4", (300,))))
    buf = layout.allocate()
    views = layout.views(buf)
    checker = wire.FiniteChecker(layout, block=64)
    info = np.finfo(np.dtype(dtype))
    views[0][:4] = [info.max, -info.max, info.smallest_subnormal, -info.smallest_subnormal]  # finite, every one
    assert checker.all_finite(views, 0, layout.total_bytes)
    views[0][:4] = 0
    for index in (0, 63, 64, 999):
        views[0][index] = bad
        assert not checker.all_finite(views, 0, layout.total_bytes)
        # only the chunk holding the element sees it
        size = np.dtype(dtype).itemsize
        pos = layout.offsets[0] + index * size
        assert not checker.all_finite(views, pos - pos % 64, pos - pos % 64 + 64)
        if pos >= 64:
            assert checker.all_finite(views, 0, pos - pos % 64)
        views[0][index] = 0


def test_fetch_may_carry_rule_extras():
    h = wire.decode_message(wire.encode_fetch("w1", 3, "fp", {"leaders": {"w1": [0.5, 2.0]}}))
    assert h.extras == {"leaders": {"w1": [0.5, 2.0]}}
    assert wire.decode_message(wire.encode_fetch("w1", 3, "fp")).extras == {}
    with pytest.raises(WireError, match="extras"):
        wire.decode_message(_raw(1, {"node": "w1", "req": 1, "fp": "x", "extras": [1]}))


def test_a_join_and_its_answer_say_whether_the_nodes_take_roles():
    assert wire.decode_message(wire.encode_join("j1", 2, "127.0.0.1", 5000, bipartite=True)).bipartite is True
    assert wire.decode_message(wire.encode_join("j1", 2, "127.0.0.1", 5000)).bipartite is False
    with pytest.raises(WireError, match="bipartite"):
        wire.decode_message(_raw(7, {"node": "j1", "req": 1, "host": "h", "port": 1, "bipartite": 1}))
    news = wire.MemberNews("0" * 16, (Member("w1", "127.0.0.1", 5000),))
    assert wire.decode_message(wire.encode_members("w1", 2, news, ("w1",), bipartite=True)).bipartite is True
    assert wire.decode_message(wire.encode_members("w1", 2, news, ("w1",))).bipartite is False


@pytest.mark.parametrize("key", ["clock", "loss"])
def test_an_integer_beyond_float_range_is_a_wire_error_not_a_crash(key):
    with pytest.raises(WireError) as err:
        wire.decode_message(
            _raw(
                2,
                '{"node":"w2","req":1,"fp":"x","clock":1,"loss":1,"extras":{},"total":64,'
                f'"chunk":1,"nframes":1,"{key}":1{"0" * 400}}}',
            )
        )
    assert err.value.reason == "non-finite"


def test_a_push_of_one_chunk_travels_whole_and_a_larger_one_streamed():
    small = Layout.of(arrays(("f4", (10,))))
    big = Layout.of(arrays(("f4", (1000,))))
    chunk = 1024  # big: 4000 bytes, four chunks

    def push(layout, whole):
        frame = wire.encode_push(
            "w2", 7, clock=1.0, loss=0.5, extras={"w_given": 0.5}, layout=layout, chunk=chunk, whole=whole
        )
        return wire.decode_message(frame)

    whole, streamed = push(small, True), push(small, False)
    assert (whole.kind, whole.stream, whole.nframes) == (Kind.PUSH, False, 1) and streamed.stream
    whole.check_against(small, chunk=chunk, whole=True)
    streamed.check_against(small, chunk=chunk)
    push(big, False).check_against(big, chunk=chunk)
    for header, layout, as_whole in [
        (whole, small, False),  # an unstreamed header came alone: its payload is missing
        (streamed, small, True),  # a streamed header may not carry a payload frame
        (push(big, True), big, True),  # only a push of one chunk travels whole
    ]:
        with pytest.raises(WireError) as err:
            header.check_against(layout, chunk=chunk, whole=as_whole)
        assert err.value.reason == "frames"
