"""The dpwa wire format: versioned headers, array layouts and payload validation (no sockets).

A message is a ZeroMQ multipart message whose frame 0 is a header (magic, version, kind, a
JSON object); a STATE or PUSH carries a snapshot's flat parameter buffer after it, cut into
chunks. The package's modules, each with one concern:

* :mod:`~dpwa.node.wire.constants` -- the protocol's numbers, message kinds and error codes;
* :mod:`~dpwa.node.wire.layout` -- :class:`Layout`: how arrays pack into one aligned buffer;
* :mod:`~dpwa.node.wire.messages` -- one frozen dataclass per message kind (:class:`Fetch`,
  :class:`State`, ...), each with ``encode()`` and ``decode(body)``, and :func:`decode_message`;
* :mod:`~dpwa.node.wire.fields` -- the header field checks the kinds share, :class:`WireError`
  and :class:`MemberNews`;
* :mod:`~dpwa.node.wire.chunks` -- the tags of a streamed payload's chunks;
* :mod:`~dpwa.node.wire.payload` -- arrays to wire bytes and back, every value checked;
* :mod:`~dpwa.node.wire.checks` -- those checks (floats finite, indices below their bound) and their reasons;
* :mod:`~dpwa.node.wire.quantized` -- ``wire_dtype: int8``: a float array's scales and int8 values.

Callers use this facade (``from dpwa.node import wire``). The ``encode_*`` functions below
are shorthands for ``Fetch(...).encode()`` and its siblings, taking the arguments a sender has at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpwa.node.wire.checks import INDEX_RANGE, NON_FINITE, IndexChecker, PayloadChecker
from dpwa.node.wire.chunks import can_stream, decode_chunk_tag, encode_chunk_tag
from dpwa.node.wire.constants import (
    ALIGN,
    ARRAY_ALIGN,
    CHUNK_BYTES,
    CHUNK_MAGIC,
    FINITE_CHECK_BLOCK,
    MAGIC,
    MAX_DETAIL_CHARS,
    MAX_HEADER_BYTES,
    MAX_HOST_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_REQ,
    PAYLOAD_BLOCK,
    PROTOCOL_VERSION,
    SETTLE_OPS,
    ErrorCode,
    Kind,
)
from dpwa.node.wire.fields import MemberNews, SharedRef, WireError, extras_sum
from dpwa.node.wire.layout import (
    FLOAT_CODES,
    INDEX_CODE,
    INDEX_CODES,
    INT8_CODE,
    QUANTIZED_CODE,
    SUPPORTED_DTYPES,
    WIRE_CODES,
    Layout,
    code_dtype,
    dtype_code,
    wire_code,
)
from dpwa.node.wire.messages import (
    MESSAGE_CLASSES,
    Ack,
    Error,
    Fetch,
    Join,
    Members,
    Message,
    Push,
    Release,
    Settle,
    State,
    WithNews,
    decode_message,
)
from dpwa.node.wire.payload import FiniteChecker, PayloadReader, PayloadWriter

__all__ = [
    "ALIGN",
    "ARRAY_ALIGN",
    "CHUNK_BYTES",
    "CHUNK_MAGIC",
    "FINITE_CHECK_BLOCK",
    "FLOAT_CODES",
    "INDEX_CODE",
    "INDEX_CODES",
    "INDEX_RANGE",
    "INT8_CODE",
    "MAGIC",
    "MAX_DETAIL_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_HOST_ID_CHARS",
    "MAX_NAME_CHARS",
    "MAX_REQ",
    "MESSAGE_CLASSES",
    "NON_FINITE",
    "PAYLOAD_BLOCK",
    "PROTOCOL_VERSION",
    "QUANTIZED_CODE",
    "SETTLE_OPS",
    "SUPPORTED_DTYPES",
    "WIRE_CODES",
    "Ack",
    "Error",
    "ErrorCode",
    "Fetch",
    "FiniteChecker",
    "IndexChecker",
    "Join",
    "Kind",
    "Layout",
    "MemberNews",
    "Members",
    "Message",
    "PayloadChecker",
    "PayloadReader",
    "PayloadWriter",
    "Push",
    "Release",
    "Settle",
    "SharedRef",
    "State",
    "WireError",
    "WithNews",
    "can_stream",
    "code_dtype",
    "decode_chunk_tag",
    "decode_message",
    "dtype_code",
    "encode_ack",
    "encode_chunk_tag",
    "encode_error",
    "encode_fetch",
    "encode_join",
    "encode_members",
    "encode_push",
    "encode_release",
    "encode_settle",
    "encode_state",
    "extras_sum",
    "wire_code",
]


def encode_fetch(
    node: str,
    req: int,
    fingerprint: str,
    extras: dict[str, Any] | None = None,
    *,
    stream: bool = False,
    exchange: int = -1,
    news: MemberNews | None = None,
    host: str = "",
) -> bytes:
    """A request for the peer's latest snapshot, optionally carrying the requester's rule extras.

    ``stream``: the requester takes the streamed framing (one message per chunk); ``exchange``: the
    sequence number of the PUSH (sent just before on the same connection) this fetch completes; ``host``: the
    requester's co-location identity (the server may lend its shared-memory segment instead)."""
    return Fetch(
        node=node,
        req=req,
        fingerprint=fingerprint,
        extras=extras or {},
        stream=stream,
        exchange=exchange,
        news=news,
        host=host,
    ).encode()


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
    shm: SharedRef | None = None,
) -> bytes:
    """The header of a reply carrying a snapshot of (wire) ``layout``; ``stream``: the chunks follow as messages;
    ``gen`` (>= 1): the snapshot's generation, so the requester can tell a snapshot it already has; ``front``
    (>= 0): see :attr:`State.front`; ``shm``: the payload lies in this shared-memory segment instead."""
    return State.announcing(
        layout,
        chunk,
        node=node,
        req=req,
        clock=clock,
        loss=loss,
        extras=extras,
        stream=stream,
        news=news,
        gen=gen,
        front=front,
        shm=shm,
    ).encode()


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
    host: str = "",
    gen: int = -1,
    shm: SharedRef | None = None,
) -> bytes:
    """The header of push ``seq`` of a snapshot of (wire) ``layout``; its chunks follow as tagged messages,
    or, ``whole`` (a layout of one chunk), its one chunk follows in the same message, or, ``shm`` given, none
    follows: the payload of generation ``gen`` lies in that segment.

    ``hold``: an exchange's push, kept by the receiver until a SETTLE commit. ``front`` (>= 0): see
    :attr:`Push.front`. ``host``: the sender's co-location identity ("": none offered)."""
    return Push.announcing(
        layout,
        chunk,
        node=node,
        req=seq,
        clock=clock,
        loss=loss,
        extras=extras,
        stream=not whole and shm is None,
        hold=hold,
        news=news,
        front=front,
        host=host,
        gen=gen if shm is not None else -1,
        shm=shm,
    ).encode()


