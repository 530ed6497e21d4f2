"""dpwa.utils.int8: blockwise symmetric int8 quantization -- its error bound, its determinism, its dtypes.

Expectations come from the formula in the module's doc-string, recomputed here in float64:
``scale = max |x|`` per block of INT8_BLOCK, ``q = clip(rint(x / scale * 127))``, ``x ~ q * scale / 127``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32
from dpwa.utils.int8 import (
    INT8_BLOCK,
    INT8_PIECE,
    Int8Scratch,
    absmax_scales_,
    dequantize_int8_,
    int8_scales,
    quantize_int8_,
)

DTYPES = ["float16", "bfloat16", "float32", "float64"]


LARGEST = {"float16": 65000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}


def make(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float64, clipped to the dtype's finite range) in ``dtype`` (bfloat16 rounded to nearest even)."""
    values = np.clip(values, -LARGEST[dtype], LARGEST[dtype])
    if dtype == "bfloat16":
        out = np.empty(values.shape, BFLOAT16)
        with np.errstate(over="ignore"):
            from_float32(values.astype(np.float32), out)
        return out
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def exact(a: np.ndarray) -> np.ndarray:
    """The float64 values of ``a`` (bfloat16 widened exactly)."""
    if a.dtype == BFLOAT16 and a.dtype.metadata:
        return to_float32(a, np.empty(a.shape, np.float32)).astype(np.float64)
    return a.astype(np.float64)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = np.empty(x.size, np.int8)
    s = np.empty(int8_scales(x.size), np.float32)
    quantize_int8_(x, q, s)
    return q, s


