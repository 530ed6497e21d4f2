"""bfloat16 as tagged uint16: conversions against torch's own, isfinite, and the wire/mixing paths that carry it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import traced_peak
from hypothesis import given
from hypothesis import strategies as st

from dpwa.node.wire import FiniteChecker, Layout
from dpwa.rules.mixing import BLOCK, interpolate_, interpolate_elementwise_
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, is_bfloat16, isfinite, to_float32

ALL_BITS = np.arange(1 << 16, dtype=np.uint16).view(BFLOAT16)
"""Every bfloat16 value there is."""


def torch_bf16(bits: np.ndarray) -> torch.Tensor:
    """The torch bfloat16 tensor with these raw bits."""
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def torch_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a torch bfloat16 tensor."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def ours_from_float32(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, BFLOAT16)
    from_float32(x, out)
    return out.view(np.uint16)


def assert_same_as_torch(x: np.ndarray) -> None:
    """from_float32 equals torch's float32 -> bfloat16 bit for bit; NaN only has to stay NaN."""
    ours = ours_from_float32(x)
    ref = torch_bits(torch.from_numpy(x).to(torch.bfloat16))
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert ((ours[nan] & 0x7F80) == 0x7F80).all() and ((ours[nan] & 0x007F) != 0).all()


# ------------------------------------------------------------ conversions


def test_to_float32_is_exact_for_every_bfloat16():
    out = np.empty(ALL_BITS.shape, np.float32)
    assert to_float32(ALL_BITS, out) is out
    ref = torch_bf16(ALL_BITS).float().numpy()
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))  # NaN payloads included


def test_from_float32_round_trips_every_non_nan_bfloat16():
    wide = np.empty(ALL_BITS.shape, np.float32)
    to_float32(ALL_BITS, wide)
    back = ours_from_float32(wide)
    keep = ~np.isnan(wide)
    np.testing.assert_array_equal(back[keep], ALL_BITS.view(np.uint16)[keep])


def test_from_float32_matches_torch_on_random_bit_patterns():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint32).view(np.float32)  # NaN, inf, subnormals included
    assert_same_as_torch(x)


def test_from_float32_ties_round_to_even():
    upper = np.arange(0, 1 << 16, 7, dtype=np.uint32) << 16  # all signs and exponents, odd and even mantissas
    x = np.concatenate([upper | low for low in (0x7FFF, 0x8000, 0x8001, 0x0001, 0xFFFF)]).view(np.float32)
    assert_same_as_torch(x)
    ties = (np.array([0x3F80_8000, 0x3F81_8000, 0x0000_8000, 0x0001_8000, 0x8001_8000], np.uint32)).view(np.float32)
    np.testing.assert_array_equal(ours_from_float32(ties), [0x3F80, 0x3F82, 0x0000, 0x0002, 0x8002])


def test_from_float32_special_values():
    f32 = np.finfo(np.float32)
    x = np.array(
        [0.0, -0.0, np.inf, -np.inf, f32.max, -f32.max, f32.tiny, f32.smallest_subnormal, -f32.smallest_subnormal],
        np.float32,
    )
    assert_same_as_torch(x)
    out = ours_from_float32(x)
    assert out[0] == 0x0000 and out[1] == 0x8000 and out[2] == 0x7F80 and out[3] == 0xFF80
    assert out[4] == 0x7F80 and out[5] == 0xFF80  # float32 max rounds up past bfloat16's max: infinity


def test_nan_stays_nan_with_its_sign():
    nans = np.array([0x7FC0_0000, 0x7F80_0001, 0x7FFF_FFFF, 0xFFFF_FFFF, 0xFF80_0001], np.uint32).view(np.float32)
    out = ours_from_float32(nans)
    np.testing.assert_array_equal(out, [0x7FC0, 0x7FC0, 0x7FC0, 0xFFC0, 0xFFC0])


@given(st.floats(width=32, allow_nan=False))
def test_from_float32_matches_torch_for_any_float(value):
    assert_same_as_torch(np.array([value], np.float32))


