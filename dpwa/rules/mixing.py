"""In-place interpolation kernels and the scalar helpers every rule shares (docs/rules.md).

The kernels compute ``x <- (1-f)*x + f*peer`` (== ``x + f*(peer - x)``) array
by array, in blocks of :data:`BLOCK` elements, so that each block is read and
written while it sits in cache (about one pass of memory traffic) and no
temporary larger than a block is ever allocated.

Numerics: the form ``(1-f)*x + f*peer`` is used because at ``f = 0.5`` it gives
the correctly rounded mean (both products are exact, one rounding in the sum);
``f = 0.5`` itself, the common case, is computed as ``(x + peer) * 0.5`` -- the
same correctly rounded mean in two operations per block instead of three, with
the three-operation form for a block whose sum would overflow;
``f == 0`` leaves ``x`` bit-exact and ``f == 1`` copies ``peer`` exactly (both
special-cased).  For other ``f``, ``x == peer`` may move by up to one ulp.
float16 and bfloat16 (:data:`dpwa.utils.bfloat16.BFLOAT16` arrays: raw bits in
uint16) are computed in float32 (block-sized scratch) and rounded once.

A *narrower peer*: :func:`interpolate_` and :func:`relative_distance` also take a peer
array held in float16 or bfloat16 beside a float32 ``x`` (a receive buffer kept in the wire's dtype); each block
of it is widened (exactly) into scratch as it is read, so the result is the bits of widening the peer first.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpwa.rules.workers import run_ranges, splitting
from dpwa.utils.bfloat16 import from_float32, is_bfloat16, to_float32

__all__ = [
    "BLOCK",
    "Scratch",
    "add_difference_",
    "add_differences_",
    "apply_divergence",
    "check_pairs",
    "compute_dtype",
    "copy_widened",
    "interpolate_",
    "interpolate_elementwise_",
    "is_half",
    "mix_clock",
    "narrow",
    "narrower",
    "relative_distance",
    "scale_motion_",
    "scale_motion_and_interpolate_",
    "widen",
]

BLOCK = 1 << 16
"""Elements per block: 256 KiB of float32, 512 KiB of float64 -- about an L2 cache."""

_SUPPORTED = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_half(dtype: np.dtype) -> bool:
    """float16 or bfloat16: the dtypes computed in float32 scratch and rounded back once."""
    return dtype == np.float16 or is_bfloat16(dtype)


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 and bfloat16 are computed in float32; float32/float64 in themselves."""
    return np.dtype(np.float32) if is_half(dtype) else dtype


