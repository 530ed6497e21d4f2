"""One ``dpwa run`` on this machine: start the local nodes, show their progress, stop them, summarize.

:func:`run_job` is the loop: start every node of a :class:`Job` (chosen by :mod:`dpwa.launcher.placement`)
under a :class:`~dpwa.launcher.supervisor.Supervisor`, watch them with live progress, stop them all on
Ctrl-C or SIGTERM, when ``timeout_s`` passes, or on the first failure when ``stop_on_failure`` (by default
a failed node is reported at once and the others run to their end; the run fails all the same), evaluate
the built-in demo once every node succeeded, and write the summary into the run directory. The ``dpwa run``
command that builds the job is :mod:`dpwa.cli.run`.
This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import click

from dpwa.checkpoint import CheckpointError
from dpwa.config import ClusterConfig, NodeSpec
from dpwa.launcher.placement import node_env, usable_cores
from dpwa.launcher.progress import NodeView, Progress, summary_table
from dpwa.launcher.restarts import Restarter, resume_env
from dpwa.launcher.rundir import NodeMetrics, RunDir, tail_lines
from dpwa.launcher.supervisor import POLL_S, SignalTrap, Supervisor, stop_and_close, stop_quietly
from dpwa.metrics import MetricsTail
from dpwa.modelfile import average_models, disagreement, read_model

log = logging.getLogger(__name__)

__all__ = ["DEMO_MODULE", "Job", "run_job", "runs_every_node"]

DEMO_MODULE = "dpwa.tools.demo"
TAIL_LINES = 20


def runs_every_node(config: ClusterConfig, nodes: list[NodeSpec]) -> bool:
    """Whether ``nodes`` are every node of ``config`` (a cluster that joins another never is): what an evaluation
    of the averaged model (the demo's, or a SCRIPT's ``--evaluate``) needs in one run directory."""
    return len(nodes) == len(config.nodes) and not config.join


@dataclasses.dataclass
class Job:
    """One ``dpwa run`` on this machine: which nodes, the command each runs, and where they write."""

    config: ClusterConfig
    nodes: list[NodeSpec]
    command: list[str]
    run_dir: RunDir
    threads: int
    evaluate: bool = False  # built-in demo with every node here: run `dpwa.tools.demo --evaluate RUN_DIR` after
    timeout_s: float | None = None
    stop_on_failure: bool = False  # stop every node at the first failure (--stop-on-failure); else they run on
    restart_failed: int = 0  # restarts per node after a failure (--restart-failed); dpwa/launcher/restarts.py
    resume: bool = False  # dpwa run --resume: every node resumes from its checkpoint and bootstraps from a peer
    average: str | None = None  # a SCRIPT's --evaluate MODULE:FUNCTION: `dpwa average RUN_DIR --evaluate` after


def run_job(job: Job, *, progress: Progress | None, env: Mapping[str, str] | None = None) -> int:
    """Start ``job``'s nodes, watch them, stop them, write ``summary.json``, print the summary; return the
    exit code: 0 when every node (and the demo's evaluation) succeeded, 1 when one failed or the run timed
    out, 128 + signal number when SIGINT or SIGTERM stopped it.

    Whatever happens -- a signal, a failing node, an exception in the launcher -- every child has been
    stopped (:meth:`Supervisor.stop`) before this returns or raises.
    """
    base = os.environ if env is None else env
    supervisor = Supervisor()
    live = {node.name: NodeMetrics() for node in job.nodes}
    tails = {node.name: MetricsTail(job.run_dir.metrics_path(node.name)) for node in job.nodes}
    started = time.time()
    deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s

    def tick(force: bool = False) -> None:
        _refresh(supervisor, tails, live, progress, force)

    specs = {node.name: node for node in job.nodes}

    def restart(name: str) -> None:
        message = f"restarting {name} ({supervisor.children[name].describe_exit()}), restart {restarter.counts[name]}"
        _say(progress, message)
        _start_node(supervisor, job, base, specs[name], restart=True)

    restarter = Restarter(
        job.restart_failed,
        {n.name: (n.host, n.port) for n in job.nodes},
        restart,
        gone=lambda name: not supervisor.left_behind(name),
    )

    def run_on(name: str) -> None:  # a node failed for good; the others keep running (no --stop-on-failure)
        child = supervisor.children[name]
        message = f"{name} failed ({child.describe_exit()}); the other nodes keep running (the run will exit 1)"
        log.info("%s", message)
        _say(progress, message)

    status = "failed"
    with SignalTrap() as trap:
        try:
            for node in job.nodes:
                if trap.received:  # interrupted while starting: start no more
                    break
                _start_node(supervisor, job, base, node)
            on_failure = None if job.stop_on_failure else run_on
            status = _watch(supervisor, trap, deadline, job.stop_on_failure, tick, restarter, on_failure)
            stop_quietly(supervisor, trap)
            tick(force=True)
            if status == "ok" and (job.evaluate or job.average is not None):
                status = _evaluate(job, supervisor, trap, deadline, base, progress)
        except OSError as err:
            click.echo(f"error: cannot start a node process: {err}", err=True)
            status = "failed"
        finally:
            try:
                stop_and_close(supervisor, trap)
            finally:
                if progress is not None:
                    progress.close()
        signum = trap.first
    if signum is not None:
        status = "interrupted"
    code = 0 if status == "ok" else 128 + signum if signum is not None else 1
    _finish(job, supervisor, status, code, signum, started)
    return code


def _refresh(
    supervisor: Supervisor,
    tails: Mapping[str, MetricsTail],
    live: Mapping[str, NodeMetrics],
    progress: Progress | None,
    force: bool = False,
) -> None:
    """Add each node's new metrics records to its ``live`` figures (to the end of the file once the node has
    exited), then redraw ``progress`` with every started node (``force``: even if drawn a moment ago)."""
    for name, tail in tails.items():
        child = supervisor.children.get(name)
        live[name].add_all(tail.read_new(final=child is not None and child.returncode is not None))
    if progress is not None:
        views = [NodeView(n, supervisor.children[n].state, live[n]) for n in live if n in supervisor.children]
        progress.update(views, force=force)


def _start_node(
    supervisor: Supervisor, job: Job, base: Mapping[str, str], node: NodeSpec, restart: bool = False
) -> None:
    """Start ``node``'s process with ``job``'s command and its environment (from ``base``), output to its log;
    a restart, or any start of a resumed job, resumes from the checkpoint and appends to the log."""
    node_vars = node_env(
        base, node=node.name, config_path=job.run_dir.config_path, run_dir=job.run_dir.path, threads=job.threads
    )
    if restart or job.resume:
        node_vars.update(resume_env())
    log_path = job.run_dir.log_path(node.name)
    supervisor.start(node.name, job.command, env=node_vars, log_path=log_path, append=restart or job.resume,
                     replace=restart)  # fmt: skip


def _say(progress: Progress | None, message: str) -> None:
    """``message`` above the live progress when there is one, else as a line on stderr."""
    if progress is not None:
        progress.message(message)
    else:
        click.echo(message, err=True)


def _watch(
    supervisor: Supervisor,
    trap: SignalTrap,
    deadline: float | None,
    fail_fast: bool,
    tick: Callable[[], None],
    restarter: Restarter | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> str:
    """Poll until every child has exited (``ok`` or ``failed``), one failed (``failed``, if ``fail_fast``),
    a signal arrived (``interrupted``) or the deadline passed (``timeout``). Does not stop anything.

    With a ``restarter``, a failed child it schedules for a restart is not a failure (yet); one whose
    restart it gives up on is. ``on_failure(name)`` is told of each failure as it is seen."""
    while True:
        exited = supervisor.poll()
        tick()
        if trap.received:
            return "interrupted"
        failed = [c for c in exited if c.state == "failed" and not (restarter is not None and restarter.handle(c))]
        gave_up = restarter.tick() if restarter is not None else []
        if on_failure is not None:
            for name in [c.name for c in failed] + gave_up:
                on_failure(name)
        if fail_fast and (failed or gave_up):
            return "failed"
        if not supervisor.running() and not (restarter is not None and restarter.pending):
            return "failed" if any(c.state == "failed" for c in supervisor.children.values()) else "ok"
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout"
        time.sleep(POLL_S * 2)


def _evaluate(
    job: Job,
    supervisor: Supervisor,
    trap: SignalTrap,
    deadline: float | None,
    base: Mapping[str, str],
    progress: Progress | None,
) -> str:
    """Run ``python -m dpwa.tools.demo --evaluate RUN_DIR`` (averaged model vs one-process baseline), or for a
    SCRIPT's ``--evaluate MODULE:FUNCTION`` ``dpwa average RUN_DIR --evaluate ...``, on every core."""
    if progress is not None:
        what = "a single-process baseline" if job.average is None else "each node's model"
        progress.message(f"evaluating the averaged model and {what} ...")
    helper_env = node_env(
        base, node=None, config_path=job.run_dir.config_path, run_dir=job.run_dir.path, threads=usable_cores()
    )
    if job.average is None:
        argv = [sys.executable, "-m", DEMO_MODULE, "--evaluate", str(job.run_dir.path)]
    else:
        argv = [sys.executable, "-m", "dpwa.cli", "average", str(job.run_dir.path), "--evaluate", job.average]
        argv += [arg for node in job.nodes for arg in ("--node", node.name)]  # not a file another run left
    supervisor.start("evaluate", argv, env=helper_env, log_path=job.run_dir.evaluate_log)
    return _watch(supervisor, trap, deadline, True, lambda: None)


