"""The rows and the two tables of ``dpwa bench exchange``: absolute figures (medians), then ratios to TARGETS.

One row per (model size, wire dtype). Its figures are medians over the rounds; its ratios are the median
over rounds of each round's ratio (a round measures everything within a second or so, so a load change on
the shared machine between rounds cancels out of its ratios), each with a check mark against
:data:`TARGETS` -- informational, never a test. (a), (a2), (a3), (c) and memcpy are measured once per size and
shown in every row of it; (d) only in the float32 row, and its co-located pair in the float32+shm row. A
skipped measurement is NaN, printed ``-`` and written to JSON as null (:func:`finite_or_none`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from dpwa.tools.bench.exchange.pair import SHARED
from dpwa.tools.bench.report import Column, render_table

__all__ = ["ABSOLUTE", "RATIOS", "TARGETS", "finite_or_none", "push_key", "render", "table_row"]

TARGETS = {
    "fetch_a": 1.15,  # (b) fetch <= 1.15 x (a), float32 wire
    "fm_c_32": 1.1,  # (b) fetch + mix <= 1.1 x (c), float32 wire
    "fm_c_16": 0.7,  # ... <= 0.7 x (c), a narrower wire (16-bit or int8)
    "socket_32": 0.6,  # the socket path close to the wire: (b) fetch + mix <= 0.6 x (c), float32 wire
    "socket_16": 0.45,  # ... <= 0.45 x (c), a 16-bit wire
    "send_memcpy": 1.2,  # update_send <= 1.2 x memcpy
    "mix_memcpy": 1.5,  # mix <= 1.5 x memcpy
    "block": 0.05,  # update_wait's wait < 5 % of a step longer than the exchange
    "push_fetch": 1.1,  # (d) push + fold <= 1.1 x (b) fetch + mix, float32 wire
    "fm_memcpy": 2.0,  # (b) through shared memory: fetch + mix <= 2 x memcpy (co-located nodes)
    "pf_memcpy": 2.0,  # (d) through shared memory: push + fold <= 2 x memcpy (co-located nodes)
}

ABSOLUTE = [
    Column("floats", "floats", ","),
    Column("wire", "wire"),
    Column("wire_mb", "wire MB", ".1f"),
    Column("memcpy_ms", "memcpy ms", ".1f"),
    Column("mix1_ms", "kernel mix ms", ".1f"),
    Column("mixn_ms", "split ms", ".1f"),
    Column("mix_threads", "threads", "d"),
    Column("a_ms", "(a) raw ms", ".1f"),
    Column("a_mbs", "(a) MB/s", ".0f"),
    Column("a2_ms", "(a2) ms", ".1f"),
    Column("a3_ms", "(a3) tcp ms", ".1f"),
    Column("fetch_ms", "(b) fetch ms", ".1f"),
    Column("fetch_mbs", "fetch MB/s", ".0f"),
    Column("mix_ms", "mix ms", ".1f"),
    Column("send_ms", "send ms", ".1f"),
    Column("ready_ms", "peer ready ms", ".1f"),
    Column("c_ms", "(c) gloo ms", ".1f"),
    Column("c_mbs", "(c) MB/s", ".0f"),
    Column("push_ms", "(d) push ms", ".1f"),
    Column("fold_ms", "fold ms", ".1f"),
    Column("step_ms", "step ms", ".1f"),
    Column("wait_ms", "wait ms", ".2f"),
]
RATIOS = [
    Column("floats", "floats", ","),
    Column("wire", "wire"),
    Column("fetch_a", "fetch/a", ".2f"),
    Column("ok_fetch_a", "<=1.15"),
    Column("fetch_a2", "fetch/a2", ".2f"),
    Column("ok_fetch_a2", "<=1.15 "),
    Column("fm_c", "(fetch+mix)/c", ".2f"),
    Column("ok_fm_c", "<=1.1|0.7"),
    Column("ok_socket", "<=0.6|0.45"),
    Column("floor_c", "(a3+mix)/c", ".2f"),
    Column("send_memcpy", "send/memcpy", ".2f"),
    Column("ok_send", "<=1.2"),
    Column("mix_memcpy", "mix/memcpy", ".2f"),
    Column("ok_mix", "<=1.5"),
    Column("split_mix", "split/kernel", ".2f"),
    Column("block", "wait/step", ".3f"),
    Column("ok_block", "<0.05"),
    Column("push_fetch", "(push+fold)/(fetch+mix)", ".2f"),
    Column("ok_push", "<=1.1"),
    Column("fm_memcpy", "(fetch+mix)/memcpy", ".2f"),
    Column("ok_fm_memcpy", "<=2 shm"),
    Column("pf_memcpy", "(push+fold)/memcpy", ".2f"),
    Column("ok_pf_memcpy", "<=2 shm "),
]


def _median(values: Sequence[float]) -> float:
    """The median of ``values``; NaN when there are none (a skipped measurement)."""
    return statistics.median(values) if values else math.nan


def _median_ratio(top: Sequence[float], bottom: Sequence[float]) -> float:
    """The median of ``top[i] / bottom[i]`` over the rounds both were measured in (NaN when none)."""
    return _median([t / b for t, b in zip(top, bottom) if b > 0 and math.isfinite(t) and math.isfinite(b)])


def _ok(value: float, limit: float) -> str:
    """A check mark for ``value <= limit``, a cross otherwise, ``-`` when there is no value."""
    if value is None or not math.isfinite(value):
        return "-"
    return "✓" if value <= limit else "✗"


def _figures(n: int, wire: str, samples: dict[str, list[float]], common: dict[str, list[float]]) -> dict[str, Any]:
    """The absolute figures of one row: medians of its wire dtype's ``samples`` and of the size's ``common`` ones."""
    med = {k: _median(v) for k, v in common.items()}
    m = {k: _median(v) for k, v in samples.items()}
    nbytes = n * 4
    c = med["c_ms"]
    return {
        "floats": n,
        "wire": wire,
        "model_mb": nbytes / 1e6,
        "wire_mb": m["bytes"] / 1e6,
        "memcpy_ms": med["memcpy_ms"],
        "mix1_ms": med["mix1_ms"],
        "mixn_ms": med["mixn_ms"],
        "a_ms": med["a_ms"],
        "a_mbs": nbytes / 1e3 / med["a_ms"],
        "a2_ms": med["a2_ms"],
        "a3_ms": med["a3_ms"],
        "send_ms": m["send_ms"],
        "ready_ms": m["ready_ms"],
        "fetch_ms": m["fetch_ms"],
        "fetch_mbs": m["bytes"] / 1e3 / m["fetch_ms"],
        "mix_ms": m["mix_ms"],
        "c_ms": c,
        "c_mbs": nbytes / 1e3 / c if c == c else math.nan,
        "step_ms": m["step_ms"],
        "wait_ms": m["wait_ms"],
        "push_ms": med[push_key(wire, "push_ms")] if wire in (SHARED, "float32") else math.nan,
        "fold_ms": med[push_key(wire, "fold_ms")] if wire in (SHARED, "float32") else math.nan,
    }


def push_key(wire: str, key: str) -> str:
    """The common samples of (d) a row shows, and that variant of (d) records (``key``: ``push_ms`` or
    ``fold_ms``): the co-located pair's in the float32+shm row."""
    return "shm_" + key if wire == SHARED else key


