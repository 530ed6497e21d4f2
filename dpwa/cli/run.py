"""``dpwa run``: the command that turns a cluster file (or a run directory to resume) into a
:class:`~dpwa.launcher.job.Job` and runs it (:func:`~dpwa.launcher.job.run_job`)."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from dpwa.cli.common import fail
from dpwa.config import ClusterConfig, ConfigError, NodeSpec, load_config
from dpwa.engines import EngineError, engine_nodes
from dpwa.engines.join import joining_host, joining_nodes
from dpwa.engines.local import LOCAL_HOST, PortReservation, local_nodes, reserve_ports
from dpwa.launcher.job import DEMO_MODULE, Job, run_job, runs_every_node
from dpwa.launcher.launchrecord import launcher_key, nodes_to_resume, threads_to_resume
from dpwa.launcher.placement import LocalHosts, select_nodes, threads_per_node
from dpwa.launcher.ports import busy_ports, busy_ports_message
from dpwa.launcher.progress import Progress
from dpwa.launcher.rundir import RunDir, default_run_dir
from dpwa.tools.average import AverageError, check_spec
from dpwa.tools.options import check_partition

__all__ = ["run"]


class _RunCommand(click.Command):
    """Launcher options may stand anywhere before SCRIPT; SCRIPT and everything after it go to the script.

    ``dpwa run cluster.yaml --steps 50`` and ``dpwa run --node w1 cluster.yaml train.py --lr 0.1 --node x``
    both parse as meant: a ``--`` is inserted before the second positional argument.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        script_at = 1 if _names_node_count(args, valued) else 2  # with -n N no CLUSTER.yaml: SCRIPT comes first
        return super().parse_args(ctx, _split_at_script(args, valued, script_at))

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS]", "(CLUSTER.yaml | -n N)", "[SCRIPT [ARGS]...]"]


