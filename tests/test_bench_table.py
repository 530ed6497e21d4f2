"""``dpwa bench exchange``'s ratio table: each ratio is the median of the rounds' ratios, and each check mark holds
it against the right target (no process, no socket: the table from made-up samples)."""

from __future__ import annotations

import math

import pytest

from dpwa.tools.bench.exchange.measure import COMMON_KEYS, PER_WIRE_KEYS
from dpwa.tools.bench.exchange.pair import SHARED
from dpwa.tools.bench.exchange.table import RATIOS, TARGETS, render, table_row

ROUNDS = 3


def samples(c_ms: float, fetch_ms: float, mix_ms: float) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Three rounds of one row: gloo ``c_ms``, this wire's fetch and mix, everything else 1 ms."""
    common = {k: [1.0] * ROUNDS for k in COMMON_KEYS} | {"c_ms": [c_ms] * ROUNDS}
    per = {k: [1.0] * ROUNDS for k in PER_WIRE_KEYS} | {"fetch_ms": [fetch_ms] * ROUNDS, "mix_ms": [mix_ms] * ROUNDS}
    return per, common


@pytest.mark.parametrize(
    ("wire", "fetch_mix", "ok_fm_c", "ok_socket"),
    [
        ("float32", 62.0, "✓", "✗"),  # meets the first target (1.1 x gloo), not the socket path's (0.6 x)
        ("float32", 59.0, "✓", "✓"),
        ("float32", 111.0, "✗", "✗"),
        ("bfloat16", 46.0, "✓", "✗"),  # 16-bit: 0.7 x and 0.45 x
        ("float16", 44.0, "✓", "✓"),
        ("bfloat16", 71.0, "✗", "✗"),
        ("int8", 40.0, "✓", "-"),  # the socket path's targets are for float32 and 16-bit wires
        (SHARED, 12.0, "-", "-"),  # co-located: held against memcpy instead
    ],
)
def test_fetch_and_mix_against_gloo_is_checked_against_both_targets(
    wire: str, fetch_mix: float, ok_fm_c: str, ok_socket: str
) -> None:
    per, common = samples(100.0, fetch_mix - 10.0, 10.0)
    row = table_row(25_000_000, wire, per, common)
    assert math.isclose(row["fm_c"], fetch_mix / 100.0)
    assert (row["ok_fm_c"], row["ok_socket"]) == (ok_fm_c, ok_socket)


def test_a_ratio_is_the_median_of_the_rounds_ratios() -> None:
    per, common = samples(100.0, 50.0, 10.0)
    per["fetch_ms"] = [50.0, 110.0, 20.0]  # fetch + mix 60, 120, 30 ms
    common["c_ms"] = [100.0, 100.0, 20.0]  # a load change between rounds: each round's ratio counts
    row = table_row(10_000_000, "float32", per, common)
    assert math.isclose(row["fm_c"], 1.2)  # rounds 0.6, 1.2, 1.5 (the ratio of the medians would be 0.6)


def test_the_socket_targets_are_printed_beside_the_first_ones() -> None:
    assert (TARGETS["socket_32"], TARGETS["socket_16"]) == (0.6, 0.45)
    headers = [c.header for c in RATIOS]
    assert headers.index("<=0.6|0.45") == headers.index("<=1.1|0.7") + 1
    per, common = samples(100.0, 52.0, 10.0)
    text = render([table_row(25_000_000, "float32", per, common)])
    assert "<=0.6|0.45" in text and "✗" in text
