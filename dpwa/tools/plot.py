"""One PNG with three panels from a run directory's metrics files (``dpwa plot RUN_DIR``, :mod:`dpwa.cli.plot`).

1. training loss vs step, one line per node (every batch faint, a moving average bold);
2. mixing factor over time (seconds since the first record), a moving average per node;
3. histogram of fetch latency (ms) of the successful fetches, per node; for a push rule (pushsum, osgp: no
   fetches) of push latency instead (``push_ms``: a push sent to its ACK), the panel's title saying which;
4. the models' disagreement vs step: each record's ``distance`` (``||x - x_peer|| / ||x||`` with the peer mixed
   in, measured every tenth step), a moving average per node, log scale;
5. the values the script reported (``adapter.report(accuracy=...)``) vs the node's step when it reported them,
   one line per node and key.

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

__all__ = [
    "DEFAULT_NAME",
    "LATENCY_TITLES",
    "MISSING_MATPLOTLIB",
    "latency_kind",
    "moving_average",
    "plot_run",
    "reported",
    "series",
]

MISSING_MATPLOTLIB = "dpwa plot needs matplotlib: pip install 'dpwa[plot]'"
DEFAULT_NAME = "plot.png"
SMOOTH = 20  # records in the moving average of the mixing factor
LATENCY_TITLES = {"fetch": "fetch latency (ok fetches)", "push": "push latency (push sent to its ACK)"}
"""The latency panel's title for each :func:`latency_kind`."""


def series(records: Sequence[Mapping[str, Any]], t0: float) -> dict[str, list[float]]:
    """The plotted columns of one node's exchange records (report lines and bad values skipped):
    ``step``/``loss``, ``time``/``factor`` (time in seconds since ``t0``), ``distance_step``/``distance`` (the
    records that measured it), ``fetch_ms`` (exchanges with an ok fetch) and ``push_ms`` (push rules: exchanges
    that found a push delivered, ``delivered`` > 0; a record without ``delivered`` counts when its ``push_ms`` is
    above 0)."""
    out: dict[str, list[float]] = {
        "step": [], "loss": [], "time": [], "factor": [], "fetch_ms": [], "push_ms": [], "distance_step": [],
        "distance": [],
    }  # fmt: skip
    for record in records:
        if record.get("event") is not None:
            continue
        distance, at = finite_number(record.get("distance")), finite_number(record.get("step"))
        if distance is not None and at is not None:
            out["distance_step"].append(at)
            out["distance"].append(distance)
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
        push_ms, delivered = finite_number(record.get("push_ms")), finite_number(record.get("delivered"))
        if push_ms is not None and (delivered > 0 if delivered is not None else push_ms > 0):
            out["push_ms"].append(push_ms)
    return out


