"""Header frames: one frozen dataclass per message kind, its encoding and its validation.

Frame 0 of every message is a header::

    b"DPWA" | version: u16 little-endian | kind: u8 | JSON object (UTF-8)

The kinds (:class:`~dpwa.node.wire.constants.Kind`) and their classes:

* :class:`Fetch` asks a peer for its latest snapshot; the answer is a :class:`State` (the
  snapshot's header, its payload after it) or an :class:`Error` (a refusal);
* :class:`Push` sends a snapshot unasked; the receiver answers :class:`Ack` (the push is in
  its inbox) or :class:`Error` (``busy``: no free inbox slot). A :class:`Settle` asks about
  (``query``), confirms (``commit``) or withdraws (``abort``) an earlier push by its sequence
  number (a push's ``req``);
* a STATE to a co-located requester may name a shared-memory segment instead of carrying its payload
  (:attr:`State.shm`); the requester sends :class:`Release` when done with it;
* :class:`Join` asks to join the cluster; :class:`Members` carries a whole member table (the
  answer to a join, or a leave announcement).

A STATE or PUSH payload follows in one of two framings: in the header's own multipart message,
one frame per chunk; or *streamed* (``stream`` set): the header alone, then one message per
chunk, tagged (:mod:`dpwa.node.wire.chunks`). A PUSH that fits one chunk travels *whole*:
``[header, chunk bytes]`` in one message.

The contract: ``X(...).encode()`` gives exactly the bytes deployed nodes expect (JSON keys in a
fixed order, optional keys left out at their defaults; tests/test_wire_golden.py records them);
:func:`decode_message` turns a received frame into the right class or raises
:class:`~dpwa.node.wire.fields.WireError` naming what is wrong. Nothing here touches a socket
and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, TypeVar

from dpwa.node.members import Member, to_wire
from dpwa.node.wire.chunks import can_stream
from dpwa.node.wire.constants import (
    CHUNK_BYTES,
    MAGIC,
    MAX_DETAIL_CHARS,
    MAX_HEADER_BYTES,
    MAX_NAME_CHARS,
    PROTOCOL_VERSION,
    SETTLE_OPS,
    ErrorCode,
    Kind,
)
from dpwa.node.wire.fields import (
    MemberNews,
    SharedRef,
    WireError,
    envelope,
    finite_clock_loss,
    host_field,
    name_list,
    optional_count,
    optional_flag,
    positive_mass,
    required,
    settled_pair,
    shared_ref,
)
from dpwa.node.wire.layout import Layout

__all__ = [
    "MESSAGE_CLASSES",
    "Ack",
    "Error",
    "Fetch",
    "Join",
    "Members",
    "Message",
    "Push",
    "Release",
    "Settle",
    "State",
    "WithNews",
    "decode_message",
]

_PREFIX = struct.Struct("<4sHB")
_KNOWN_CODES = frozenset(code.value for code in ErrorCode)


# --------------------------------------------------------------------------- encoding


def _frame(kind: Kind, body: dict[str, Any], news: MemberNews | None = None) -> bytes:
    """The header frame of ``body`` (``news`` appended as ``md`` and ``members``); ValueError when too large."""
    if news is not None:
        body["md"] = news.digest
        if news.members is not None:
            body["members"] = to_wire(news.members)
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) + _PREFIX.size > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind)) + data


# --------------------------------------------------------------------------- the message classes


@dataclass(frozen=True, kw_only=True)
class _Message:
    """What every message has: the sender's name and a request id (a push's sequence number)."""

    KIND: ClassVar[Kind]
    node: str
    req: int

    @property
    def kind(self) -> Kind:
        """The message's kind (the class's ``KIND``)."""
        return self.KIND

    def encode(self) -> bytes:
        """The header frame of this message."""
        raise NotImplementedError

    @classmethod
    def decode(cls, body: dict[str, Any]) -> _Message:
        """This kind's message from a header's parsed JSON ``body``; raises WireError naming what is wrong."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class WithNews(_Message):
    """A message that may carry the sender's member news (``news`` None: it says nothing of its table)."""

    news: MemberNews | None = None

    @property
    def digest(self) -> str:
        """The sender's member table digest (:meth:`~dpwa.node.members.MemberTable.digest`); "" when not sent."""
        return self.news.digest if self.news is not None else ""

    @property
    def members(self) -> Sequence[Member] | None:
        """The sender's whole member table, sent when it believes the receiver's differs (shape-checked)."""
        return self.news.members if self.news is not None else None


