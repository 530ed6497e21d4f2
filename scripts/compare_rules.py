#!/usr/bin/env python3
"""Run the built-in demo once per mixing rule and compare them: a Markdown table, a JSON file and a PNG.

    python scripts/compare_rules.py [--steps N] [--partition P] [--out DIR] [--rules constant,gem,...] [--cluster FILE]

(``scripts/compare_rules.sh`` sets up ./.venv with matplotlib first.) For every rule it writes a cluster
file ``OUT/<rule>.yaml`` -- the nodes, ports, fetch probability, timeout and transport of ``--cluster`` (default
samples/localhost.yaml, ports 45000-45003: do not run two comparisons at once), the rule and its
settings -- and runs ``dpwa run OUT/<rule>.yaml --steps N --partition P --run-dir OUT/<rule> -q``: same
data, seed (the demo's default, 0), initial weights, split (``--partition``: ``iid``, the default,
``dirichlet:ALPHA`` or ``classes:K``), shards and steps for every rule. Then it reads each run
directory and writes

* ``OUT/comparison.md``: one row per rule (the columns are explained under the table);
* ``OUT/comparison.json``: the same numbers, the settings of every rule, the machine;
* ``OUT/comparison.png``: training loss vs step (mean over nodes, moving average) per rule, the
  accuracy of the averaged model and of the nodes, and the spread between the nodes' final models.

``--plot-only`` redraws the table and the figures from an existing OUT without running anything.
Exit status 0 when every run succeeded, 1 otherwise (the table still lists the runs that did).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from dpwa.config import load_config, yaml12  # noqa: E402
from dpwa.metrics import read_metrics  # noqa: E402
from dpwa.utils.partition import parse_partition  # noqa: E402

NODE_SETTINGS = ("nodes", "fetch_probability", "timeout_ms", "transport")  # from --cluster; the rest is the rule's

# label -> (what it is, the cluster-file keys it sets). Settings not given are the rules' defaults (each rule
# module's settings class); group uses pairs, as samples/group.yaml (with 4 nodes, group_size 4 is everyone
# every step).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("no gossip (fetch_probability 0): 4 independent nodes", {"fetch_probability": 0.0}),
    "constant": ("f = 0.5", {"interpolation": "constant", "constant": {"value": 0.5}}),
    "clock": ("f = peer_clock / (clock + peer_clock)", {"interpolation": "clock"}),
    "loss": ("f = loss / (loss + peer_loss)", {"interpolation": "loss"}),
    "gem": ("GEM, reference sent (the default)", {"interpolation": "gem"}),
    "gem-now": ("GEM, reference now (the literal form)", {"interpolation": "gem", "gem": {"reference": "now"}}),
    "pushsum": ("SGP push-sum, exponential graph", {"interpolation": "pushsum"}),
    "osgp": ("OSGP: push-sum, overlap 1", {"interpolation": "pushsum", "pushsum": {"overlap": 1}}),
    "adpsgd": ("AD-PSGD, random peers", {"interpolation": "adpsgd"}),
    "dpsgd": ("D-PSGD, ring", {"interpolation": "dpsgd"}),
    "leader": ("LSGD, strength 0.1, window 10", {"interpolation": "leader"}),
    "group": (
        "WAGMA, pairs, sync every 11",
        {"interpolation": "group", "group": {"group_size": 2, "sync_every": 11, "max_staleness": 10.0}},
    ),
    "gt": ("gradient tracking (DIGing), ring", {"interpolation": "gt"}),
    "choco-topk": (
        "CHOCO-SGD, top-1 %, ring",
        {"interpolation": "choco", "choco": {"compressor": "topk:0.01"}},
    ),
    "choco-topk-directed": (
        "CHOCO-SGD, top-1 %, directed ring (one fetch a step)",
        {"interpolation": "choco", "choco": {"compressor": "topk:0.01", "graph": "directed-ring"}},
    ),
    "choco-int8": ("CHOCO-SGD, int8, ring", {"interpolation": "choco", "choco": {"compressor": "int8"}}),
    "constant-int8": ("f = 0.5, wire_dtype int8", {"interpolation": "constant", "wire_dtype": "int8"}),
    "constant-outer8": (
        "f = 0.5 under the outer optimizer (SlowMo), every 8 steps",
        {"interpolation": "constant", "outer": {"every": 8, "lr": 1.0, "momentum": 0.5, "nesterov": False}},
    ),
    "constant-diloco8": (
        "f = 0.5 under the outer optimizer (DiLoCo: lr 0.7, Nesterov momentum 0.9), every 8 steps",
        {"interpolation": "constant", "outer": {"every": 8, "lr": 0.7, "momentum": 0.9, "nesterov": True}},
    ),
    "constant-local8": (
        "f = 0.5 every 8 steps, no outer momentum (lr 1, momentum 0: periodic gossip)",
        {"interpolation": "constant", "outer": {"every": 8, "lr": 1.0, "momentum": 0.0}},
    ),
}
DEFAULT_RULES = (
    "constant",
    "clock",
    "loss",
    "gem",
    "gem-now",
    "pushsum",
    "osgp",
    "leader",
    "group",
    "adpsgd",
    "dpsgd",
    "gt",
    "choco-topk",
    "choco-topk-directed",
    "choco-int8",
    "constant-int8",
    "constant-outer8",
    "constant-local8",
    "constant-diloco8",
    "none",
)
SMOOTH = 100  # steps in the moving average of the loss curves
POLL_S = 0.5
PROGRESS_EVERY_S = 10.0


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- running


def write_cluster(base: dict[str, Any], label: str, path: Path) -> None:
    """``--cluster``'s nodes, fetch probability, timeout and transport (``shared_memory: off`` measures the
    socket's bytes) plus ``label``'s rule settings, checked."""
    doc = {k: base[k] for k in NODE_SETTINGS if k in base}
    doc.setdefault("interpolation", "constant")
    doc.update(VARIANTS[label][1])
    header = f"# written by scripts/compare_rules.py: {label} -- {VARIANTS[label][0]}\n"
    path.write_text(header + yaml12.dump(doc, sort_keys=False))
    load_config(path)  # a ConfigError here is a bug in VARIANTS


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1" if host == "localhost" else host, port))
            return True
        except OSError:
            return False


def last_step(run_dir: Path, node: str) -> int:
    """The step of the node's last metrics record (0 before any)."""
    path = run_dir / f"{node}.metrics.jsonl"
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            return int(record["step"])
    return 0