def reported(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """The numbers of one node's ``"event": "report"`` records, by key: (the node's step when it reported -- that
    of the exchange record before it, 0 before any --, the value)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    step = 0.0
    for record in records:
        event = record.get("event")
        if event is None:
            step = finite_number(record.get("step")) or step
        elif event == "report":
            for key, value in record.items():
                number = finite_number(value)
                if key not in ("time", "node", "event", "step") and number is not None:  # as TensorBoard's
                    steps, values = out.setdefault(key, ([], []))
                    steps.append(step)
                    values.append(number)
    return out


def latency_kind(data: Mapping[str, Mapping[str, Sequence[float]]]) -> str:
    """Which latency the panel shows for the nodes' :func:`series`: ``fetch`` when some node has an ok fetch's,
    else ``push`` (a push rule fetches nothing)."""
    return "fetch" if any(cols["fetch_ms"] for cols in data.values()) else "push"


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

    fig = Figure(figsize=(15, 9), layout="constrained")
    axes = fig.subplot_mosaic([["loss", "factor", "latency"], ["distance", "report", "report"]])
    _draw_lines(axes["loss"], axes["factor"], axes["distance"], data)
    _draw_reports(axes["report"], {name: reported(rs) for name, rs in records.items()})
    _finish_distance(axes["distance"], data)
    _draw_latency(axes["latency"], data)
    loss_ax, factor_ax = axes["loss"], axes["factor"]
    loss_ax.set(title="training loss", xlabel="step (faint: every batch, bold: moving average)", ylabel="loss")
    factor_ax.set(title=f"mixing factor (moving average of {SMOOTH})", xlabel="seconds", ylabel="factor")
    for ax in (loss_ax, factor_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(str(run_dir.path), fontsize="small")
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    log.info("wrote %s", output)
    return output


def _draw_lines(loss_ax: Any, factor_ax: Any, distance_ax: Any, data: Mapping[str, Mapping[str, Any]]) -> None:
    """Each node's lines, in its own colour: the loss (every batch faint, a moving average bold), the mixing
    factor's moving average and, where measured, the distance's."""
    for i, (name, cols) in enumerate(data.items()):
        color = f"C{i % 10}"
        window = max(SMOOTH, len(cols["loss"]) // 50)  # ~50 independent points across the run
        loss_ax.plot(cols["step"], cols["loss"], color=color, linewidth=0.5, alpha=0.2)
        loss_ax.plot(cols["step"], moving_average(cols["loss"], window), color=color, label=name, linewidth=1.5)
        factor_ax.plot(cols["time"], moving_average(cols["factor"], SMOOTH), color=color, label=name, linewidth=1)
        if cols["distance"]:
            smooth = moving_average(cols["distance"], max(1, len(cols["distance"]) // 50))
            distance_ax.plot(cols["distance_step"], smooth, color=color, label=name, linewidth=1)


def _draw_reports(report_ax: Any, reports: Mapping[str, Mapping[str, tuple[list[float], list[float]]]]) -> None:
    """The reported-values panel: one line per node (its colour) and key (a marker style per key), or a note
    that nothing was reported."""
    styles = ("o-", "s--", "^:", "d-.")
    keys = sorted({key for values in reports.values() for key in values})
    for i, name in enumerate(reports):
        for j, key in enumerate(keys):
            if key in reports[name]:
                steps, values = reports[name][key]
                report_ax.plot(steps, values, styles[j % len(styles)], color=f"C{i % 10}", label=f"{name} {key}")
    if not keys:
        report_ax.text(0.5, 0.5, "nothing reported", ha="center", va="center", transform=report_ax.transAxes)
    else:
        report_ax.legend(fontsize="small", ncol=max(1, len(keys)))
    report_ax.set(title="reported values (adapter.report)", xlabel="step", ylabel="value")
    report_ax.grid(alpha=0.3)


def _finish_distance(distance_ax: Any, data: Mapping[str, Mapping[str, Any]]) -> None:
    """The distance panel's log scale and legend (or a note that no node measured it), titles and grid."""
    if any(cols["distance"] for cols in data.values()):
        distance_ax.set_yscale("log")
        distance_ax.legend(fontsize="small")
    else:
        distance_ax.text(0.5, 0.5, "no distance measured", ha="center", va="center", transform=distance_ax.transAxes)
    distance_ax.set(title="the models' disagreement (distance to the peer mixed in)", xlabel="step",
                    ylabel="||x - x_peer|| / ||x||")  # fmt: skip
    distance_ax.grid(alpha=0.3)


def _draw_latency(latency_ax: Any, data: Mapping[str, Mapping[str, Any]]) -> None:
    """The latency panel (:func:`latency_kind`): one step histogram per node on shared bins, the slowest 0.5 %
    in the last bin, or a note that there is none."""
    kind = latency_kind(data)
    fetches = [ms for cols in data.values() for ms in cols[f"{kind}_ms"]]
    if fetches:
        top = float(np.percentile(fetches, 99.5)) or max(fetches)  # rare outliers would squash the rest
        bins = np.histogram_bin_edges(np.minimum(fetches, top), bins=40)
        for i, (name, cols) in enumerate(data.items()):
            color = f"C{i % 10}"  # the same colour as the node's lines in the other panels
            latency_ax.hist(np.minimum(cols[f"{kind}_ms"], top), bins=bins, histtype="step", label=name, color=color)
        latency_ax.legend(fontsize="small")
    else:
        latency_ax.text(0.5, 0.5, "no fetch or push latency", ha="center", va="center", transform=latency_ax.transAxes)
    ylabel = "fetches" if kind == "fetch" else "exchanges"
    latency_ax.set(title=LATENCY_TITLES[kind], xlabel="ms (last bin: slowest 0.5 %)", ylabel=ylabel)


# --------------------------------------------------------------------------- helpers


def _node_order(run_dir: RunDir) -> list[str]:
    """Nodes with a metrics file, in the order of the run's cluster.yaml (then any others, sorted)."""
    present = run_dir.metrics_nodes()
    try:
        ordered = [node.name for node in load_config(run_dir.config_path).nodes]
    except ConfigError:
        ordered = []
    return [n for n in ordered if n in present] + [n for n in present if n not in ordered]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values, each window's from its own values (a running sum would carry a
    huge value's rounding, or an infinity, into every later window)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return []
    w = max(1, min(window, a.size))
    head = [float(a[: i + 1].mean()) for i in range(w - 1)]  # the first windows, shorter
    return head + np.lib.stride_tricks.sliding_window_view(a, w).mean(axis=1).tolist()