@dataclass(frozen=True, kw_only=True)
class Fetch(WithNews):
    """A request for the peer's latest snapshot (answered STATE or ERROR)."""

    KIND: ClassVar[Kind] = Kind.FETCH
    fingerprint: str
    """The requester's wire layout fingerprint: the server refuses a request for another layout."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The requester's rule extras (``on_request``); left out of the frame when empty."""
    stream: bool = False
    """The requester takes a streamed reply."""
    exchange: int = -1
    """The sequence number of the PUSH this fetch answers (an exchange), -1 for a plain fetch."""
    host: str = ""
    """The requester's co-location identity (dpwa/node/sharedmem.py): a server with the same one may answer
    with its snapshot's shared-memory segment; "" (left out of the frame): answer over the socket."""

    def encode(self) -> bytes:
        """The FETCH header frame."""
        body: dict[str, Any] = {"node": self.node, "req": self.req, "fp": self.fingerprint}
        if self.extras:
            body["extras"] = self.extras
        if self.stream:
            body["stream"] = True
        if self.exchange >= 0:
            body["exchange"] = self.exchange
        if self.host:
            body["host"] = self.host
        return _frame(Kind.FETCH, body, self.news)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Fetch:
        """A FETCH from its parsed JSON body; raises WireError."""
        node, req, news = envelope(body)
        extras = body.get("extras", {})
        if not isinstance(extras, dict):
            raise WireError("header", "field 'extras' of the wrong type")
        exchange = body.get("exchange", -1)
        if isinstance(exchange, bool) or not isinstance(exchange, int):
            raise WireError("header", "field 'exchange' of the wrong type")
        fingerprint = required(body, "fp", str)
        stream = optional_flag(body, "stream")
        host = host_field(body)
        return cls(
            node=node,
            req=req,
            fingerprint=fingerprint,
            extras=extras,
            stream=stream,
            exchange=exchange,
            host=host,
            news=news,
        )


_S = TypeVar("_S", bound="_Snapshot")


@dataclass(frozen=True, kw_only=True)
class _Snapshot(WithNews):
    """The header of a message that carries a snapshot (STATE, PUSH): its scalars and how its payload is cut."""

    fingerprint: str
    """The fingerprint of the payload's (wire) layout."""
    clock: float
    loss: float
    extras: dict[str, Any]
    """The sender's rule extras."""
    total: int
    """Payload bytes in all."""
    chunk: int
    """Bytes per chunk (the last one shorter)."""
    nframes: int
    """Chunks in all."""
    stream: bool = False
    """The chunks follow as messages of their own (tagged); else they follow in the header's message."""
    front: int = -1
    """The most steps the sender knew any node to have started (its own included); -1: not said."""

    @classmethod
    def announcing(cls: type[_S], layout: Layout, chunk: int = CHUNK_BYTES, **fields: Any) -> _S:
        """A header announcing a payload of (wire) ``layout`` in ``chunk``-byte chunks; ``fields``: the rest."""
        nframes = len(layout.frame_bounds(chunk))
        return cls(fingerprint=layout.fingerprint, total=layout.total_bytes, chunk=chunk, nframes=nframes, **fields)

    def _body(self) -> dict[str, Any]:
        """The JSON fields every snapshot header has, in their order on the wire."""
        body: dict[str, Any] = {
            "node": self.node,
            "req": self.req,
            "fp": self.fingerprint,
            "clock": self.clock,
            "loss": self.loss,
            "extras": self.extras,
            "total": self.total,
            "chunk": self.chunk,
            "nframes": self.nframes,
        }
        if self.front >= 0:
            body["front"] = self.front
        return body

    @staticmethod
    def _fields(body: dict[str, Any], *, gen: bool) -> dict[str, Any]:
        """The checked snapshot fields of ``body`` (with ``gen`` when asked) as constructor arguments."""
        node, req, news = envelope(body)
        clock, loss = finite_clock_loss(body)
        fields: dict[str, Any] = {"node": node, "req": req, "news": news, "clock": clock, "loss": loss}
        fields["extras"] = required(body, "extras", dict)
        if gen:
            fields["gen"] = optional_count(body, "gen", 1)  # -1: a reply that names no generation
        fields.update(
            front=optional_count(body, "front", 0),  # -1: a message that does not say
            fingerprint=required(body, "fp", str),
            total=required(body, "total", int),
            chunk=required(body, "chunk", int),
            nframes=required(body, "nframes", int),
            stream=optional_flag(body, "stream"),
        )
        return fields

    def _check_payload(self, layout: Layout, chunk: int) -> None:
        """Reject a header that does not announce exactly ``layout`` in ``chunk``-byte chunks."""
        if self.fingerprint != layout.fingerprint:
            raise WireError("layout", f"layout {self.fingerprint} differs from ours {layout.fingerprint}")
        if self.total != layout.total_bytes or self.chunk != chunk:
            raise WireError("size", f"payload of {self.total} bytes in {self.chunk}-byte chunks")
        if self.nframes != len(layout.frame_bounds(chunk)):
            raise WireError("frames", f"{self.nframes} payload frames announced")


