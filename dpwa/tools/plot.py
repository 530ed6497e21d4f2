"""One PNG with three panels from a run directory's metrics files (``dpwa plot RUN_DIR``, :mod:`dpwa.cli.plot`).

1. training loss vs step, one line per node (every batch faint, a moving average bold);
2. mixing factor over time (seconds since the first record), a moving average per node;
3. histogram of fetch latency (ms) of the successful fetches, per node.

matplotlib is an optional extra (``pip install 'dpwa[plot]'``); it is imported only here, only when
the command runs, and drawn with the Agg canvas (no display needed, pyplot's global state untouched).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpwa.config import ConfigError, load_config
from dpwa.launcher.rundir import RunDir, finite_number

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_NAME", "MISSING_MATPLOTLIB", "plot_run", "series"]

MISSING_MATPLOTLIB = "dpwa plot needs matplotlib: pip install 'dpwa[plot]'"
DEFAULT_NAME = "plot.png"
SMOOTH = 20  # records in the moving average of the mixing factor


def series(records: Sequence[Mapping[str, Any]], t0: float) -> dict[str, list[float]]:
    """The plotted columns of one node's exchange records (report lines and bad values skipped):
    ``step``/``loss``, ``time``/``factor`` (time in seconds since ``t0``) and ``fetch_ms`` (ok fetches)."""
    out: dict[str, list[float]] = {"step": [], "loss": [], "time": [], "factor": [], "fetch_ms": []}
    for record in records:
        if record.get("event") is not None:
            continue
        step, loss, t, factor = (finite_number(record.get(k)) for k in ("step", "loss", "time", "factor"))
        if step is not None and loss is not None:
            out["step"].append(step)
            out["loss"].append(loss)
        if t is not None and factor is not None:
            out["time"].append(t - t0)
            out["factor"].append(factor)
        fetch_ms = finite_number(record.get("fetch_ms"))
        if fetch_ms is not None and "ok" in str(record.get("status") or "").split(","):
            out["fetch_ms"].append(fetch_ms)
    return out


def plot_run(run_dir: RunDir, output: Path) -> Path:
    """Draw ``run_dir``'s metrics into the PNG ``output``; ValueError when it has no metrics files.

    ImportError when matplotlib is missing.
    """
    from matplotlib.figure import Figure  # the optional extra

    names = _node_order(run_dir)
    if not names:
        raise ValueError(f"{run_dir.path}: no *.metrics.jsonl files (is it a dpwa run directory?)")
    records = {name: run_dir.read_metrics(name) for name in names}
    times = [t for rs in records.values() for r in rs if (t := finite_number(r.get("time"))) is not None]
    t0 = min(times, default=0.0)
    data = {name: series(rs, t0) for name, rs in records.items()}

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    loss_ax, factor_ax, fetch_ax = fig.subplots(1, 3)
    for i, (name, cols) in enumerate(data.items()):
        color = f"C{i % 10}"
        window = max(SMOOTH, len(cols["loss"]) // 50)  # ~50 independent points across the run
        loss_ax.plot(cols["step"], cols["loss"], color=color, linewidth=0.5, alpha=0.2)
        loss_ax.plot(cols["step"], _moving_average(cols["loss"], window), color=color, label=name, linewidth=1.5)
        factor_ax.plot(cols["time"], _moving_average(cols["factor"], SMOOTH), color=color, label=name, linewidth=1)
    fetches = [ms for cols in data.values() for ms in cols["fetch_ms"]]
    if fetches:
        top = float(np.percentile(fetches, 99.5)) or max(fetches)  # rare outliers would squash the rest
        bins = np.histogram_bin_edges(np.minimum(fetches, top), bins=40)
        for i, (name, cols) in enumerate(data.items()):
            color = f"C{i % 10}"  # the same colour as the node's lines in the other panels
            fetch_ax.hist(np.minimum(cols["fetch_ms"], top), bins=bins, histtype="step", label=name, color=color)
        fetch_ax.legend(fontsize="small")
    else:
        fetch_ax.text(0.5, 0.5, "no successful fetches", ha="center", va="center", transform=fetch_ax.transAxes)
    loss_ax.set(title="training loss", xlabel="step (faint: every batch, bold: moving average)", ylabel="loss")
    factor_ax.set(title=f"mixing factor (moving average of {SMOOTH})", xlabel="seconds", ylabel="factor")
    fetch_ax.set(title="fetch latency (ok fetches)", xlabel="ms (last bin: slowest 0.5 %)", ylabel="fetches")
    for ax in (loss_ax, factor_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(str(run_dir.path), fontsize="small")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    log.info("wrote %s", output)
    return output


# --------------------------------------------------------------------------- helpers


def _node_order(run_dir: RunDir) -> list[str]:
    """Nodes with a metrics file, in the order of the run's cluster.yaml (then any others, sorted)."""
    present = run_dir.metrics_nodes()
    try:
        ordered = [node.name for node in load_config(run_dir.config_path).nodes]
    except ConfigError:
        ordered = []
    return [n for n in ordered if n in present] + [n for n in present if n not in ordered]


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