def _finish(job: Job, supervisor: Supervisor, status: str, code: int, signum: int | None, started: float) -> None:
    """Write ``summary.json`` and print the table, the demo's numbers, failing logs and the run directory."""
    nodes = {node.name: _node_summary(job, supervisor, node) for node in job.nodes}
    summary = _summary(job, status, code, started, nodes)
    evaluation = supervisor.children.get("evaluate")
    evaluated = evaluation is not None and evaluation.state == "ok"
    demo = job.run_dir.read_demo() if evaluated and job.evaluate else None
    if job.evaluate:
        summary["demo"] = demo
    models = None if job.evaluate else _models(job, job.run_dir.read_average() if evaluated else None)
    if models is not None:
        summary["models"] = models
    try:
        job.run_dir.write_summary(summary)
    except OSError as err:
        click.echo(f"error: cannot write {job.run_dir.summary_path}: {err}", err=True)

    click.echo(summary_table(nodes))
    _print_evaluation(job, status, demo, models)
    _print_failures(job, supervisor, status, signum)
    click.echo(f"run dir: {job.run_dir.path}")


def _node_summary(job: Job, supervisor: Supervisor, node: NodeSpec) -> dict[str, Any]:
    """``node``'s entry in ``summary.json``: where it ran, how its process ended (``not started`` without
    one), its restarts, its files and the summary of its metrics."""
    child = supervisor.children.get(node.name)
    metrics = NodeMetrics.of(job.run_dir.read_metrics(node.name))
    return {
        "host": node.host,
        "port": node.port,
        "status": child.state if child is not None else "not started",
        "returncode": None if child is None else child.returncode,
        "exit": None if child is None else child.describe_exit(),
        "pid": None if child is None else child.pid,
        "restarts": len(supervisor.previous.get(node.name, [])),
        "restarted_after": [c.describe_exit() for c in supervisor.previous.get(node.name, [])],
        "log": job.run_dir.log_path(node.name).name,
        "metrics": job.run_dir.metrics_path(node.name).name,
        "data": job.run_dir.read_data(node.name),
        **metrics.summary(),
    }


