"""``dpwa bench exchange --plot``: ``exchange.png``, a bar chart of each model size's times (needs matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_rows"]


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """A bar chart (ms, log scale) per model size: memcpy, (a), (a2), (a3), (b) fetch+mix per wire dtype, (c)."""
    from matplotlib.figure import Figure  # the optional extra

    sizes = sorted({r["floats"] for r in rows})
    fig = Figure(figsize=(4 + 3 * len(sizes), 4.5))
    ax = fig.add_subplot()
    labels: list[str] = ["memcpy", "(a) raw", "(a2) raw chunked", "(a3) tcp"]
    labels += [f"(b) {w}" for w in dict.fromkeys(r["wire"] for r in rows)] + ["(c) gloo"]
    width = 0.8 / len(labels)
    for i, n in enumerate(sizes):
        these = [r for r in rows if r["floats"] == n]
        first = these[0]
        values = [first["memcpy_ms"], first["a_ms"], first["a2_ms"], first["a3_ms"]]
        values += [r["fetch_ms"] + r["mix_ms"] for r in these] + [first["c_ms"]]
        for j, v in enumerate(values):
            ax.bar(i + j * width, v, width, color=f"C{j}", label=labels[j] if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{n:,} floats" for n in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title("one exchange: dpwa fetch+mix vs raw pyzmq and gloo all_reduce")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
