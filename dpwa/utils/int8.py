"""Blockwise symmetric int8 quantization (absmax per block), deterministic to the bit.

An array of ``n`` floats is cut into blocks of :data:`INT8_BLOCK` consecutive elements (the last one
shorter); each block ``b`` gets one float32 *scale* and each element one int8 *value*::

    scale_b = max |x_k|                        over the elements k of block b (float32)
    q_k     = clip(rint(x_k / scale_b * 127), -127, 127)      (0 in a block whose scale is 0)
    x_k    ~= q_k * (scale_b / 127)                            (dequantized; (q_k * scale_b) / 127
                                                               when scale_b / 127 is subnormal)

the linear absmax code of bitsandbytes' blockwise 8-bit quantization (``quantize_blockwise`` without its
dynamic map), as hivemind's 8-bit compression uses it. ``rint`` rounds half to even, so the error of a
finite element is at most half a step: ``|x - dequantize(quantize(x))| <= scale_b / 254``, plus the
float rounding of the formulas (a few ulps of ``scale_b``, or half the output's smallest subnormal for
a result that small; for a float16 or bfloat16 output, also that format's rounding of the result).

Computation: in float32 for float16, bfloat16 and float32 inputs and outputs, in float64 for float64
ones; every step is an IEEE operation with one correctly rounded result (abs, max, divide, multiply,
rint, a cast), so the same input bytes give the same output bytes on every machine, whatever the SIMD
width or the block size of the scratch. A float64 input rounds its scale to float32 (values beyond
float32's range give an infinite scale; magnitudes below its smallest subnormal a zero scale, and
values 0).

Non-finite input: a block holding a NaN gets the scale NaN (always the quiet NaN ``0x7FC00000``), one
holding an infinity (and no NaN) the scale +inf; the values of such a block are all 0. A receiver must
reject a non-finite scale (dequantizing it gives NaN). Values are in [-127, 127]; -128 never comes out
of :func:`quantize_int8_` (dequantized, it is just ``-128 * scale / 127``).

Every function writes into arrays the caller gives (``*_out``, ``out``) and works through them in
pieces of :data:`INT8_PIECE` elements with fixed-size scratch (an :class:`Int8Scratch`, kept by callers
that quantize often); nothing proportional to the input is allocated. Inputs and outputs must be
C-contiguous (any shape: they are taken flat).
"""

from __future__ import annotations

import numpy as np

from dpwa.utils.bfloat16 import from_float32, is_bfloat16, to_float32

__all__ = [
    "INT8_BLOCK",
    "INT8_MAX",
    "INT8_PIECE",
    "Int8Scratch",
    "absmax_scales_",
    "dequantize_int8_",
    "int8_scales",
    "quantize_int8_",
]

INT8_BLOCK = 1024
"""Elements per block (one float32 scale each). 1024 keeps the scales at 0.4 % of the int8 bytes (a float32
model travels in 25.1 % of its size), while one outlier coarsens at most 1024 values: bitsandbytes uses
blocks of 64 to 4096, hivemind 4096 for gradients; 1024 float32 inputs are 4 KiB, a few cache lines."""
INT8_MAX = 127
"""The largest magnitude of a value: the code is symmetric, [-127, 127]."""
INT8_PIECE = 64 * INT8_BLOCK
"""Elements per piece: how far one pass of numpy goes before the next (the scratch is this size)."""

_NAN = np.float32(np.nan)  # the canonical quiet NaN, 0x7FC00000