def test_scratch_gives_the_same_result_and_is_checked():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1000).astype(np.float32)
    out = np.empty(1000, BFLOAT16)
    from_float32(x, out, scratch=np.empty(2000, np.uint32))
    np.testing.assert_array_equal(out.view(np.uint16), ours_from_float32(x))
    with pytest.raises(ValueError, match="scratch"):
        from_float32(x, out, scratch=np.empty(999, np.uint32))
    with pytest.raises(ValueError, match="shape|src"):
        from_float32(x, np.empty(999, BFLOAT16))
    with pytest.raises(ValueError, match="dtypes"):
        to_float32(x, np.empty(1000, np.float32))


def test_conversions_work_on_strided_views():
    wide = np.empty(ALL_BITS.shape, np.float32)
    to_float32(ALL_BITS, wide)
    finite = wide[np.isfinite(wide)].reshape(-1, 2)[:, 0]  # a strided view
    out = np.empty(finite.shape, BFLOAT16)
    from_float32(finite, out)
    back = np.empty(finite.shape, np.float32)
    to_float32(out, back)
    np.testing.assert_array_equal(back, finite)


# ------------------------------------------------------------ isfinite and the tag


def test_isfinite_for_every_bfloat16():
    out = np.empty(ALL_BITS.shape, bool)
    assert isfinite(ALL_BITS, out) is out
    np.testing.assert_array_equal(out, torch.isfinite(torch_bf16(ALL_BITS)).numpy())
    assert (~out).sum() == 2 * 128  # +-inf and every NaN: exponent all ones
    again = np.empty(ALL_BITS.shape, bool)
    isfinite(ALL_BITS, again, scratch=np.empty(1 << 17, np.uint16))
    np.testing.assert_array_equal(again, out)


def test_the_tag_survives_views_and_is_told_apart():
    a = np.zeros(12, np.uint16).view(BFLOAT16)
    for v in (a.reshape(3, 4), a[2:7], a.reshape(3, 4)[:, 1], a.copy(), np.empty_like(a)):
        assert is_bfloat16(v.dtype)
    assert is_bfloat16(BFLOAT16)
    assert not is_bfloat16(np.dtype(np.uint16)) and not is_bfloat16(np.dtype(np.float16))
    assert not is_bfloat16(np.dtype(">u2", metadata={"dpwa": "bfloat16"}))
    t = torch.randn(5).to(torch.bfloat16)
    view = t.view(torch.int16).numpy().view(BFLOAT16)
    assert is_bfloat16(view.dtype) and view.flags.writeable
    view[0] = 0x3F80  # writes through to the tensor
    assert t[0].item() == 1.0


# ------------------------------------------------------------ wire


def bf16_array(values, shape=None) -> np.ndarray:
    t = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    a = torch_bits(t).copy().view(BFLOAT16)
    return a.reshape(shape) if shape else a


def test_layout_accepts_bfloat16_with_its_own_fingerprint():
    a = Layout.of([np.zeros((3, 4), np.uint16).view(BFLOAT16)])
    assert a.dtypes == ("bf16",)
    assert a.fingerprint != Layout.of([np.zeros((3, 4), np.float16)]).fingerprint
    assert Layout.of([np.zeros((3, 4), np.uint16)]).dtypes == ("<u2",)  # a real uint16 is an (index) array apart
    views = a.views(a.allocate())
    assert views[0].shape == (3, 4) and is_bfloat16(views[0].dtype)
    assert a.matches([np.zeros((3, 4), BFLOAT16)])
    assert not a.matches([np.zeros((3, 4), np.uint16)]) and not a.matches([np.zeros((3, 4), np.float16)])


def test_mixed_layout_offsets_cover_bfloat16():
    layout = Layout.of([np.zeros(5, np.float32), np.zeros(7, BFLOAT16), np.zeros(3, np.float64)])
    buf = layout.allocate()
    views = layout.views(buf)
    views[1][:] = bf16_array([1.0] * 7)
    start = layout.offsets[1]
    np.testing.assert_array_equal(buf[start : start + 14].view(np.uint16), [0x3F80] * 7)
    assert layout.total_bytes >= layout.offsets[1] + 14


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_finite_checker_rejects_bfloat16_inf_and_nan(bad):
    n = 3 * 1000 + 17
    layout = Layout.of([np.zeros(10, np.float32), np.zeros(n, BFLOAT16)])
    buf = layout.allocate()
    views = layout.views(buf)
    views[1][:] = bf16_array(np.linspace(-1e30, 1e30, n).tolist())
    checker = FiniteChecker(layout, block=1000)
    assert checker.all_finite(views, 0, layout.total_bytes)
    views[1][n - 5] = bf16_array([bad])[0]
    assert not checker.all_finite(views, 0, layout.total_bytes)
    end_of_first = layout.offsets[1]
    assert checker.all_finite(views, 0, end_of_first)  # bytes of the float32 array only


