"""The dpwa wire format: versioned headers, array layouts and payload validation.

A message is a ZeroMQ multipart message. Frame 0 is a header::

    b"DPWA" | version: u16 little-endian | kind: u8 | JSON object (UTF-8)

A STATE reply (and a PUSH, the same payload sent unasked) carries the flat parameter buffer (in the *wire layout*: each
array in its ``wire_dtype``) split into chunks of ``chunk`` bytes (the last one
shorter), in one of two framings:

* *single message* (the original): the header frame, then one frame per chunk,
  all in one multipart message;
* *streamed*, when the FETCH asked for it with ``"stream": true`` and the reply
  says ``"stream": true``: the header alone, then one message per chunk, each
  ``[chunk tag, chunk bytes]`` with the tag ``b"DPWC" | req: u64 | index: u32``.
  ZeroMQ hands over a multipart message only once all of it has arrived; one
  message per chunk lets the receiver copy and validate chunk *i* while the
  later chunks are still on the wire.

A PUSH of a model that fits one chunk travels *whole*: ``[header, chunk bytes]`` in one message
(``"stream"`` absent), so the receiver takes all of it in one step. A larger PUSH is streamed: its
header alone, then ``[chunk tag, chunk bytes]`` messages whose tag carries the push's sequence
number. The receiver answers ACK (the push is in its inbox) or
ERROR (``busy``: no free inbox slot; the sender keeps what it tried to give). A SETTLE asks
about (``query``), confirms (``commit``) or withdraws (``abort``) an earlier push by its
sequence number.

Nothing here touches a socket and nothing is ever unpickled: JSON for a few
scalars, raw bytes for the arrays.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpwa.node.members import Member, from_wire, to_wire
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, is_bfloat16
from dpwa.utils.bfloat16 import isfinite as bf16_isfinite

__all__ = [
    "ALIGN",
    "BLOCK",
    "CHUNK_BYTES",
    "CHUNK_MAGIC",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_NAME_CHARS",
    "MAX_REQ",
    "MemberNews",
    "PROTOCOL_VERSION",
    "SUPPORTED_DTYPES",
    "WIRE_DTYPES",
    "ErrorCode",
    "FiniteChecker",
    "Header",
    "Kind",
    "Layout",
    "PayloadReader",
    "PayloadWriter",
    "WireError",
    "can_stream",
    "check_state_header",
    "code_dtype",
    "decode_chunk_tag",
    "decode_header",
    "dtype_code",
    "encode_chunk_tag",
    "check_push_header",
    "encode_ack",
    "encode_error",
    "encode_fetch",
    "encode_join",
    "encode_members",
    "encode_push",
    "encode_settle",
    "encode_state",
    "extras_sum",
    "SETTLE_OPS",
    "wire_code",
]

MAGIC = b"DPWA"
PROTOCOL_VERSION = 1
CHUNK_BYTES = 1 << 22
"""Payload frame size: a reply is validated chunk by chunk as it is received."""
MAX_HEADER_BYTES = 1 << 16
ALIGN = 64
"""Every array starts at a multiple of this in the flat buffer (and CHUNK_BYTES is one)."""
MAX_NAME_CHARS = 256

_PREFIX = struct.Struct("<4sHB")
SUPPORTED_DTYPES = ("<f2", "<f4", "<f8", "bf16")
"""Layout dtype codes: numpy's little-endian float codes; ``bf16`` for :data:`~dpwa.utils.bfloat16.BFLOAT16` arrays."""
WIRE_DTYPES: dict[str, str] = {"float16": "<f2", "bfloat16": "bf16", "float32": "<f4"}
"""The ``wire_dtype`` settings other than ``auto``, and their layout codes."""
CHUNK_MAGIC = b"DPWC"
_CHUNK_TAG = struct.Struct("<4sQI")
MAX_REQ = (1 << 64) - 1
"""Largest request id a chunk tag can carry; a FETCH with a request id outside [0, MAX_REQ] is never streamed."""
BLOCK = 1 << 17
"""Elements per block when copying, converting and validating payloads: a few hundred KiB, in cache."""


class Kind(enum.IntEnum):
    """What a message is: a fetch request, a state reply, an error reply, a push, its ack, a settle, a join
    request, or a member table (the answer to a join, or a leave announcement)."""

    FETCH = 1
    STATE = 2
    ERROR = 3
    PUSH = 4
    ACK = 5
    SETTLE = 6
    JOIN = 7
    MEMBERS = 8


