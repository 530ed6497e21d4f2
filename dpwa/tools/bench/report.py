"""What every benchmark writes: a table on stdout, ``<name>.json`` (rows + machine) in its run directory."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["Column", "Report", "bench_run_dir", "comma_list", "machine_info", "render_table"]


@dataclass(frozen=True)
class Column:
    """One table column: the row key, its header and a format spec (e.g. ``".1f"``)."""

    key: str
    header: str
    fmt: str = ""


_T = TypeVar("_T")


def comma_list(text: str, convert: Callable[[str], _T], valid: Callable[[_T], bool], example: str) -> list[_T]:
    """``"1,4"`` -> ``[convert("1"), convert("4")]``; click.BadParameter unless non-empty and every value ``valid``."""
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(valid(v) for v in values):
        raise click.BadParameter(f"{text!r}: give {example}, comma-separated")
    return values


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) if fmt else str(value)


def render_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[c.header for c in columns]] + [[_cell(r.get(c.key), c.fmt) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """The facts a reader needs to compare figures: cores, CPU model, memory, versions, date."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    for module in ("numpy", "zmq", "torch"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            pass
    return info


def bench_run_dir(kind: str, given: str | os.PathLike[str] | None = None) -> Path:
    """``given``, or ``runs/bench-<kind>-<YYYYmmdd-HHMMSS>``; created."""
    path = Path(given) if given else Path("runs") / f"bench-{kind}-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Report:
    """A benchmark's result: rows of figures (and ratios), the machine, the settings."""

    name: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=machine_info)

    def write(self, run_dir: Path) -> Path:
        """``<run_dir>/<name>.json``."""
        path = run_dir / f"{self.name}.json"
        doc = {"benchmark": self.name, "settings": self.settings, "machine": self.machine, "rows": self.rows}
        path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
        return path
