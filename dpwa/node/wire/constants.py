"""The wire protocol's fixed vocabulary: its numbers, its message kinds and its error codes.

Every other module of :mod:`dpwa.node.wire` takes these from here; nothing else defines a
protocol constant. Changing any value here changes the protocol that deployed nodes speak
(tests/test_wire_golden.py records the bytes), so it must come with a new PROTOCOL_VERSION.
"""

from __future__ import annotations

import enum

__all__ = [
    "ALIGN",
    "ARRAY_ALIGN",
    "CHUNK_BYTES",
    "CHUNK_MAGIC",
    "FINITE_CHECK_BLOCK",
    "MAGIC",
    "MAX_DETAIL_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_HOST_ID_CHARS",
    "MAX_NAME_CHARS",
    "MAX_REQ",
    "PAYLOAD_BLOCK",
    "PROTOCOL_VERSION",
    "SETTLE_OPS",
    "ErrorCode",
    "Kind",
]

MAGIC = b"DPWA"
"""The first four bytes of every header frame."""
PROTOCOL_VERSION = 2
"""The version a header frame carries after the magic; a node drops a message of any other version."""
CHUNK_BYTES = 1 << 22
"""Payload frame size: a reply is validated chunk by chunk as it is received."""
MAX_HEADER_BYTES = 1 << 16
"""The largest header frame (prefix and JSON body) a node sends or accepts."""
ALIGN = 64
"""Every flat buffer starts at an address that is a multiple of this (a cache line)."""
ARRAY_ALIGN = 8
"""Every array starts at a multiple of this many bytes in the flat buffer: the widest element (float64), so
every view is aligned for its dtype and no element straddles a chunk (CHUNK_BYTES is a multiple of it). A
message of many small arrays (a sparse or quantized one) pays at most 7 bytes of padding per array."""
MAX_HOST_ID_CHARS = 64
"""The longest co-location identity a FETCH may carry (``host``; dpwa/node/sharedmem.py uses 32)."""
MAX_NAME_CHARS = 256
"""The longest node name (and JOIN host) a header may carry."""
MAX_DETAIL_CHARS = 1000
"""The most characters of an ERROR's ``detail`` that travel (and that a receiver keeps)."""
CHUNK_MAGIC = b"DPWC"
"""The first four bytes of a streamed chunk's tag frame."""
MAX_REQ = (1 << 64) - 1
"""Largest request id a chunk tag can carry; a FETCH with a request id outside [0, MAX_REQ] is never streamed."""
PAYLOAD_BLOCK = 1 << 17
"""Elements per block when copying, converting and validating payloads: a few hundred KiB, in cache."""
FINITE_CHECK_BLOCK = 1 << 16
"""Elements per block of a :class:`~dpwa.node.wire.payload.FiniteChecker` built without an explicit block."""
SETTLE_OPS = ("query", "commit", "abort")
"""What a SETTLE asks of push ``req``: its verdict, to keep it (an exchange), or to drop it."""


class Kind(enum.IntEnum):
    """What a message is: a fetch request, a state reply, an error reply, a push, its ack, a settle, a join
    request, a member table (the answer to a join, or a leave announcement), or the end of a shared-memory loan."""

    FETCH = 1
    STATE = 2
    ERROR = 3
    PUSH = 4
    ACK = 5
    SETTLE = 6
    JOIN = 7
    MEMBERS = 8
    RELEASE = 9


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
    SHARED_MEMORY = "shared-memory"
    """A push through shared memory this node would not or could not read (not co-located, a segment it cannot
    open, of another size or token): push over the socket instead. (A segment that no longer holds the generation
    the push names is refused ``busy``: a passing race.)"""
    JOIN_REFUSED = "join-refused"
    """A JOIN this node does not admit (a name clash, a file node's name, a full table); the detail says which."""
    LEFT = "left"
    """The node has left the cluster (a clean close); the error carries its member table saying so."""
    UNKNOWN = "unknown"
    """Never sent: what a receiver makes of a code it does not know (the code goes into the detail), so that the
    counters keyed by code stay bounded whatever a peer sends."""