@dataclass(frozen=True, kw_only=True)
class State(_Snapshot):
    """A reply carrying a snapshot: its header (its chunks follow, in this message or streamed)."""

    KIND: ClassVar[Kind] = Kind.STATE
    gen: int = -1
    """The snapshot's generation (the server's publish count, from 1); -1 when the reply carries none."""
    shm: SharedRef | None = None
    """The payload is not in this message: it lies in the server's shared-memory segment this names, lent to the
    requester until it sends RELEASE for this request or ``shm.until`` passes (co-located nodes only)."""

    def encode(self) -> bytes:
        """The STATE header frame."""
        body = self._body()
        if self.stream:
            body["stream"] = True
        if self.gen >= 1:
            body["gen"] = self.gen
        if self.shm is not None:
            body["shm"] = self.shm.to_wire()
        return _frame(Kind.STATE, body, self.news)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> State:
        """A STATE from its parsed JSON body; raises WireError."""
        fields = cls._fields(body, gen=True)
        shm = shared_ref(body.get("shm"))
        if shm is not None and (fields["stream"] or fields["gen"] < 1):
            raise WireError("header", "a shared-memory reply is never streamed and names its generation")
        return cls(**fields, shm=shm)

    def check_against(self, layout: Layout, *, peer: str, req: int, chunk: int = CHUNK_BYTES) -> None:
        """Reject (WireError) a reply that does not announce exactly ``layout`` from ``peer`` for request ``req``."""
        if self.node != peer:
            raise WireError("identity", f"reply names node {self.node!r}, expected {peer!r}")
        if self.req != req:
            raise WireError("stale", f"reply to request {self.req}, expected {req}")
        self._check_payload(layout, chunk)


@dataclass(frozen=True, kw_only=True)
class Push(_Snapshot):
    """A snapshot sent unasked (push ``req``): its header; the chunks follow streamed, or in this message when
    the push travels whole (``stream`` False), or nowhere when it lies in the sender's segment (``shm``)."""

    KIND: ClassVar[Kind] = Kind.PUSH
    hold: bool = False
    """Part of an exchange: the receiver keeps it until the sender's SETTLE commit (or abort)."""
    host: str = ""
    """The sender's co-location identity (dpwa/node/sharedmem.py): a receiver with the same one says in its ACK
    that it takes this sender's pushes through shared memory; "" (left out of the frame): it offers none."""
    gen: int = -1
    """The pushed snapshot's generation (>= 1) when ``shm`` is set; -1 otherwise."""
    shm: SharedRef | None = None
    """The payload is not in the message: it lies in the sender's shared-memory segment this names, kept
    unchanged until the push has its verdict (ACK, ERROR, or a SETTLE's answer), an exchange's push until its
    fetch ended."""

    def encode(self) -> bytes:
        """The PUSH header frame."""
        body = self._body()
        if self.stream:
            body["stream"] = True
        if self.hold:
            body["hold"] = True
        if self.host:
            body["host"] = self.host
        if self.shm is not None:
            body["gen"] = self.gen
            body["shm"] = self.shm.to_wire()
        return _frame(Kind.PUSH, body, self.news)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Push:
        """A PUSH from its parsed JSON body; raises WireError."""
        fields = cls._fields(body, gen=True)
        shm = shared_ref(body.get("shm"))
        if (shm is not None) != (fields["gen"] >= 1) or (shm is not None and fields["stream"]):
            raise WireError("header", "a shared-memory push names its generation, is never streamed, and only it does")
        return cls(**fields, hold=optional_flag(body, "hold"), host=host_field(body), shm=shm)

    def check_against(self, layout: Layout, *, chunk: int = CHUNK_BYTES, whole: bool = False) -> None:
        """Reject (WireError) a push that does not announce exactly ``layout`` in ``chunk``-byte chunks, streamed,
        or ``whole`` (its one chunk in the header's message) for a layout of one chunk, or in shared memory."""
        self._check_payload(layout, chunk)
        if self.shm is not None:
            if whole:
                raise WireError("frames", "a shared-memory push came with a payload frame")
        elif whole and (self.stream or self.nframes != 1):
            raise WireError("frames", "only an unstreamed push of one chunk carries its payload with its header")
        elif not whole and not self.stream:
            raise WireError("frames", "an unstreamed push came without its payload")
        if not can_stream(self.req):
            raise WireError("header", f"push sequence number {self.req} does not fit a chunk tag")


