"""One ``dpwa run`` on this machine: start the local nodes, show their progress, stop them, summarize.

:func:`run_job` is the loop: start every node of a :class:`Job` (chosen by :mod:`dpwa.launcher.placement`)
under a :class:`~dpwa.launcher.supervisor.Supervisor`, watch them with live progress, stop them all on the
first failure (unless ``keep_going``), on Ctrl-C or SIGTERM, evaluate the built-in demo, and write the
summary into the run directory. The ``dpwa run`` command that builds the job is :mod:`dpwa.cli.run`.
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

from dpwa.config import ClusterConfig, NodeSpec
from dpwa.launcher.placement import node_env, usable_cores
from dpwa.launcher.progress import NodeView, Progress, summary_table
from dpwa.launcher.restarts import Restarter, resume_env
from dpwa.launcher.rundir import NodeMetrics, RunDir, tail_lines
from dpwa.launcher.supervisor import POLL_S, SignalTrap, Supervisor, stop_quietly
from dpwa.metrics import MetricsTail

log = logging.getLogger(__name__)

__all__ = ["DEMO_MODULE", "Job", "run_job"]

DEMO_MODULE = "dpwa.tools.demo"
TAIL_LINES = 20


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
    keep_going: bool = False
    restart_failed: int = 0  # restarts per node after a failure (--restart-failed); dpwa/launcher/restarts.py
    resume: bool = False  # dpwa run --resume: every node resumes from its checkpoint and bootstraps from a peer


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
        for name, tail in tails.items():
            child = supervisor.children.get(name)
            live[name].add_all(tail.read_new(final=child is not None and child.returncode is not None))
        if progress is not None:
            views = [NodeView(n, supervisor.children[n].state, live[n]) for n in live if n in supervisor.children]
            progress.update(views, force=force)

    def start(node: NodeSpec, restart: bool = False) -> None:
        node_vars = node_env(
            base, node=node.name, config_path=job.run_dir.config_path, run_dir=job.run_dir.path, threads=job.threads
        )
        if restart or job.resume:
            node_vars.update(resume_env())
        log_path = job.run_dir.log_path(node.name)
        supervisor.start(node.name, job.command, env=node_vars, log_path=log_path, append=restart or job.resume,
                         replace=restart)  # fmt: skip

    specs = {node.name: node for node in job.nodes}

    def restart(name: str) -> None:
        message = f"restarting {name} ({supervisor.children[name].describe_exit()}), restart {restarter.counts[name]}"
        if progress is not None:
            progress.message(message)
        else:
            click.echo(message, err=True)
        start(specs[name], restart=True)

    restarter = Restarter(job.restart_failed, {n.name: (n.host, n.port) for n in job.nodes}, restart)
    status = "failed"
    with SignalTrap() as trap:
        try:
            for node in job.nodes:
                start(node)
            status = _watch(supervisor, trap, deadline, not job.keep_going, tick, restarter)
            stop_quietly(supervisor, trap)
            tick(force=True)
            if status == "ok" and job.evaluate:
                status = _evaluate(job, supervisor, trap, deadline, base, progress)
        except OSError as err:
            click.echo(f"error: cannot start a node process: {err}", err=True)
            status = "failed"
        finally:
            stop_quietly(supervisor, trap)
            if progress is not None:
                progress.close()
        signum = trap.first
    if signum is not None:
        status = "interrupted"
    code = 0 if status == "ok" else 128 + signum if signum is not None else 1
    _finish(job, supervisor, status, code, signum, started)
    return code


def _watch(
    supervisor: Supervisor,
    trap: SignalTrap,
    deadline: float | None,
    fail_fast: bool,
    tick: Callable[[], None],
    restarter: Restarter | None = None,
) -> str:
    """Poll until every child has exited (``ok`` or ``failed``), one failed (``failed``, if ``fail_fast``),
    a signal arrived (``interrupted``) or the deadline passed (``timeout``). Does not stop anything.

    With a ``restarter``, a failed child it schedules for a restart is not a failure (yet); one whose
    restart it gives up on is."""
    while True:
        exited = supervisor.poll()
        tick()
        if trap.received:
            return "interrupted"
        failed = [c for c in exited if c.state == "failed" and not (restarter is not None and restarter.handle(c))]
        gave_up = restarter.tick() if restarter is not None else []
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
    """Run ``python -m dpwa.tools.demo --evaluate RUN_DIR`` (averaged model vs one-process baseline), every core."""
    if progress is not None:
        progress.message("evaluating the averaged model and a single-process baseline ...")
    helper_env = node_env(
        base, node=None, config_path=job.run_dir.config_path, run_dir=job.run_dir.path, threads=usable_cores()
    )
    argv = [sys.executable, "-m", DEMO_MODULE, "--evaluate", str(job.run_dir.path)]
    supervisor.start("evaluate", argv, env=helper_env, log_path=job.run_dir.evaluate_log)
    return _watch(supervisor, trap, deadline, True, lambda: None)


def _finish(job: Job, supervisor: Supervisor, status: str, code: int, signum: int | None, started: float) -> None:
    """Write ``summary.json`` and print the table, the demo's numbers, failing logs and the run directory."""
    nodes: dict[str, dict[str, Any]] = {}
    for node in job.nodes:
        child = supervisor.children.get(node.name)
        metrics = NodeMetrics.of(job.run_dir.read_metrics(node.name))
        nodes[node.name] = {
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
    summary: dict[str, Any] = {
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
        "resumed": job.resume,
        "ok": status == "ok",
        "nodes": nodes,
    }
    evaluation = supervisor.children.get("evaluate")
    demo = job.run_dir.read_demo() if evaluation is not None and evaluation.state == "ok" else None
    if job.evaluate:
        summary["demo"] = demo
    try:
        job.run_dir.write_summary(summary)
    except OSError as err:
        click.echo(f"error: cannot write {job.run_dir.summary_path}: {err}", err=True)

    click.echo(summary_table(nodes))
    if demo is not None:
        click.echo(
            f"averaged model accuracy {_num(demo.get('averaged_accuracy'))}, "
            f"single-process baseline {_num(demo.get('baseline_accuracy'))}"
        )
    elif not job.evaluate and job.command[1:3] == ["-m", DEMO_MODULE] and status == "ok":
        click.echo("(averaged-model evaluation skipped: it needs every node of the file in one run directory)")
    for child in supervisor.children.values():
        if child.state == "failed":
            click.echo(f"{child.name} failed ({child.describe_exit()}); last lines of {child.log_path}:", err=True)
            for line in tail_lines(child.log_path, TAIL_LINES):
                click.echo(f"    {line}", err=True)
    if status == "interrupted" and signum is not None:
        click.echo(f"interrupted by {signal.Signals(signum).name}: stopped every process this run started", err=True)
    elif status == "timeout":
        click.echo(f"timed out after {job.timeout_s:g} s: stopped the processes still running", err=True)
    click.echo(f"run dir: {job.run_dir.path}")


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="seconds")


def _num(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"
