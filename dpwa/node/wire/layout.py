"""Array layouts: how a parameter list is packed into one flat, aligned byte buffer.

A :class:`Layout` names each array's dtype (by a *layout code*, see :func:`dtype_code`) and
shape; from those alone it derives every array's offset (each a multiple of
:data:`~dpwa.node.wire.constants.ALIGN`), the buffer's size, the chunk bounds a payload is cut
at, and a fingerprint two nodes compare before they exchange. The *wire layout* is the same
arrays in their ``wire_dtype`` (:meth:`Layout.on_wire`): only ever narrower than their own.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dpwa.node.wire.constants import ALIGN, CHUNK_BYTES
from dpwa.utils.bfloat16 import BFLOAT16, is_bfloat16
from dpwa.utils.dtypes import WIRE_DTYPES

__all__ = ["SUPPORTED_DTYPES", "WIRE_CODES", "Layout", "code_dtype", "dtype_code", "wire_code"]

SUPPORTED_DTYPES = ("<f2", "<f4", "<f8", "bf16")
"""Layout dtype codes: numpy's little-endian float codes; ``bf16`` for :data:`~dpwa.utils.bfloat16.BFLOAT16` arrays."""
WIRE_CODES: dict[str, str] = dict(zip(WIRE_DTYPES, ("<f2", "bf16", "<f4"), strict=True))
"""The layout code each ``wire_dtype`` name (:data:`~dpwa.utils.dtypes.WIRE_DTYPES`) travels as."""


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
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
    if wire_dtype not in WIRE_CODES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; allowed: auto, {', '.join(WIRE_CODES)}")
    code = WIRE_CODES[wire_dtype]
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
        """Derive the offsets, total size and fingerprint; ValueError when dtypes and shapes differ in length."""
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