@dataclass(frozen=True, kw_only=True)
class Ack(_Message):
    """Push ``req`` is in ``node``'s inbox (or, answering a commit, kept for good)."""

    KIND: ClassVar[Kind] = Kind.ACK
    shm: bool = False
    """The receiver is co-located with the sender (the push offered the same ``host``) and takes its pushes
    through shared memory from now on."""

    def encode(self) -> bytes:
        """The ACK header frame."""
        body: dict[str, Any] = {"node": self.node, "req": self.req}
        if self.shm:
            body["shm"] = True
        return _frame(Kind.ACK, body)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Ack:
        """An ACK from its parsed JSON body; raises WireError."""
        node, req, _ = envelope(body)
        return cls(node=node, req=req, shm=optional_flag(body, "shm"))


@dataclass(frozen=True, kw_only=True)
class Settle(_Message):
    """Asks about, keeps or drops push ``req``."""

    KIND: ClassVar[Kind] = Kind.SETTLE
    op: str
    """One of :data:`~dpwa.node.wire.constants.SETTLE_OPS`."""

    def encode(self) -> bytes:
        """The SETTLE header frame; ValueError for an unknown ``op``."""
        if self.op not in SETTLE_OPS:
            raise ValueError(f"unknown settle op {self.op!r}")
        return _frame(Kind.SETTLE, {"node": self.node, "req": self.req, "op": self.op})

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Settle:
        """A SETTLE from its parsed JSON body; raises WireError."""
        node, req, _ = envelope(body)
        op = required(body, "op", str)
        if op not in SETTLE_OPS:
            raise WireError("header", f"unknown settle op {op[:40]!r}")
        return cls(node=node, req=req, op=op)


@dataclass(frozen=True, kw_only=True)
class Release(_Message):
    """The requester is done with the shared-memory segment lent to its request ``req`` (no answer)."""

    KIND: ClassVar[Kind] = Kind.RELEASE

    def encode(self) -> bytes:
        """The RELEASE header frame."""
        return _frame(Kind.RELEASE, {"node": self.node, "req": self.req})

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Release:
        """A RELEASE from its parsed JSON body; raises WireError."""
        node, req, _ = envelope(body)
        return cls(node=node, req=req)


@dataclass(frozen=True, kw_only=True)
class Error(WithNews):
    """A refusal of request ``req`` (or of push ``req``), e.g. no snapshot published yet or a layout mismatch."""

    KIND: ClassVar[Kind] = Kind.ERROR
    code: str
    """An :class:`~dpwa.node.wire.constants.ErrorCode` value."""
    detail: str = ""
    """Free text for a person (at most 1000 characters travel)."""

    def encode(self) -> bytes:
        """The ERROR header frame."""
        body = {"node": self.node, "req": self.req, "code": self.code, "detail": self.detail[:MAX_DETAIL_CHARS]}
        return _frame(Kind.ERROR, body, self.news)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Error:
        """An ERROR from its parsed JSON body; raises WireError."""
        node, req, news = envelope(body)
        code = required(body, "code", str)
        detail = str(body.get("detail", ""))
        if code not in _KNOWN_CODES:  # counted and logged by code: a peer must not make up new keys
            code, detail = ErrorCode.UNKNOWN.value, f"code {code[:64]!r}: {detail}"
        return cls(node=node, req=req, code=code, detail=detail[:MAX_DETAIL_CHARS], news=news)


