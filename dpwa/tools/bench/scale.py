"""``dpwa bench scale``: the demo job with a small model on N local nodes, for several N, on this machine.

For every N of ``--nodes 4,8,16,32`` one *step* runs N node processes (:mod:`dpwa.tools.bench.scaleworker`:
the demo's data, shards, optimizer and training loop around a ``DpwaPyTorchAdapter``, with a
32-``hidden``-``hidden``-10 MLP, ``--hidden 16`` by default: 970 parameters) under one cluster file
(constant 0.5, random peers with flow control).  The nodes start, build everything, bind, and wait
at a start barrier; the bench releases them together once all are ready.  Measured per N:

memory
    each node's RSS (``VmRSS`` of /proc/<pid>/status, sampled every ``--sample-s`` while it trains):
    mean over nodes of each node's peak, the largest peak, and the part added after the node's
    torch, data, model and optimizer were built (adapter, buffers, training).  Also the most file
    descriptors any node held (sockets to its peers, ZeroMQ's internal pipes, files).
exchange latency
    ``fetch_ms`` of every successful fetch in the nodes' metrics files: median and 95th percentile.
mixes/s
    all mixes of all nodes / the training window (from the release to the last node's last step),
    and per node (its mixes / its own training time).  On 2 cores N nodes share the CPU, so a node's
    rate falls like 1/N and the machine's total is what a pairwise rule should keep flat.
CPU per step
    a node's CPU time (all its threads: training, serving, fetching) / its steps.
spread
    every node appends its flat parameters every ``--record-every`` steps; in each of 20 time
    buckets the bench takes every node's latest record, their mean, and the largest distance of a
    node to that mean, relative to the mean's norm.  Reported: the largest over the run, and at the
    end (final models).  The nodes start from the same weights (spread 0).

churn
    with ``--churn K`` every N runs twice, side by side: as above, and with K of the N nodes not in the
    cluster file: each joins the running cluster
    (through the first node) once that node has done a third of its steps, trains a third of the steps,
    and leaves cleanly (docs/membership.md). The spread at a time counts the members of that time
    (a joiner from its join to its leave); ``timeouts`` counts every node's, joiners' included, so the
    table shows what joining and leaving cost next to the same N without churn.

shared memory
    ``--shared-memory auto,off`` (the default) runs every N twice, side by side: co-located nodes reading each
    other's snapshots in shared memory (``transport: {shared_memory: auto}``), and over loopback TCP (``off``).
    The ``shm`` column says which; ``--hidden`` sets the model's size (the exchange's share of a step grows with
    it).

Output: a table on stdout, ``scale.json`` (rows, settings, machine) and with ``--plot``
``scale.png`` (spread over time per N; latency, mixes/s and memory against N) in the run
directory; each N's logs, metrics and parameter records under ``<run_dir>/nodes-<N>/``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from dpwa.config import SHARED_MEMORY_MODES, TransportConfig
from dpwa.metrics import read_metrics
from dpwa.tools.bench.fingerprint import SUFFIX, mean_state_at, read_records, spread
from dpwa.tools.bench.procs import BenchInterrupted, WorkerFailed, free_ports, node_names, run_workers, write_cluster
from dpwa.tools.bench.report import Column, Report, bench_run_dir, comma_list, render_table

log = logging.getLogger(__name__)

__all__ = ["scale", "spread_over_time", "summarize"]

WORKER_MODULE = "dpwa.tools.bench.scaleworker"
READY_SUFFIX = ".ready"  # = dpwa.tools.bench.scaleworker.READY_SUFFIX (not imported: that module imports torch)
GO_FILE = "go"
SPREAD_BUCKETS = 20
KIB_PER_MB = 1024.0

COLUMNS = [
    Column("nodes", "nodes", "d"),
    Column("churn", "churn", "d"),
    Column("shared_memory", "shm"),
    Column("startup_s", "start s", ".1f"),
    Column("train_s", "train s", ".1f"),
    Column("rss_mb_mean", "RSS MB/node", ".0f"),
    Column("rss_mb_max", "max", ".0f"),
    Column("rss_added_mb", "dpwa+train MB", ".1f"),
    Column("fetch_ms_p50", "fetch ms p50", ".1f"),
    Column("fetch_ms_p95", "p95", ".1f"),
    Column("mixes_per_s", "mixes/s", ".0f"),
    Column("mixes_per_s_node", "per node", ".1f"),
    Column("mixes_per_step", "mixes/step", ".2f"),
    Column("cpu_ms_per_step", "CPU ms/step", ".2f"),
    Column("timeouts", "timeouts", "d"),
    Column("fds_per_node_max", "fds", "d"),
    Column("spread_max", "spread max", ".4f"),
    Column("spread_final", "final", ".4f"),
    Column("accuracy", "avg acc", ".4f"),
]


# --------------------------------------------------------------------------- analysis (pure)


def spread_over_time(
    records: Sequence[np.ndarray], start: float, end: float, buckets: int, visiting: Sequence[int] = ()
) -> list[dict[str, float]]:
    """Spread at the end of each of ``buckets`` equal time buckets of [start, end] (seconds since start).

    ``visiting``: indices of records of members that joined and left (churn): counted only between their
    first and last record."""
    out = []
    for edge in np.linspace(start, end, buckets + 1)[1:]:
        present = [
            r for i, r in enumerate(records) if i not in visiting or (len(r) and r["time"][0] <= edge <= r["time"][-1])
        ]
        stacked, mean = mean_state_at(present, float(edge))
        distance, relative = spread(stacked, mean)
        out.append({"t": float(edge - start), "distance": distance, "relative": relative})
    return out


def _ok(record: dict[str, Any]) -> bool:
    return "ok" in str(record.get("status") or "").split(",")


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(
    n: int,
    metrics: dict[str, list[dict[str, Any]]],
    ready: dict[str, dict[str, Any]],
    rss_kib: dict[str, list[int]],
    go_time: float,
    records: Sequence[np.ndarray],
    visiting: Sequence[int] = (),
) -> dict[str, Any]:
    """One table row for N nodes from their metrics records, ready files, RSS samples and parameter records
    (``visiting``: the records of nodes that joined and left mid-run)."""
    fetch_ms: list[float] = []
    reports: dict[str, dict[str, Any]] = {}
    last_time = go_time
    steps_total = 0
    for name, recs in metrics.items():
        exchanges = [r for r in recs if r.get("event") is None]
        reports[name] = next((r for r in reversed(recs) if r.get("event") == "report"), {})
        fetch_ms += [float(r["fetch_ms"]) for r in exchanges if _ok(r) and r.get("fetch_ms") is not None]
        if exchanges:
            last_time = max(last_time, float(exchanges[-1]["time"]))
            steps_total += int(exchanges[-1]["step"])
    train_s = last_time - go_time
    mixes = {name: int(r.get("mixes_total", 0)) for name, r in reports.items()}
    seconds = {name: float(r.get("seconds", math.nan)) for name, r in reports.items()}
    peaks = [max(v) for v in rss_kib.values() if v]
    added = [max(v) - int(ready[name]["rss_base_kib"]) for name, v in rss_kib.items() if v and name in ready]
    cpu_per_step = [1000.0 * float(r["cpu_s"]) / int(r["steps"]) for r in reports.values() if r.get("steps")]
    timeline = spread_over_time(records, go_time, last_time, SPREAD_BUCKETS, visiting) if records else []
    staying = [r for i, r in enumerate(records) if i not in visiting]
    final_stack = np.stack([r["params"][-1].astype(np.float64) for r in staying]) if staying else None
    final = spread(final_stack, final_stack.mean(axis=0))[1] if final_stack is not None else None
    return {
        "nodes": n,
        "churn": len(visiting),
        "train_s": train_s,
        "steps_total": steps_total,
        "rss_mb_mean": float(np.mean(peaks)) / KIB_PER_MB if peaks else None,
        "rss_mb_max": float(np.max(peaks)) / KIB_PER_MB if peaks else None,
        "rss_added_mb": float(np.mean(added)) / KIB_PER_MB if added else None,
        "rss_mb_total": float(np.sum(peaks)) / KIB_PER_MB if peaks else None,
        "fetch_ms_p50": _percentile(fetch_ms, 50),
        "fetch_ms_p95": _percentile(fetch_ms, 95),
        "fetches_ok": len(fetch_ms),
        "mixes": sum(mixes.values()),
        "mixes_per_s": sum(mixes.values()) / train_s if train_s > 0 else None,
        "mixes_per_s_node": _mean([mixes[k] / seconds[k] for k in mixes if seconds.get(k, 0) > 0]),
        "mixes_per_step": sum(mixes.values()) / steps_total if steps_total else None,
        "steps_per_s": steps_total / train_s if train_s > 0 else None,
        "cpu_ms_per_step": float(np.mean(cpu_per_step)) if cpu_per_step else None,
        "timeouts": sum(int(r.get("fetches_timed_out", 0)) for r in reports.values()),
        "refused": sum(int(r.get("fetches_refused", 0)) for r in reports.values()),
        "spread_max": max((b["relative"] for b in timeline), default=None),
        "spread_final": final,
        "spread_over_time": timeline,
        "node_accuracy_mean": _mean([r["accuracy"] for r in reports.values() if "accuracy" in r]),
    }


def averaged_accuracy(config: dict[str, Any], records: Sequence[np.ndarray]) -> float:
    """Held-out accuracy of the mean of the nodes' final parameters (the demo's model of ``config``)."""
    import torch

    from dpwa.tools import demo

    cfg = demo.TrainConfig.from_dict(config)
    data = demo.make_dataset(cfg.seed, cfg.data)
    model = demo.build_model(cfg)
    mean = np.mean([r["params"][-1].astype(np.float64) for r in records], axis=0).astype(np.float32)
    torch.nn.utils.vector_to_parameters(torch.from_numpy(mean), model.parameters())
    return demo.evaluate(model, data.x_test, data.y_test)[0]


# --------------------------------------------------------------------------- one N


def _remove_stale(directory: Path, names: Sequence[str]) -> None:
    """Delete the go file and every node's ready, record and metrics file a reused ``directory`` may hold."""
    stale = [directory / GO_FILE]
    stale += [directory / f"{name}{suffix}" for name in names for suffix in (READY_SUFFIX, SUFFIX, ".metrics.jsonl")]
    for path in stale:  # no earlier go, ready or appended-to file may count
        path.unlink(missing_ok=True)


