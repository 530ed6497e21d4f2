"""Chunk tags: frame 0 of each message of a streamed payload.

A streamed STATE or PUSH sends its header alone, then one ``[tag, chunk bytes]`` message per
chunk. The tag is 16 bytes::

    b"DPWC" | req: u64 little-endian | index: u32 little-endian

``req`` is the FETCH's request id (or the push's sequence number), ``index`` the chunk's
position from 0. Only a request id in [0, MAX_REQ] fits (:func:`can_stream`).
"""

from __future__ import annotations

import struct

from dpwa.node.wire.constants import CHUNK_MAGIC, MAX_REQ

__all__ = ["can_stream", "decode_chunk_tag", "encode_chunk_tag"]

_CHUNK_TAG = struct.Struct("<4sQI")


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