def run_rule(
    label: str, cluster: Path, run_dir: Path, steps: int, nodes: Sequence[str], partition: str = "iid"
) -> tuple[int, float]:
    """``dpwa run`` of the demo for one rule, with a progress line now and then; (exit status, wall seconds)."""
    argv = [sys.executable, "-m", "dpwa.cli", "run", str(cluster), "--steps", str(steps), "--run-dir", str(run_dir)]
    argv += ["--partition", partition]
    argv.append("-q")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = time.monotonic()
    with open(run_dir.with_suffix(".out"), "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        shown = start
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if time.monotonic() - shown >= PROGRESS_EVERY_S:
                    shown = time.monotonic()
                    done = [last_step(run_dir, n) for n in nodes]
                    where = "evaluating" if min(done) >= steps else f"steps {' '.join(map(str, done))} of {steps}"
                    say(f"  {label}: {where} ({shown - start:.0f} s)")
        except BaseException:
            proc.terminate()  # dpwa run stops its nodes on SIGTERM
            proc.wait(timeout=30)
            raise
    return proc.returncode, time.monotonic() - start


# --------------------------------------------------------------------------- reading a run


def model_vector(path: Path) -> np.ndarray:
    """Every floating array of a demo model file (``<node>.model.npz``), flattened to one float64 vector."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = [npz[k] for k in sorted(npz.files) if k != "__meta__"]
    return np.concatenate([a.astype(np.float64).ravel() for a in arrays if np.issubdtype(a.dtype, np.floating)])


def spread(run_dir: Path, nodes: Sequence[str]) -> float | None:
    """Mean over nodes of ``|x_i - mean_j x_j| / |mean_j x_j|`` of the final models; None if one is missing."""
    paths = [run_dir / f"{n}.model.npz" for n in nodes]
    if not all(p.is_file() for p in paths):
        return None
    vectors = [model_vector(p) for p in paths]
    mean = np.mean(vectors, axis=0)
    return float(np.mean([np.linalg.norm(v - mean) for v in vectors]) / np.linalg.norm(mean))


def _weight_range(exchanges: dict[str, list[dict[str, Any]]]) -> list[float] | None:
    """[lowest, highest] push-sum weight any node had after a step (None for the other rules)."""
    weights = [r["weight"] for recs in exchanges.values() for r in recs if isinstance(r.get("weight"), (int, float))]
    return [min(weights), max(weights)] if weights else None


def _classes(run_dir: Path, node: str) -> list[int] | None:
    """The node's class histogram from ``<node>.data.json`` (None when it wrote none)."""
    path = run_dir / f"{node}.data.json"
    try:
        return [int(n) for n in json.loads(path.read_text())["classes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mean(values: Sequence[float | None]) -> float | None:
    good = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(good) / len(good) if good else None


def summarize(label: str, run_dir: Path, nodes: Sequence[str], code: int | None, wall: float | None) -> dict[str, Any]:
    """One row of the comparison from a finished run directory."""
    exchanges: dict[str, list[dict[str, Any]]] = {}
    reports: dict[str, dict[str, Any]] = {}
    for node in nodes:
        records = read_metrics(run_dir / f"{node}.metrics.jsonl", missing_ok=True)
        exchanges[node] = [r for r in records if r.get("event") is None]
        found = [r for r in records if r.get("event") == "report"]
        reports[node] = found[-1] if found else {}
    last = {n: recs[-1] for n, recs in exchanges.items() if recs}
    demo_path = run_dir / "demo.json"
    demo = json.loads(demo_path.read_text()) if demo_path.is_file() else {}
    node_accuracy = demo.get("node_accuracy") or {n: r.get("accuracy") for n, r in reports.items()}
    steps = max((len(r) for r in exchanges.values()), default=0)
    losses = np.full((len(nodes), steps), np.nan)
    for i, recs in enumerate(exchanges.values()):
        losses[i, : len(recs)] = [r.get("loss", np.nan) for r in recs]
    return {
        "rule": label,
        "what": VARIANTS.get(label, ("", {}))[0],
        "settings": VARIANTS.get(label, ("", {}))[1],
        "ok": code == 0,
        "exit": code,
        "final_loss": _mean([r.get("final_loss") for r in reports.values()]),
        "averaged_accuracy": demo.get("averaged_accuracy"),
        "baseline_accuracy": demo.get("baseline_accuracy"),
        "mean_node_accuracy": _mean(list(node_accuracy.values())),
        "node_accuracy": node_accuracy,
        "node_classes": {n: _classes(run_dir, n) for n in nodes},
        "spread": spread(run_dir, nodes),
        "weight_range": _weight_range(exchanges),
        "mixes": sum(int(r.get("mixes", 0)) for r in last.values()),
        "moves": sum(1 for recs in exchanges.values() for r in recs if (r.get("factor") or 0.0) > 0.0),
        "bytes_in": sum(int(r.get("bytes_in", 0)) for r in last.values()),
        "bytes_per_step": _mean([int(r.get("bytes_out", 0)) / max(1, int(r.get("step", 0))) for r in last.values()]),
        "train_seconds": _mean([r.get("seconds") for r in reports.values()]),
        "wall_seconds": wall,
        # mean loss over the nodes per step (NaN where no node has a record), for the plot
        "loss_curve": [None if math.isnan(v) else v for v in np.nanmean(losses, axis=0).tolist()] if steps else [],
    }


# --------------------------------------------------------------------------- output


def _f(value: Any, digits: int) -> str:
    return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else f"{value:.{digits}f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown comparison table."""
    head = (
        "| rule | final loss | averaged-model acc. | baseline acc. | mean node acc. | spread | weights | mixes "
        "| moves | MB in | kB sent/step | train s | wall s |"
    )
    lines = [head, "|---|" + "---:|" * 12]
    for r in rows:
        rule = r["rule"] if r["ok"] else f"{r['rule']} (exit {r['exit']})"
        cells = [
            rule,
            _f(r["final_loss"], 4),
            _f(r["averaged_accuracy"], 4),
            _f(r["baseline_accuracy"], 4),
            _f(r["mean_node_accuracy"], 4),
            "-" if r["spread"] is None else f"{r['spread']:.2e}",
            "-" if not r.get("weight_range") else f"{r['weight_range'][0]:.2f}-{r['weight_range'][1]:.2f}",
            str(r["mixes"]),
            str(r["moves"]),
            _f(r["bytes_in"] / 1e6, 1),
            _f((r.get("bytes_per_step") or math.nan) / 1e3, 1),
            _f(r["train_seconds"], 1),
            _f(r["wall_seconds"], 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LEGEND = """\
Columns: *final loss* -- mean over the nodes of the training loss of their last 50 batches (the demo's
`final_loss` report); *averaged-model acc.* -- held-out accuracy of the average of the 4 final models,
*baseline acc.* -- one process trained on all the data for the same number of samples (`demo.json`);
*mean node acc.* -- mean of the nodes' own held-out accuracies; *spread* -- mean over the nodes of
`|x_i - x_mean| / |x_mean|` over all parameters of the final models; *weights* -- the lowest and highest
push-sum weight any node had after a step (push-sum only); *mixes* -- exchanges that got a
reply, *moves* -- exchanges whose factor was > 0, *MB in* -- bytes received (each summed over the
nodes); *kB sent/step* -- the bytes a node sent (replies served, pushes) per step, mean over the nodes;
*train s* -- a node's training loop (mean over nodes), *wall s* -- the whole `dpwa run`
(process start-up, training, lingering for peers, the baseline's training and the evaluation)."""


def machine() -> dict[str, Any]:
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch,
        "load_average_at_start": load,
    }


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    what = "\n".join(f"- `{r['rule']}`: {r['what']}" for r in rows)
    total = meta.get("total_seconds")
    took = f", {total:.0f} s in all" if isinstance(total, (int, float)) else ""
    partition = meta.get("partition", "iid")
    data = ""
    held = next((r.get("node_classes") for r in rows if any((r.get("node_classes") or {}).values())), None)
    if held:
        shares = "; ".join(f"{n}: {_held(h)}" for n, h in held.items() if h)
        data = f" Classes per node (share of its samples): {shares}."
    return (
        f"# Mixing rules on the built-in demo\n\n"
        f"`{meta['command'].strip()}` on {meta['date']}: 4 nodes of `{meta['cluster']}`, {meta['steps']} steps "
        f"of 32 per node, seed 0, partition `{partition}`{took}; {m['usable_cpus']} usable cores, {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}.{data}\n\n{table(rows)}\n\n{LEGEND}\n\n{what}\n"
    )


def _held(histogram: Sequence[int]) -> str:
    """``3 (62%), 7 (35%)``: the classes holding at least 5% of a node's samples, with their shares."""
    total = sum(histogram) or 1
    return ", ".join(f"{c} ({100 * n / total:.0f}%)" for c, n in enumerate(histogram) if n >= 0.05 * total)


def smooth(values: Sequence[float | None], window: int) -> tuple[np.ndarray, np.ndarray]:
    """(step, trailing moving average) of a loss curve (steps counted from 1)."""
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    x = np.arange(1, len(y) + 1)
    keep = ~np.isnan(y)
    x, y = x[keep], y[keep]
    if len(y) < window:
        return x, y
    kernel = np.ones(window) / window
    return x[window - 1 :], np.convolve(y, kernel, mode="valid")


def plot(rows: Sequence[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # the "plot" extra

    fig = Figure(figsize=(15, 4.8), layout="constrained")
    ax_loss, ax_acc, ax_spread = fig.subplots(1, 3, width_ratios=[1.5, 1, 1])
    import matplotlib

    palette = matplotlib.colormaps["tab20"].colors  # one colour per rule for up to 20 rules (tab10 repeats after 10)
    colors = {r["rule"]: palette[(2 * i) % 20 + (2 * i) // 20] for i, r in enumerate(rows)}
    window = max(1, min(SMOOTH, meta["steps"] // 10))
    for r in rows:
        x, y = smooth(r["loss_curve"], window)
        if len(y):
            style = ":" if r["rule"] == "none" else "-"
            ax_loss.plot(x, y, style, color=colors[r["rule"]], label=r["rule"], linewidth=1.4)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (mean over nodes, moving average of {window})")
    ax_loss.set_title("training loss")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(fontsize="small", ncol=2)

    labels = [r["rule"] for r in rows]
    pos = np.arange(len(rows))
    avg = [r["averaged_accuracy"] or 0.0 for r in rows]
    node = [r["mean_node_accuracy"] or 0.0 for r in rows]
    ax_acc.bar(pos - 0.2, avg, 0.4, label="averaged model", color=[colors[label] for label in labels])
    ax_acc.bar(pos + 0.2, node, 0.4, label="mean of the nodes", color="0.7")
    for p, a in zip(pos, avg):
        ax_acc.text(p - 0.2, a + 0.01, f"{a:.3f}", ha="center", va="bottom", fontsize=7, rotation=90)
    baselines = [r["baseline_accuracy"] for r in rows if r["baseline_accuracy"] is not None]
    if baselines:
        ax_acc.axhline(max(baselines), color="k", linestyle="--", linewidth=1, label="one-process baseline")
    ax_acc.set_xticks(pos, labels, rotation=45, ha="right")
    ax_acc.set_ylim(0, 1.25)
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.set_title("accuracy")
    ax_acc.legend(fontsize="small", loc="upper left", ncol=2)

    spreads = [r["spread"] if r["spread"] else np.nan for r in rows]
    ax_spread.bar(pos, spreads, 0.6, color=[colors[label] for label in labels])
    ax_spread.set_yscale("log")
    ax_spread.set_xticks(pos, labels, rotation=45, ha="right")
    ax_spread.set_ylabel("|x_i - x_mean| / |x_mean| (mean over nodes)")
    ax_spread.set_title("spread between the final models")
    ax_spread.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(f"dpwa built-in demo, 4 nodes, {meta['steps']} steps per node, seed 0")
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="batches per node (default %(default)s)")
    parser.add_argument(
        "--partition", default="iid", help="iid | dirichlet:ALPHA | classes:K: the data split (default %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "compare-rules", help="default %(default)s")
    parser.add_argument(
        "--rules",
        default=",".join(DEFAULT_RULES),
        help=f"comma-separated, from: {', '.join(VARIANTS)} (default: all, in that order)",
    )
    parser.add_argument("--cluster", type=Path, default=ROOT / "samples" / "localhost.yaml", help="default %(default)s")
    parser.add_argument("--plot-only", action="store_true", help="redraw from OUT/comparison.json, run nothing")
    args = parser.parse_args(argv)
    args.rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    unknown = [r for r in args.rules if r not in VARIANTS]
    if unknown or not args.rules:
        parser.error(f"unknown rule(s) {', '.join(unknown) or '(none given)'}; allowed: {', '.join(VARIANTS)}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        args.partition = str(parse_partition(args.partition))
    except ValueError as err:
        parser.error(str(err))
    return args


def write_outputs(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    (out / "comparison.json").write_text(json.dumps({**meta, "rules": rows}, indent=1) + "\n")
    (out / "comparison.md").write_text(markdown(rows, meta))
    try:
        plot(rows, meta, out / "comparison.png")
    except ImportError:
        say("matplotlib is missing (pip install 'dpwa[plot]'): no comparison.png")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    if args.plot_only:
        saved = json.loads((out / "comparison.json").read_text())
        rows = saved.pop("rules")
        write_outputs(rows, saved, out)
        say(f"wrote {out / 'comparison.md'}, {out / 'comparison.png'}")
        return 0
    config = load_config(args.cluster)
    base = yaml12.load(args.cluster.read_text(encoding="utf-8"))
    if not isinstance(base, dict):
        raise SystemExit(f"{args.cluster}: use a cluster file in the mapping format")
    nodes = [n.name for n in config.nodes]
    out.mkdir(parents=True, exist_ok=True)
    try:
        shown = os.path.relpath(args.cluster, ROOT)
    except ValueError:
        shown = str(args.cluster)
    meta = {
        "command": " ".join(["scripts/compare_rules.sh", *(argv if argv is not None else sys.argv[1:])]),
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cluster": shown,
        "steps": args.steps,
        "partition": args.partition,
        "seed": 0,
        "machine": machine(),
    }
    say(f"{len(args.rules)} runs of the demo, {args.steps} steps on {len(nodes)} nodes of {shown}; output in {out}")
    rows = []
    started = time.monotonic()
    for i, label in enumerate(args.rules, 1):
        taken = [f"{n.host}:{n.port}" for n in config.nodes if not port_is_free(n.host, n.port)]
        if taken:
            say(f"[{i}/{len(args.rules)}] {label}: ports in use ({', '.join(taken)}): is another run going? skipped")
            rows.append(summarize(label, out / label, nodes, None, None))
            continue
        cluster = out / f"{label}.yaml"
        write_cluster(base, label, cluster)
        say(f"[{i}/{len(args.rules)}] {label}: {VARIANTS[label][0]}")
        code, wall = run_rule(label, cluster, out / label, args.steps, nodes, args.partition)
        row = summarize(label, out / label, nodes, code, wall)
        rows.append(row)
        status = "ok" if code == 0 else f"FAILED (exit {code}, see {out / label}.out)"
        say(
            f"[{i}/{len(args.rules)}] {label}: {status} in {wall:.1f} s: final loss {_f(row['final_loss'], 4)}, "
            f"averaged-model accuracy {_f(row['averaged_accuracy'], 4)}, spread {_f(row['spread'], 5)}"
        )
        write_outputs(rows, meta, out)  # partial results survive an interrupted comparison
    meta["total_seconds"] = round(time.monotonic() - started, 1)
    write_outputs(rows, meta, out)
    print(table(rows), flush=True)
    say(f"done in {meta['total_seconds']:.0f} s: {out / 'comparison.md'}, comparison.json, comparison.png")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
