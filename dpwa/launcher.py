"""``dpwa run``: start the local nodes of a cluster file, show their progress, stop them, summarize.

:func:`run_job` is the loop: start every selected node (:mod:`dpwa.placement`) under a
:class:`~dpwa.supervisor.Supervisor`, watch them with live progress, stop them all on the first
failure (unless ``--keep-going``), on Ctrl-C or SIGTERM, evaluate the built-in demo, and write the
summary into the run directory. :func:`run` is the click command. This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from .cli import EXIT_CONFIG_ERROR as EXIT_USAGE
from .cli import fail
from .config import ClusterConfig, ConfigError, NodeSpec, load_config
from .placement import node_env, select_nodes, threads_per_node, usable_cores
from .progress import NodeView, Progress, summary_table
from .restarts import Restarter, resume_env
from .rundir import MetricsTail, NodeMetrics, RunDir, default_run_dir, tail_lines
from .supervisor import POLL_S, SignalTrap, Supervisor, stop_quietly

log = logging.getLogger(__name__)

__all__ = ["Job", "run", "run_job"]

DEMO_MODULE = "dpwa.demo"
TAIL_LINES = 20


@dataclasses.dataclass
class Job:
    """One ``dpwa run`` on this machine: which nodes, the command each runs, and where they write."""

    config: ClusterConfig
    nodes: list[NodeSpec]
    command: list[str]
    run_dir: RunDir
    threads: int
    evaluate: bool = False  # built-in demo with every node here: run `dpwa.demo --evaluate RUN_DIR` after
    timeout_s: float | None = None
    keep_going: bool = False
    restart_failed: int = 0  # restarts per node after a failure (--restart-failed); dpwa/restarts.py
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
    """Run ``python -m dpwa.demo --evaluate RUN_DIR`` (averaged model vs single-process baseline) with every core."""
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


# --------------------------------------------------------------------------- the command


class _RunCommand(click.Command):
    """Launcher options may stand anywhere before SCRIPT; SCRIPT and everything after it go to the script.

    ``dpwa run cluster.yaml --steps 50`` and ``dpwa run --node w1 cluster.yaml train.py --lr 0.1 --node x``
    both parse as meant: a ``--`` is inserted before the second positional argument.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        return super().parse_args(ctx, _split_at_script(args, valued))

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS]", "CLUSTER.yaml", "[SCRIPT [ARGS]...]"]


def _split_at_script(args: Sequence[str], valued: set[str]) -> list[str]:
    """``args`` with ``--`` before the second positional argument (SCRIPT), unless a ``--`` comes first."""
    positional = 0
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "--":
            break
        if arg.startswith("-") and arg != "-":
            skip = arg in valued
            continue
        positional += 1
        if positional == 2:
            return [*args[:i], "--", *args[i:]]
    return list(args)


