"""The dpwa wire format: versioned headers, array layouts and payload validation.

A message is a ZeroMQ multipart message. Frame 0 is a header::

    b"DPWA" | version: u16 little-endian | kind: u8 | JSON object (UTF-8)

A STATE reply is followed by the flat parameter buffer split into frames of
``chunk`` bytes (the last one shorter). Nothing here touches a socket and
nothing is ever unpickled: JSON for a few scalars, raw bytes for the arrays.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bfloat16 import BFLOAT16, is_bfloat16
from .bfloat16 import isfinite as bf16_isfinite

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
"""Layout dtype codes: numpy's little-endian float codes, and ``bf16`` for :data:`~dpwa.bfloat16.BFLOAT16` arrays."""


class Kind(enum.IntEnum):
    """What a message is: a fetch request, a state reply or an error reply."""

    FETCH = 1
    STATE = 2
    ERROR = 3


class ErrorCode(str, enum.Enum):
    """Why a node refused a fetch."""

    NOT_READY = "not-ready"
    LAYOUT = "layout-mismatch"
    BAD_REQUEST = "bad-request"


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


def _encode(kind: Kind, body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) + _PREFIX.size > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return _PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind)) + data


def encode_fetch(node: str, req: int, fingerprint: str, extras: dict[str, Any] | None = None) -> bytes:
    """A request for the peer's latest snapshot, optionally carrying the requester's rule extras."""
    body: dict[str, Any] = {"node": node, "req": req, "fp": fingerprint}
    if extras:
        body["extras"] = extras
    return _encode(Kind.FETCH, body)


def encode_state(
    node: str, req: int, *, clock: float, loss: float, extras: dict[str, Any], layout: Layout, chunk: int = CHUNK_BYTES
) -> bytes:
    """The header of a reply carrying a snapshot of ``layout``."""
    return _encode(
        Kind.STATE,
        {
            "node": node,
            "req": req,
            "fp": layout.fingerprint,
            "clock": clock,
            "loss": loss,
            "extras": extras,
            "total": layout.total_bytes,
            "chunk": chunk,
            "nframes": len(layout.frame_bounds(chunk)),
        },
    )


def encode_error(node: str, req: int, code: ErrorCode, detail: str = "") -> bytes:
    """A refusal, e.g. no snapshot published yet or a layout mismatch."""
    return _encode(Kind.ERROR, {"node": node, "req": req, "code": code.value, "detail": detail[:1000]})


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _field(body: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        raise WireError("header", f"field {key!r} missing or of the wrong type")
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
    if kind is Kind.FETCH:
        extras = body.get("extras", {})
        if not isinstance(extras, dict):
            raise WireError("header", "field 'extras' of the wrong type")
        return Header(kind, node, req, fingerprint=_field(body, "fp", str), extras=extras)
    if kind is Kind.ERROR:
        return Header(kind, node, req, code=_field(body, "code", str), detail=str(body.get("detail", ""))[:1000])
    clock = float(_field(body, "clock", (int, float)))
    loss = float(_field(body, "loss", (int, float)))
    if not (math.isfinite(clock) and math.isfinite(loss)):
        raise WireError("non-finite", "clock or loss is not finite")
    extras = _field(body, "extras", dict)
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
    )


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
