"""dpwa.rules.mixing.add_differences_: ``x <- x + a * sum_j (p_j - r)`` in one pass, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import traced_peak

from dpwa.rules.mixing import BLOCK, add_difference_, add_differences_
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

MULTI_BLOCK = 2 * BLOCK + 123  # several blocks, the last one partial
DTYPES = ["float64", "float32", "float16", "bfloat16"]


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype != "bfloat16":
        return values.astype(dtype)
    return from_float32(values.astype(np.float32), np.empty(values.shape, np.uint16)).view(BFLOAT16)


def compute(a: np.ndarray) -> np.ndarray:
    """``a`` in the dtype the kernel computes it in (float16/bfloat16 widened exactly to float32)."""
    if a.dtype == BFLOAT16:
        return to_float32(a, np.empty(a.shape, np.float32))
    return a.astype(np.float32) if a.dtype == np.float16 else a.copy()


def expected(x: np.ndarray, peers: list[np.ndarray], ref: np.ndarray | None, a: float) -> np.ndarray:
    """The contract over whole arrays: the differences summed in order, times ``a``, added once, rounded once."""
    c = compute(x).dtype.type
    acc = compute(peers[0]) - compute(ref) if ref is not None else compute(peers[0])
    for p in peers[1:]:
        acc = acc + (compute(p) - compute(ref) if ref is not None else compute(p))
    out = compute(x) + acc * c(a)
    return as_dtype(out, x.dtype.name if x.dtype != BFLOAT16 else "bfloat16")


def random_arrays(dtype: str, k: int, n: int = MULTI_BLOCK, seed: int = 1) -> tuple[np.ndarray, list, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, *peers, ref = (as_dtype(rng.standard_normal(n) * 3, dtype) for _ in range(k + 2))
    return x, peers, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("with_reference", [True, False])
def test_is_the_whole_array_formula_bit_for_bit_across_blocks(dtype: str, k: int, with_reference: bool) -> None:
    x, peers, ref = random_arrays(dtype, k)
    ref = ref if with_reference else None
    want = expected(x, peers, ref, 1 / 3)
    before = [p.copy() for p in peers]
    add_differences_([x], [[p] for p in peers], None if ref is None else [ref], 1 / 3)
    assert x.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    assert all(np.array_equal(p.view(np.uint8), b.view(np.uint8)) for p, b in zip(peers, before))  # only read


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_peer_is_add_difference_and_many_arrays_each_take_their_own(dtype: str) -> None:
    x, (p,), r = random_arrays(dtype, 1, seed=2)
    small_x, small_p, small_r = (as_dtype(np.arange(6.0).reshape(2, 3) * s, dtype) for s in (1.0, 2.0, 0.5))
    one, many = [x.copy(), small_x.copy()], [x.copy(), small_x.copy()]
    add_difference_(one, [p, small_p], [r, small_r], 0.25)
    add_differences_(many, [[p, small_p]], [r, small_r], 0.25)
    for a, b in zip(one, many):
        assert a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()
    # the small array moved by 0.25 * (2 - 0.5) * its values, exact in every dtype here
    np.testing.assert_array_equal(compute(many[1]), compute(as_dtype(np.arange(6.0).reshape(2, 3) * 1.375, dtype)))


def test_the_sum_of_the_differences_is_the_sum_of_the_single_steps_in_exact_arithmetic() -> None:
    """Small integers: every operation exact, so one pass over two peers equals two passes over one each."""
    x = np.array([1.0, -2.0, 8.0], np.float32)
    p1, p2, r = (np.array(v, np.float32) for v in ([4.0, 0.0, 8.0], [2.0, 2.0, 0.0], [1.0, 1.0, 4.0]))
    twice = x.copy()
    add_difference_([twice], [p1], [r], 0.5)
    add_difference_([twice], [p2], [r], 0.5)
    once = x.copy()
    add_differences_([once], [[p1], [p2]], [r], 0.5)
    np.testing.assert_array_equal(once, twice)
    np.testing.assert_array_equal(once, [3.0, -2.0, 8.0])  # x + 0.5 * ((p1 - r) + (p2 - r))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nothing_to_add_leaves_x_bit_exact(dtype: str) -> None:
    x, peers, ref = random_arrays(dtype, 2, n=100)
    before = x.copy()
    add_differences_([x], [[p] for p in peers], [ref], 0.0)
    add_differences_([x], [], [ref], 0.5)
    assert x.tobytes() == before.tobytes()


@pytest.mark.parametrize(
    ("bad_peer", "message"),
    [
        (np.zeros(5, np.float32), "peer 1"),  # the wrong shape
        (np.zeros(4, np.float64), "peer 1"),  # the wrong dtype
        (np.zeros(4, np.float16), "peer 1"),  # a narrower peer is not taken here
    ],
)
def test_a_bad_peer_anywhere_raises_before_x_is_written(bad_peer: np.ndarray, message: str) -> None:
    x = np.ones(4, np.float32)
    good = np.full(4, 3.0, np.float32)
    with pytest.raises(ValueError, match=message):
        add_differences_([x], [[good], [bad_peer]], [np.zeros(4, np.float32)], 0.5)
    with pytest.raises(ValueError, match="reference"):
        add_differences_([x], [[good]], [np.zeros(3, np.float32)], 0.5)
    with pytest.raises(ValueError, match="factor"):
        add_differences_([x], [[good]], None, 1.5)
    np.testing.assert_array_equal(x, 1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allocates_at_most_block_scratch_whatever_the_number_of_peers(dtype: str) -> None:
    x, peers, ref = random_arrays(dtype, 3, n=64 * BLOCK)
    peak = traced_peak(lambda: add_differences_([x], [[p] for p in peers], [ref], 0.25))
    # three float32 blocks, plus numpy's fixed-size casting buffers and small objects; the model is 8-16 MiB
    assert peak < 3 * BLOCK * 4 + 128 * 1024