def widen(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out <- float32(src)`` for a float16 or bfloat16 block (exact). float16 goes through torch's cast when this
    process has imported torch (the rules never import it) and ``src`` is writable: the same values, about 15x
    numpy's emulated cast."""
    if is_bfloat16(src.dtype):
        return to_float32(src, out)
    torch = sys.modules.get("torch")
    if torch is not None and src.dtype == np.float16 and src.flags.writeable and src.flags.c_contiguous:
        torch.from_numpy(out).copy_(torch.from_numpy(src))  # torch takes no read-only array (a peer's segment)
        return out
    np.copyto(out, src)
    return out


def narrower(x: np.dtype, peer: np.dtype) -> bool:
    """Whether a ``peer`` array is a float16 or bfloat16 one beside a float32 ``x`` (widened as it is read)."""
    return np.dtype(x) == np.float32 and not is_bfloat16(x) and is_half(peer)


def narrow(src: np.ndarray, out: np.ndarray, spare: np.ndarray) -> None:
    """``out <- src`` rounded once (to nearest even) from float32 to ``out``'s float16 or bfloat16.

    ``spare`` is a float32 block no longer needed, used as the bfloat16 rounding's scratch."""
    if is_bfloat16(out.dtype):
        from_float32(src, out, scratch=spare.view(np.uint32))
    else:
        np.copyto(out, src, casting="same_kind")


def _flat(a: np.ndarray) -> np.ndarray:
    """A 1-D view of an array already checked to be C-contiguous (so never a copy)."""
    return a.reshape(-1)


def check_pairs(
    x: Sequence[np.ndarray], peer: Sequence[np.ndarray], what: str = "peer", *, narrower_peer: bool = False
) -> None:
    """Raise unless x/peer are same-length lists of same-dtype, same-shape, C-contiguous float arrays
    (``narrower_peer``: a peer array may also be float16 or bfloat16 beside a float32 ``x``, :func:`narrower`).

    TypeError for non-arrays; ValueError for everything else."""
    if len(x) != len(peer):
        raise ValueError(f"x has {len(x)} arrays but {what} has {len(peer)}")
    for i, (a, b) in enumerate(zip(x, peer)):
        if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
            raise TypeError(f"array {i}: expected numpy arrays, got {type(a).__name__} and {type(b).__name__}")
        if a.dtype not in _SUPPORTED and not is_bfloat16(a.dtype):
            raise ValueError(f"array {i}: dtype {a.dtype} is not float16/float32/float64/BFLOAT16")
        same = a.dtype == b.dtype and is_bfloat16(a.dtype) == is_bfloat16(b.dtype)
        if not (same or (narrower_peer and narrower(a.dtype, b.dtype))) or a.shape != b.shape:
            raise ValueError(f"array {i}: x is {a.dtype}{a.shape} but {what} is {b.dtype}{b.shape}")
        if not (a.flags.c_contiguous and b.flags.c_contiguous):
            raise ValueError(f"array {i}: arrays must be C-contiguous")
        if not a.flags.writeable:
            raise ValueError(f"array {i}: x is read-only")
        if a.size and np.may_share_memory(a, b):
            raise ValueError(f"array {i}: x and {what} overlap in memory")


def _check_factor(f: float) -> float:
    f = float(f)
    if not 0.0 <= f <= 1.0:  # also rejects NaN
        raise ValueError(f"interpolation factor must lie in [0, 1], got {f!r}")
    return f


class Scratch:
    """Block-sized scratch buffers, allocated lazily, at most one per (dtype, slot)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[np.dtype, int], np.ndarray] = {}

    def get(self, dtype: np.dtype, n: int, slot: int = 0) -> np.ndarray:
        key = (np.dtype(dtype), slot)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = np.empty(BLOCK, dtype=dtype)
        return buf[:n]


def _for_blocks(
    n: int, scratch: Scratch, block_fn: Callable[[int, int, Scratch], None], *, raise_overflow: bool = False
) -> None:
    """``block_fn(start, stop, scratch)`` for every block of ``[0, n)``, in order within each range of
    :func:`~dpwa.rules.workers.run_ranges` (the whole array, or its split over the active mix workers: the same
    blocks either way, so the same bits). A range run by a worker gets a scratch of its own and the caller's numpy
    error state (a thread's is its own); ``raise_overflow``: every range runs under ``np.errstate(over="raise")``."""
    if splitting(n) is None:  # the common case, many small arrays or one mix thread: no split, no closure
        with np.errstate(over="raise") if raise_overflow else contextlib.nullcontext():
            for start in range(0, n, BLOCK):
                block_fn(start, min(start + BLOCK, n), scratch)
        return
    caller = threading.get_ident()
    errors = {**np.geterr(), **({"over": "raise"} if raise_overflow else {})}

    def span(lo: int, hi: int) -> None:
        sc = scratch if threading.get_ident() == caller else Scratch()
        with np.errstate(**errors):
            for start in range(lo, hi, BLOCK):
                block_fn(start, min(start + BLOCK, hi), sc)

    run_ranges(n, BLOCK, span)


def interpolate_(x: Sequence[np.ndarray], peer: Sequence[np.ndarray], f: float) -> None:
    """In place, array by array: ``x <- (1-f)*x + f*peer``, for a scalar ``f`` in [0, 1].

    ``peer`` arrays are used as scratch when writable (their contents are then
    undefined afterwards); read-only peers are left alone and a block-sized
    buffer is used instead.  ``f == 0``: ``x`` untouched; ``f == 1``: ``x``
    becomes ``peer`` exactly.  A peer array may be narrower (see the module
    doc-string).  All arrays are validated before any is written.
    Raises ValueError on mismatched layouts, overlap or ``f`` outside [0, 1]
    (TypeError for non-arrays).
    """
    f = _check_factor(f)
    check_pairs(x, peer, narrower_peer=True)
    if f == 0.0:
        return
    if f == 1.0:
        for a, b in zip(x, peer):
            copy_widened(a, b)
        return
    scratch = Scratch()
    for a, b in zip(x, peer):
        if a.size == 0:
            continue
        xv, pv = _flat(a), _flat(b)
        fg, kinds, mean = _interpolation_plan(a, b, f)
        if mean:
            _mean_(xv, pv, scratch)
            continue
        block = functools.partial(_interpolate_slice, xv, pv, fg, kinds)
        _for_blocks(xv.size, scratch, block)


def _interpolation_plan(
    a: np.ndarray, b: np.ndarray, f: float
) -> tuple[tuple[Any, Any], tuple[bool, bool, bool], bool]:
    """How ``x <- (1-f)*a + f*b`` runs for one array pair: ``f`` and ``1 - f`` in the compute dtype, the kinds of
    :func:`_interpolate_block` (``a`` is half, ``b`` narrower, ``b`` its own scratch), and whether the
    two-operation mean applies instead (``f = 0.5``, ``a`` float32 or float64)."""
    c, half = compute_dtype(a.dtype), is_half(a.dtype)
    kinds = (half, narrower(a.dtype, b.dtype), b.flags.writeable and not half)
    return (c.type(f), c.type(1.0 - f)), kinds, f == 0.5 and not half


def _interpolate_slice(
    xv: np.ndarray,
    pv: np.ndarray,
    fg: tuple[Any, Any],
    kinds: tuple[bool, bool, bool],
    start: int,
    stop: int,
    sc: Scratch,
) -> None:
    """:func:`_interpolate_block` on elements ``[start, stop)`` of the flat arrays (a :func:`_for_blocks` body)."""
    _interpolate_block(xv[start:stop], pv[start:stop], fg, kinds, sc)


def _interpolate_block(
    xb: np.ndarray, pb: np.ndarray, fg: tuple[Any, Any], kinds: tuple[bool, bool, bool], scratch: Scratch
) -> None:
    """One block of :func:`interpolate_`. ``fg``: ``f`` and ``1 - f`` in the compute dtype (neither 0 nor 1, nor
    0.5 for a float32/float64 ``x``); ``kinds``: ``x`` is half, the peer narrower, the peer its own scratch
    (writable, of ``x``'s dtype)."""
    fc, gc = fg
    half, wide, in_place = kinds
    c, n = fc.dtype, xb.size
    if wide:  # a narrower peer: its block widened into writable scratch
        pb = widen(pb, scratch.get(c, n, 1))
    if half:
        acc = widen(xb, scratch.get(c, n, 0))
        tmp = widen(pb, scratch.get(c, n, 1))
        np.multiply(acc, gc, out=acc)
        np.multiply(tmp, fc, out=tmp)
        np.add(acc, tmp, out=acc)
        narrow(acc, xb, tmp)
    else:
        tmp = pb if in_place or wide else scratch.get(c, n, 0)
        np.multiply(pb, fc, out=tmp)
        np.multiply(xb, gc, out=xb)
        np.add(xb, tmp, out=xb)


def add_difference_(
    x: Sequence[np.ndarray], peer: Sequence[np.ndarray], reference: Sequence[np.ndarray] | None, a: float
) -> None:
    """In place: ``x <- x + a*(peer - reference)`` (AD-PSGD's half step toward the pair's average); ``reference``
    None: ``peer`` already holds the difference (for float32/float64 the same bits as subtracting here).

    :func:`add_differences_` with one peer (the same bits).
    """
    add_differences_(x, [peer], reference, a)


def add_differences_(
    x: Sequence[np.ndarray], peers: Sequence[Sequence[np.ndarray]], reference: Sequence[np.ndarray] | None, a: float
) -> None:
    """In place, in one pass: ``x <- x + a * sum_j (peers[j] - reference)`` (D-PSGD's move toward its neighbours'
    average); ``reference`` None: each peer already holds a difference.

    Block by block with block-sized scratch: the differences are summed in the order given, multiplied by ``a``
    and added to ``x`` once, so one peer gives ``x + a*(p - r)`` and the bits never depend on the block size.
    float16/bfloat16 are computed in float32 and rounded once. ``a == 0`` or no peers leaves ``x`` untouched. All
    arrays are validated before any is written.
    """
    a = _check_factor(a)
    for j, peer in enumerate(peers):
        check_pairs(x, peer, f"peer {j}")
    if reference is not None:
        check_pairs(x, reference, "reference")
    if a == 0.0 or not peers:
        return
    scratch = Scratch()
    for i, xa in enumerate(x):
        if xa.size == 0:
            continue
        xv, rv = _flat(xa), None if reference is None else _flat(reference[i])
        pvs = [_flat(peer[i]) for peer in peers]
        ac = compute_dtype(xa.dtype).type(a)
        _for_blocks(xv.size, scratch, functools.partial(_differences_slice, xv, pvs, rv, ac))


def _differences_slice(
    xv: np.ndarray, pvs: list[np.ndarray], rv: np.ndarray | None, ac: Any, start: int, stop: int, scratch: Scratch
) -> None:
    """One block of :func:`add_differences_`: ``xv[start:stop] += ac * sum_j (pvs[j] - rv)`` (flat arrays; ``ac``
    in the compute dtype; ``rv`` None: each peer holds a difference)."""
    c, n, half = ac.dtype, stop - start, is_half(xv.dtype)
    acc, tmp = scratch.get(c, n, 0), scratch.get(c, n, 1)
    ref = None if rv is None else (widen(rv[start:stop], scratch.get(c, n, 2)) if half else rv[start:stop])
    for j, pv in enumerate(pvs):
        term = widen(pv[start:stop], tmp) if half else pv[start:stop]
        if j == 0 and ref is not None:
            np.subtract(term, ref, out=acc)
        elif j == 0:
            np.copyto(acc, term)
        else:
            if ref is not None:
                term = np.subtract(term, ref, out=tmp)
            np.add(acc, term, out=acc)
    np.multiply(acc, ac, out=acc)
    if half:
        np.add(widen(xv[start:stop], tmp), acc, out=acc)
        narrow(acc, xv[start:stop], tmp)
    else:
        np.add(xv[start:stop], acc, out=xv[start:stop])


def scale_motion_(x: Sequence[np.ndarray], reference: Sequence[np.ndarray], s: float) -> None:
    """In place: ``x <- reference + s*(x - reference)`` (push-sum's local step moved to the numerator).

    ``s`` must be finite and > 0; ``s == 1`` leaves ``x`` untouched. Block by block with block-sized
    scratch; float16/bfloat16 computed in float32 and rounded once. ``reference`` is only read. All arrays
    are validated before any is written.
    """
    s = _check_scale(s)
    check_pairs(x, reference, "reference")
    if s == 1.0:
        return
    scratch = Scratch()
    for xa, ra in zip(x, reference):
        if xa.size == 0:
            continue
        xv, rv = _flat(xa), _flat(ra)
        sc, half = compute_dtype(xa.dtype).type(s), is_half(xa.dtype)
        _for_blocks(xv.size, scratch, functools.partial(_scale_slice, xv, rv, sc, half))


def scale_motion_and_interpolate_(
    x: Sequence[np.ndarray], reference: Sequence[np.ndarray], s: float, peer: Sequence[np.ndarray], f: float
) -> None:
    """In place: ``x <- (1-f)*(reference + s*(x - reference)) + f*peer``, the bits of :func:`scale_motion_` then
    :func:`interpolate_`, in one pass: each block of ``x`` is scaled, then mixed, while it is in cache (push-sum's
    local step and the fold of its first message). All arrays are validated before any is written."""
    s, f = _check_scale(s), _check_factor(f)
    check_pairs(x, reference, "reference")
    check_pairs(x, peer, narrower_peer=True)
    if s == 1.0 or f in (0.0, 1.0):  # one of the two does nothing, or f = 1 overwrites x: no pass to save
        scale_motion_(x, reference, s)
        interpolate_(x, peer, f)
        return
    scratch = Scratch()
    for a, r, b in zip(x, reference, peer):
        if a.size == 0:
            continue
        xv, rv, pv = _flat(a), _flat(r), _flat(b)
        sc = compute_dtype(a.dtype).type(s)
        fg, kinds, mean = _interpolation_plan(a, b, f)
        _for_blocks(xv.size, scratch, functools.partial(_scale_and_interpolate_slice, xv, rv, pv, sc, fg, kinds, mean))


def _scale_and_interpolate_slice(
    xv: np.ndarray,
    rv: np.ndarray,
    pv: np.ndarray,
    sc: Any,
    fg: tuple[Any, Any],
    kinds: tuple[bool, bool, bool],
    mean: bool,
    start: int,
    stop: int,
    scratch: Scratch,
) -> None:
    """One block of :func:`scale_motion_and_interpolate_` (flat arrays): scaled, then mixed, while in cache."""
    half, wide, _ = kinds
    _scale_block(xv[start:stop], rv[start:stop], sc, half, scratch)
    if mean:
        with np.errstate(over="raise"):  # the mean's own overflow check; the scaling's stays as it was
            _mean_block(xv[start:stop], pv[start:stop], wide, scratch)
    else:
        _interpolate_block(xv[start:stop], pv[start:stop], fg, kinds, scratch)


def _check_scale(s: float) -> float:
    s = float(s)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"motion scale must be finite and > 0, got {s!r}")
    return s


def _scale_slice(xv: np.ndarray, rv: np.ndarray, sc: Any, half: bool, start: int, stop: int, s: Scratch) -> None:
    """:func:`_scale_block` on elements ``[start, stop)`` of the flat arrays (a :func:`_for_blocks` body)."""
    _scale_block(xv[start:stop], rv[start:stop], sc, half, s)


def _scale_block(xb: np.ndarray, rb: np.ndarray, sc: Any, half: bool, scratch: Scratch) -> None:
    """One block of :func:`scale_motion_`: ``xb <- rb + sc*(xb - rb)`` (``sc`` in the compute dtype; ``half``:
    ``xb`` is float16 or bfloat16)."""
    c, n = sc.dtype, xb.size
    if half:
        acc = widen(xb, scratch.get(c, n, 0))
        ref = widen(rb, scratch.get(c, n, 1))
        np.subtract(acc, ref, out=acc)
        np.multiply(acc, sc, out=acc)
        np.add(acc, ref, out=acc)
        narrow(acc, xb, ref)
    else:
        diff = scratch.get(c, n, 0)
        np.subtract(xb, rb, out=diff)
        np.multiply(diff, sc, out=diff)
        np.add(rb, diff, out=xb)


def copy_widened(x: np.ndarray, peer: np.ndarray) -> None:
    """``x <- peer`` exactly, of the same dtype or a narrower one (widened block by block straight into ``x``)."""
    if not narrower(x.dtype, peer.dtype):
        np.copyto(x, peer, casting="no")
        return
    xv, pv = _flat(x), _flat(peer)
    for start in range(0, xv.size, BLOCK):
        widen(pv[start : start + BLOCK], xv[start : start + BLOCK])


def _mean_(xv: np.ndarray, pv: np.ndarray, scratch: Scratch) -> None:
    """``xv <- (xv + pv) / 2`` for float32/float64, two operations per block (the mix's common case, f = 0.5).

    ``RN(x + p) * 0.5`` is the correctly rounded mean whenever the sum does not
    overflow (halving is exact; in the subnormal range the sum is exact). A block
    whose sum overflows (both values beyond half the largest float) is computed
    as ``0.5*x + 0.5*p`` instead. ``pv`` is only read (a narrower one widened block by block).
    """
    wide = narrower(xv.dtype, pv.dtype)

    def block(start: int, stop: int, sc: Scratch) -> None:
        _mean_block(xv[start:stop], pv[start:stop], wide, sc)

    _for_blocks(xv.size, scratch, block, raise_overflow=True)


def _mean_block(xb: np.ndarray, pb: np.ndarray, wide: bool, scratch: Scratch) -> None:
    """One block of :func:`_mean_`, under ``np.errstate(over="raise")`` (``wide``: ``pb`` is narrower)."""
    c, n = xb.dtype, xb.size
    if wide:
        pb = widen(pb, scratch.get(c, n, 1))
    tmp = scratch.get(c, n, 0)
    try:
        np.add(xb, pb, out=tmp)
    except FloatingPointError:  # x + p overflowed in this block: halve first (x is untouched)
        half = c.type(0.5)
        with np.errstate(over="ignore"):
            np.multiply(pb, half, out=tmp)
            np.multiply(xb, half, out=xb)
            np.add(xb, tmp, out=xb)
        return
    np.multiply(tmp, c.type(0.5), out=xb)


def interpolate_elementwise_(
    x: Sequence[np.ndarray], peer: Sequence[np.ndarray], factors: Sequence[np.ndarray]
) -> float:
    """In place, element by element: ``x <- x - f*x + f*peer`` (== ``(1-f)*x + f*peer``) with ``f = factors``.

    ``factors`` holds one float array per ``x`` array, same shape, values in
    [0, 1] (not checked -- the caller clamps; GEM's ``f0*pi`` is in range by
    construction).  ``peer`` and ``factors`` are only read.  Elements with
    ``f == 0`` keep their value and ``f == 1`` take the peer's (up to the sign
    of a zero); ``f == 0.5`` gives the correctly rounded mean.  Returns the
    mean factor over all elements (0.0 when there are none), for
    :attr:`MixOutcome.factor`.  Uses at most two block-sized scratch buffers.
    """
    check_pairs(x, peer)
    if len(factors) != len(x):
        raise ValueError(f"x has {len(x)} arrays but factors has {len(factors)}")
    for i, (a, fa) in enumerate(zip(x, factors)):
        if not isinstance(fa, np.ndarray):
            raise TypeError(f"array {i}: factors must be numpy arrays, got {type(fa).__name__}")
        if fa.dtype.kind != "f":
            raise ValueError(f"array {i}: factors must be floating-point, got {fa.dtype}")
        if fa.shape != a.shape or not fa.flags.c_contiguous:
            raise ValueError(f"array {i}: factors are {fa.shape} (C-contiguous required) but x is {a.shape}")
        if a.size and np.may_share_memory(a, fa):
            raise ValueError(f"array {i}: x and factors overlap in memory")
    scratch = Scratch()
    total, count = 0.0, 0
    for a, b, fa in zip(x, peer, factors):
        if a.size == 0:
            continue
        xv, pv, fv = _flat(a), _flat(b), _flat(fa)
        c = compute_dtype(a.dtype)
        half = is_half(a.dtype)
        for start in range(0, xv.size, BLOCK):
            stop = min(start + BLOCK, xv.size)
            xb, pb, fb = xv[start:stop], pv[start:stop], fv[start:stop]
            n = stop - start
            tmp = scratch.get(c, n, 0)
            acc = widen(xb, scratch.get(c, n, 1)) if half else xb
            np.multiply(fb, acc, out=tmp, dtype=c)
            np.subtract(acc, tmp, out=acc)
            if half:  # f*peer with the peer widened exactly to float32 first
                widen(pb, tmp)
                np.multiply(fb, tmp, out=tmp, dtype=c)
            else:
                np.multiply(fb, pb, out=tmp, dtype=c)
            np.add(acc, tmp, out=acc)
            if half:
                narrow(acc, xb, tmp)
            total += float(np.add.reduce(fb, dtype=np.float64))
        count += xv.size
    return total / count if count else 0.0


def apply_divergence(f: float, loss: float, threshold: float) -> float:
    """Divergence damping: if ``loss < t`` then ``f <- f * loss / t``; ``t == 0`` is off.

    A negative loss counts as 0 (``f`` becomes 0: the node is already as good
    as it gets and keeps its own model).  A NaN or infinite loss never damps.
    Raises ValueError for a negative or non-finite threshold.
    """
    t = float(threshold)
    if not (math.isfinite(t) and t >= 0.0):
        raise ValueError(f"divergence threshold must be a finite number >= 0, got {threshold!r}")
    loss = float(loss)
    if t == 0.0 or not loss < t:
        return f
    return f * max(loss, 0.0) / t


def mix_clock(clock: float, peer_clock: float, f: float) -> float:
    """The clock after mixing with factor ``f``: ``f*peer_clock + (1-f)*clock`` (exact at f = 0 and f = 1)."""
    if f == 0.0:
        return clock
    if f == 1.0:
        return peer_clock
    return f * peer_clock + (1.0 - f) * clock


def relative_distance(x: Sequence[np.ndarray], peer: Sequence[np.ndarray]) -> float:
    """``||x - peer|| / ||x||`` over all arrays taken as one vector (0.0 when both are 0, inf when only ``x``
    is; nan when a sum of squares overflows float64): how far apart two models are, for the metrics. Reads both
    once, block by block, each block widened into float64 scratch (float32's squares of large finite values
    would overflow float32)."""
    if len(x) != len(peer):
        raise ValueError(f"x has {len(x)} arrays but peer has {len(peer)}")
    scratch = Scratch()
    wide = np.dtype(np.float64)
    diff2 = norm2 = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a, b in zip(x, peer):
            if a.shape != b.shape:
                raise ValueError(f"x is {a.shape} but peer is {b.shape}")
            xv, pv = a.reshape(-1), b.reshape(-1)
            x_half, p_half = is_half(a.dtype), is_half(b.dtype)  # a peer may be narrower than x
            for start in range(0, xv.size, BLOCK):
                stop = min(start + BLOCK, xv.size)
                n = stop - start
                xw, pw = scratch.get(wide, n, 0), scratch.get(wide, n, 1)
                xs, ps = xv[start:stop], pv[start:stop]
                np.copyto(xw, widen(xs, scratch.get(np.float32, n, 2)) if x_half else xs)
                np.copyto(pw, widen(ps, scratch.get(np.float32, n, 3)) if p_half else ps)
                norm2 += float(np.dot(xw, xw))
                np.subtract(xw, pw, out=pw)
                diff2 += float(np.dot(pw, pw))
    if not (math.isfinite(diff2) and math.isfinite(norm2)):
        return math.nan
    if norm2 == 0.0:
        return 0.0 if diff2 == 0.0 else math.inf
    return math.sqrt(diff2 / norm2)