def _die(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@click.command("run", cls=_RunCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("cluster", metavar="CLUSTER.yaml", required=False)
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--steps", type=click.IntRange(min=1), help="Batches per node of the built-in demo (not with SCRIPT).")
@click.option(
    "--node",
    "node_names",
    multiple=True,
    metavar="NAME",
    help="Start only this node; repeatable. One `dpwa run` per host for a multi-machine cluster.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory  [default: runs/<YYYYmmdd-HHMMSS>, under SLURM runs/slurm-<job>.<step>]",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop everything after this many seconds and exit 1.",
)
@click.option("--threads", type=click.IntRange(min=1), help="Threads per node  [default: usable cores // local nodes]")
@click.option("--keep-going", is_flag=True, help="Keep the other nodes running when one fails.")
@click.option(
    "--restart-failed",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Restart a node that fails (non-zero exit, or killed) up to N times; it resumes from its checkpoint.",
)
@click.option(
    "--resume",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="RUN_DIR",
    help="Resume the run in RUN_DIR (its nodes, cluster file and command) from the nodes' last checkpoints.",
)
@click.option("--quiet", "-q", is_flag=True, help="No live progress (the summary is still printed).")
def run(
    cluster: str | None,
    script: str | None,
    script_args: tuple[str, ...],
    steps: int | None,
    node_names: tuple[str, ...],
    run_dir: Path | None,
    timeout_s: float | None,
    threads: int | None,
    keep_going: bool,
    restart_failed: int,
    resume: Path | None,
    quiet: bool,
) -> None:
    """Start this machine's nodes of CLUSTER.yaml, each running SCRIPT with ARGS (default: the built-in demo).

    A node runs here when its host is this machine (localhost, 127.x, this host's names and addresses),
    or when named with --node. Under SLURM (SLURM_PROCID and SLURM_NTASKS set, no --node) each task
    starts node number SLURM_PROCID, so `srun dpwa run cluster.yaml train.py` starts one node per task.

    Every node process gets DPWA_NODE, DPWA_CONFIG (the resolved copy in the run directory),
    DPWA_RUN_DIR, and OMP/MKL/OPENBLAS_NUM_THREADS and DPWA_TORCH_THREADS so the nodes share the cores.
    Its output goes to RUN_DIR/<node>.log. Without SCRIPT each node runs `python -m dpwa.demo`, and once
    all succeeded the averaged model is compared with a single-process baseline.

    `dpwa run --resume RUN_DIR` starts the same nodes with the same command again; each resumes from its
    last checkpoint (`checkpoint_every` in the cluster file) and copies a peer's model if it is ahead
    (DPWA_RESUME=1, DPWA_BOOTSTRAP=peer). --restart-failed N restarts a failed node the same way.

    Ctrl-C or SIGTERM stops every process the run started (SIGTERM, then SIGKILL after 3 s).
    Exit status: 0 all nodes succeeded; 1 a node failed or --timeout-s passed; 2 a bad cluster file
    or usage; 130/143 interrupted.
    """
    if resume is not None:
        if cluster is not None or node_names or run_dir is not None:
            raise click.UsageError("--resume RUN_DIR takes the cluster file, nodes and command from RUN_DIR")
        config, nodes, command, directory, evaluate, per_node = _resume_plan(RunDir(resume), steps, threads)
        _start(config, nodes, command, directory, evaluate, per_node, timeout_s, keep_going, restart_failed, True,
               quiet)  # fmt: skip
    if cluster is None:
        raise click.UsageError("missing CLUSTER.yaml (or --resume RUN_DIR)")
    try:
        config = load_config(cluster)
    except ConfigError as err:
        fail(err)
    if script is None:
        if importlib.util.find_spec(DEMO_MODULE) is None:
            _die(f"the built-in demo ({DEMO_MODULE}) is not installed; give a SCRIPT to run")
        command = [sys.executable, "-m", DEMO_MODULE, *(["--steps", str(steps)] if steps is not None else [])]
    else:
        if steps is not None:
            raise click.UsageError("--steps is for the built-in demo; pass SCRIPT its own options after its name")
        if not os.path.isfile(script):
            _die(f"{script}: no such file")
        command = [sys.executable, os.path.abspath(script), *script_args]
    try:
        nodes, warnings = select_nodes(config, node_names)
    except ConfigError as err:
        fail(err)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    directory = RunDir(run_dir if run_dir is not None else default_run_dir())
    evaluate = script is None and len(nodes) == len(config.nodes)
    per_node = threads if threads is not None else threads_per_node(len(nodes))
    _start(config, nodes, command, directory, evaluate, per_node, timeout_s, keep_going, restart_failed, False, quiet)


def _start(
    config: ClusterConfig,
    nodes: list[NodeSpec],
    command: list[str],
    directory: RunDir,
    evaluate: bool,
    per_node: int,
    timeout_s: float | None,
    keep_going: bool,
    restart_failed: int,
    resume: bool,
    quiet: bool,
) -> NoReturn:
    """Check the nodes' keys, prepare the run directory (kept as it is by ``resume``), run the job and exit."""
    try:
        for node in nodes if config.security.curve else ():  # every node started here needs its secret key
            config.check_secret_key(node.name)
    except ConfigError as err:
        fail(err)
    try:
        directory.prepare([node.name for node in nodes], evaluate=evaluate, resume=resume)
        if not resume:
            directory.write_config(config)
        launch = {"version": 1, "nodes": [n.name for n in nodes], "command": command, "threads": per_node}
        directory.write_launch({**launch, "evaluate": evaluate, "demo": command[1:3] == ["-m", DEMO_MODULE]})
    except OSError as err:
        _die(f"{directory.path}: cannot write the run directory: {err.strerror or err}")
    if not quiet:
        names = ", ".join(node.name for node in nodes)
        plural = "s" if per_node != 1 else ""
        what = "resuming" if resume else "run dir"
        click.echo(f"dpwa run: {names} ({per_node} thread{plural} each); {what} {directory.path}", err=True)
    job = Job(config, nodes, command, directory, per_node, evaluate, timeout_s, keep_going, restart_failed, resume)
    progress = None if quiet else Progress(sys.stderr)
    sys.exit(run_job(job, progress=progress))


def _resume_plan(
    directory: RunDir, steps: int | None, threads: int | None
) -> tuple[ClusterConfig, list[NodeSpec], list[str], RunDir, bool, int]:
    """(config, nodes, command, run dir, evaluate, threads) of the run recorded in ``directory``'s launch.json."""
    record = directory.read_launch()
    if record is None:
        _die(f"{directory.path}: no {directory.launch_path.name}: not a run directory of `dpwa run`")
    try:
        config = load_config(directory.config_path)
    except ConfigError as err:
        fail(err)
    try:
        nodes = [config.node(name) for name in record["nodes"]]
        command = [str(arg) for arg in record["command"]]
        evaluate, demo, per_node = bool(record["evaluate"]), bool(record["demo"]), int(record["threads"])
    except (KeyError, TypeError, ValueError) as err:
        _die(f"{directory.launch_path}: unreadable launch record: {err}")
    if steps is not None:
        if not demo:
            raise click.UsageError("--steps is for the built-in demo; this run's SCRIPT keeps its own options")
        command = [*command[:3], "--steps", str(steps)]
    if config.checkpoint_every == 0:
        click.echo(f"warning: {config.source}: checkpoint_every is 0: the nodes start over from step 0", err=True)
    return config, nodes, command, directory, evaluate, threads if threads is not None else per_node
