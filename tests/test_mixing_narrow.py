"""A narrower peer: the mixing kernels read a float16 or bfloat16 peer beside a float32 ``x`` (a receive buffer
kept in the wire's dtype under ``transport: {memory: low}``), widening it block by block as they read it.

Widening is exact, so each kernel must give the very bits it gives for the peer widened first, allocate no more
than its block scratch, leave the peer as it was, and still refuse every other dtype mismatch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest
from conftest import traced_peak

from dpwa.rules.mixing import (
    BLOCK,
    add_difference_,
    interpolate_,
    interpolate_elementwise_,
    relative_distance,
    scale_motion_,
    widen,
)
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

MULTI_BLOCK = 2 * BLOCK + 123  # several blocks and a partial one
WIRES = ["float16", "bfloat16"]


def narrow_and_wide(rng: np.random.Generator, n: int, wire: str) -> tuple[np.ndarray, np.ndarray]:
    """A peer array in ``wire``'s dtype, and the same values widened to float32."""
    values = (rng.standard_normal(n) * 3).astype(np.float32)
    if wire == "bfloat16":
        narrow = from_float32(values, np.empty(n, BFLOAT16))
        return narrow, to_float32(narrow, np.empty(n, np.float32))
    narrow = values.astype(np.float16)
    return narrow, narrow.astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("f", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("writeable", [True, False])
def test_interpolate_with_a_narrower_peer_gives_the_bits_of_the_peer_widened_first(
    wire: str, f: float, writeable: bool
) -> None:
    rng = np.random.default_rng(1)
    narrow, widened = narrow_and_wide(rng, MULTI_BLOCK, wire)
    small, small_wide = narrow_and_wide(rng, 7, wire)
    narrow.flags.writeable = writeable
    before = narrow.copy()
    x = [rng.standard_normal(MULTI_BLOCK).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    expected = [a.copy() for a in x]
    interpolate_(expected, [widened, small_wide], f)
    interpolate_(x, [narrow, small], f)
    for a, b in zip(x, expected):
        same_bits(a, b)
    np.testing.assert_array_equal(narrow, before)  # a narrower peer is only read, writable or not


@pytest.mark.parametrize("wire", WIRES)
def test_relative_distance_to_a_narrower_peer_is_the_distance_to_the_peer_widened(wire: str) -> None:
    rng = np.random.default_rng(3)
    narrow, widened = narrow_and_wide(rng, MULTI_BLOCK, wire)
    x = [rng.standard_normal(MULTI_BLOCK).astype(np.float32)]
    assert relative_distance(x, [narrow]) == relative_distance(x, [widened]) > 0.5


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(
    "kernel",
    [
        lambda x, p: interpolate_(x, p, 0.3),
        lambda x, p: interpolate_(x, p, 0.5),
    ],
    ids=["interpolate", "mean"],
)
def test_a_narrower_peer_costs_no_more_than_block_scratch(
    wire: str, kernel: Callable[[list[np.ndarray], list[np.ndarray]], None]
) -> None:
    n = 1 << 22  # 16 MiB of float32 x: block scratch is a small part of it
    narrow, _ = narrow_and_wide(np.random.default_rng(4), n, wire)
    x = [np.ones(n, np.float32)]
    peak = traced_peak(lambda: kernel(x, [narrow]))
    assert peak < 4 * BLOCK * 4 + 128 * 1024 and peak < x[0].nbytes / 10


@pytest.mark.parametrize("wire", WIRES)
def test_every_other_dtype_mismatch_is_still_refused_before_anything_is_written(wire: str) -> None:
    rng = np.random.default_rng(5)
    narrow, widened = narrow_and_wide(rng, 64, wire)
    x32 = np.ones(64, np.float32)
    for x, peer in (
        (np.ones(64, np.float64), narrow),  # a narrower peer beside float64: not taken
        (narrow.copy(), widened),  # a wider peer beside a 16-bit x
    ):
        before = x.copy()
        with pytest.raises(ValueError, match="array 0"):
            interpolate_([x], [peer], 0.5)
        np.testing.assert_array_equal(x, before)
    # the kernels that take a reference or per-element factors take no narrower peer
    with pytest.raises(ValueError, match="array 0"):
        add_difference_([x32], [narrow], [x32.copy()], 0.5)
    with pytest.raises(ValueError, match="array 0"):
        interpolate_elementwise_([x32], [narrow], [np.full(64, 0.5, np.float32)])
    with pytest.raises(ValueError, match="array 0"):
        scale_motion_([x32], [narrow], 2.0)
    np.testing.assert_array_equal(x32, 1.0)


def test_widen_gives_every_float16_exactly_through_torch_and_through_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 is widened by torch's cast once the process has imported torch (the adapter's), else by numpy's:
    every one of the 65,536 bit patterns comes out as numpy's exact cast (NaNs as NaNs)."""
    pytest.importorskip("torch")
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    expected = every.astype(np.float32)
    finite = ~np.isnan(expected)
    through_torch = widen(every.copy(), np.empty(every.size, np.float32))
    monkeypatch.delitem(sys.modules, "torch")
    through_numpy = widen(every.copy(), np.empty(every.size, np.float32))
    for got in (through_torch, through_numpy):
        np.testing.assert_array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))
        assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize("rule_name", ["constant", "clock", "loss"])
def test_a_rule_that_says_it_mixes_narrower_peers_mixes_the_bits_of_the_peers_widened(rule_name: str) -> None:
    """What ``Rule.mixes_narrower_peers`` promises (the node then receives 16-bit replies as they travel): the
    rule's whole mix, given a peer in float16 or bfloat16, moves the parameters exactly as given it widened."""
    from dpwa.rules import NodeState, PeerSnapshot, make_rule

    for wire in WIRES:
        rng = np.random.default_rng(6)
        (narrow, widened), x0 = narrow_and_wide(rng, MULTI_BLOCK, wire), rng.standard_normal(MULTI_BLOCK)
        results = []
        for peer_array in (narrow, widened):
            rule = make_rule(rule_name, None, 0.0)
            assert rule.mixes_narrower_peers()
            own = NodeState("w1", clock=5.0, loss=1.0, extras=rule.initial_extras("w1", ["w1", "w2"]))
            peer = NodeState("w2", clock=7.0, loss=0.5, extras=rule.initial_extras("w2", ["w1", "w2"]))
            x = [x0.astype(np.float32)]
            outcome = rule.mix(own, x, [PeerSnapshot(peer, [peer_array])])
            assert outcome.factor > 0, outcome
            results.append(x[0])
        same_bits(results[0], results[1])


def test_the_rules_that_mix_otherwise_say_so() -> None:
    """A rule whose mix reads a peer through another kernel (or keeps it) must not be handed 16-bit peers."""
    from dpwa.rules import make_rule

    for name in ("gem", "pushsum", "adpsgd", "group", "gt", "choco", "dpsgd"):
        assert not make_rule(name, None, 0.0).mixes_narrower_peers(), name


def test_a_catch_up_copy_of_a_16_bit_peer_takes_its_values_widened() -> None:
    from dpwa.node.recovery import copy_peer
    from dpwa.rules import NodeState, PeerSnapshot, make_rule

    for wire in WIRES:
        narrow, widened = narrow_and_wide(np.random.default_rng(8), MULTI_BLOCK, wire)
        rule, own = make_rule("constant", None, 0.0), NodeState("w1", clock=1.0)
        params = [np.zeros(MULTI_BLOCK, np.float32)]
        copy_peer(own, rule, params, PeerSnapshot(NodeState("w2", clock=9.0), [narrow]))
        same_bits(params[0], widened)
        assert own.clock == 9.0
