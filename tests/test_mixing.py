"""The in-place mixing kernels and scalar helpers of dpwa.rules.mixing."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from conftest import traced_peak

from dpwa.rules.mixing import (
    BLOCK,
    add_difference_,
    apply_divergence,
    interpolate_,
    interpolate_elementwise_,
    mix_clock,
    scale_motion_,
    scale_motion_and_interpolate_,
)
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

DTYPES = [np.float16, np.float32, np.float64]
# Spans several blocks and ends with a partial one.
MULTI_BLOCK = 2 * BLOCK + 123


def wide(rng: np.random.Generator, n: int, dtype, span: float) -> np.ndarray:
    """Finite values of both signs whose magnitudes span ``exp(+-span)``."""
    a = rng.standard_normal(n) * np.exp(rng.uniform(-span, span, n))
    return a.astype(dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.itemsize}")).copy()


# ---------------------------------------------------------------- interpolate_


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpolate_hand_computed(dtype):
    x = [np.array([0, 1, 2, 4], dtype=dtype), np.array([[8, -8]], dtype=dtype)]
    peer = [np.array([4, 3, 2, 0], dtype=dtype), np.array([[0, 8]], dtype=dtype)]
    interpolate_(x, peer, 0.25)  # 0.75*x + 0.25*peer, all exact in binary
    np.testing.assert_array_equal(x[0], np.array([1, 1.5, 2, 3], dtype=dtype))
    np.testing.assert_array_equal(x[1], np.array([[6, -4]], dtype=dtype))
    assert x[0].dtype == dtype and x[1].shape == (1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [0.1, 0.3, 0.5, 0.9])
def test_interpolate_matches_reference(dtype, f):
    rng = np.random.default_rng(1)
    x0 = wide(rng, MULTI_BLOCK, dtype, 3)
    p0 = wide(rng, MULTI_BLOCK, dtype, 3)
    ref = (1 - f) * x0.astype(np.float64) + f * p0.astype(np.float64)
    x, p = x0.copy(), p0.copy()
    interpolate_([x], [p], f)
    rtol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype]
    atol = float(np.abs(ref).max()) * rtol
    np.testing.assert_allclose(x.astype(np.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_f0_leaves_x_bit_exact(dtype):
    rng = np.random.default_rng(2)
    x = wide(rng, 1000, dtype, 5)
    x[:3] = [-0.0, np.nan, np.inf]
    before = bits(x)
    p = wide(rng, 1000, dtype, 5)
    interpolate_([x], [p], 0.0)
    np.testing.assert_array_equal(bits(x), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_f1_copies_peer_bit_exact(dtype):
    rng = np.random.default_rng(3)
    x = wide(rng, MULTI_BLOCK, dtype, 5)
    x[:2] = [np.inf, np.nan]
    p = wide(rng, MULTI_BLOCK, dtype, 5)
    p[:2] = [-0.0, 0.0]
    expect = bits(p)
    interpolate_([x], [p], 1.0)
    np.testing.assert_array_equal(bits(x), expect)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_half_gives_correctly_rounded_mean_short_floats(dtype):
    """float16/float32 sums are exact in float64, so (a + b) / 2 there, rounded once, is the true mean."""
    rng = np.random.default_rng(4)
    span = 8 if dtype == np.float16 else 40
    a = wide(rng, MULTI_BLOCK, dtype, span)
    b = wide(rng, MULTI_BLOCK, dtype, span)
    expect = ((a.astype(np.float64) + b.astype(np.float64)) / 2).astype(dtype)
    interpolate_([a], [b], 0.5)
    np.testing.assert_array_equal(a, expect)


def test_half_gives_correctly_rounded_mean_float64():
    rng = np.random.default_rng(5)
    a = wide(rng, 3000, np.float64, 200)
    b = wide(rng, 3000, np.float64, 200)
    expect = np.array([float((Fraction(u) + Fraction(v)) / 2) for u, v in zip(a.tolist(), b.tolist())])
    interpolate_([a], [b], 0.5)
    np.testing.assert_array_equal(a, expect)


@pytest.mark.parametrize("f", [0.1, 0.3, 0.7])
def test_float16_is_computed_in_float32_and_rounded_once(f):
    rng = np.random.default_rng(12)
    x = wide(rng, MULTI_BLOCK, np.float16, 6)
    p = wide(rng, MULTI_BLOCK, np.float16, 6)
    expect = (np.float32(1 - f) * x.astype(np.float32) + np.float32(f) * p.astype(np.float32)).astype(np.float16)
    native = (np.float16(1 - f) * x + np.float16(f) * p).astype(np.float16)
    assert np.count_nonzero(native != expect) > 100  # the check below can tell the two apart
    interpolate_([x], [p], f)
    np.testing.assert_array_equal(x, expect)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_only_peer_is_not_written_and_gives_same_result(dtype):
    rng = np.random.default_rng(6)
    x0 = wide(rng, MULTI_BLOCK, dtype, 3)
    p0 = wide(rng, MULTI_BLOCK, dtype, 3)
    x_rw, x_ro = x0.copy(), x0.copy()
    p_ro = p0.copy()
    p_ro.flags.writeable = False
    interpolate_([x_rw], [p0.copy()], 0.3)
    interpolate_([x_ro], [p_ro], 0.3)
    np.testing.assert_array_equal(bits(x_ro), bits(x_rw))
    np.testing.assert_array_equal(bits(p_ro), bits(p0))


def test_empty_and_scalar_arrays():
    x = [np.zeros(0, np.float32), np.array(2.0), np.zeros((3, 0), np.float16)]
    p = [np.zeros(0, np.float32), np.array(4.0), np.zeros((3, 0), np.float16)]
    interpolate_(x, p, 0.5)
    assert x[1] == 3.0
    assert interpolate_elementwise_([np.zeros(0)], [np.zeros(0)], [np.zeros(0)]) == 0.0


@pytest.mark.parametrize(
    "peer, message",
    [
        ([np.zeros(4, np.float32)], "x has 2 arrays"),
        ([np.zeros(4, np.float32), np.zeros(3, np.float32)], "array 1"),
        ([np.zeros(4, np.float32), np.zeros(4, np.float32)], "array 1"),
        ([np.zeros(4, np.float32), np.zeros(6, np.float64)[::2].copy().reshape(1, 3)], "array 1"),
    ],
)
def test_mismatch_raises_before_writing(peer, message):
    x = [np.ones(4, np.float32), np.ones(3, np.float64)]
    with pytest.raises(ValueError, match=message):
        interpolate_(x, peer, 0.5)
    np.testing.assert_array_equal(x[0], np.ones(4, np.float32))


def test_rejects_bad_inputs():
    x = np.ones(6)
    with pytest.raises(ValueError, match="C-contiguous"):
        interpolate_([np.ones(12)[::2]], [np.ones(6)], 0.5)
    with pytest.raises(ValueError, match="overlap"):
        interpolate_([x], [x], 0.5)
    with pytest.raises(ValueError, match="dtype"):
        interpolate_([np.ones(3, np.int64)], [np.ones(3, np.int64)], 0.5)
    with pytest.raises(TypeError, match="numpy arrays"):
        interpolate_([np.ones(3)], [[1.0, 2.0, 3.0]], 0.5)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        interpolate_([ro], [np.ones(3)], 0.5)
    for f in (-0.01, 1.01, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            interpolate_([x], [np.ones(6)], f)


# ------------------------------------------------------- interpolate_elementwise_


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_hand_computed(dtype):
    x = [np.array([4, 4, 4, 4, 8], dtype=dtype)]
    p = [np.array([0, 0, 0, 0, 0], dtype=dtype)]
    f = [np.array([0, 0.25, 0.5, 1, 0.75], dtype=dtype)]
    p_before, f_before = p[0].copy(), f[0].copy()
    mean = interpolate_elementwise_(x, p, f)
    np.testing.assert_array_equal(x[0], np.array([4, 3, 2, 0, 2], dtype=dtype))
    assert mean == pytest.approx(2.5 / 5)
    np.testing.assert_array_equal(p[0], p_before)  # peer and factors are only read
    np.testing.assert_array_equal(f[0], f_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_constant_factor_matches_scalar_kernel(dtype):
    rng = np.random.default_rng(7)
    x0 = wide(rng, MULTI_BLOCK, dtype, 4)
    p0 = wide(rng, MULTI_BLOCK, dtype, 4)
    xs, xe = x0.copy(), x0.copy()
    interpolate_([xs], [p0.copy()], 0.5)
    mean = interpolate_elementwise_([xe], [p0], [np.full(MULTI_BLOCK, 0.5, dtype)])
    np.testing.assert_array_equal(xe, xs)  # both are the correctly rounded mean
    assert mean == 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_zero_and_one_factors(dtype):
    rng = np.random.default_rng(8)
    x0 = np.abs(wide(rng, MULTI_BLOCK, dtype, 4)) + dtype(1)
    p0 = np.abs(wide(rng, MULTI_BLOCK, dtype, 4)) + dtype(1)
    f = np.zeros(MULTI_BLOCK, dtype)
    f[::3] = 1
    x = x0.copy()
    mean = interpolate_elementwise_([x], [p0], [f])
    expect = np.where(f == 1, p0, x0)
    np.testing.assert_array_equal(bits(x), bits(expect))
    assert mean == pytest.approx(np.count_nonzero(f) / MULTI_BLOCK)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_random_factors_match_reference(dtype):
    rng = np.random.default_rng(9)
    x0 = wide(rng, MULTI_BLOCK, dtype, 3)
    p0 = wide(rng, MULTI_BLOCK, dtype, 3)
    f64 = rng.uniform(0, 1, MULTI_BLOCK)
    x = x0.copy()
    mean = interpolate_elementwise_([x], [p0], [f64])  # float64 factors for any parameter dtype
    ref = (1 - f64) * x0.astype(np.float64) + f64 * p0.astype(np.float64)
    rtol = {np.float16: 3e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype]
    np.testing.assert_allclose(x.astype(np.float64), ref, rtol=rtol, atol=float(np.abs(ref).max()) * rtol)
    assert mean == pytest.approx(float(f64.mean()), rel=1e-12)


def test_elementwise_rejects_bad_factors():
    x, p = [np.ones(4)], [np.zeros(4)]
    with pytest.raises(ValueError, match="factors has 0"):
        interpolate_elementwise_(x, p, [])
    with pytest.raises(ValueError, match="factors are"):
        interpolate_elementwise_(x, p, [np.ones(5)])
    with pytest.raises(ValueError, match="floating-point"):
        interpolate_elementwise_(x, p, [np.ones(4, np.int32)])
    with pytest.raises(TypeError, match="numpy arrays"):
        interpolate_elementwise_(x, p, [[1.0, 1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="overlap"):
        interpolate_elementwise_(x, p, [x[0]])
    np.testing.assert_array_equal(x[0], np.ones(4))


# ------------------------------------------------------------ no allocation


N_BIG = 4 * 1024 * 1024
# The largest scratch the kernels may use: two float32 blocks (float16 path), plus slack for small
# objects and numpy's own fixed-size casting buffers (8192 elements per operand).
SCRATCH_LIMIT = 2 * BLOCK * 4 + 128 * 1024


def test_tracemalloc_sees_numpy_allocations():
    """Control: the naive expression allocates model-sized temporaries and the probe notices."""
    x, p = np.ones(N_BIG, np.float32), np.zeros(N_BIG, np.float32)
    peak = traced_peak(lambda: np.add(x, 0.5 * (p - x), out=x))
    assert peak >= x.nbytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpolate_allocates_at_most_block_scratch(dtype):
    rng = np.random.default_rng(10)
    x = rng.standard_normal(N_BIG).astype(dtype)
    p = rng.standard_normal(N_BIG).astype(dtype)
    peak = traced_peak(lambda: interpolate_([x], [p], 0.3))
    assert peak < SCRATCH_LIMIT
    assert peak < x.nbytes / 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpolate_read_only_peer_allocates_at_most_block_scratch(dtype):
    x = np.ones(N_BIG, dtype)
    p = np.zeros(N_BIG, dtype)
    p.flags.writeable = False
    peak = traced_peak(lambda: interpolate_([x], [p], 0.3))
    assert peak < SCRATCH_LIMIT
    assert peak < x.nbytes / 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_allocates_at_most_block_scratch(dtype):
    x = np.ones(N_BIG, dtype)
    p = np.zeros(N_BIG, dtype)
    f = np.full(N_BIG, 0.25, dtype)
    peak = traced_peak(lambda: interpolate_elementwise_([x], [p], [f]))
    assert peak < SCRATCH_LIMIT
    assert peak < x.nbytes / 10
    np.testing.assert_array_equal(x[:: BLOCK - 1], dtype(0.75))


# ------------------------------------------------------------ scalar helpers


@pytest.mark.parametrize(
    "f, loss, t, expect",
    [
        (0.5, 0.05, 0.2, 0.125),  # loss < t: f * loss / t
        (0.8, 0.1, 0.4, 0.2),
        (0.5, 0.2, 0.2, 0.5),  # loss == t: untouched
        (0.5, 3.0, 0.2, 0.5),  # loss > t
        (0.5, 0.0, 0.2, 0.0),  # zero loss: no mixing
        (0.5, -1.0, 0.2, 0.0),  # negative loss counts as 0
        (0.5, 0.05, 0.0, 0.5),  # t == 0: off
        (0.5, math.nan, 0.2, 0.5),  # NaN loss never damps
        (0.5, math.inf, 0.2, 0.5),
        (0.5, -math.inf, 0.2, 0.0),
    ],
)
def test_apply_divergence(f, loss, t, expect):
    assert apply_divergence(f, loss, t) == pytest.approx(expect, rel=1e-15, abs=0)


@pytest.mark.parametrize("t", [-0.1, math.nan, math.inf])
def test_apply_divergence_rejects_bad_threshold(t):
    with pytest.raises(ValueError, match="threshold"):
        apply_divergence(0.5, 0.1, t)


@pytest.mark.parametrize(
    "clock, peer_clock, f, expect",
    [
        (3.0, 1.0, 0.25, 2.5),  # 0.25*1 + 0.75*3
        (10.0, 20.0, 0.5, 15.0),
        (7.5, 100.0, 0.0, 7.5),
        (7.5, 100.0, 1.0, 100.0),
        (0.1, 0.7, 1.0, 0.7),
    ],
)
def test_mix_clock(clock, peer_clock, f, expect):
    assert mix_clock(clock, peer_clock, f) == expect


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_half_is_the_correctly_rounded_mean_near_overflow_and_underflow(dtype):
    """f = 0.5 runs as (x + p) * 0.5: exact means of subnormals, and no overflow where the sum would overflow."""
    info = np.finfo(dtype)
    tiny = info.smallest_subnormal
    x = [np.full(MULTI_BLOCK, 3 * tiny, dtype), np.full(5, info.max, dtype)]
    p = [np.full(MULTI_BLOCK, 2 * tiny, dtype), np.full(5, info.max * dtype(0.75), dtype)]  # the sum overflows
    mean = float(Fraction(float(info.max)) / 2 + Fraction(float(p[1][0])) / 2)
    interpolate_(x, [a.copy() for a in p], 0.5)
    assert (x[0] == 2 * tiny).all()  # 2.5 subnormal steps, ties to even: 0.5*x + 0.5*p would give 3
    np.testing.assert_array_equal(x[1], np.full(5, mean, dtype))


def test_half_leaves_the_peer_untouched():
    x, p = np.ones(MULTI_BLOCK, np.float32), np.full(MULTI_BLOCK, 3.0, np.float32)
    interpolate_([x], [p], 0.5)
    assert (x == 2.0).all() and (p == 3.0).all()


# ---------------------------------------------------------------- scale_motion_


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scale_motion_moves_x_along_its_motion(dtype):
    """x <- reference + s*(x - reference): hand-computed (exact in binary), over several blocks too."""
    x = [np.array([3.0, -1.0, 2.0], dtype=dtype), np.zeros(0, dtype=dtype)]
    ref = [np.array([1.0, 1.0, 2.0], dtype=dtype), np.zeros(0, dtype=dtype)]
    scale_motion_(x, ref, 4.0)
    np.testing.assert_array_equal(x[0], np.array([9.0, -7.0, 2.0], dtype=dtype))
    rng = np.random.default_rng(1)
    big, base = rng.standard_normal(MULTI_BLOCK).astype(dtype), rng.standard_normal(MULTI_BLOCK).astype(dtype)
    expected = base + dtype(2.5) * (big - base)
    scale_motion_([big], [base], 2.5)
    np.testing.assert_array_equal(big, expected)


def test_scale_motion_of_half_dtypes_is_computed_in_float32_and_rounded_once():
    rng = np.random.default_rng(2)
    x32, r32 = rng.standard_normal(MULTI_BLOCK).astype(np.float32), rng.standard_normal(MULTI_BLOCK).astype(np.float32)
    x16, r16 = x32.astype(np.float16), r32.astype(np.float16)
    want16 = r16.astype(np.float32) + np.float32(3.0) * (x16.astype(np.float32) - r16.astype(np.float32))
    scale_motion_([x16], [r16], 3.0)
    np.testing.assert_array_equal(x16, want16.astype(np.float16))
    xb, rb = np.empty(MULTI_BLOCK, BFLOAT16), np.empty(MULTI_BLOCK, BFLOAT16)
    from_float32(x32, xb)
    from_float32(r32, rb)
    xf, rf = to_float32(xb, np.empty(MULTI_BLOCK, np.float32)), to_float32(rb, np.empty(MULTI_BLOCK, np.float32))
    want = np.empty(MULTI_BLOCK, BFLOAT16)
    from_float32(rf + np.float32(3.0) * (xf - rf), want)
    scale_motion_([xb], [rb], 3.0)
    np.testing.assert_array_equal(xb.view(np.uint16), want.view(np.uint16))


def test_scale_motion_by_one_is_a_no_op_and_bad_input_writes_nothing():
    x = [np.array([1.0, 2.0])]
    scale_motion_(x, [np.array([5.0, 5.0])], 1.0)
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite and > 0"):
            scale_motion_(x, [np.array([5.0, 5.0])], bad)
    with pytest.raises(ValueError):
        scale_motion_([np.array([1.0, 2.0]), np.array([3.0])], [np.array([0.0, 0.0]), np.array([0.0, 0.0])], 2.0)
    np.testing.assert_array_equal(x[0], [1.0, 2.0])


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (float64) in ``dtype``: a numpy float dtype's name, or "bfloat16" (rounded once)."""
    if dtype != "bfloat16":
        return values.astype(dtype)
    return from_float32(values.astype(np.float32), np.empty(values.shape, np.uint16)).view(BFLOAT16)


