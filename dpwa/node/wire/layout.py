"""Array layouts: how a parameter list is packed into one flat, aligned byte buffer.

A :class:`Layout` names each array's dtype (by a *layout code*, see :func:`dtype_code`) and
shape, and the exclusive upper bound of each *index array* (``bounds``); from those alone it
derives every array's offset (each a multiple of :data:`~dpwa.node.wire.constants.ARRAY_ALIGN`), the
buffer's size, the chunk bounds a payload is cut at, and a fingerprint two nodes compare before
they exchange. The *wire layout* is the same arrays in their ``wire_dtype``
(:meth:`Layout.on_wire`): only ever narrower than their own. Under ``int8`` a float array travels
as two wire arrays, its float32 scales (:func:`~dpwa.utils.int8.int8_scales` of them) and then
its int8 values (code ``q8``); :meth:`Layout.sources` says which local array each wire array
carries. Integer arrays (``<u2``/``<u4`` indices, ``|i1`` values) always travel as themselves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpwa.node.wire.constants import ALIGN, ARRAY_ALIGN, CHUNK_BYTES
from dpwa.utils.bfloat16 import BFLOAT16, is_bfloat16
from dpwa.utils.dtypes import WIRE_DTYPES
from dpwa.utils.int8 import int8_scales

__all__ = [
    "FLOAT_CODES",
    "INDEX_CODE",
    "INDEX_CODES",
    "INT8_CODE",
    "MAX_BOUND",
    "QUANTIZED_CODE",
    "ROLE_PLAIN",
    "ROLE_SCALES",
    "ROLE_VALUES",
    "SUPPORTED_DTYPES",
    "WIRE_CODES",
    "Layout",
    "code_dtype",
    "dtype_code",
    "wire_code",
]

FLOAT_CODES = ("<f2", "<f4", "<f8", "bf16")
"""The float layout codes: numpy's little-endian codes; ``bf16`` for :data:`~dpwa.utils.bfloat16.BFLOAT16` arrays.
Only these are checked finite, and only these travel narrower under a ``wire_dtype``."""
INDEX_CODE = "<u4"
"""uint32: an index array when its layout gives it a bound (every element checked below it on receipt)."""
INDEX_CODES = ("<u2", INDEX_CODE)
"""The codes an index array may have: uint16 (bounds up to 2^16) and uint32 (up to 2^32)."""
INT8_CODE = "|i1"
"""int8 values a rule publishes itself (e.g. CHOCO's quantized difference): taken as they come."""
QUANTIZED_CODE = "q8"
"""Wire only: the int8 values of a float array under ``wire_dtype: int8``, right after its float32 scales."""
SUPPORTED_DTYPES = (*FLOAT_CODES, *INDEX_CODES, INT8_CODE)
"""The layout codes of the arrays a node may exchange."""
WIRE_CODES: dict[str, str] = dict(zip(WIRE_DTYPES, ("<f2", "bf16", "<f4", QUANTIZED_CODE), strict=True))
"""The layout code each ``wire_dtype`` name (:data:`~dpwa.utils.dtypes.WIRE_DTYPES`) travels as."""
MAX_BOUND = 1 << 32
"""The largest bound of an index array: every uint32 is below it (so it checks nothing)."""
ROLE_PLAIN = "plain"
"""A wire array that carries a local array element for element (copied, or rounded to a narrower float)."""
ROLE_SCALES = "scales"
"""A wire array holding the float32 block scales of a quantized local array."""
ROLE_VALUES = "values"
"""A wire array holding the int8 values of a quantized local array (its scales are the wire array before it)."""


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ARRAY_ALIGN."""
    return (n + ARRAY_ALIGN - 1) // ARRAY_ALIGN * ARRAY_ALIGN


def _bound_limit(code: str) -> int:
    """The largest bound an index array of ``code`` may have: one past its largest value."""
    return 1 << (8 * code_dtype(code).itemsize)


def _check_bounds(dtypes: tuple[str, ...], bounds: tuple[int, ...]) -> None:
    """ValueError unless ``bounds`` is empty or one integer in [0, MAX_BOUND] per array, nonzero only on index
    arrays (uint16 or uint32) and never beyond what their dtype holds."""
    if not bounds:
        return
    if len(bounds) != len(dtypes):
        raise ValueError(f"{len(bounds)} bounds for {len(dtypes)} arrays")
    for i, (code, bound) in enumerate(zip(dtypes, bounds)):
        if isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= MAX_BOUND:
            raise ValueError(f"bound {bound!r} of array {i} is not an integer in [0, 2^32]")
        if bound and code not in INDEX_CODES:
            raise ValueError(f"array {i} has a bound but dtype code {code}: only uint16/uint32 arrays are index arrays")
        if bound and bound > _bound_limit(code):
            raise ValueError(f"bound {bound} of array {i} exceeds what its dtype code {code} holds")


def _check_pairs(dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
    """ValueError unless every ``q8`` array comes right after the float32 scales of its elements."""
    for j, code in enumerate(dtypes):
        if code != QUANTIZED_CODE:
            continue
        scales = (int8_scales(math.prod(shapes[j])),)
        if j == 0 or dtypes[j - 1] != "<f4" or shapes[j - 1] != scales:
            raise ValueError(f"array {j} (int8 values) must follow its float32 scales of shape {scales}")


def dtype_code(dtype: np.dtype) -> str:
    """The layout code of ``dtype``: ``"bf16"`` for BFLOAT16, else numpy's little-endian code (e.g. ``"<f4"``)."""
    if is_bfloat16(dtype):
        return "bf16"
    return (dtype.newbyteorder("<") if dtype.byteorder == "=" else dtype).str


def code_dtype(code: str) -> np.dtype:
    """The numpy dtype of a layout code (inverse of :func:`dtype_code`; ``q8`` is int8)."""
    if code == "bf16":
        return BFLOAT16
    return np.dtype(np.int8) if code == QUANTIZED_CODE else np.dtype(code)


def wire_code(own: str, wire_dtype: str | None) -> str:
    """The layout code an array of code ``own`` travels as under ``wire_dtype`` (None or ``auto``: ``own``).

    Only ever narrower: an array whose own dtype is no wider than the wire dtype
    travels as itself (float16 stays float16 under ``bfloat16`` and vice versa);
    integer arrays always travel as themselves. ``int8`` gives ``q8`` for every float
    (its wire layout adds the scales, :meth:`Layout.on_wire`).
    Raises ValueError for an unknown ``wire_dtype``.
    """
    if wire_dtype is None or wire_dtype == "auto":
        return own
    if wire_dtype not in WIRE_CODES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; allowed: auto, {', '.join(WIRE_CODES)}")
    if own not in FLOAT_CODES:
        return own
    code = WIRE_CODES[wire_dtype]
    return code if code_dtype(code).itemsize < code_dtype(own).itemsize else own


@dataclass(frozen=True)
class Layout:
    """The dtypes, shapes and index bounds of a list of arrays, packed into one flat buffer (each array at a
    multiple of ARRAY_ALIGN bytes).

    ``bounds``: per array, the exclusive upper bound of every element of an index array
    (:data:`INDEX_CODES`), 0 for any other array (or an unchecked uint32 one); ``()`` when no array
    has one (stored so: all zeros become ``()``). The fingerprint covers the bounds only when one is
    set, so a layout without index arrays has the fingerprint it always had.
    """

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    bounds: tuple[int, ...] = ()
    offsets: tuple[int, ...] = field(init=False)
    total_bytes: int = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        """Check the arrays, derive the offsets, total size and fingerprint; ValueError for an impossible layout
        (dtypes, shapes and bounds of different lengths, a bound on an array that is no index array or beyond
        :data:`MAX_BOUND`, int8 wire values not right after their scales)."""
        if len(self.dtypes) != len(self.shapes):
            raise ValueError("dtypes and shapes differ in length")
        bounds = tuple(self.bounds)
        _check_bounds(self.dtypes, bounds)
        _check_pairs(self.dtypes, self.shapes)
        object.__setattr__(self, "bounds", bounds if any(bounds) else ())
        offsets, pos = [], 0
        for dt, shape in zip(self.dtypes, self.shapes):
            offsets.append(pos)
            pos = _aligned(pos + code_dtype(dt).itemsize * math.prod(shape))
        described: list[list[Any]] = [list(self.dtypes), [list(s) for s in self.shapes]]
        if self.bounds:
            described.append(list(self.bounds))
        canonical = json.dumps(described, separators=(",", ":"))
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "total_bytes", pos)
        object.__setattr__(self, "fingerprint", hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest())

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray], bounds: Sequence[int] | None = None) -> Layout:
        """The layout of ``arrays`` (``bounds``: of their index arrays, see the class); raises ValueError for
        anything dpwa cannot exchange."""
        if len(arrays) == 0:
            raise ValueError("params must be a non-empty list of numpy arrays")
        dtypes, shapes = [], []
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise ValueError(f"params[{i}] is {type(a).__name__}, expected a numpy array")
            code = dtype_code(a.dtype)
            if code not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"params[{i}] has dtype {a.dtype}; supported: float16, float32, float64, BFLOAT16, "
                    "uint16 or uint32 (indices), int8"
                )
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"params[{i}] must be C-contiguous and writeable")
            dtypes.append(code)
            shapes.append(tuple(int(s) for s in a.shape))
        if bounds is not None and len(bounds) != len(arrays):
            raise ValueError(f"{len(bounds)} bounds for {len(arrays)} arrays")
        return cls(tuple(dtypes), tuple(shapes), tuple(int(b) for b in bounds or ()))

    def on_wire(self, wire_dtype: str | None) -> Layout:
        """The layout of these arrays on the wire under ``wire_dtype`` (:func:`wire_code` per array).

        ``self`` when nothing changes, so the fingerprint is the wire layout's: two
        nodes exchange exactly when their wire layouts agree. Under ``int8`` each float
        array becomes two: its float32 scales, then its ``q8`` values (same shape).
        """
        codes = tuple(wire_code(d, wire_dtype) for d in self.dtypes)
        if codes == self.dtypes:
            return self
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        bounds: list[int] = []
        for code, shape, bound in zip(codes, self.shapes, self.bounds or (0,) * len(codes)):
            if code == QUANTIZED_CODE:
                dtypes.append("<f4")
                shapes.append((int8_scales(math.prod(shape)),))
                bounds.append(0)
            dtypes.append(code)
            shapes.append(shape)
            bounds.append(bound if code in INDEX_CODES else 0)
        return Layout(tuple(dtypes), tuple(shapes), tuple(bounds))

    def sources(self, local: Layout) -> tuple[tuple[int, str], ...]:
        """For each array of this (wire) layout: the index of the ``local`` array it carries and its role
        (:data:`ROLE_PLAIN`, :data:`ROLE_SCALES`, :data:`ROLE_VALUES`). ValueError when this is not a wire
        layout of ``local`` (:meth:`on_wire`): another count, shape or bound."""
        out: list[tuple[int, str]] = []
        j, n = 0, len(self.dtypes)
        for i, (code, shape) in enumerate(zip(local.dtypes, local.shapes)):
            if code in FLOAT_CODES and j + 1 < n and self.dtypes[j + 1] == QUANTIZED_CODE:
                out += [(i, ROLE_SCALES), (i, ROLE_VALUES)]  # the scales' shape is checked by the layout itself
                j += 1
            elif j >= n or self.bound(j) != local.bound(i) or (self.dtypes[j] in FLOAT_CODES) != (code in FLOAT_CODES):
                raise ValueError("wire and local layouts differ in shapes or bounds")
            elif code not in FLOAT_CODES and self.dtypes[j] != code:
                raise ValueError("wire and local layouts differ in shapes or bounds")
            else:
                out.append((i, ROLE_PLAIN))
            if self.shapes[j] != shape:
                raise ValueError("wire and local layouts differ in shapes or bounds")
            j += 1
        if j != n:
            raise ValueError("wire and local layouts differ in shapes or bounds")
        return tuple(out)

    def bound(self, index: int) -> int:
        """The bound of array ``index``: > 0 for an index array, 0 for any other."""
        return self.bounds[index] if self.bounds else 0

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
