"""bfloat16 without a numpy dtype: raw 16-bit words tagged as bfloat16.

numpy has no bfloat16, so dpwa carries a bfloat16 array as its raw bits in a
``uint16`` array whose dtype is :data:`BFLOAT16` -- ``<u2`` with the metadata
``{"dpwa": "bfloat16"}``.  The tag survives views, slices, reshapes and copies,
so the wire layout and the mixing kernels can tell a bfloat16 array from a real
``uint16`` one (which dpwa refuses).  Note that numpy compares dtypes without
their metadata (``BFLOAT16 == np.uint16``): use :func:`is_bfloat16`.

A bfloat16 is the upper half of a float32 (sign, 8 exponent bits, 7 mantissa
bits), so widening is a 16-bit shift and narrowing is a rounding of the lower
half.  The functions below are pure and write into caller-given arrays; pass
block-sized slices to bound their temporaries.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BFLOAT16", "from_float32", "is_bfloat16", "isfinite", "to_float32"]

BFLOAT16 = np.dtype("<u2", metadata={"dpwa": "bfloat16"})
"""A uint16 dtype tagged as bfloat16: view a torch bf16 tensor as ``t.view(torch.int16).numpy().view(BFLOAT16)``."""

_EXPONENT = np.uint16(0x7F80)
_SIGN = np.uint16(0x8000)
_QUIET_NAN = np.uint16(0x7FC0)


def is_bfloat16(dtype: np.dtype) -> bool:
    """True for a little-endian 16-bit unsigned dtype carrying the :data:`BFLOAT16` tag."""
    dtype = np.dtype(dtype)
    return (
        dtype.kind == "u"
        and dtype.itemsize == 2
        and dtype.byteorder in ("<", "=")
        and (dtype.metadata or {}).get("dpwa") == "bfloat16"
    )


def _check(src: np.ndarray, out: np.ndarray, src_itemsize: int, out_kind: str, out_itemsize: int) -> None:
    if src.shape != out.shape:
        raise ValueError(f"src is {src.shape} but out is {out.shape}")
    if src.dtype.itemsize != src_itemsize or out.dtype.kind != out_kind or out.dtype.itemsize != out_itemsize:
        raise ValueError(f"unexpected dtypes: src {src.dtype}, out {out.dtype}")


def to_float32(src_u16: np.ndarray, out_f32: np.ndarray) -> np.ndarray:
    """``out_f32 <- float(src_u16)``, exactly: the bits are ``src << 16``. Returns ``out_f32``."""
    _check(src_u16, out_f32, 2, "f", 4)
    np.left_shift(src_u16.view(np.uint16), 16, out=out_f32.view(np.uint32), dtype=np.uint32)
    return out_f32


def from_float32(src_f32: np.ndarray, out_u16: np.ndarray, *, scratch: np.ndarray | None = None) -> np.ndarray:
    """``out_u16 <- bfloat16(src_f32)``, rounding to nearest, ties to even. Returns ``out_u16``.

    With ``u`` the float32 bits: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` -- the
    same formula as torch's ``c10::BFloat16``; overflow rounds to +-inf and
    infinities stay infinite.  A NaN becomes the quiet NaN ``0x7FC0`` with the
    input's sign.  ``scratch`` (uint32, at least ``src.size`` elements) avoids
    allocating the one same-sized temporary.
    """
    _check(src_f32, out_u16, 4, "u", 2)
    bits = src_f32.view(np.uint32)
    n = src_f32.size
    if scratch is None:
        tmp = np.empty(src_f32.shape, dtype=np.uint32)
    else:
        if scratch.dtype != np.uint32 or scratch.size < n:
            raise ValueError(f"scratch must be uint32 with at least {n} elements")
        tmp = scratch.reshape(-1)[:n].reshape(src_f32.shape)
    out = out_u16.view(np.uint16)
    np.right_shift(bits, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, bits, out=tmp)  # wraps only for negative NaNs, fixed below
    np.right_shift(tmp, 16, out=out, casting="same_kind")
    nan = np.isnan(src_f32)
    if nan.any():
        out[nan] = ((bits[nan] >> 16).astype(np.uint16) & _SIGN) | _QUIET_NAN
    return out_u16


def isfinite(src_u16: np.ndarray, out_bool: np.ndarray, *, scratch: np.ndarray | None = None) -> np.ndarray:
    """``out_bool <- True`` where the exponent bits of ``src_u16`` are not all ones (not inf, not NaN).

    ``scratch`` (uint16, at least ``src.size`` elements) avoids allocating the one
    same-sized temporary.  Returns ``out_bool``.
    """
    if src_u16.shape != out_bool.shape or src_u16.dtype.itemsize != 2 or out_bool.dtype != np.bool_:
        raise ValueError(f"src is {src_u16.dtype}{src_u16.shape} but out is {out_bool.dtype}{out_bool.shape}")
    n = src_u16.size
    if scratch is None:
        tmp = np.empty(src_u16.shape, dtype=np.uint16)
    else:
        if scratch.dtype.itemsize != 2 or scratch.dtype.kind != "u" or scratch.size < n:
            raise ValueError(f"scratch must be uint16 with at least {n} elements")
        tmp = scratch.reshape(-1)[:n].reshape(src_u16.shape)
    np.bitwise_and(src_u16.view(np.uint16), _EXPONENT, out=tmp.view(np.uint16))
    np.not_equal(tmp, _EXPONENT, out=out_bool)
    return out_bool