FUSED_CASES = [  # x's dtype, the peer's (a narrower one beside float32), the scale s, the factor f
    (dtype, peer, s, f)
    for dtype, peer in [
        ("float32", "float32"),
        ("float64", "float64"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float32", "float16"),
        ("float32", "bfloat16"),
    ]
    for s, f in [(0.8, 0.3), (1.25, 0.5), (1.0, 0.3), (0.8, 0.0), (0.8, 1.0)]
]


@pytest.mark.parametrize(("dtype", "peer_dtype", "s", "f"), FUSED_CASES)
@pytest.mark.parametrize("writable_peer", [True, False])
def test_scale_motion_and_interpolate_is_the_two_calls_bit_for_bit(dtype, peer_dtype, s, f, writable_peer):
    """One pass, the same bits as scale_motion_ then interpolate_ (push-sum's step and first fold), over several
    blocks, for every dtype, a narrower peer, f = 0.5 (the mean's own path), and the cases that make one call
    nothing (s = 1, f = 0) or overwrite x (f = 1); a writable peer may serve as scratch in both."""
    rng = np.random.default_rng(7)
    x0, ref = (as_dtype(wide(rng, MULTI_BLOCK, np.float64, 3.0), dtype) for _ in range(2))
    p0 = as_dtype(wide(rng, MULTI_BLOCK, np.float64, 3.0), peer_dtype)
    p0.flags.writeable = writable_peer
    x = [x0.copy(), np.zeros(0, x0.dtype)]
    scale_motion_(x, [ref, np.zeros(0, x0.dtype)], s)
    interpolate_(x, [p0.copy() if writable_peer else p0, np.zeros(0, p0.dtype)], f)
    fused = [x0.copy(), np.zeros(0, x0.dtype)]
    peer = p0.copy() if writable_peer else p0
    scale_motion_and_interpolate_(fused, [ref, np.zeros(0, x0.dtype)], s, [peer, np.zeros(0, p0.dtype)], f)
    np.testing.assert_array_equal(bits(fused[0]), bits(x[0]))
    assert not np.array_equal(bits(fused[0]), bits(x0)) or (s == 1.0 and f == 0.0)


def test_scale_motion_and_interpolate_takes_the_mean_s_overflow_path_in_its_block():
    """f = 0.5: a block whose scaled x plus the peer overflows is halved first, as interpolate_ does (the plain
    mean would give inf there); the other blocks take the two-operation mean. Same bits as the two calls."""
    rng = np.random.default_rng(3)
    x, ref, peer = (rng.standard_normal(MULTI_BLOCK).astype(np.float32) for _ in range(3))
    huge = np.float32(0.75) * np.finfo(np.float32).max
    x[BLOCK + 5] = ref[BLOCK + 5] = peer[BLOCK + 5] = huge  # no motion there: scaled, it stays huge
    want = x.copy()
    scale_motion_([want], [ref], 1.5)
    interpolate_([want], [peer.copy()], 0.5)
    scale_motion_and_interpolate_([x], [ref], 1.5, [peer], 0.5)
    np.testing.assert_array_equal(bits(x), bits(want))
    assert x[BLOCK + 5] == huge and np.isfinite(x).all()


def test_scale_motion_and_interpolate_validates_everything_before_writing():
    x = [np.array([1.0, 2.0])]
    good = [np.array([5.0, 5.0])]
    for bad_s in (0.0, math.nan):
        with pytest.raises(ValueError, match="finite and > 0"):
            scale_motion_and_interpolate_(x, good, bad_s, [np.array([0.0, 0.0])], 0.5)
    with pytest.raises(ValueError, match="interpolation factor"):
        scale_motion_and_interpolate_(x, good, 2.0, [np.array([0.0, 0.0])], 1.5)
    with pytest.raises(ValueError, match="term|peer"):
        scale_motion_and_interpolate_(x, good, 2.0, [np.array([0.0, 0.0, 0.0])], 0.5)
    with pytest.raises(ValueError, match="reference"):
        scale_motion_and_interpolate_(x, [np.array([5.0])], 2.0, [np.array([0.0, 0.0])], 0.5)
    np.testing.assert_array_equal(x[0], [1.0, 2.0])


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_relative_distance_is_the_norm_of_the_difference_over_the_norm_of_x(dtype: str) -> None:
    from dpwa.rules.mixing import BLOCK, relative_distance
    from dpwa.utils.bfloat16 import BFLOAT16, from_float32

    def arr(values: np.ndarray) -> np.ndarray:
        if dtype == "bfloat16":
            return from_float32(values.astype(np.float32), np.empty(values.shape, np.uint16)).view(BFLOAT16)
        return values.astype(dtype)

    x = [arr(np.full(BLOCK + 3, 2.0)), arr(np.zeros((2, 2)))]  # more than one block
    peer = [arr(np.full(BLOCK + 3, 1.0)), arr(np.ones((2, 2)))]
    expected = np.sqrt((BLOCK + 3 + 4) / (4.0 * (BLOCK + 3)))
    assert relative_distance(x, peer) == pytest.approx(expected, rel=1e-6)
    assert relative_distance(x, x) == 0.0
    assert relative_distance([arr(np.zeros(3))], [arr(np.zeros(3))]) == 0.0
    assert relative_distance([arr(np.zeros(3))], [arr(np.ones(3))]) == float("inf")
    if dtype == "float32":  # squares of large finite float32 values would overflow float32: computed in float64
        big = np.finfo(np.float32).max / 2
        assert relative_distance([np.full(4, big, np.float32)], [np.full(4, -big, np.float32)]) == pytest.approx(2.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_difference_of_a_difference_taken_first_is_the_same_bits(dtype: type) -> None:
    """``x + a*(p - r)`` against ``x + a*d`` with ``d = p - r`` taken first (``reference`` None: what an exchange
    keeps when a one-buffer node rewrote the snapshot it served), across block boundaries; and it moves x."""
    rng = np.random.default_rng(4)
    x, p, r = (rng.standard_normal(2 * BLOCK + 17).astype(dtype) for _ in range(3))
    direct, folded = x.copy(), x.copy()
    add_difference_([direct], [p], [r], 0.5)
    add_difference_([folded], [p - r], None, 0.5)
    assert folded.tobytes() == direct.tobytes() and not np.array_equal(direct, x)