def per_element(scales: np.ndarray, n: int) -> np.ndarray:
    return np.repeat(scales.astype(np.float64), INT8_BLOCK)[:n]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    """float64 values: a partial last block most of the time, blocks of zeros, magnitudes from 1e-40 to 1e30."""
    n = draw(st.integers(1, 5 * INT8_BLOCK + 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    exponent = draw(st.sampled_from([-40, -20, -5, 0, 3, 30]))
    x = rng.standard_normal(n) * 10.0**exponent * np.exp(rng.uniform(-3, 3, n))
    for b in range(int8_scales(n)):
        if draw(st.booleans()) and draw(st.booleans()):
            x[b * INT8_BLOCK : (b + 1) * INT8_BLOCK] = 0.0  # a block of zeros: scale 0, values 0
    return x


def test_int8_scales_counts_blocks() -> None:
    assert [int8_scales(n) for n in (0, 1, INT8_BLOCK, INT8_BLOCK + 1, 10 * INT8_BLOCK)] == [0, 1, 1, 2, 10]
    with pytest.raises(ValueError):
        int8_scales(-1)


@settings(max_examples=120, deadline=None)
@given(values=arrays(), dtype=st.sampled_from(DTYPES))
def test_error_is_at_most_half_a_step_per_element(values: np.ndarray, dtype: str) -> None:
    x = make(values, dtype)
    xs = exact(x)
    q, s = quantize(x)
    scale = per_element(s, x.size)
    # the scales are each block's max |x|, exactly (float32 holds every 16- and 32-bit float)
    expect = [np.abs(xs[b * INT8_BLOCK : (b + 1) * INT8_BLOCK]).max() for b in range(s.size)]
    np.testing.assert_array_equal(s, np.array(expect).astype(np.float32))
    assert q.min() >= -127 and q.max() <= 127
    assert (q[scale == 0] == 0).all()
    out = np.empty(x.size, np.float64)
    dequantize_int8_(q, s, out)
    bound = scale / 254 * (1 + 1e-4) + np.abs(xs) * 2.0**-22 + 2.0**-149
    assert (np.abs(xs - out) <= bound).all(), float(np.max(np.abs(xs - out) / np.maximum(scale, 1e-300)))


@settings(max_examples=60, deadline=None)
@given(values=arrays(), dtype=st.sampled_from(DTYPES))
def test_a_narrow_output_is_the_float32_result_rounded_once(values: np.ndarray, dtype: str) -> None:
    """Into float16 / bfloat16 / float32: the float32 dequantization, rounded to nearest even (bit for bit)."""
    q, s = quantize(make(values, "float32"))
    wide = np.empty(q.size, np.float32)
    dequantize_int8_(q, s, wide)
    out = make(np.zeros(q.size), dtype)
    dequantize_int8_(q, s, out)
    if dtype == "float64":
        np.testing.assert_allclose(out, wide, rtol=2.0**-22, atol=2.0**-149)
    else:
        want = make(np.zeros(q.size), dtype)
        if dtype == "bfloat16":
            from_float32(wide, want)
        else:
            with np.errstate(over="ignore"):  # beyond float16's range: an infinity, as the cast gives
                np.copyto(want, wide, casting="unsafe")
        assert out.tobytes() == want.tobytes()


def test_values_are_the_rounded_ratio_and_ties_go_to_even() -> None:
    x = np.array([127.0, 0.5, 1.5, 2.5, -2.5, -127.0, 64.0, 0.0, -0.0], np.float32)
    q, s = quantize(x)
    assert s.tolist() == [127.0]
    assert q.tolist() == [127, 0, 2, 2, -2, -127, 64, 0, 0]  # rint: half to even


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_bytes_whatever_the_piece_size(dtype: str) -> None:
    """The same input bytes give the same output bytes: whole or in pieces, any scratch, again and again."""
    rng = np.random.default_rng(5)
    x = make(rng.standard_normal(3 * INT8_PIECE + 777) * 3.0, dtype)
    q1, s1 = quantize(x)
    q2 = np.empty_like(q1)
    s2 = np.empty_like(s1)
    quantize_int8_(x, q2, s2, scratch=Int8Scratch(INT8_BLOCK * 3))
    assert q1.tobytes() == q2.tobytes() and s1.tobytes() == s2.tobytes()
    s3 = np.empty_like(s1)
    absmax_scales_(x, s3, scratch=Int8Scratch(INT8_BLOCK))
    assert s3.tobytes() == s1.tobytes()
    out1 = make(np.zeros(x.size), dtype)
    dequantize_int8_(q1, s1, out1)
    out2 = make(np.zeros(x.size), dtype)
    dequantize_int8_(q1, s1, out2, scratch=Int8Scratch(2 * INT8_BLOCK))
    assert out1.tobytes() == out2.tobytes()
    # and a part starting anywhere (a received chunk) gives the same values as the whole
    for first in (1, INT8_BLOCK - 1, INT8_BLOCK, INT8_PIECE + 5):
        part = make(np.zeros(x.size - first), dtype)
        dequantize_int8_(q1[first:], s1, part, first=first)
        assert part.tobytes() == out1[first:].tobytes()


def test_a_recorded_digest_pins_the_formula() -> None:
    """Every machine computes these bytes; a change of the formula changes them (and breaks every mixed cluster)."""
    k = np.arange(5000, dtype=np.uint64)
    u = (k * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(2**32)  # integer arithmetic: no libm, no RNG
    x = ((u.astype(np.float64) / 2**32 - 0.5) * 0.1).astype(np.float32)
    x[::997] *= 40  # an outlier per block or so
    q, s = quantize(x)
    out = np.empty(x.size, np.float32)
    dequantize_int8_(q, s, out)
    digest = hashlib.blake2b(q.tobytes() + s.tobytes() + out.tobytes(), digest_size=8).hexdigest()
    # recomputed independently in float64 (exact for these float32 inputs)
    xs = x.astype(np.float64)
    scale = per_element(s, x.size)
    want_q = np.clip(np.rint(xs / scale * 127), -127, 127)
    assert (q == want_q).all()
    assert digest == RECORDED_DIGEST, digest


RECORDED_DIGEST = "08c692adbedf6a3c"


def test_non_finite_blocks_get_a_non_finite_scale_and_zero_values() -> None:
    x = np.ones(3 * INT8_BLOCK + 10, np.float32)
    x[5] = np.nan
    x[INT8_BLOCK + 7] = -np.inf
    x[3 * INT8_BLOCK + 1] = np.inf
    x[3 * INT8_BLOCK + 2] = np.nan  # NaN wins over an infinity in the same block
    q, s = quantize(x)
    assert np.isnan(s[0]) and s[1] == np.inf and s[2] == 1.0 and np.isnan(s[3])
    assert s[[0, 3]].view(np.uint32).tolist() == [0x7FC00000, 0x7FC00000]  # one canonical NaN
    assert (q[: 2 * INT8_BLOCK] == 0).all() and (q[2 * INT8_BLOCK : 3 * INT8_BLOCK] == 127).all()
    assert (q[3 * INT8_BLOCK :] == 0).all()
    out = np.empty(x.size, np.float32)
    dequantize_int8_(q, s, out)
    assert np.isnan(out[:INT8_BLOCK]).all() and np.isfinite(out[2 * INT8_BLOCK : 3 * INT8_BLOCK]).all()


def test_float64_beyond_float32_range_gives_an_infinite_scale() -> None:
    x = np.array([1e300, 1.0, -2.0])
    q, s = quantize(x)
    assert s[0] == np.inf and (q == 0).all()
    tiny = np.array([1e-300, -1e-310])  # below float32's smallest subnormal: scale 0, values 0
    q, s = quantize(tiny)
    assert s[0] == 0 and (q == 0).all()


def test_shapes_are_taken_flat_and_outputs_checked() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    q = np.empty((2, 12), np.int8)
    s = np.empty(1, np.float32)
    quantize_int8_(x, q, s)
    assert s[0] == 23 and q.reshape(-1)[-1] == 127
    with pytest.raises(ValueError, match="values_out"):
        quantize_int8_(x, np.empty(23, np.int8), s)
    with pytest.raises(ValueError, match="scales_out"):
        quantize_int8_(x, q, np.empty(2, np.float32))
    with pytest.raises(ValueError, match="dtype"):
        quantize_int8_(np.arange(3), np.empty(3, np.int8), np.empty(1, np.float32))
    with pytest.raises(ValueError, match="scales"):
        dequantize_int8_(q.reshape(-1)[1:], s, np.empty(23, np.float32), first=INT8_BLOCK)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_int8_(np.zeros((4, 4), np.float32)[:, 0], np.empty(4, np.int8), np.empty(1, np.float32))


def test_minus_128_from_a_hostile_sender_dequantizes_finitely() -> None:
    q = np.array([-128, 127], np.int8)
    out = np.empty(2, np.float32)
    dequantize_int8_(q, np.array([127.0], np.float32), out)
    assert out.tolist() == [-128.0, 127.0]