SETTLE_OPS = ("query", "commit", "abort")
"""What a SETTLE asks of push ``req``: its verdict, to keep it (an exchange), or to drop it."""


class ErrorCode(str, enum.Enum):
    """Why a node refused a fetch."""

    NOT_READY = "not-ready"
    LAYOUT = "layout-mismatch"
    BAD_REQUEST = "bad-request"
    BUSY = "busy"
    """A push refused: no free inbox slot, or the sender's previous push is still unmixed."""
    UNSUPPORTED = "unsupported"
    """A push (or settle) sent to a node whose rule takes none."""
    NOT_DELIVERED = "not-delivered"
    """A push that did not arrive whole and never will: the answer to a SETTLE about it."""
    JOIN_REFUSED = "join-refused"
    """A JOIN this node does not admit (a name clash, a file node's name, a full table); the detail says which."""
    LEFT = "left"
    """The node has left the cluster (a clean close); the error carries its member table saying so."""


class WireError(Exception):
    """A message that must be dropped; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- layout


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_code(dtype: np.dtype) -> str:
    """The layout code of ``dtype``: ``"bf16"`` for BFLOAT16, else numpy's little-endian code (e.g. ``"<f4"``)."""
    if is_bfloat16(dtype):
        return "bf16"
    return (dtype.newbyteorder("<") if dtype.byteorder == "=" else dtype).str


def code_dtype(code: str) -> np.dtype:
    """The numpy dtype of a layout code (inverse of :func:`dtype_code`)."""
    return BFLOAT16 if code == "bf16" else np.dtype(code)


def wire_code(own: str, wire_dtype: str | None) -> str:
    """The layout code an array of code ``own`` travels as under ``wire_dtype`` (None or ``auto``: ``own``).

    Only ever narrower: an array whose own dtype is no wider than the wire dtype
    travels as itself (float16 stays float16 under ``bfloat16`` and vice versa).
    Raises ValueError for an unknown ``wire_dtype``.
    """
    if wire_dtype is None or wire_dtype == "auto":
        return own
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; allowed: auto, {', '.join(WIRE_DTYPES)}")
    code = WIRE_DTYPES[wire_dtype]
    return code if code_dtype(code).itemsize < code_dtype(own).itemsize else own