def _finite_seconds(param: click.Parameter, value: float | None) -> float | None:
    """A number of seconds an option gives: finite (``nan`` passes FloatRange, and would turn the timeout off)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param=param)
    return value


def _names_node_count(args: Sequence[str], valued: set[str]) -> bool:
    """True when ``-n`` / ``--nodes`` is among the launcher's options before the first positional argument
    (``valued``: the options that take a value, skipped with it); one after it belongs to the script (``dpwa run
    cluster.yaml --quiet train.py -n 4``), or names a cluster file and -n at once, which the command refuses."""
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return False
        if arg in ("-n", "--nodes") or arg.startswith("--nodes=") or (arg.startswith("-n") and arg[2:].isdigit()):
            return True
        skip = arg in valued
    return False


def _split_at_script(args: Sequence[str], valued: set[str], script_at: int = 2) -> list[str]:
    """``args`` with ``--`` before positional argument number ``script_at`` (SCRIPT), unless a ``--`` comes
    first."""
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
        if positional == script_at:
            return [*args[:i], "--", *args[i:]]
    return list(args)


@click.command("run", cls=_RunCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("cluster", metavar="CLUSTER.yaml", required=False)
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-n",
    "--nodes",
    "node_count",
    type=click.IntRange(min=1),
    help="N nodes on this machine on free ports, no cluster file (settings from --config).",
)
@click.option(
    "--config",
    "settings_file",
    type=click.Path(dir_okay=False),
    help="With -n: the cluster file of the settings (no `nodes`)  [default: every setting's default]",
)
@click.option(
    "--join",
    "join",
    metavar="[NAME@]HOST:PORT",
    help="With -n: the N nodes join the running cluster that has a member at HOST:PORT (docs/membership.md).",
)
@click.option("--steps", type=click.IntRange(min=1), help="Batches per node of the built-in demo (not with SCRIPT).")
@click.option(
    "--partition",
    callback=check_partition,
    metavar="P",
    help="The built-in demo's data split: iid | dirichlet:ALPHA | classes:K  [default: iid] (not with SCRIPT).",
)
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
    help="Run directory  [default: runs/<YYYYmmdd-HHMMSS>; a cluster file's in an srun step: runs/slurm-<job>.<step>]",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    callback=lambda ctx, param, value: _finite_seconds(param, value),
    help="Stop everything after this many seconds and exit 1.",
)
@click.option("--threads", type=click.IntRange(min=1), help="Threads per node  [default: usable cores // local nodes]")
@click.option(
    "--stop-on-failure",
    is_flag=True,
    help="Stop every node when one fails for good  [default: the others keep running; the run still exits 1]",
)
@click.option(
    "--keep-going",
    is_flag=True,
    help="The default, kept for old command lines: the other nodes keep running when one fails. With --resume it "
    "overrides the run's recorded --stop-on-failure.",
)
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
@click.option(
    "--evaluate",
    "average",
    metavar="MODULE:FUNCTION",
    help="With SCRIPT, once every node succeeded: `dpwa average RUN_DIR --evaluate MODULE:FUNCTION` (the average of "
    "the models the nodes saved, evaluated beside each node's); its figure goes into the summary.",
)
@click.option(
    "--no-baseline",
    is_flag=True,
    help="Built-in demo: skip the evaluation after the run (the averaged model against a single-process baseline, "
    "a process of its own); the nodes' own figures stay in the summary.",
)
@click.option("--quiet", "-q", is_flag=True, help="No live progress (the summary is still printed).")
@click.option(
    "--tensorboard",
    is_flag=True,
    help="At the end, write each node's metrics as TensorBoard scalars to RUN_DIR/tensorboard (dpwa[tensorboard]).",
)
def run(
    cluster: str | None,
    script: str | None,
    script_args: tuple[str, ...],
    node_count: int | None,
    settings_file: str | None,
    join: str | None,
    steps: int | None,
    partition: str | None,
    node_names: tuple[str, ...],
    run_dir: Path | None,
    timeout_s: float | None,
    threads: int | None,
    stop_on_failure: bool,
    keep_going: bool,
    restart_failed: int,
    resume: Path | None,
    average: str | None,
    no_baseline: bool,
    quiet: bool,
    tensorboard: bool,
) -> None:
    """Start this machine's nodes of CLUSTER.yaml, each running SCRIPT with ARGS (default: the built-in demo).

    `dpwa run -n N [--config SETTINGS.yaml] [SCRIPT [ARGS]]` needs no cluster file: N nodes w1..wN on
    127.0.0.1, on ports no other `dpwa run -n` holds; the resolved cluster file is written into the run
    directory. With `--join [NAME@]HOST:PORT` the N nodes (named `<host>-<port>`) join the running cluster
    that has a member at HOST:PORT instead of forming one.

    A node runs here when its host is this machine (localhost, 127.x, this host's names and addresses),
    or when named with --node. In an srun step (SLURM_STEP_ID and SLURM_PROCID set, no --node) each task
    starts node number SLURM_PROCID, so `srun dpwa run cluster.yaml train.py` starts one node per task
    (a batch script's own shell is no step: there `dpwa run` starts the nodes of this machine);
    a file without `nodes` takes them from the step (one per task, `<host>-<SLURM_LOCALID>` on
    base_port + SLURM_LOCALID). Before anything starts, the port of every node of the cluster file that
    runs here is bound for an instant: one in use by another process is one error line and exit status 2.

    Every node process gets DPWA_NODE, DPWA_CONFIG (the resolved copy in the run directory),
    DPWA_RUN_DIR, and OMP/MKL/OPENBLAS_NUM_THREADS and DPWA_TORCH_THREADS so the nodes share the cores.
    Its output goes to RUN_DIR/<node>.log. Without SCRIPT each node runs `python -m dpwa.tools.demo`, and once
    all succeeded the averaged model is compared with a single-process baseline. A SCRIPT's nodes that saved
    their models (adapter.save_model) get the models' disagreement in the summary, and with --evaluate
    MODULE:FUNCTION the averaged model's figure (`dpwa average`).

    `dpwa run --resume RUN_DIR` starts the same nodes with the same command again; each resumes from its
    last checkpoint (`checkpoint_every` in the cluster file) and copies a peer's model if it is ahead
    (DPWA_RESUME=1, DPWA_BOOTSTRAP=peer). --restart-failed N restarts a failed node the same way.

    A node that fails (for good, after its --restart-failed restarts) is reported and the others keep
    running to their end; --stop-on-failure stops them all at once instead. Either way the run exits 1.
    Ctrl-C or SIGTERM stops every process the run started (SIGTERM, then SIGKILL after 3 s).
    Exit status: 0 all nodes succeeded; 1 a node failed or --timeout-s passed; 2 a bad cluster file
    or usage; 130/143 interrupted.
    """
    if node_count is not None and resume is None:
        script, script_args = _script_first(cluster, script, script_args, node_names)
        cluster = None
    elif settings_file is not None:
        raise click.UsageError("--config goes with -n N; without -n the cluster file is the first argument")
    elif join is not None:
        raise click.UsageError("--join goes with -n N; in a cluster file, write `join: HOST:PORT`")
    if stop_on_failure and keep_going:
        raise click.UsageError("--stop-on-failure and --keep-going contradict each other: give one")
    stop = True if stop_on_failure else False if keep_going else None  # None: not given on this command line
    if no_baseline and (script is not None or resume is not None):
        raise click.UsageError("--no-baseline is for a new run of the built-in demo (no SCRIPT, no --resume)")
    if resume is not None:
        _check_resume_usage(node_count, cluster, node_names, run_dir, partition)
        _resume(RunDir(resume), steps, threads, timeout_s, stop, restart_failed, quiet, tensorboard, average)
    config, reservation, node_names, listed = _cluster(cluster, node_count, settings_file, join, node_names)
    try:  # the reserved ports stay locked until the job is over (and the process exits), or it fails to start
        _check_average(script, average)
        command = _command(script, script_args, steps, partition)
        nodes = _nodes_here(config, node_names, listed)
        shared = node_count is None  # a file's nodes: one launcher per task of a step; -n N's are this one's
        directory = RunDir(run_dir if run_dir is not None else default_run_dir(step_shared=shared))
        evaluate = script is None and runs_every_node(config, nodes) and not no_baseline
        average = _average_here(config, nodes, average)
        per_node = threads if threads is not None else threads_per_node(len(nodes))
        _start(config, nodes, command, directory, evaluate, per_node, timeout_s, bool(stop), restart_failed, False,
               quiet, tensorboard, average)  # fmt: skip
    finally:
        if reservation is not None:
            reservation.release()


def _script_first(
    cluster: str | None, script: str | None, script_args: tuple[str, ...], node_names: tuple[str, ...]
) -> tuple[str | None, tuple[str, ...]]:
    """``-n N``: (SCRIPT, ARGS) from the positional arguments, there being no CLUSTER.yaml among them; a
    UsageError with ``--node``."""
    positional = [a for a in (cluster, script) if a is not None] + list(script_args)
    script, script_args = (positional[0], tuple(positional[1:])) if positional else (None, ())
    if node_names:
        raise click.UsageError("-n N starts every node here; --node is for a cluster file's nodes")
    return script, script_args


def _check_resume_usage(
    node_count: int | None,
    cluster: str | None,
    node_names: tuple[str, ...],
    run_dir: Path | None,
    partition: str | None,
) -> None:
    """A UsageError for an option that ``--resume RUN_DIR`` takes from the run directory instead."""
    if node_count is not None:
        raise click.UsageError("--resume RUN_DIR takes its nodes from RUN_DIR; drop -n")
    if cluster is not None or node_names or run_dir is not None:
        raise click.UsageError("--resume RUN_DIR takes the cluster file, nodes and command from RUN_DIR")
    if partition is not None:
        raise click.UsageError("--resume RUN_DIR keeps the run's data split; drop --partition")


def _resume(
    directory: RunDir,
    steps: int | None,
    threads: int | None,
    timeout_s: float | None,
    stop: bool | None,
    restart_failed: int,
    quiet: bool,
    tensorboard: bool,
    average: str | None,
) -> NoReturn:
    """``--resume``: run the job recorded in ``directory`` again and exit; ``stop`` (``average``), when not None,
    overrides the recorded ``--stop-on-failure`` (``--evaluate``)."""
    config, nodes, command, directory, evaluate, per_node, recorded, spec = _resume_plan(directory, steps, threads)
    _check_average(None if command[1:3] == ["-m", DEMO_MODULE] else command[-1], average)  # as a new run does
    average = _average_here(config, nodes, average if average is not None else spec)
    _check_ports(config, nodes)  # an `-n` run's ports too: nothing holds them for it any more
    stop = recorded if stop is None else stop
    _start(config, nodes, command, directory, evaluate, per_node, timeout_s, stop, restart_failed, True,
           quiet, tensorboard, average)  # fmt: skip


def _cluster(
    cluster: str | None,
    node_count: int | None,
    settings_file: str | None,
    join: str | None,
    node_names: tuple[str, ...],
) -> tuple[ClusterConfig, PortReservation | None, tuple[str, ...], bool]:
    """(the cluster, the ``-n`` reservation holding its ports or None, the nodes named to start here, whether
    the nodes come from the cluster file rather than from ``-n``'s reservation or an engine)."""
    if node_count is not None:
        config, reservation = _local_cluster(node_count, settings_file, join)
        return config, reservation, node_names, False
    if cluster is None:
        raise click.UsageError("missing CLUSTER.yaml (or -n N, or --resume RUN_DIR)")
    try:
        config = load_config(cluster)
    except ConfigError as err:
        fail(err)
    if config.nodes:
        return config, None, node_names, True
    try:
        config, mine, _ = engine_nodes(config, os.environ)
    except EngineError as err:
        fail(f"{cluster}: {err}")
    return config, None, node_names or ((mine,) if mine is not None else ()), False


def _check_average(script: str | None, average: str | None) -> None:
    """``--evaluate MODULE:FUNCTION``: a UsageError without SCRIPT, exit 2 when the spec does not resolve --
    before any node trains: a typo found after the training would cost it all."""
    if script is None and average is not None:
        raise click.UsageError("--evaluate MODULE:FUNCTION is for a SCRIPT's saved models; the demo evaluates itself")
    if average is not None:
        try:
            check_spec(average)
        except AverageError as err:
            fail(err)


def _command(script: str | None, script_args: tuple[str, ...], steps: int | None, partition: str | None) -> list[str]:
    """Each node's command: the built-in demo with ``--steps`` / ``--partition``, or ``python SCRIPT ARGS``;
    exit 2 when the demo is not installed or SCRIPT is not a file, a UsageError for a demo option with SCRIPT."""
    if script is None:
        if importlib.util.find_spec(DEMO_MODULE) is None:
            fail(f"the built-in demo ({DEMO_MODULE}) is not installed; give a SCRIPT to run")
        command = [sys.executable, "-m", DEMO_MODULE]
        command += ["--steps", str(steps)] if steps is not None else []
        command += ["--partition", partition] if partition is not None else []
        return command
    if steps is not None or partition is not None:
        option = "--steps" if steps is not None else "--partition"
        raise click.UsageError(f"{option} is for the built-in demo; pass SCRIPT its own options after its name")
    if not os.path.isfile(script):
        fail(f"{script}: no such file")
    return [sys.executable, os.path.abspath(script), *script_args]


def _nodes_here(config: ClusterConfig, node_names: tuple[str, ...], listed: bool) -> list[NodeSpec]:
    """The nodes to start on this machine (warnings on stderr); exit 2 when a ``listed`` one's port is in use
    (ports ``-n`` reserved, or an engine derived, are this launcher's own: not checked). SLURM_PROCID picks one
    node of a ``listed`` file only: ``-n``'s nodes are all this launcher's, also inside a SLURM job (an engine's
    come named)."""
    is_local = LocalHosts()
    if not node_names:
        is_local.learn(node.host for node in config.nodes)
    try:
        nodes, warnings = select_nodes(config, node_names, env=None if listed else {}, is_local=is_local)
    except ConfigError as err:
        fail(err)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    if listed:
        _check_ports(config, nodes, is_local)
    return nodes


def _average_here(config: ClusterConfig, nodes: list[NodeSpec], average: str | None) -> str | None:
    """``average``, or None with a warning when this run does not hold every node of the cluster."""
    if average is not None and not runs_every_node(config, nodes):
        click.echo("warning: --evaluate needs every node of the cluster in this run; run `dpwa average RUN_DIR "
                   f"--evaluate {average}` once every launcher is done", err=True)  # fmt: skip
        return None
    return average


def _check_ports(config: ClusterConfig, nodes: list[NodeSpec], is_local: LocalHosts | None = None) -> None:
    """Exit 2 with one line when the port of one of ``nodes`` whose host is this machine is in use."""
    busy = busy_ports(nodes, is_local=is_local if is_local is not None else LocalHosts())
    if busy:
        fail(busy_ports_message(config, busy))


def _local_cluster(n: int, settings_file: str | None, join: str | None = None) -> tuple[ClusterConfig, PortReservation]:
    """``-n N``: the settings (``settings_file`` without ``nodes``, or the defaults) with N local nodes on ports
    reserved for this run; with ``join``, nodes that join the cluster of the member at ``join``."""
    source = f"dpwa run -n {n}" + (f" --join {join}" if join else "")
    try:
        settings = load_config(settings_file) if settings_file is not None else ClusterConfig(source=source)
        if join is not None:
            settings = settings.with_join(join)
    except ConfigError as err:
        fail(err)
    if settings.nodes:
        fail(settings.error("nodes", "with -n N the nodes are chosen here: leave `nodes` out of the file, or drop -n"))
    address = settings.join_address
    host = LOCAL_HOST
    if address is not None:  # the nodes listen on the advertised address: their ports are reserved there
        try:
            host = joining_host(address, os.environ)
        except (OSError, TypeError, ValueError) as err:  # TypeError, ValueError: a host no resolver takes
            fail(f"join {join or address}: {err}")
    try:
        reservation = reserve_ports(n, host)
    except OSError as err:
        fail(f"-n {n}: cannot reserve {n} free ports on {host}: {err.strerror or err}")
    try:
        if address is None:
            return settings.with_nodes(local_nodes(reservation.ports)), reservation
        return settings.with_nodes(joining_nodes(host, reservation.ports)), reservation
    except ConfigError as err:
        reservation.release()
        fail(err)


def _start(
    config: ClusterConfig,
    nodes: list[NodeSpec],
    command: list[str],
    directory: RunDir,
    evaluate: bool,
    per_node: int,
    timeout_s: float | None,
    stop_on_failure: bool,
    restart_failed: int,
    resume: bool,
    quiet: bool,
    tensorboard: bool = False,
    average: str | None = None,
) -> NoReturn:
    """Check the nodes' keys, prepare the run directory (kept as it is by ``resume``), run the job and exit
    (``tensorboard``: after writing the nodes' TensorBoard scalars; ``average``: the ``--evaluate`` of a SCRIPT's
    models). ``launch.json`` records ``stop_on_failure`` and ``average`` for ``--resume``."""
    try:
        for node in nodes if config.security.curve else ():  # every node started here needs its secret key
            config.check_secret_key(node.name)
    except ConfigError as err:
        fail(err)
    try:
        claimed = directory.claim([node.name for node in nodes])
    except OSError as err:
        fail(str(err))
    with claimed:  # let go when this launcher ends, however
        launch = {
            "version": 1,
            "nodes": [n.name for n in nodes],
            "command": command,
            "threads": per_node,
            "evaluate": evaluate,
            "demo": command[1:3] == ["-m", DEMO_MODULE],
            "stop_on_failure": stop_on_failure,
            "average": average,
        }
        _prepare(directory, config, launch, evaluate, resume)
        if not quiet:
            names = ", ".join(node.name for node in nodes)
            plural = "s" if per_node != 1 else ""
            what = "resuming" if resume else "run dir"
            click.echo(f"dpwa run: {names} ({per_node} thread{plural} each); {what} {directory.path}", err=True)
        job = Job(config, nodes, command, directory, per_node, evaluate, timeout_s, stop_on_failure, restart_failed,
                  resume, average)  # fmt: skip
        code = run_job(job, progress=None if quiet else Progress(sys.stderr))
        if tensorboard:
            _write_tensorboard(directory, [node.name for node in nodes])
    sys.exit(code)


def _prepare(directory: RunDir, config: ClusterConfig, launch: dict[str, Any], evaluate: bool, resume: bool) -> None:
    """Prepare the run directory for the nodes of ``launch`` (kept as it is by ``resume``) and write its
    cluster.yaml and ``launch`` as launch.json; exit 2 when it cannot be written."""
    try:
        directory.prepare(launch["nodes"], evaluate=evaluate, resume=resume)
        if not resume:
            directory.write_config(config)
        directory.write_launch(launch, launcher_key(os.environ, socket.gethostname()))
    except OSError as err:
        fail(f"{directory.path}: cannot write the run directory: {err.strerror or err}")


def _write_tensorboard(directory: RunDir, nodes: list[str]) -> None:
    """The nodes' metrics as TensorBoard scalars; a missing extra or no metrics is a warning (the run's exit
    status stays the job's)."""
    from dpwa.tools.tensorboard import MISSING_TENSORBOARDX, write_tensorboard

    present = set(directory.metrics_nodes())
    try:
        written = write_tensorboard(directory, nodes=[n for n in nodes if n in present])
    except ImportError:
        click.echo(f"warning: {MISSING_TENSORBOARDX}", err=True)
        return
    except (ValueError, OSError) as err:
        click.echo(f"warning: no TensorBoard files: {err}", err=True)
        return
    if written:
        click.echo(f"tensorboard: tensorboard --logdir {written[0].parent}")


def _with_option(command: list[str], option: str, value: str) -> list[str]:
    """``command`` with ``option value`` set: replaced where it is already given, else appended."""
    out = list(command)
    for i, arg in enumerate(out[:-1]):
        if arg == option:
            out[i + 1] = value
            return out
    return [*out, option, value]


def _resume_plan(
    directory: RunDir, steps: int | None, threads: int | None
) -> tuple[ClusterConfig, list[NodeSpec], list[str], RunDir, bool, int, bool, str | None]:
    """(config, nodes, command, run dir, evaluate, threads, stop on failure, the SCRIPT's --evaluate) of the run
    recorded in ``directory``'s launch.json. A record written before ``stop_on_failure`` (``average``) was recorded
    gives False (None), the default."""
    record = directory.read_launch()
    if record is None:
        fail(f"{directory.path}: no {directory.launch_path.name}: not a run directory of `dpwa run`")
    try:
        config = load_config(directory.config_path)
    except ConfigError as err:
        fail(err)
    launcher = launcher_key(os.environ, socket.gethostname())
    try:
        names = nodes_to_resume(record, launcher)
    except (KeyError, TypeError) as err:
        fail(f"{directory.launch_path}: unreadable launch record: {err}")
    except ValueError as err:
        fail(f"{directory.launch_path}: {err}")
    try:
        nodes = [config.node(name) for name in names]
        command = [str(arg) for arg in record["command"]]
        if not command:
            raise ValueError("the command is empty")
        evaluate, demo = bool(record["evaluate"]), bool(record["demo"])
        per_node = int(threads_to_resume(record, launcher))
        stop_on_failure = record.get("stop_on_failure", False)
        if not isinstance(stop_on_failure, bool):
            raise TypeError(f"stop_on_failure must be true or false, got {stop_on_failure!r}")
        spec = record.get("average")
        if spec is not None and not isinstance(spec, str):
            raise TypeError(f"average must be MODULE:FUNCTION or null, got {spec!r}")
    except (KeyError, TypeError, ValueError, OverflowError) as err:  # OverflowError: int(Infinity)
        fail(f"{directory.launch_path}: unreadable launch record: {err}")
    if steps is not None:
        if not demo:
            raise click.UsageError("--steps is for the built-in demo; this run's SCRIPT keeps its own options")
        command = _with_option(command, "--steps", str(steps))
    if config.checkpoint_every == 0:
        click.echo(f"warning: {config.source}: checkpoint_every is 0: the nodes start over from step 0", err=True)
    per_node = threads if threads is not None else per_node
    return config, nodes, command, directory, evaluate, per_node, stop_on_failure, spec