def _ratios(wire: str, samples: dict[str, list[float]], common: dict[str, list[float]]) -> dict[str, float]:
    """The ratios of one row, each the median over rounds of that round's ratio."""
    fetches, mixes = samples["fetch_ms"], samples["mix_ms"]
    fetch_mix = [f + x for f, x in zip(fetches, mixes)]
    pushes = [p + f for p, f in zip(common[push_key(wire, "push_ms")], common[push_key(wire, "fold_ms")])]
    pushed = wire in (SHARED, "float32")
    return {
        "fetch_a": _median_ratio(fetches, common["a_ms"]),
        "fetch_a2": _median_ratio(fetches, common["a2_ms"]),
        "fm_c": _median_ratio(fetch_mix, common["c_ms"]),
        "floor_c": _median_ratio([t + x for t, x in zip(common["a3_ms"], mixes)], common["c_ms"])
        if wire == "float32"
        else math.nan,
        "send_memcpy": _median_ratio(samples["send_ms"], common["memcpy_ms"]),
        "mix_memcpy": _median_ratio(mixes, common["memcpy_ms"]),
        "split_mix": _median_ratio(common["mixn_ms"], common["mix1_ms"]),
        "block": _median_ratio(samples["wait_ms"], samples["step_ms"]),
        "push_fetch": _median_ratio(pushes, fetch_mix) if pushed else math.nan,
        "fm_memcpy": _median_ratio(fetch_mix, common["memcpy_ms"]),
        "pf_memcpy": _median_ratio(pushes, common["memcpy_ms"]) if wire == SHARED else math.nan,
    }


def _checks(wire: str, ratios: dict[str, float]) -> dict[str, str]:
    """The check mark of each ratio against its target (the fetch/raw ones in the float32 row only)."""
    return {
        "ok_fetch_a": _ok(ratios["fetch_a"], TARGETS["fetch_a"]) if wire == "float32" else "-",
        "ok_fetch_a2": _ok(ratios["fetch_a2"], TARGETS["fetch_a"]) if wire == "float32" else "-",
        "ok_fm_c": _ok(ratios["fm_c"], TARGETS["fm_c_32" if wire == "float32" else "fm_c_16"])
        if wire != SHARED
        else "-",
        "ok_socket": _ok(ratios["fm_c"], TARGETS["socket_32" if wire == "float32" else "socket_16"])
        if wire in ("float32", "float16", "bfloat16")
        else "-",
        "ok_send": _ok(ratios["send_memcpy"], TARGETS["send_memcpy"]),
        "ok_mix": _ok(ratios["mix_memcpy"], TARGETS["mix_memcpy"]),
        "ok_block": _ok(ratios["block"], TARGETS["block"]),
        "ok_push": _ok(ratios["push_fetch"], TARGETS["push_fetch"]),
        "ok_fm_memcpy": _ok(ratios["fm_memcpy"], TARGETS["fm_memcpy"]) if wire == SHARED else "-",
        "ok_pf_memcpy": _ok(ratios["pf_memcpy"], TARGETS["pf_memcpy"]) if wire == SHARED else "-",
    }


def table_row(n: int, wire: str, samples: dict[str, list[float]], common: dict[str, list[float]]) -> dict[str, Any]:
    """The row of model size ``n`` and wire dtype ``wire``: figures, ratios, check marks, and every sample.

    ``samples``: that wire dtype's samples per key (``fetch_ms``, ...); ``common``: the size's, shared by its rows.
    """
    ratios = _ratios(wire, samples, common)
    row = _figures(n, wire, samples, common) | ratios | _checks(wire, ratios)
    row["samples"] = {**common, **samples}
    return row


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The two tables: absolute figures (medians), then the target ratios."""
    return render_table(rows, ABSOLUTE) + "\n\n" + render_table(rows, RATIOS)


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinity (a skipped measurement) replaced by None: strict JSON."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