def _summary(job: Job, status: str, code: int, started: float, nodes: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` without the evaluation's figures: the run, its outcome and exit code, and ``nodes``."""
    return {
        "version": 1,
        "run_dir": str(job.run_dir.path),
        "config": job.config.source,
        "command": job.command,
        "host": socket.gethostname(),
        "threads_per_node": job.threads,
        "started": _iso(started),
        "ended": _iso(time.time()),
        "duration_s": round(time.time() - started, 3),
        "outcome": status,
        "exit_code": code,
        "restart_failed": job.restart_failed,
        "stop_on_failure": job.stop_on_failure,
        "resumed": job.resume,
        "ok": status == "ok",
        "nodes": nodes,
    }


def _print_evaluation(job: Job, status: str, demo: Mapping[str, Any] | None, models: Mapping[str, Any] | None) -> None:
    """On stdout: the demo's averaged-model and baseline accuracies (or why they were skipped) and the saved
    models' line."""
    if demo is not None:
        apart = demo.get("disagreement")
        click.echo(
            f"averaged model accuracy {_num(demo.get('averaged_accuracy'))}, "
            f"single-process baseline {_num(demo.get('baseline_accuracy'))}"
            + (f"; the models {100 * apart:.3g} % apart" if isinstance(apart, (int, float)) else "")
        )
    elif not job.evaluate and job.command[1:3] == ["-m", DEMO_MODULE] and status == "ok":
        every = runs_every_node(job.config, job.nodes)
        why = "--no-baseline" if every else "it needs every node of the file in one run directory"
        click.echo(f"(averaged-model evaluation skipped: {why})")
    if models is not None:
        click.echo(_models_line(models, job.run_dir.path))


def _print_failures(job: Job, supervisor: Supervisor, status: str, signum: int | None) -> None:
    """On stderr: the last lines of each failed process's log, and what stopped the run early (a signal or the
    timeout)."""
    for child in supervisor.children.values():
        if child.state == "failed":
            click.echo(f"{child.name} failed ({child.describe_exit()}); last lines of {child.log_path}:", err=True)
            for line in tail_lines(child.log_path, TAIL_LINES):
                click.echo(f"    {line}", err=True)
    if status == "interrupted" and signum is not None:
        click.echo(f"interrupted by {signal.Signals(signum).name}: stopped every process this run started", err=True)
    elif status == "timeout":
        click.echo(f"timed out after {job.timeout_s:g} s: stopped the processes still running", err=True)


def _models(job: Job, average: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The models this run's nodes saved (``<node>.model.npz``): how many, their disagreement (relative distance to
    their mean, :mod:`dpwa.modelfile`) and, after ``--evaluate``, the figures; taken from ``average.json`` when the
    evaluation wrote it (it averaged these very files), else measured here. None when no node saved one. A file
    that cannot be read is reported, not raised."""
    if average is not None and isinstance(average.get("nodes"), list):  # `dpwa average` measured them already
        out: dict[str, Any] = {"saved": len(average["nodes"])}
        keys = ("disagreement", "node_distance", "evaluate", "averaged", "node_figures", "averaged_model")
        out.update({k: average[k] for k in keys if k in average})
        return out
    paths = [job.run_dir.model_path(node.name) for node in job.nodes]
    present = [path for path in paths if path.exists()]
    if not present:
        return None
    try:
        saved = [read_model(path) for path in present]
        spread = disagreement(saved, average_models(saved))
    except (CheckpointError, ValueError) as err:
        return {"saved": len(present), "error": str(err)}
    return {"saved": len(saved), "disagreement": spread.overall, "node_distance": dict(spread.nodes)}


def _models_line(models: Mapping[str, Any], run_dir: object) -> str:
    """One line: the saved models' disagreement and, when evaluated, the averaged model's headline figure."""
    if "error" in models:
        return f"models: {models['saved']} saved, not averaged: {models['error']}"
    apart = f"{100 * models['disagreement']:.3g} % apart (relative distance to their mean)"
    line = f"models: {models['saved']} saved, {apart}"
    averaged, nodes = models.get("averaged"), models.get("node_figures")
    if isinstance(averaged, Mapping) and averaged and isinstance(nodes, Mapping):
        key = next(iter(averaged))
        figures = [f[key] for f in nodes.values() if isinstance(f, Mapping) and key in f]
        spread = f" (nodes {_num(min(figures))} to {_num(max(figures))})" if figures else ""
        line += f"; averaged model {key} {_num(averaged[key])}{spread}"
    else:
        line += f"; `dpwa average {run_dir} --evaluate MODULE:FUNCTION` evaluates their average"
    return line


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"