class _StartBarrier:
    """The nodes' start barrier: :meth:`release_when_ready` creates the go file once every node is ready.

    ``time`` (``time.time()``) and ``elapsed`` (seconds since the workers' start): the release; None until then.
    """

    def __init__(self, directory: Path, names: Sequence[str]) -> None:
        self.directory = directory
        self.names = list(names)
        self.time: float | None = None
        self.elapsed: float | None = None

    def release_when_ready(self, elapsed: float) -> None:
        """Release the nodes (once) if every one has written its ready file; ``elapsed``: seconds since the start."""
        if self.time is None and all((self.directory / f"{name}{READY_SUFFIX}").exists() for name in self.names):
            self.time, self.elapsed = time.time(), elapsed
            (self.directory / GO_FILE).touch()
            log.info("%d nodes ready after %.1f s: released", len(self.names), elapsed)


def run_step(
    directory: Path,
    n: int,
    config: dict[str, Any],
    *,
    record_every: int,
    timeout_s: float,
    sample_s: float,
    churn: int = 0,
    shared_memory: str = "auto",
) -> dict[str, Any]:
    """Run N nodes to completion in ``directory`` and return their table row (plus timings); ``churn`` of them
    join mid-run and leave (see the module doc-string); ``shared_memory``: the cluster's ``transport`` setting."""
    directory.mkdir(parents=True, exist_ok=True)
    founders = node_names(n - churn)
    joiners = [f"j{i + 1}" for i in range(churn)]
    names = founders + joiners
    cluster = directory / "cluster.yaml"
    ports = free_ports(n - churn)
    write_cluster(cluster, ports, transport=TransportConfig(shared_memory=shared_memory))
    steps = int(config["steps"])
    spec = {
        "names": names,
        "joiners": joiners,
        "join": f"127.0.0.1:{ports[0]}",
        "join_at": steps // 3,
        "join_steps": max(1, steps // 3),
        "cluster": str(cluster.absolute()),
        "run_dir": str(directory.absolute()),
        "config": config,
        "record_every": record_every,
        "start_timeout_s": timeout_s,
    }
    _remove_stale(directory, names)
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    barrier = _StartBarrier(directory, names)
    run = run_workers(
        directory, WORKER_MODULE, names, lambda rank, _n: [str(spec_path), str(rank)], timeout_s=timeout_s,
        config_path=cluster, sample_s=sample_s, on_tick=barrier.release_when_ready,
    )  # fmt: skip
    if barrier.time is None or barrier.elapsed is None:
        raise WorkerFailed(f"the {n} nodes all exited before they were released")
    ready = {name: json.loads((directory / f"{name}{READY_SUFFIX}").read_text()) for name in names}
    size = int(ready[names[0]]["params"])
    records = [read_records(directory / f"{name}{SUFFIX}", size) for name in names]
    metrics = {name: read_metrics(directory / f"{name}.metrics.jsonl", missing_ok=True) for name in names}
    go_elapsed = barrier.elapsed
    samples_per_s = 1.0 / sample_s
    training_rss = {name: v[int(go_elapsed * samples_per_s) :] or v for name, v in run.rss_kib.items()}
    visiting = [names.index(name) for name in joiners]
    row = summarize(n, metrics, ready, training_rss, barrier.time, records, visiting)
    row["accuracy"] = averaged_accuracy(config, [r for i, r in enumerate(records) if i not in visiting])
    row["fds_per_node_max"] = max(run.fds_max.values())
    row["startup_s"] = go_elapsed
    row["shared_memory"] = shared_memory
    row["total_s"] = run.wall_s
    return row


# --------------------------------------------------------------------------- the command


def _modes(ctx: click.Context, param: click.Parameter, text: str) -> list[str]:
    """``--shared-memory``: comma-separated ``transport.shared_memory`` settings, each once."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in SHARED_MEMORY_MODES]
    if bad or not modes:
        raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: allowed: {', '.join(SHARED_MEMORY_MODES)}")
    return modes


def _counts(text: str) -> list[int]:
    return comma_list(text, int, lambda n: n >= 2, "node counts >= 2 (e.g. 4,8,16,32)")


def plot_scale(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``scale.png``: spread over time per N, and fetch latency, mixes/s and RSS against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    modes = list(dict.fromkeys(row.get("shared_memory", "auto") for row in rows))
    for row in rows:
        t = [b["t"] for b in row["spread_over_time"]]
        label = f"{row['nodes']} nodes" + (f", shm {row.get('shared_memory')}" if len(modes) > 1 else "")
        axes[0].plot(t, [b["relative"] for b in row["spread_over_time"]], marker=".", label=label)
    axes[0].set(title="spread: max ||x_i - mean|| / ||mean||", xlabel="seconds since release")
    axes[0].legend()
    ns = sorted({row["nodes"] for row in rows})
    lines = {
        1: (("fetch_ms_p50", "p50"), ("fetch_ms_p95", "p95")),
        2: (("mixes_per_s", "all nodes"), ("mixes_per_s_node", "per node")),
        3: (("rss_mb_mean", "RSS per node"), ("rss_added_mb", "added by dpwa + training")),
    }
    for mode in modes:
        mine = [row for row in rows if row.get("shared_memory", "auto") == mode]
        suffix = f" (shm {mode})" if len(modes) > 1 else ""
        for index, keys in lines.items():
            for key, name in keys:
                axes[index].plot([r["nodes"] for r in mine], [r[key] for r in mine], marker="o", label=name + suffix)
    axes[1].set(title="fetch latency (ms)", xlabel="nodes", yscale="log")
    axes[2].set(title="mixes/s", xlabel="nodes", yscale="log")
    axes[3].set(title="memory (MB)", xlabel="nodes")
    for ax in axes[1:]:
        ax.legend()
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@click.command("scale", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", "counts", default="4,8,16,32", show_default=True, help="Node counts, comma-separated.")
@click.option("--steps", type=click.IntRange(min=1), default=300, show_default=True, help="Steps per node.")
@click.option("--hidden", type=click.IntRange(min=1), default=16, show_default=True, help="MLP hidden width.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--record-every", type=click.IntRange(min=1), default=10, show_default=True,
              help="Steps between parameter records (spread).")  # fmt: skip
@click.option("--sample-s", type=click.FloatRange(min=0.05), default=0.5, show_default=True,
              help="Seconds between RSS samples.")  # fmt: skip
@click.option("--timeout-s", type=click.FloatRange(min=1), help="Per N  [default: 120 + 10 s per node].")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="[default: runs/bench-scale-<time>]")
@click.option("--churn", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also run each N with this many of its nodes joining mid-run and leaving.")  # fmt: skip
@click.option("--shared-memory", "shm_modes", default="auto,off", show_default=True, callback=_modes,
              help="transport.shared_memory settings to run each N with, side by side.")  # fmt: skip
@click.option("--plot", is_flag=True, help="Also write scale.png.")
def scale(
    counts: str,
    steps: int,
    hidden: int,
    batch_size: int,
    seed: int,
    record_every: int,
    sample_s: float,
    timeout_s: float | None,
    run_dir: Path | None,
    churn: int,
    shm_modes: list[str],
    plot: bool,
) -> None:
    """The demo job with a small model on N local nodes for each N: memory, fetch latency, mixes/s, spread.

    Prints one row per N; writes scale.json (and scale.png with --plot) into the run directory.
    """
    from dpwa.tools.demo import TrainConfig  # torch only once the options are checked

    ns = _counts(counts)
    if churn and min(ns) - churn < 2:
        raise click.BadParameter(f"--churn {churn} leaves fewer than 2 founding nodes of {min(ns)}")
    config = TrainConfig(steps=steps, batch_size=batch_size, seed=seed, hidden=hidden)
    if batch_size * max(ns) > config.data.n_train:
        raise click.BadParameter(f"{max(ns)} nodes x batch {batch_size} exceed the {config.data.n_train} samples")
    directory = bench_run_dir("scale", run_dir)
    click.echo(f"dpwa bench scale: nodes {counts}, {steps} steps each, run dir {directory}", err=True)
    rows = []
    runs = ((n, c, m) for n in ns for c in ([0, churn] if churn else [0]) for m in shm_modes)
    for n, joining, mode in runs:
        limit = timeout_s if timeout_s is not None else 120.0 + 10.0 * n
        label = f"{n} nodes, shared memory {mode}" + (f", {joining} joining and leaving" if joining else "")
        click.echo(f"  {label} ...", err=True)
        step_dir = directory / (f"nodes-{n}" + (f"-churn-{joining}" if joining else "") + f"-shm-{mode}")
        try:
            row = run_step(step_dir, n, config.to_dict(), record_every=record_every,
                           timeout_s=limit, sample_s=sample_s, churn=joining, shared_memory=mode)  # fmt: skip
        except WorkerFailed as err:
            click.echo(f"error: {n} nodes: {err}", err=True)
            sys.exit(1)
        except BenchInterrupted as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(128 + err.signum)
        click.echo(f"  {label}: started in {row['startup_s']:.1f} s, trained in {row['train_s']:.1f} s, "
                   f"{row['total_s']:.1f} s in all", err=True)  # fmt: skip
        rows.append(row)
    settings = {"nodes": ns, "steps": steps, "hidden": hidden, "batch_size": batch_size, "seed": seed,
                "record_every": record_every, "sample_s": sample_s, "churn": churn, "shared_memory": shm_modes,
                "interpolation": "constant 0.5", "spread_buckets": SPREAD_BUCKETS,
                "command": " ".join(sys.argv)}  # fmt: skip
    path = Report("scale", rows=rows, settings=settings).write(directory)
    click.echo(render_table(rows, COLUMNS))
    if plot:
        click.echo(f"plot: {plot_scale(directory / 'scale.png', rows)}")
    click.echo(f"json: {path}")