@dataclass(frozen=True)
class Layout:
    """The dtypes and shapes of a parameter list, packed into one aligned flat buffer."""

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = field(init=False)
    total_bytes: int = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        if len(self.dtypes) != len(self.shapes):
            raise ValueError("dtypes and shapes differ in length")
        offsets, pos = [], 0
        for dt, shape in zip(self.dtypes, self.shapes):
            offsets.append(pos)
            pos = _aligned(pos + code_dtype(dt).itemsize * math.prod(shape))
        canonical = json.dumps([list(self.dtypes), [list(s) for s in self.shapes]], separators=(",", ":"))
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "total_bytes", pos)
        object.__setattr__(self, "fingerprint", hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest())

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> Layout:
        """The layout of ``arrays``; raises ValueError for anything dpwa cannot exchange."""
        if len(arrays) == 0:
            raise ValueError("params must be a non-empty list of numpy arrays")
        dtypes, shapes = [], []
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise ValueError(f"params[{i}] is {type(a).__name__}, expected a numpy array")
            code = dtype_code(a.dtype)
            if code not in SUPPORTED_DTYPES:
                raise ValueError(f"params[{i}] has dtype {a.dtype}; supported: float16, float32, float64, BFLOAT16")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"params[{i}] must be C-contiguous and writeable")
            dtypes.append(code)
            shapes.append(tuple(int(s) for s in a.shape))
        return cls(tuple(dtypes), tuple(shapes))

    def on_wire(self, wire_dtype: str | None) -> Layout:
        """The layout of these arrays on the wire under ``wire_dtype`` (:func:`wire_code` per array).

        ``self`` when nothing changes, so the fingerprint is the wire layout's: two
        nodes exchange exactly when their wire layouts agree.
        """
        codes = tuple(wire_code(d, wire_dtype) for d in self.dtypes)
        return self if codes == self.dtypes else Layout(codes, self.shapes)

    def matches(self, arrays: Sequence[np.ndarray]) -> bool:
        """True when ``arrays`` still have this layout (same count, dtypes and shapes)."""
        return len(arrays) == len(self.shapes) and all(
            a.shape == s and dtype_code(a.dtype) == d for a, s, d in zip(arrays, self.shapes, self.dtypes)
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        """Element count of every array."""
        return tuple(math.prod(s) for s in self.shapes)

    def allocate(self) -> np.ndarray:
        """A zeroed flat uint8 buffer of ``total_bytes`` whose address is ALIGN-aligned."""
        raw = np.zeros(self.total_bytes + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        return raw[start : start + self.total_bytes]

    def views(self, buffer: np.ndarray) -> list[np.ndarray]:
        """Typed, shaped arrays that alias ``buffer`` (bfloat16 ones with the BFLOAT16 dtype)."""
        out = []
        for dt, shape, off, n in zip(self.dtypes, self.shapes, self.offsets, self.sizes):
            dtype = code_dtype(dt)
            out.append(buffer[off : off + n * dtype.itemsize].view(dtype).reshape(shape))
        return out

    def frame_bounds(self, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of the payload frames."""
        return [(s, min(s + chunk, self.total_bytes)) for s in range(0, self.total_bytes, chunk)] or [(0, 0)]

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The (array index, first element, end element) pieces of arrays inside bytes [start, end)."""
        out = []
        for i, (dt, off, n) in enumerate(zip(self.dtypes, self.offsets, self.sizes)):
            size = code_dtype(dt).itemsize
            lo, hi = max(start, off), min(end, off + n * size)
            if lo < hi:
                out.append((i, (lo - off) // size, (hi - off + size - 1) // size))
        return out


# --------------------------------------------------------------------------- headers


@dataclass(frozen=True)
class Header:
    """A decoded, type-checked header. Fields not used by a kind keep their defaults."""

    kind: Kind
    node: str
    req: int
    fingerprint: str = ""
    clock: float = 0.0
    loss: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    total: int = 0
    chunk: int = 0
    nframes: int = 0
    code: str = ""
    detail: str = ""
    stream: bool = False
    """FETCH: the requester takes a streamed reply; STATE: the chunks follow as messages of their own."""
    hold: bool = False
    """PUSH: part of an exchange; the receiver keeps it until the sender's SETTLE commit (or abort)."""
    exchange: int = -1
    """FETCH: the sequence number of the PUSH this fetch answers (an exchange), -1 for a plain fetch."""
    op: str = ""
    """SETTLE: one of :data:`SETTLE_OPS`."""
    digest: str = ""
    """The sender's member table digest (:meth:`~dpwa.node.members.MemberTable.digest`); "" when not sent."""
    members: tuple[Member, ...] | None = None
    """The sender's whole member table, sent when it believes the receiver's differs (shape-checked here)."""
    host: str = ""
    port: int = 0
    """JOIN: where the joining node listens."""
    permanent: tuple[str, ...] = ()
    """MEMBERS answering a JOIN: the names of the cluster file's nodes (members never forgotten)."""
    settled: tuple[int, bool | None] | None = None
    """MEMBERS announcing a leave: the receiver's latest push sequence number there and its final verdict."""
    mass: float | None = None
    """MEMBERS answering a JOIN: the sender's bound on the cluster's push-sum mass (members ever admitted)."""
    front: int = -1
    """STATE, PUSH: the most steps the sender knew any node to have started (its own included); -1: not said."""
    gen: int = -1
    """STATE: the snapshot's generation (the server's publish count, from 1); -1 when the reply carries none."""


@dataclass(frozen=True)
class MemberNews:
    """What a message says about the sender's member table: its digest, and the whole table when the sender
    believes the receiver's differs (``members`` None: digest only)."""

    digest: str
    members: Sequence[Member] | None = None


def _encode(kind: Kind, body: dict[str, Any], news: MemberNews | None = None) -> bytes:
    if news is not None:
        body["md"] = news.digest
        if news.members is not None:
            body["members"] = to_wire(news.members)
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) + _PREFIX.size > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind)) + data


def encode_fetch(
    node: str,
    req: int,
    fingerprint: str,
    extras: dict[str, Any] | None = None,
    *,
    stream: bool = False,
    exchange: int = -1,
    news: MemberNews | None = None,
) -> bytes:
    """A request for the peer's latest snapshot, optionally carrying the requester's rule extras.

    ``stream``: the requester takes the streamed framing (one message per chunk); ``exchange``: the
    sequence number of the PUSH (sent just before on the same connection) this fetch completes."""
    body: dict[str, Any] = {"node": node, "req": req, "fp": fingerprint}
    if extras:
        body["extras"] = extras
    if stream:
        body["stream"] = True
    if exchange >= 0:
        body["exchange"] = exchange
    return _encode(Kind.FETCH, body, news)


def encode_push(
    node: str,
    seq: int,
    *,
    clock: float,
    loss: float,
    extras: dict[str, Any],
    layout: Layout,
    chunk: int = CHUNK_BYTES,
    hold: bool = False,
    whole: bool = False,
    news: MemberNews | None = None,
    front: int = -1,
) -> bytes:
    """The header of push ``seq`` of a snapshot of (wire) ``layout``; its chunks follow as tagged messages,
    or, ``whole`` (a layout of one chunk), its one chunk follows in the same message.

    ``hold``: an exchange's push, kept by the receiver until a SETTLE commit. ``front`` (>= 0): see
    :attr:`Header.front`."""
    body = _payload_body(node, seq, clock, loss, extras, layout, chunk, front)
    if not whole:
        body["stream"] = True
    if hold:
        body["hold"] = True
    return _encode(Kind.PUSH, body, news)


def encode_ack(node: str, seq: int) -> bytes:
    """Push ``seq`` is in ``node``'s inbox (or, answering a commit, kept for good)."""
    return _encode(Kind.ACK, {"node": node, "req": seq})


def encode_settle(node: str, seq: int, op: str) -> bytes:
    """Ask about (``query``), keep (``commit``) or drop (``abort``) push ``seq``; see :data:`SETTLE_OPS`."""
    if op not in SETTLE_OPS:
        raise ValueError(f"unknown settle op {op!r}")
    return _encode(Kind.SETTLE, {"node": node, "req": seq, "op": op})


def encode_state(
    node: str,
    req: int,
    *,
    clock: float,
    loss: float,
    extras: dict[str, Any],
    layout: Layout,
    chunk: int = CHUNK_BYTES,
    stream: bool = False,
    news: MemberNews | None = None,
    gen: int = -1,
    front: int = -1,
) -> bytes:
    """The header of a reply carrying a snapshot of (wire) ``layout``; ``stream``: the chunks follow as messages;
    ``gen`` (>= 1): the snapshot's generation, so the requester can tell a snapshot it already has; ``front``
    (>= 0): see :attr:`Header.front`."""
    body = _payload_body(node, req, clock, loss, extras, layout, chunk, front)
    if stream:
        body["stream"] = True
    if gen >= 1:
        body["gen"] = gen
    return _encode(Kind.STATE, body, news)


def _payload_body(
    node: str, req: int, clock: float, loss: float, extras: dict[str, Any], layout: Layout, chunk: int, front: int
) -> dict[str, Any]:
    """The header fields of a message that carries a snapshot (STATE, PUSH)."""
    body: dict[str, Any] = {
        "node": node,
        "req": req,
        "fp": layout.fingerprint,
        "clock": clock,
        "loss": loss,
        "extras": extras,
        "total": layout.total_bytes,
        "chunk": chunk,
        "nframes": len(layout.frame_bounds(chunk)),
    }
    if front >= 0:
        body["front"] = front
    return body


def can_stream(req: int) -> bool:
    """True when request id ``req`` fits a chunk tag."""
    return 0 <= req <= MAX_REQ


def encode_chunk_tag(req: int, index: int) -> bytes:
    """Frame 0 of streamed chunk ``index`` of the reply to request ``req`` (see :func:`can_stream`)."""
    return _CHUNK_TAG.pack(CHUNK_MAGIC, req, index)


def decode_chunk_tag(frame: bytes | memoryview) -> tuple[int, int] | None:
    """``(req, index)`` when ``frame`` is a chunk tag, else None."""
    if len(frame) != _CHUNK_TAG.size or bytes(frame[:4]) != CHUNK_MAGIC:
        return None
    _, req, index = _CHUNK_TAG.unpack(bytes(frame))
    return req, index


def encode_error(node: str, req: int, code: ErrorCode, detail: str = "", news: MemberNews | None = None) -> bytes:
    """A refusal, e.g. no snapshot published yet or a layout mismatch."""
    return _encode(Kind.ERROR, {"node": node, "req": req, "code": code.value, "detail": detail[:1000]}, news)


def encode_join(node: str, req: int, host: str, port: int) -> bytes:
    """Node ``node``, listening on ``host:port``, asks to join; the answer is MEMBERS or ERROR join-refused."""
    return _encode(Kind.JOIN, {"node": node, "req": req, "host": host, "port": port})


def encode_members(
    node: str,
    req: int,
    news: MemberNews,
    permanent: Sequence[str] = (),
    settled: tuple[int, bool | None] | None = None,
    mass: float | None = None,
) -> bytes:
    """``node``'s member table (``news.members`` must be set): a join's answer (with the names of the cluster
    file's nodes, ``permanent``, and ``mass``: the sender's bound on the cluster's push-sum mass), or a leave
    announcement (with ``settled``: the receiver's latest push sequence number at ``node`` and its final verdict,
    so the receiver settles a push that is still open)."""
    if news.members is None:
        raise ValueError("a MEMBERS message carries the whole table")
    body: dict[str, Any] = {"node": node, "req": req}
    if permanent:
        body["permanent"] = list(permanent)
    if settled is not None:
        body["settled"] = [settled[0], settled[1]]
    if mass is not None:
        body["mass"] = mass
    return _encode(Kind.MEMBERS, body, news)


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _field(body: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        raise WireError("header", f"field {key!r} missing or of the wrong type")
    return value


def _optional_count(body: dict[str, Any], key: str, lowest: int) -> int:
    """``body[key]``: an integer in ``[lowest, MAX_REQ]``, or -1 when the field is absent (-1 itself is invalid)."""
    if key not in body:
        return -1
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= MAX_REQ:
        raise WireError("header", f"field {key!r} is not an integer in [{lowest}, 2^64 - 1]")
    return value


def decode_header(frame: bytes | memoryview) -> Header:
    """Parse and type-check a header frame; raises WireError naming what is wrong."""
    data = bytes(frame)
    if len(data) < _PREFIX.size or len(data) > MAX_HEADER_BYTES:
        raise WireError("header", f"header of {len(data)} bytes")
    magic, version, kind_value = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireError("magic", "not a dpwa message")
    if version != PROTOCOL_VERSION:
        raise WireError("version", f"protocol version {version}, expected {PROTOCOL_VERSION}")
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise WireError("header", f"unknown message kind {kind_value}") from None
    try:
        body = json.loads(data[_PREFIX.size :], parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise WireError("header", f"malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise WireError("header", "header body is not an object")
    node = _field(body, "node", str)
    if not 0 < len(node) <= MAX_NAME_CHARS:
        raise WireError("header", "bad node name")
    req = _field(body, "req", int)
    digest, members = _member_news(body)
    if kind is Kind.JOIN:
        return Header(kind, node, req, host=_field(body, "host", str)[:MAX_NAME_CHARS], port=_field(body, "port", int))
    if kind is Kind.MEMBERS:
        if members is None:
            raise WireError("header", "a MEMBERS message without members")
        permanent = body.get("permanent", [])
        if not isinstance(permanent, list) or not all(isinstance(n, str) for n in permanent):
            raise WireError("header", "field 'permanent' of the wrong type")
        settled = body.get("settled")
        if settled is not None and not (
            isinstance(settled, list)
            and len(settled) == 2
            and isinstance(settled[0], int)
            and not isinstance(settled[0], bool)
            and (settled[1] is None or isinstance(settled[1], bool))
        ):
            raise WireError("header", "field 'settled' malformed")
        return Header(
            kind,
            node,
            req,
            digest=digest,
            members=members,
            permanent=tuple(permanent),
            settled=(settled[0], settled[1]) if settled is not None else None,
            mass=_mass(body.get("mass")),
        )
    if kind is Kind.FETCH:
        extras = body.get("extras", {})
        if not isinstance(extras, dict):
            raise WireError("header", "field 'extras' of the wrong type")
        exchange = body.get("exchange", -1)
        if isinstance(exchange, bool) or not isinstance(exchange, int):
            raise WireError("header", "field 'exchange' of the wrong type")
        return Header(
            kind,
            node,
            req,
            fingerprint=_field(body, "fp", str),
            extras=extras,
            stream=_flag(body, "stream"),
            exchange=exchange,
            digest=digest,
            members=members,
        )
    if kind is Kind.ERROR:
        return Header(
            kind,
            node,
            req,
            code=_field(body, "code", str),
            detail=str(body.get("detail", ""))[:1000],
            digest=digest,
            members=members,
        )
    if kind is Kind.ACK:
        return Header(kind, node, req)
    if kind is Kind.SETTLE:
        op = _field(body, "op", str)
        if op not in SETTLE_OPS:
            raise WireError("header", f"unknown settle op {op[:40]!r}")
        return Header(kind, node, req, op=op)
    try:
        clock = float(_field(body, "clock", (int, float)))
        loss = float(_field(body, "loss", (int, float)))
    except OverflowError:  # a JSON integer beyond float range (10**400): as non-finite as it gets
        raise WireError("non-finite", "clock or loss is not finite") from None
    if not (math.isfinite(clock) and math.isfinite(loss)):
        raise WireError("non-finite", "clock or loss is not finite")
    extras = _field(body, "extras", dict)
    gen = _optional_count(body, "gen", 1) if kind is Kind.STATE else -1  # -1: a reply that names no generation
    front = _optional_count(body, "front", 0)  # -1: a message that does not say
    return Header(
        kind,
        node,
        req,
        fingerprint=_field(body, "fp", str),
        clock=clock,
        loss=loss,
        extras=extras,
        total=_field(body, "total", int),
        chunk=_field(body, "chunk", int),
        nframes=_field(body, "nframes", int),
        stream=_flag(body, "stream"),
        hold=_flag(body, "hold") if kind is Kind.PUSH else False,
        digest=digest,
        members=members,
        gen=gen,
        front=front,
    )


def _mass(value: Any) -> float | None:
    """An optional positive finite number (a MEMBERS ``mass``); anything else is as if absent."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        mass = float(value)
    except OverflowError:
        return None
    return mass if math.isfinite(mass) and mass > 0 else None


def _member_news(body: dict[str, Any]) -> tuple[str, tuple[Member, ...] | None]:
    """The optional ``md`` (a digest: 16 hex digits) and ``members`` (see :func:`~dpwa.node.members.from_wire`)."""
    digest = body.get("md", "")
    if not isinstance(digest, str) or len(digest) > 16:
        raise WireError("header", "field 'md' of the wrong type")
    if "members" not in body:
        return digest, None
    members = from_wire(body["members"])
    if members is None:
        raise WireError("header", "field 'members' malformed")
    return digest, tuple(members)


def _flag(body: dict[str, Any], key: str) -> bool:
    """An optional boolean header field (``stream``, ``hold``), False when absent."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise WireError("header", f"field {key!r} of the wrong type")
    return value


def extras_sum(extras: Iterable[Mapping[str, Any]], key: str) -> float:
    """The sum of ``e[key]`` over ``extras`` where it is a number (an int or float, not a bool); others count 0."""
    total = 0.0
    for e in extras:
        value = e.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total += float(value)
    return total


def check_state_header(header: Header, layout: Layout, *, peer: str, req: int, chunk: int = CHUNK_BYTES) -> None:
    """Reject a STATE header that does not announce exactly ``layout`` from ``peer`` for request ``req``."""
    if header.node != peer:
        raise WireError("identity", f"reply names node {header.node!r}, expected {peer!r}")
    if header.req != req:
        raise WireError("stale", f"reply to request {header.req}, expected {req}")
    if header.fingerprint != layout.fingerprint:
        raise WireError("layout", f"layout {header.fingerprint} differs from ours {layout.fingerprint}")
    if header.total != layout.total_bytes or header.chunk != chunk:
        raise WireError("size", f"payload of {header.total} bytes in {header.chunk}-byte chunks")
    if header.nframes != len(layout.frame_bounds(chunk)):
        raise WireError("frames", f"{header.nframes} payload frames announced")


def check_push_header(header: Header, layout: Layout, *, chunk: int = CHUNK_BYTES, whole: bool = False) -> None:
    """Reject a PUSH header that does not announce exactly ``layout`` in ``chunk``-byte chunks, streamed,
    or ``whole`` (its one chunk in the header's message) for a layout of one chunk."""
    if header.fingerprint != layout.fingerprint:
        raise WireError("layout", f"layout {header.fingerprint} differs from ours {layout.fingerprint}")
    if header.total != layout.total_bytes or header.chunk != chunk:
        raise WireError("size", f"payload of {header.total} bytes in {header.chunk}-byte chunks")
    if header.nframes != len(layout.frame_bounds(chunk)):
        raise WireError("frames", f"{header.nframes} payload frames announced")
    if whole and (header.stream or header.nframes != 1):
        raise WireError("frames", "only an unstreamed push of one chunk carries its payload with its header")
    if not whole and not header.stream:
        raise WireError("frames", "an unstreamed push came without its payload")
    if not can_stream(header.req):
        raise WireError("header", f"push sequence number {header.req} does not fit a chunk tag")


# --------------------------------------------------------------------------- payload


class FiniteChecker:
    """Checks that received array bytes hold only finite numbers, with fixed-size scratch buffers."""

    def __init__(self, layout: Layout, block: int = 1 << 16) -> None:
        self._layout = layout
        self._block = block
        self._scratch = np.empty(block, dtype=bool)
        self._bits = np.empty(block, dtype=np.uint16) if "bf16" in layout.dtypes else None

    def all_finite(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        """True when every element of the arrays lying in bytes [start, end) is finite."""
        for index, lo, hi in self._layout.segments(start, end):
            flat = views[index].reshape(-1)
            for s in range(lo, hi, self._block):
                e = min(s + self._block, hi)
                out = self._scratch[: e - s]
                if self._bits is not None and self._layout.dtypes[index] == "bf16":
                    bf16_isfinite(flat[s:e], out, scratch=self._bits)
                else:
                    np.isfinite(flat[s:e], out=out)
                if not out.all():
                    return False
        return True


_F16_TABLE: np.ndarray | None = None


def _f16_table() -> np.ndarray:
    """Every float16 value as float32, indexed by its bits (256 KiB, built once): widening by table look-up
    is about 1.5x faster than numpy's float16 cast and exactly the same."""
    global _F16_TABLE
    if _F16_TABLE is None:
        _F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    return _F16_TABLE


class PayloadReader:
    """Takes a received chunk into a receive buffer: copy (or widen), and check that every value is finite.

    ``wire`` is the layout the bytes travel in, ``local`` the receive buffer's
    (same shapes; a float32 array may travel as float16 or bfloat16). Without
    conversion (``direct``) the transport lets ZeroMQ copy a chunk straight into
    place and calls :meth:`check`; otherwise :meth:`read` widens each block of
    :data:`BLOCK` elements exactly (float16 and bfloat16 are subsets of float32)
    from ZeroMQ's buffer and checks it while it is in cache: one pass over the
    received bytes. When the process has already imported torch, float16 and
    bfloat16 are widened by torch's casts (the same values, 1.2-2.7x faster);
    else by a table look-up (float16) or a shift (bfloat16). Scratch is
    fixed-size; nothing proportional to the model is allocated.
    """

    def __init__(self, wire: Layout, local: Layout, block: int = BLOCK) -> None:
        if wire.shapes != local.shapes:
            raise ValueError("wire and local layouts differ in shapes")
        self.wire = wire
        self.local = local
        self.direct = wire is local or wire.dtypes == local.dtypes
        """No conversion: the bytes may be received straight into the buffer, then :meth:`check`-ed."""
        self._checker = FiniteChecker(local, block)
        self._block = block
        self._ok = np.empty(block, dtype=bool)
        self._bits = np.empty(block, dtype=np.uint16)
        self._f32 = np.empty(block, dtype=np.float32)
        self._table = None
        if any(w == "<f2" != d for w, d in zip(wire.dtypes, local.dtypes)):
            self._table = _f16_table()
            self._index = np.empty(block, dtype=np.intp)  # np.take would allocate one per call

    def check(self, views: Sequence[np.ndarray], start: int, end: int) -> bool:
        """After bytes [start, end) were received straight into the buffer (``direct``): all finite?

        ZeroMQ's own copy into the buffer (a large memcpy) plus this check measured a few
        percent faster than :meth:`read`'s block-by-block copy; :meth:`read` is for widening.
        """
        return self._checker.all_finite(views, start, end)

    def read(self, src: np.ndarray, start: int, views: Sequence[np.ndarray]) -> bool:
        """Take ``src`` (uint8, the wire bytes from offset ``start``) into ``views`` (arrays of the local layout).

        Returns False at the first block holding a NaN or an infinity (``views`` are then partly written:
        receive buffers are scratch until a reply is accepted).
        """
        end = start + src.size
        for index, lo, hi in self.wire.segments(start, end):
            code = self.wire.dtypes[index]
            dtype = code_dtype(code)
            first = self.wire.offsets[index] + lo * dtype.itemsize - start
            values = src[first : first + (hi - lo) * dtype.itemsize].view(dtype)
            out = views[index].reshape(-1)[lo:hi]
            if not self._take(values, out, code, self.local.dtypes[index]):
                return False
        return True

    def _take(self, src: np.ndarray, dst: np.ndarray, wire: str, local: str) -> bool:
        block = self._block
        torch = _loaded_torch() if local == "<f4" and wire in ("bf16", "<f2") else None  # once per array
        for a in range(0, src.size, block):
            b = min(a + block, src.size)
            s, d, ok = src[a:b], dst[a:b], self._ok[: b - a]
            if wire == local:
                np.copyto(d, s)
            elif wire == "bf16" and torch is not None and s.flags.aligned:
                torch.from_numpy(d).copy_(torch.from_numpy(s.view(np.uint16)).view(torch.bfloat16))
            elif wire == "bf16":
                wide = d if local == "<f4" else self._f32[: b - a]
                bits = wide.view(np.uint32)  # a bfloat16 is the upper half of a float32: zero-extend, shift
                np.copyto(bits, s.view(np.uint16))
                np.left_shift(bits, 16, out=bits)
                if wide is not d:
                    np.copyto(d, wide)
            elif wire == "<f2" and torch is not None and s.flags.aligned:
                torch.from_numpy(d).copy_(torch.from_numpy(s))  # exact, vectorized: ~2.7x the table look-up
            elif wire == "<f2" and local == "<f4" and self._table is not None:
                index = self._index[: b - a]
                np.copyto(index, s.view(np.uint16))
                np.take(self._table, index, out=d, mode="clip")
            else:
                np.copyto(d, s)  # numpy's exact widening cast
            if local == "bf16":
                bf16_isfinite(d, ok, scratch=self._bits)
            else:
                np.isfinite(d, out=ok)
            if not ok.all():
                return False
        return True


def _loaded_torch() -> Any | None:
    """torch if this process has already imported it (the PyTorch adapter always has), else None.

    The core never imports torch itself: without it every conversion runs in numpy.
    """
    return sys.modules.get("torch")


class PayloadWriter:
    """Rounds a snapshot's values (``local`` layout) into its wire buffer (``wire`` layout), chunk by chunk.

    float32/float64 -> float16 and float64 -> float32 round to nearest even
    (beyond float16's range a value becomes an infinity, which the receiver
    rejects as non-finite); -> bfloat16 rounds to nearest even like torch
    (:func:`dpwa.utils.bfloat16.from_float32`; float64 goes through float32). Finite
    values come out bit for bit the same whichever way they are computed: when the
    process has already imported torch, float32 sources are cast by torch's
    vectorized ``copy_`` (about a memcpy; numpy's casts cost 3x (bfloat16) to 7x
    (float16) that), else by numpy in cache-sized blocks. Fixed-size scratch.
    """

    def __init__(self, local: Layout, wire: Layout, block: int = BLOCK) -> None:
        if wire.shapes != local.shapes:
            raise ValueError("wire and local layouts differ in shapes")
        self.wire = wire
        self.local = local
        self._block = block
        self._u32 = np.empty(block, dtype=np.uint32)
        self._f32 = np.empty(block, dtype=np.float32)

    def write(self, views: Sequence[np.ndarray], wire_views: Sequence[np.ndarray], start: int, end: int) -> None:
        """Fill the elements of ``wire_views`` lying in wire bytes [start, end) from ``views`` (writable arrays)."""
        torch = _loaded_torch()
        for index, lo, hi in self.wire.segments(start, end):
            src = views[index].reshape(-1)[lo:hi]
            dst = wire_views[index].reshape(-1)[lo:hi]
            code, own = self.wire.dtypes[index], self.local.dtypes[index]
            if code == own:
                np.copyto(dst, src)
            elif torch is not None and own == "<f4":
                out = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16) if code == "bf16" else None
                (torch.from_numpy(dst) if out is None else out).copy_(torch.from_numpy(src))
            else:
                self._numpy(src, dst, code, own)

    def _numpy(self, src: np.ndarray, dst: np.ndarray, code: str, own: str) -> None:
        block = self._block
        with np.errstate(over="ignore", invalid="ignore"):
            for a in range(0, src.size, block):
                b = min(a + block, src.size)
                s, d = src[a:b], dst[a:b]
                if code == "bf16":
                    if own != "<f4":
                        s = self._f32[: b - a]
                        np.copyto(s, src[a:b], casting="same_kind")
                    from_float32(s, d, scratch=self._u32)
                else:
                    np.copyto(d, s, casting="same_kind")