# ------------------------------------------------------------ mixing

MULTI_BLOCK = 2 * BLOCK + 123


def random_bf16(rng: np.random.Generator, n: int, span: float = 20.0) -> np.ndarray:
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-span, span, n))).astype(np.float32)
    return ours_from_float32(x).copy().view(BFLOAT16)


@pytest.mark.parametrize("f", [0.5, 0.3, 0.9])
def test_interpolate_bfloat16_matches_torch_float32_rounded_once(f):
    rng = np.random.default_rng(2)
    x, p = random_bf16(rng, MULTI_BLOCK), random_bf16(rng, MULTI_BLOCK)
    tx, tp = torch_bf16(x), torch_bf16(p)
    expect = torch_bits((tx.float() * (1.0 - f) + tp.float() * f).to(torch.bfloat16))
    p_before = p.copy()
    interpolate_([x], [p], f)
    assert is_bfloat16(x.dtype)
    np.testing.assert_array_equal(x.view(np.uint16), expect)
    np.testing.assert_array_equal(p.view(np.uint16), p_before.view(np.uint16))  # a half peer is never scratch


def test_interpolate_bfloat16_f0_and_f1_are_bit_exact():
    rng = np.random.default_rng(3)
    x, p = random_bf16(rng, 1000), random_bf16(rng, 1000)
    before = x.copy()
    interpolate_([x], [p], 0.0)
    np.testing.assert_array_equal(x.view(np.uint16), before.view(np.uint16))
    interpolate_([x], [p], 1.0)
    np.testing.assert_array_equal(x.view(np.uint16), p.view(np.uint16))


def test_interpolate_refuses_plain_uint16_against_bfloat16():
    x = np.zeros(4, BFLOAT16)
    with pytest.raises(ValueError):
        interpolate_([x], [np.zeros(4, np.uint16)], 0.5)
    with pytest.raises(ValueError, match="dtype"):
        interpolate_([np.zeros(4, np.uint16)], [np.zeros(4, np.uint16)], 0.5)


def test_elementwise_bfloat16_matches_torch():
    rng = np.random.default_rng(4)
    x, p = random_bf16(rng, MULTI_BLOCK), random_bf16(rng, MULTI_BLOCK)
    f = rng.uniform(0, 1, MULTI_BLOCK).astype(np.float32)
    f[:3] = [0.0, 1.0, 0.5]
    tx, tp, tf = torch_bf16(x).float(), torch_bf16(p).float(), torch.from_numpy(f)
    expect = torch_bits(((tx - tf * tx) + tf * tp).to(torch.bfloat16))
    mean = interpolate_elementwise_([x], [p], [f])
    np.testing.assert_array_equal(x.view(np.uint16), expect)
    assert x.view(np.uint16)[1] == p.view(np.uint16)[1]
    assert mean == pytest.approx(float(f.astype(np.float64).mean()))


def test_bfloat16_mixing_allocates_at_most_block_scratch():
    n = 4 * 1024 * 1024
    x = np.full(n, 0x3F80, np.uint16).view(BFLOAT16)  # 1.0
    p = np.zeros(n, BFLOAT16)
    f = np.full(n, 0.25, np.float32)
    for run in (lambda: interpolate_([x], [p], 0.5), lambda: interpolate_elementwise_([x], [p], [f])):
        peak = traced_peak(run)
        # two float32 blocks + the NaN mask of one block + numpy's casting buffers
        assert peak < 2 * BLOCK * 4 + BLOCK + 128 * 1024, peak
    assert x.view(np.uint16)[0] == bf16_array([0.375])[0]  # 1 -> 0.5 -> 0.375