@dataclass(frozen=True, kw_only=True)
class Join(_Message):
    """Node ``node``, listening on ``host:port``, asks to join; the answer is MEMBERS or ERROR join-refused."""

    KIND: ClassVar[Kind] = Kind.JOIN
    host: str
    port: int
    bipartite: bool = False
    """The joining node's file splits AD-PSGD's nodes into active and passive ones (left out of the frame when
    false); a member whose own file says otherwise refuses the join."""

    def encode(self) -> bytes:
        """The JOIN header frame."""
        body: dict[str, Any] = {"node": self.node, "req": self.req, "host": self.host, "port": self.port}
        if self.bipartite:
            body["bipartite"] = True
        return _frame(Kind.JOIN, body)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Join:
        """A JOIN from its parsed JSON body; raises WireError."""
        node, req, _ = envelope(body)
        host, port = required(body, "host", str)[:MAX_NAME_CHARS], required(body, "port", int)
        return cls(node=node, req=req, host=host, port=port, bipartite=optional_flag(body, "bipartite"))


@dataclass(frozen=True, kw_only=True)
class Members(WithNews):
    """``node``'s whole member table (in ``news``): a join's answer, or a leave announcement."""

    KIND: ClassVar[Kind] = Kind.MEMBERS
    news: MemberNews
    """The table itself: ``news.members`` is always set."""
    permanent: tuple[str, ...] = ()
    """Answering a JOIN: the names of the cluster file's nodes (members never forgotten)."""
    settled: tuple[int, bool | None] | None = None
    """Announcing a leave: the receiver's latest push sequence number there and its final verdict."""
    mass: float | None = None
    """Answering a JOIN: the sender's bound on the cluster's push-sum mass (members ever admitted)."""
    bipartite: bool = False
    """Answering a JOIN: the sender's nodes are AD-PSGD's active and passive ones, placed by ``permanent``'s order
    (left out of the frame when false)."""

    def encode(self) -> bytes:
        """The MEMBERS header frame; ValueError when ``news`` holds no table."""
        if self.news.members is None:
            raise ValueError("a MEMBERS message carries the whole table")
        body: dict[str, Any] = {"node": self.node, "req": self.req}
        if self.permanent:
            body["permanent"] = list(self.permanent)
        if self.settled is not None:
            body["settled"] = [self.settled[0], self.settled[1]]
        if self.mass is not None:
            body["mass"] = self.mass
        if self.bipartite:
            body["bipartite"] = True
        return _frame(Kind.MEMBERS, body, self.news)

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Members:
        """A MEMBERS from its parsed JSON body; raises WireError."""
        node, req, news = envelope(body)
        if news is None or news.members is None:
            raise WireError("header", "a MEMBERS message without members")
        permanent = name_list(body, "permanent")
        settled = settled_pair(body.get("settled"))
        mass = positive_mass(body.get("mass"))
        bipartite = optional_flag(body, "bipartite")
        return cls(node=node, req=req, news=news, permanent=permanent, settled=settled, mass=mass, bipartite=bipartite)


# --------------------------------------------------------------------------- decoding a frame

Message: TypeAlias = Fetch | State | Push | Ack | Settle | Release | Error | Join | Members
"""Any decoded header."""

MESSAGE_CLASSES: dict[Kind, type[Message]] = {
    cls.KIND: cls for cls in (Fetch, State, Push, Ack, Settle, Release, Error, Join, Members)
}
"""The class of each message kind."""


def _reject_constant(name: str) -> float:
    """JSON's NaN and Infinity are no numbers here."""
    raise ValueError(f"non-finite number {name}")


def _parse(data: bytes) -> dict[str, Any]:
    """A header's JSON body: an object, with no NaN or Infinity; raises WireError."""
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise WireError("header", f"malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise WireError("header", "header body is not an object")
    return body


def decode_message(frame: bytes | memoryview) -> Message:
    """Parse and type-check a header frame into its kind's class; raises WireError naming what is wrong."""
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
    body = _parse(data[_PREFIX.size :])
    try:
        return MESSAGE_CLASSES[kind].decode(body)
    except WireError:
        raise
    except Exception as err:  # noqa: BLE001 - a check its decoder lacks (any kind): still a drop, never a dead thread
        raise WireError("header", f"malformed {kind.name} header ({type(err).__name__})") from None