def encode_ack(node: str, seq: int, *, shm: bool = False) -> bytes:
    """Push ``seq`` is in ``node``'s inbox (or, answering a commit, kept for good); ``shm``: and this node takes
    the sender's pushes through shared memory."""
    return Ack(node=node, req=seq, shm=shm).encode()


def encode_settle(node: str, seq: int, op: str) -> bytes:
    """Ask about (``query``), keep (``commit``) or drop (``abort``) push ``seq``; see :data:`SETTLE_OPS`."""
    return Settle(node=node, req=seq, op=op).encode()


def encode_release(node: str, req: int) -> bytes:
    """``node`` is done with the shared-memory segment lent to its request ``req``."""
    return Release(node=node, req=req).encode()


def encode_error(node: str, req: int, code: ErrorCode, detail: str = "", news: MemberNews | None = None) -> bytes:
    """A refusal, e.g. no snapshot published yet or a layout mismatch."""
    return Error(node=node, req=req, code=code.value, detail=detail, news=news).encode()


def encode_join(node: str, req: int, host: str, port: int, bipartite: bool = False) -> bytes:
    """Node ``node``, listening on ``host:port``, asks to join (``bipartite``: its file splits AD-PSGD's nodes
    into roles); the answer is MEMBERS or ERROR join-refused."""
    return Join(node=node, req=req, host=host, port=port, bipartite=bipartite).encode()


def encode_members(
    node: str,
    req: int,
    news: MemberNews,
    permanent: Sequence[str] = (),
    settled: tuple[int, bool | None] | None = None,
    mass: float | None = None,
    bipartite: bool = False,
) -> bytes:
    """``node``'s member table (``news.members`` must be set): a join's answer (with the names of the cluster
    file's nodes, ``permanent``, and ``mass``: the sender's bound on the cluster's push-sum mass), or a leave
    announcement (with ``settled``: the receiver's latest push sequence number at ``node`` and its final verdict,
    so the receiver settles a push that is still open; ``bipartite``: answering a JOIN, the sender's nodes take
    AD-PSGD's roles by ``permanent``'s order)."""
    members = Members(
        node=node, req=req, news=news, permanent=tuple(permanent), settled=settled, mass=mass, bipartite=bipartite
    )
    return members.encode()