def int8_scales(n: int) -> int:
    """How many scales an array of ``n`` elements has: ``ceil(n / INT8_BLOCK)``."""
    if n < 0:
        raise ValueError(f"negative element count {n}")
    return -(-n // INT8_BLOCK)


def _code(dtype: np.dtype) -> str:
    """``"bf16"``, ``"f2"``, ``"f4"`` or ``"f8"``; ValueError for any other dtype."""
    if is_bfloat16(dtype):
        return "bf16"
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return f"f{dtype.itemsize}"
    raise ValueError(f"dtype {dtype} is not float16, bfloat16, float32 or float64")


def _flat(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` as a flat view (never a copy)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a.reshape(-1)


class Int8Scratch:
    """Fixed-size scratch for the functions of this module: :data:`INT8_PIECE` elements per buffer, made on
    first use. Keep one per thread (it is not shared safely)."""

    def __init__(self, piece: int = INT8_PIECE) -> None:
        if piece <= 0 or piece % INT8_BLOCK:
            raise ValueError(f"piece must be a positive multiple of {INT8_BLOCK}, got {piece}")
        self.piece = piece
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, dtype: type, size: int) -> np.ndarray:
        """The first ``size`` elements of buffer ``name`` (``dtype``; ``size`` at most :attr:`piece`)."""
        key = f"{name}:{np.dtype(dtype).str}"
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = np.empty(self.piece, dtype)
        return buffer[:size]


def _wide(code: str) -> type:
    """The dtype the arithmetic runs in for a float of ``code``: float64 for float64, else float32."""
    return np.float64 if code == "f8" else np.float32


def _widen(src: np.ndarray, code: str, out: np.ndarray) -> np.ndarray:
    """``src`` exactly as ``out``'s dtype (float32 or float64); ``src`` itself when it already is."""
    if code in ("f4", "f8"):
        return src
    if code == "bf16":
        return to_float32(src, out)
    np.copyto(out, src)
    return out


def _piece_scales(x: np.ndarray, code: str, out: np.ndarray, scratch: Int8Scratch) -> None:
    """``out[b] <- max |x|`` over each block b of piece ``x`` (block-aligned), NaN made canonical."""
    work = scratch.get("work", _wide(code), x.size)
    np.abs(_widen(x, code, work), out=work)
    full = x.size // INT8_BLOCK
    if code == "f8":
        wide = scratch.get("max64", np.float64, -(-x.size // INT8_BLOCK))
        _block_max(work, full, wide)
        with np.errstate(over="ignore"):
            np.copyto(out, wide, casting="same_kind")
    else:
        _block_max(work, full, out)
    bad = np.isnan(out)
    if bad.any():
        out[bad] = _NAN


def _block_max(work: np.ndarray, full: int, out: np.ndarray) -> None:
    """``out[b] <- max(work[block b])`` for the ``full`` whole blocks and a partial last one."""
    if full:
        np.max(work[: full * INT8_BLOCK].reshape(full, INT8_BLOCK), axis=1, out=out[:full])
    if full * INT8_BLOCK < work.size:
        out[full] = work[full * INT8_BLOCK :].max()


def _scratch_for(n: int) -> Int8Scratch:
    """A scratch just large enough for ``n`` elements (at most one piece), for a caller that gave none."""
    return Int8Scratch(min(INT8_PIECE, max(INT8_BLOCK, int8_scales(n) * INT8_BLOCK)))


def absmax_scales_(src: np.ndarray, scales_out: np.ndarray, *, scratch: Int8Scratch | None = None) -> np.ndarray:
    """``scales_out[b] <- max |src|`` over each block b (float32; NaN for a block holding one). Returns it.

    ``src``: float16, bfloat16, float32 or float64; ``scales_out``: float32 of :func:`int8_scales` elements.
    """
    code = _code(src.dtype)
    flat, scales = _flat(src, "src"), _flat(scales_out, "scales_out")
    if scales.dtype != np.float32 or scales.size != int8_scales(flat.size):
        raise ValueError(f"scales_out must be float32 of {int8_scales(flat.size)} elements")
    scratch = scratch or _scratch_for(flat.size)
    step = scratch.piece
    for a in range(0, flat.size, step):
        b = min(a + step, flat.size)
        _piece_scales(flat[a:b], code, scales[a // INT8_BLOCK : -(-b // INT8_BLOCK)], scratch)
    return scales_out


def quantize_int8_(
    src: np.ndarray, values_out: np.ndarray, scales_out: np.ndarray, *, scratch: Int8Scratch | None = None
) -> None:
    """``scales_out`` <- each block's ``max |src|``; ``values_out`` <- ``clip(rint(src / scale * 127), -127, 127)``.

    ``src``: float16, bfloat16, float32 or float64, any shape; ``values_out``: int8 of ``src.size`` elements;
    ``scales_out``: float32 of ``int8_scales(src.size)`` elements. A block whose scale is 0 gets values 0, one
    whose scale is not finite (a NaN or an infinity in it) values 0 and that scale (see the module doc).
    """
    code = _code(src.dtype)
    flat, values, scales = _flat(src, "src"), _flat(values_out, "values_out"), _flat(scales_out, "scales_out")
    if values.dtype != np.int8 or values.size != flat.size:
        raise ValueError(f"values_out must be int8 of {flat.size} elements")
    if scales.dtype != np.float32 or scales.size != int8_scales(flat.size):
        raise ValueError(f"scales_out must be float32 of {int8_scales(flat.size)} elements")
    scratch = scratch or _scratch_for(flat.size)
    step = scratch.piece
    for a in range(0, flat.size, step):
        b = min(a + step, flat.size)
        piece_scales = scales[a // INT8_BLOCK : -(-b // INT8_BLOCK)]
        _piece_scales(flat[a:b], code, piece_scales, scratch)
        _piece_values(flat[a:b], code, piece_scales, values[a:b], scratch)


def _piece_values(x: np.ndarray, code: str, scales: np.ndarray, out: np.ndarray, scratch: Int8Scratch) -> None:
    """``out <- clip(rint(x / scale * 127))`` for piece ``x`` (block-aligned) and its ``scales``."""
    wide = _wide(code)
    nb = scales.size
    divisor = scratch.get("div", wide, nb)
    np.copyto(divisor, scales)
    good = np.isfinite(divisor) & (divisor != 0)  # nb booleans: a small fixed size
    divisor[~good] = 1  # zero blocks hold zeros (0 / 1 = 0); non-finite ones are set to 0 below
    work = scratch.get("work", wide, x.size)
    xs = _widen(x, code, work)
    full = x.size // INT8_BLOCK
    with np.errstate(invalid="ignore", over="ignore"):
        if full:
            body, shape = slice(0, full * INT8_BLOCK), (full, INT8_BLOCK)
            np.divide(xs[body].reshape(shape), divisor[:full, None], out=work[body].reshape(shape))
        if full * INT8_BLOCK < x.size:
            np.divide(xs[full * INT8_BLOCK :], divisor[full : full + 1], out=work[full * INT8_BLOCK :])
        np.multiply(work, INT8_MAX, out=work)
        np.rint(work, out=work)
        np.clip(work, -INT8_MAX, INT8_MAX, out=work)
    if not good.all():
        for block in np.flatnonzero(~np.isfinite(scales)):
            work[block * INT8_BLOCK : (block + 1) * INT8_BLOCK] = 0
    np.copyto(out, work, casting="unsafe")  # whole numbers in [-127, 127]: exact


def dequantize_int8_(
    values: np.ndarray,
    scales: np.ndarray,
    out: np.ndarray,
    *,
    first: int = 0,
    scratch: Int8Scratch | None = None,
) -> None:
    """``out[k] <- values[k] * (scale / 127)``, ``scale`` that of the block element ``first + k`` lies in.

    ``values``: int8; ``out``: float16, bfloat16, float32 or float64 of the same size; ``scales``: float32, the
    scales of the whole array (``values`` may be a part of it starting at element ``first``: a received
    chunk). Computed in float32 (float64 for a float64 ``out``; ``(q * scale) / 127`` in a block whose
    ``scale / 127`` is subnormal), then rounded to nearest even into a 16-bit ``out``. A non-finite scale
    gives NaN (a receiver rejects it first).
    """
    code = _code(out.dtype)
    q, s, dst = _flat(values, "values"), _flat(scales, "scales"), _flat(out, "out")
    if q.dtype != np.int8 or q.size != dst.size:
        raise ValueError(f"values must be int8 of {dst.size} elements")
    if s.dtype != np.float32 or first < 0 or s.size < int8_scales(first + q.size):
        raise ValueError(f"scales must be float32 with at least {int8_scales(first + q.size)} elements")
    scratch = scratch or _scratch_for(dst.size)
    k = 0
    while k < dst.size:  # pieces [k, e) whose later end sits on a block boundary of the whole array
        e = min(dst.size, (first + k) // INT8_BLOCK * INT8_BLOCK + scratch.piece - first)
        _piece_dequantize(q[k:e], s, first + k, dst[k:e], code, scratch)
        k = e


def _piece_dequantize(
    q: np.ndarray, scales: np.ndarray, first: int, out: np.ndarray, code: str, scratch: Int8Scratch
) -> None:
    """Dequantize piece ``q`` (elements ``first`` on, at most one piece of blocks) into ``out``."""
    wide = _wide(code)
    b0, b1 = first // INT8_BLOCK, -(-(first + q.size) // INT8_BLOCK)
    factor = scratch.get("factor", wide, b1 - b0)
    np.copyto(factor, scales[b0:b1])
    target = out if code in ("f4", "f8") else scratch.get("deq", np.float32, q.size)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        np.divide(factor, INT8_MAX, out=factor)
        head = min(q.size, (b0 + 1) * INT8_BLOCK - first)  # up to the first block boundary
        # 1-element arrays, never scalars: numpy 1.x would pick a float16 loop for int8 times a float scalar
        np.multiply(q[:head], factor[:1], out=target[:head])
        full = (q.size - head) // INT8_BLOCK
        if full:
            shape = (full, INT8_BLOCK)
            body = slice(head, head + full * INT8_BLOCK)
            np.multiply(q[body].reshape(shape), factor[1 : 1 + full, None], out=target[body].reshape(shape))
        if head + full * INT8_BLOCK < q.size:
            np.multiply(
                q[head + full * INT8_BLOCK :], factor[1 + full : 2 + full], out=target[head + full * INT8_BLOCK :]
            )
        _tiny_blocks(q, scales, first, target, factor)
    if code == "f2":
        with np.errstate(over="ignore"):
            np.copyto(out, target, casting="same_kind")
    elif code == "bf16":
        from_float32(target, out, scratch=scratch.get("bits", np.uint32, q.size))


def _tiny_blocks(q: np.ndarray, scales: np.ndarray, first: int, target: np.ndarray, factor: np.ndarray) -> None:
    """Blocks whose ``scale / 127`` is subnormal (scale below 127 x the smallest normal float): ``q * scale / 127``
    instead, which keeps their precision (rare: only such tiny blocks are looked at again)."""
    tiny = (factor != 0) & (np.abs(factor) < np.finfo(factor.dtype).tiny)
    if not tiny.any():
        return
    b0 = first // INT8_BLOCK
    for b in np.flatnonzero(tiny):
        lo = max(0, (b0 + int(b)) * INT8_BLOCK - first)
        hi = min(q.size, (b0 + int(b) + 1) * INT8_BLOCK - first)
        np.multiply(q[lo:hi], scales[b0 + int(b) : b0 + int(b) + 1].astype(factor.dtype), out=target[lo:hi])
        np.divide(target[lo:hi], INT8_MAX, out=target[lo:hi])
