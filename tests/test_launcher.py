"""`dpwa run`: which nodes start, their environment, the run directory, failures, and clean stops.

The process tests run the launcher as a real subprocess (``python -m dpwa.cli run ...``) with a small
numpy node script (DpwaConnection plus metrics lines in the docs/metrics.md format), then check what
it left behind: exit status, run directory, and -- after SIGINT/SIGTERM -- that every process it
started is gone, the ports are free, and a process it did not start is untouched.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from conftest import free_ports, port_is_free, wait_until
from test_slurm import step_env

from dpwa.cli import app as cli
from dpwa.cli import run as run_command
from dpwa.cli.lazy import EXIT_INTERRUPTED, LazyGroup
from dpwa.cli.run import _split_at_script, _with_option
from dpwa.config import ClusterConfig, parse_config
from dpwa.launcher import lifeline, placement, restarts
from dpwa.launcher import supervisor as supervisor_module
from dpwa.launcher.job import _watch
from dpwa.launcher.placement import THREAD_VARIABLES, LocalHosts, node_env, select_nodes, threads_per_node, usable_cores
from dpwa.launcher.progress import NodeView, Progress, summary_table
from dpwa.launcher.restarts import Restarter
from dpwa.launcher.rundir import NodeMetrics, RunDir, default_run_dir
from dpwa.launcher.supervisor import STOP_GRACE_S, SignalTrap
from dpwa.metrics import MetricsTail, read_metrics

ROOT = Path(__file__).resolve().parents[1]
BAD_FILE = ROOT / "tests" / "data" / "configs" / "bad" / "fetch_probability_out_of_range.yaml"
NOT_HERE = "192.0.2.10"  # TEST-NET-1 (RFC 5737): never an address of this machine

NODE_SCRIPT = r'''
"""Test node: gossips a numpy vector, writes metrics lines, prints what the launcher gave it."""
import argparse, json, os, signal, subprocess, sys, time
import numpy as np
from dpwa import DpwaConnection, load_config

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)          # 0 = until stopped
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--fail", default="")                     # this node raises at step 3
parser.add_argument("--ignore-term", default="")              # this node ignores SIGTERM
parser.add_argument("--grandchild", default="")               # this node starts a helper process
parser.add_argument("--node", default="")                     # only here to prove pass-through
parser.add_argument("--barrier", action="store_true")         # mix once every peer published; serve until idle
args = parser.parse_args()
name = os.environ["DPWA_NODE"]
env = {k: os.environ.get(k) for k in ("DPWA_NODE", "DPWA_CONFIG", "DPWA_RUN_DIR", "OMP_NUM_THREADS",
                                      "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "DPWA_TORCH_THREADS")}
print("ARGV " + json.dumps(sys.argv[1:]))
print("ENV " + json.dumps(env))
print(f"PID {os.getpid()}")
if args.ignore_term == name:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.grandchild == name:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"CHILD {helper.pid}")
sys.stdout.flush()

def published(peer):  # the peer's metrics file says it published its first snapshot
    try:
        with open(os.path.join(os.environ["DPWA_RUN_DIR"], peer + ".metrics.jsonl")) as f:
            return '"published"' in f.read()
    except FileNotFoundError:
        return False

conn = DpwaConnection(name, os.environ["DPWA_CONFIG"], seed=1)
params = [np.full(256, float(sum(map(ord, name))), dtype=np.float32)]
path = os.path.join(os.environ["DPWA_RUN_DIR"], name + ".metrics.jsonl")
with open(path, "a", buffering=1) as out:
    step, loss, mixes = 0, 1.0, 0
    while args.steps == 0 or step < args.steps:
        step += 1
        conn.update_send(params, loss)
        if args.barrier and step == 1:  # from step 2 on every fetch finds a published peer
            out.write(json.dumps({"time": time.time(), "node": name, "event": "published"}) + "\n")
            deadline = time.monotonic() + 30
            for peer in load_config(os.environ["DPWA_CONFIG"]).peers_of(name):
                while not published(peer.name):
                    assert time.monotonic() < deadline, f"{peer.name} never published"
                    time.sleep(0.02)
        loss = 1.0 / (1.0 + step)
        factor = conn.update_wait(loss)
        mixes += factor > 0
        ex = conn.last_exchange or {}
        stats = conn.stats()
        out.write(json.dumps({
            "time": time.time(), "node": name, "step": step, "clock": conn.clock, "loss": loss,
            "factor": factor, "peer": ex.get("peer"), "status": ex.get("status"), "bytes": ex.get("bytes", 0),
            "fetch_ms": ex.get("fetch_ms"), "clock_gap": ex.get("clock_gap"), "mixes": mixes,
            "failed": stats["fetches_timed_out"] + stats["fetches_refused"] + stats["fetches_rejected"],
            "bytes_in": stats["bytes_in"], "bytes_out": stats["bytes_out"],
        }) + "\n")
        if args.fail == name and step == 3:
            raise RuntimeError(f"boom from {name}")
        time.sleep(args.sleep)
    out.write(json.dumps({"time": time.time(), "node": name, "event": "report", "accuracy": 0.5}) + "\n")
conn.close(linger=5.0 if args.barrier else 0.0, idle=0.5)  # --barrier: peers still training find this one
'''


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def node_script(tmp_path: Path) -> Path:
    path = tmp_path / "gossip_node.py"
    path.write_text(NODE_SCRIPT)
    return path


def cluster(path: Path, ports: list[int], hosts: list[str] | None = None, **settings: Any) -> Path:
    hosts = hosts or ["127.0.0.1"] * len(ports)
    doc = {"nodes": [{"name": f"w{i + 1}", "host": h, "port": p} for i, (h, p) in enumerate(zip(hosts, ports))]}
    doc.update({"timeout_ms": 500, **settings})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def config_of(*hosts: str) -> ClusterConfig:
    """A parsed cluster with nodes a, b, c, ... on ``hosts``."""
    lines = [f"  - {{name: {chr(ord('a') + i)}, host: {h}, port: {i + 1}}}" for i, h in enumerate(hosts)]
    return parse_config("nodes:\n" + "\n".join(lines) + "\n", "c.yaml")


def launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``dpwa run ARGS`` as a subprocess, stdout/stderr to files in tmp_path."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env or {})
    with open(tmp_path / "launcher.out", "wb") as out, open(tmp_path / "launcher.err", "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "dpwa.cli", "run", *args], stdout=out, stderr=err, env=full_env, cwd=tmp_path
        )


def finish(proc: subprocess.Popen[bytes], tmp_path: Path, timeout: float = 30) -> tuple[int, str, str]:
    code = proc.wait(timeout=timeout)
    return code, (tmp_path / "launcher.out").read_text(), (tmp_path / "launcher.err").read_text()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def log_values(log: Path, key: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines() if line.startswith(key + " ")]


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Pids the test learned about; any still alive at teardown (a failed test) is killed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- which nodes, which environment


def test_local_hosts_are_loopback_and_this_machines_names() -> None:
    local = LocalHosts()
    for host in ("localhost", "127.0.0.1", "127.3.2.1", "::1", socket.gethostname(), socket.getfqdn()):
        assert local(host), host
    assert not local(NOT_HERE)
    assert not local("no-such-host.invalid")


def test_many_hosts_are_looked_up_at_once_and_decided_as_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster file of hosts that do not resolve made ``dpwa validate`` and ``dpwa run`` wait for each lookup in
    turn (6 s for 30 here). ``learn`` runs them at once: each fake lookup waits until 4 are in flight together (a
    barrier with a 10 s timeout, which lookups one at a time would break), and the verdicts are those of the
    lookups made one by one."""
    in_flight = threading.Barrier(4, timeout=10.0)
    looked_up: list[str] = []

    def slow_lookup(host: str) -> set[str]:
        looked_up.append(host)
        in_flight.wait()
        return {"127.0.0.1"} if host.startswith("here") else set()

    local = LocalHosts()  # its own names looked up first, for real
    monkeypatch.setattr(placement, "_addresses", slow_lookup)
    hosts = ["here-1", "Far-1", "here-2", "far-2", "far-1", "[far-2]"]
    local.learn(hosts, workers=8)
    assert sorted(looked_up) == ["far-1", "far-2", "here-1", "here-2"]  # once per host, case and brackets aside
    monkeypatch.setattr(placement, "_addresses", lambda host: pytest.fail(f"{host} looked up again"))
    assert [local(h) for h in hosts] == [True, False, True, False, False, False]


def test_select_nodes_picks_the_local_ones_and_names_hosts_when_none() -> None:
    nodes, warnings = select_nodes(config_of("localhost", NOT_HERE, "127.0.0.2"), env={})
    assert [n.name for n in nodes] == ["a", "c"] and warnings == []
    with pytest.raises(ValueError, match=rf"c.yaml:1: nodes: no node runs on this machine .*: {NOT_HERE}, x.invalid;"):
        select_nodes(config_of(NOT_HERE, "x.invalid"), env={})


def test_select_nodes_by_name_warns_for_a_remote_host_and_rejects_unknown_names() -> None:
    config = config_of("localhost", NOT_HERE)
    nodes, warnings = select_nodes(config, ["b", "a", "b"], env=srun_task(0, 2))
    assert [n.name for n in nodes] == ["b", "a"]  # --node wins over SLURM; duplicates dropped
    assert len(warnings) == 1 and NOT_HERE in warnings[0]
    with pytest.raises(ValueError, match=r"no node named 'c'"):
        select_nodes(config, ["c"], env={})


def srun_task(procid: int, ntasks: int, **more: str) -> dict[str, str]:
    """What srun sets in task ``procid`` of a one-host step of ``ntasks`` on localhost (``step_env``), with
    SLURM_NTASKS, which placement reads."""
    return step_env(procid, "localhost", str(ntasks), SLURM_NTASKS=str(ntasks), **more)


def test_select_nodes_under_slurm_takes_the_node_of_its_rank() -> None:
    config = config_of(NOT_HERE, "localhost")
    nodes, _ = select_nodes(config, env=srun_task(0, 2))
    assert [n.name for n in nodes] == ["a"]
    nodes, warnings = select_nodes(config, env=srun_task(1, 2))
    assert [n.name for n in nodes] == ["b"] and warnings == []
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=3 but the file has 2 nodes.*srun --ntasks=2"):
        select_nodes(config, env=srun_task(0, 3))


def test_select_nodes_in_a_batch_scripts_own_shell_takes_every_local_node() -> None:
    """``sbatch -n 2`` sets SLURM_PROCID=0 and SLURM_NTASKS=2 in the script's own shell, but no SLURM_STEP_ID:
    `dpwa run cluster.yaml` written there is no task of a step and starts every node of this machine. Before,
    it started node number 0 alone, and its peers never came."""
    config = config_of("localhost", "127.0.0.1")
    batch = {k: v for k, v in srun_task(0, 2).items() if k != "SLURM_STEP_ID"}
    nodes, warnings = select_nodes(config, env=batch)
    assert [n.name for n in nodes] == ["a", "b"] and warnings == []


def test_threads_split_the_cores_and_the_environment_names_the_node(tmp_path: Path) -> None:
    assert threads_per_node(4, 2) == 1
    assert threads_per_node(3, 8) == 2
    assert threads_per_node(2, 8) == 4
    assert threads_per_node(1, 1) == 1
    assert threads_per_node(2) == max(1, usable_cores() // 2)
    env = node_env({"PATH": "/bin", "DPWA_NODE": "old"}, node="w2", config_path=tmp_path / "c.yaml",
                   run_dir=tmp_path, threads=3)  # fmt: skip
    assert env["DPWA_NODE"] == "w2" and env["DPWA_CONFIG"] == str(tmp_path / "c.yaml")
    assert env["DPWA_RUN_DIR"] == str(tmp_path) and env["PATH"] == "/bin"
    assert all(env[name] == "3" for name in THREAD_VARIABLES)
    assert "DPWA_NODE" not in node_env({"DPWA_NODE": "old"}, node=None, config_path="c", run_dir="r", threads=1)


def test_script_and_its_arguments_are_split_from_the_launchers_options() -> None:
    valued = {"--node", "--steps", "--run-dir"}
    assert _split_at_script(["c.yaml", "--steps", "5"], valued) == ["c.yaml", "--steps", "5"]
    assert _split_at_script(["--node", "w1", "c.yaml", "t.py", "--node", "x"], valued) == [
        "--node", "w1", "c.yaml", "--", "t.py", "--node", "x",
    ]  # fmt: skip
    assert _split_at_script(["c.yaml", "--quiet", "t.py", "-h"], valued) == ["c.yaml", "--quiet", "--", "t.py", "-h"]
    assert _split_at_script(["c.yaml", "--", "t.py", "a"], valued) == ["c.yaml", "--", "t.py", "a"]


def test_a_scripts_own_n_after_the_cluster_file_goes_to_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dpwa run c.yaml --quiet t.py -n 4``: the launcher's --quiet, the script's -n. Before, the script's -n
    switched the parse to `dpwa run -n N` and --quiet was taken for the SCRIPT (exit 2, no such file)."""
    commands: list[list[str]] = []
    monkeypatch.setattr(run_command, "_start", recording_start(lambda *args: args[2], commands))
    path = cluster(tmp_path / "c.yaml", free_ports(1))
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.main, ["run", str(path), "--quiet", "t.py", "-n", "4"])
    assert result.exit_code == 0, result.output
    assert commands[0][-3:] == [str(tmp_path / "t.py"), "-n", "4"]


# --------------------------------------------------------------------------- run directory, metrics, progress


def test_metrics_are_read_tolerantly_and_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "w1.metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == [] and read_metrics(path, missing_ok=True) == []
    path.write_text('{"step": 1, "loss": 2.0, "status": "ok", "fetch_ms": 4.0, "bytes": 10}\n{"step": 2, "lo')
    assert [r["step"] for r in tail.read_new()] == [1]  # the torn line waits for its end
    assert [r["step"] for r in read_metrics(path, missing_ok=True)] == [1]
    with open(path, "a") as handle:
        handle.write('ss": 1.0, "status": "timeout", "fetch_ms": 500.0}\n{"event": "report", "accuracy": 0.75}\n')
    records = tail.read_new()
    assert [r.get("step") for r in records] == [2, None]
    metrics = NodeMetrics.of(read_metrics(path, missing_ok=True))
    assert (metrics.steps, metrics.loss, metrics.timeouts, metrics.failed) == (2, 1.0, 1, 1)
    assert metrics.mean_fetch_ms == 4.0 and metrics.accuracy == 0.75 and metrics.bytes_in == 10
    with open(path, "a") as handle:
        handle.write('{"step": 3, "lo')  # a writer killed mid-line
    assert tail.read_new(final=True) == []


def test_summaries_of_two_launchers_sharing_a_run_dir_are_merged(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_summary({"ok": True, "nodes": {"a1": {"status": "ok"}}})
    merged = run_dir.write_summary({"ok": True, "nodes": {"b1": {"status": "failed"}}})
    assert set(merged["nodes"]) == {"a1", "b1"} and merged["ok"] is False
    assert run_dir.read_summary() == merged
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["summary.json"]


def test_progress_redraws_on_a_terminal_and_prints_compact_lines_otherwise() -> None:
    now = [0.0]
    views = [NodeView("w1", "running", NodeMetrics(steps=7, loss=0.25, mixes=5, failed=1, bytes_in=0))]
    plain = io.StringIO()
    progress = Progress(plain, interactive=False, clock=lambda: now[0])
    assert not progress.update(views)  # the first compact line comes after the interval
    now[0] = 5.0
    assert progress.update(views)
    assert not progress.update(views)
    line = plain.getvalue()
    assert line.count("\n") == 1 and "w1 step 7 loss 0.25 mix 5 fail 1" in line and "MB/s" in line

    tty = io.StringIO()
    now[0] = 0.0
    progress = Progress(tty, interactive=True, clock=lambda: now[0])
    assert progress.update(views)
    now[0] = 1.0
    views = [NodeView("w1", "ok", NodeMetrics(steps=9, loss=0.125, mixes=6, bytes_in=2_000_000))]
    assert progress.update(views)
    text = tty.getvalue()
    assert "\x1b[1F" in text  # moved up over the previous line to redraw it
    assert "step       9" in text and "2.00 MB/s" in text  # 2 MB received in one second


def test_progress_shows_the_members_a_node_sees_from_its_member_records() -> None:
    metrics = NodeMetrics()
    metrics.add({"time": 1.0, "event": "member", "member": "w1", "state": "started", "version": 0, "members": 3})
    metrics.add({"time": 2.0, "event": "member", "member": "j1", "state": "joined", "version": 0, "members": 4})
    metrics.add({"time": 3.0, "event": "member", "member": "j1", "state": "left", "version": 1, "members": True})
    assert metrics.members == 4  # a malformed count is ignored
    out = io.StringIO()
    Progress(out, interactive=True, clock=lambda: 0.0).update([NodeView("w1", "running", metrics)])
    assert "members   4" in out.getvalue()
    done = io.StringIO()  # a node that ended has left: its count says nothing any more
    Progress(done, interactive=True, clock=lambda: 0.0).update([NodeView("w1", "ok", metrics)])
    assert "members" not in done.getvalue()
    assert NodeMetrics().members is None


def test_summary_table_has_a_row_per_node() -> None:
    rows = {
        "w1": {"status": "ok", "steps": 100, "final_loss": 0.5, "accuracy": 0.91, "mixes": 97, "timeouts": 1,
               "failed_fetches": 3, "mean_fetch_ms": 2.25},
        "w2": {"status": "failed", "returncode": 1, "steps": 3},
    }  # fmt: skip
    lines = summary_table(rows).splitlines()
    assert lines[0].split() == ["node", "status", "steps", "final", "loss", "accuracy", "mixes", "failed",
                                "timeouts", "fetch", "ms"]  # fmt: skip
    assert lines[1].split() == ["w1", "ok", "100", "0.5000", "0.9100", "97", "3", "1", "2.2"]
    assert lines[2].split() == ["w2", "failed", "(1)", "3", "-", "-", "-", "-", "-", "-"]


def test_summary_table_shows_each_nodes_classes_when_nodes_wrote_their_data() -> None:
    rows = {
        "w1": {"status": "ok", "data": {"partition": "classes:2", "classes": [500, 0, 0, 480, 0]}},
        "w2": {"status": "ok", "data": {"partition": "classes:2", "classes": ["x"]}},  # malformed: no label
        "w3": {"status": "ok"},
    }
    lines = summary_table(rows).splitlines()
    assert lines[0].split()[-3:] == ["data", "(classes", ">=", "5%)"][-3:]
    assert lines[1].endswith("classes:2: 0,3")
    assert lines[2].endswith("-") and lines[3].endswith("-")
    assert "data" not in summary_table({"w1": {"status": "ok"}}).splitlines()[0]


def test_metrics_count_every_outcome_under_its_reason_and_only_failures_as_failed() -> None:
    """A start-up "not ready" and AD-PSGD's "busy" are declined, not failed; the failures add up to failed."""
    records = [
        {"step": 1, "status": "refused", "reasons": ["refused: not-ready"], "failed": 0},
        {"step": 2, "status": "ok,pushed", "reasons": [], "fetch_ms": 4.0, "failed": 0},
        {"step": 3, "status": "refused,pushed", "reasons": ["refused: busy"], "failed": 0},
        {"step": 4, "status": "timeout", "reasons": ["timeout"], "failed": 1},
        {"step": 5, "status": "refused,rejected", "reasons": ["refused: busy", "rejected: nan"], "failed": 2},
        {"step": 6, "status": "refused", "reasons": ["refused: layout-mismatch"], "failed": 3},
        {"step": 7, "status": "timeout", "reasons": ["timeout: late"], "failed": 4},
    ]
    summary = NodeMetrics.of(records).summary()
    assert summary["steps"] == 7 and summary["timeouts"] == 2 and summary["mean_fetch_ms"] == 4.0
    assert summary["failed_fetches"] == 4 == sum(summary["failed_by_reason"].values())
    assert summary["failed_by_reason"] == {"refused: layout-mismatch": 1, "rejected: nan": 1, "timeout": 1,
                                           "timeout: late": 1}  # fmt: skip
    assert summary["declined_fetches"] == 3
    assert list(summary["declined_by_reason"].items()) == [("refused: busy", 2), ("refused: not-ready", 1)]
    assert summary["mean_push_ms"] is None


def test_metrics_of_an_older_file_without_reasons_take_the_statuses_as_reasons() -> None:
    records = [
        {"step": 1, "status": "ok,pushed", "failed": 0},
        {"step": 2, "status": "refused", "failed": 1},
        {"step": 3, "status": "timeout,pushed"},  # no cumulative counter either: counted here
    ]
    summary = NodeMetrics.of(records).summary()
    assert summary["failed_fetches"] == 2 and summary["failed_by_reason"] == {"refused": 1, "timeout": 1}
    assert summary["declined_fetches"] == 0 and summary["declined_by_reason"] == {}


def test_metrics_of_a_push_rule_average_the_push_latency_of_exchanges_that_had_a_push_delivered() -> None:
    records = [
        {"step": 1, "status": "pushed", "reasons": [], "fetch_ms": 0.0, "delivered": 1, "push_ms": 3.0},
        {"step": 2, "status": None, "reasons": [], "fetch_ms": 0.0, "delivered": 0, "push_ms": 0.0},
        {"step": 3, "status": "pushed", "reasons": [], "fetch_ms": 0.0, "delivered": 2, "push_ms": 5.0},
    ]
    summary = NodeMetrics.of(records).summary()
    assert summary["mean_push_ms"] == 4.0 and summary["mean_fetch_ms"] is None
    assert summary["failed_fetches"] == 0 and summary["steps"] == 3


def test_summary_table_shows_failures_and_declined_fetches_by_reason() -> None:
    rows = {
        "w1": {"status": "ok", "steps": 300, "mixes": 279, "failed_fetches": 3, "timeouts": 2, "mean_fetch_ms": 10.5,
               "declined_fetches": 35, "failed_by_reason": {"timeout": 2, "rejected: nan": 1},
               "declined_by_reason": {"refused: busy": 34, "refused: not-ready": 1}},
        "w2": {"status": "ok", "steps": 300, "mixes": 281, "failed_fetches": 0, "timeouts": 0, "mean_fetch_ms": 9.0,
               "declined_fetches": 0, "failed_by_reason": {}, "declined_by_reason": {}},
    }  # fmt: skip
    header, first, second = summary_table(rows).splitlines()
    assert header.split()[-4:] == ["fetch", "ms", "declined", "reasons"]
    assert first.split("  ")[-1] == "timeout 2, rejected: nan 1, busy 34, not-ready 1"
    assert first.split()[6:11] == ["3", "2", "10.5", "35", "timeout"]
    assert second.split()[-2:] == ["0", "-"]
    quiet = summary_table({"w2": rows["w2"]}).splitlines()[0]  # nothing declined, nothing failed: no columns
    assert "declined" not in quiet and "reasons" not in quiet


def test_summary_table_shows_push_latency_for_push_rules_and_says_so() -> None:
    push = {"status": "ok", "steps": 60, "mean_fetch_ms": None, "mean_push_ms": 2.5}
    lines = summary_table({"w1": push, "w2": {**push, "mean_push_ms": 3.25}}).splitlines()
    assert lines[0].split()[-2:] == ["push", "ms"]
    assert [line.split()[-1] for line in lines[1:]] == ["2.5", "3.2"]
    mixed = summary_table({"w1": push, "w2": {"status": "ok", "mean_fetch_ms": 4.0}}).splitlines()
    assert mixed[0].split()[-2:] == ["fetch/push", "ms"]
    assert mixed[1].endswith("2.5 (push)") and mixed[2].endswith("4.0")
    assert summary_table({"w1": {"status": "ok"}}).splitlines()[0].split()[-2:] == ["fetch", "ms"]


def test_resume_with_steps_keeps_the_other_demo_options() -> None:
    command = ["python", "-m", "dpwa.tools.demo", "--partition", "classes:3", "--steps", "10"]
    assert _with_option(command, "--steps", "20") == [*command[:-1], "20"]
    assert _with_option(command[:5], "--steps", "20") == [*command[:5], "--steps", "20"]


# --------------------------------------------------------------------------- command-line errors


def test_run_with_a_bad_file_exits_2_with_one_line() -> None:
    result = CliRunner().invoke(cli.main, ["run", str(BAD_FILE)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {BAD_FILE}:7: fetch_probability: must be a number in [0, 1]")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_run_with_no_local_node_names_the_hosts(
    tmp_path: Path, node_script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.chdir(tmp_path)
    path = cluster(tmp_path / "c.yaml", [1, 2], hosts=[NOT_HERE, "far.invalid"])
    result = CliRunner().invoke(cli.main, ["run", str(path), str(node_script)])
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1
    assert "no node runs on this machine" in result.stderr and f"{NOT_HERE}, far.invalid" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_run_usage_errors(tmp_path: Path, node_script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = cluster(tmp_path / "c.yaml", [1])
    result = CliRunner().invoke(cli.main, ["run", "--steps", "3", str(path), str(node_script)])
    assert result.exit_code == 2 and "--steps is for the built-in demo" in result.stderr
    result = CliRunner().invoke(cli.main, ["run", str(path), str(tmp_path / "missing.py")])
    assert result.exit_code == 2 and result.stderr == f"error: {tmp_path / 'missing.py'}: no such file\n"
    result = CliRunner().invoke(cli.main, ["run", str(path), str(node_script)], env=srun_task(0, 4))
    assert result.exit_code == 2 and "SLURM_NTASKS=4 but the file has 1 node" in result.stderr
    result = CliRunner().invoke(cli.main, ["run", "--stop-on-failure", "--keep-going", str(path), str(node_script)])
    assert result.exit_code == 2 and "--stop-on-failure and --keep-going contradict each other" in result.stderr
    result = CliRunner().invoke(cli.main, ["run", "--no-baseline", str(path), str(node_script)])
    assert result.exit_code == 2 and "--no-baseline is for a new run of the built-in demo" in result.stderr


# --------------------------------------------------------------------------- ports checked before anything starts


def recording_start(what: Any, into: list[Any]) -> Any:
    """A stand-in for ``dpwa.cli.run._start`` that records ``what(*args)`` and exits 0, as a job that succeeded."""

    def start(*args: Any) -> None:
        into.append(what(*args))
        sys.exit(0)

    return start


def line_of(path: Path, text: str) -> int:
    """The 1-based number of the only line of ``path`` that contains ``text``."""
    (number,) = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if text in line]
    return number


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket of this process listens on, for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_run_with_a_port_in_use_exits_2_with_one_line_before_starting_anything(
    tmp_path: Path, node_script: Path, busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.chdir(tmp_path)
    path = cluster(tmp_path / "c.yaml", [free_ports(1)[0], busy_port])
    result = CliRunner().invoke(cli.main, ["run", str(path), str(node_script)])
    assert result.exit_code == 2, result.output
    line = line_of(path, f"port: {busy_port}")
    said = f"error: {path}:{line}: nodes[1].port: node w2: port {busy_port} on 127.0.0.1 is already in use\n"
    assert result.stderr == said
    assert result.stdout == "" and not (tmp_path / "runs").exists()  # no run directory, no process
    # --node w1 starts only w1: w2's port is not this launcher's business
    started: list[list[str]] = []
    monkeypatch.setattr(
        run_command, "_start", recording_start(lambda config, nodes, *a: [n.name for n in nodes], started)
    )
    result = CliRunner().invoke(cli.main, ["run", "--node", "w1", str(path), str(node_script)])
    assert result.exit_code == 0, result.output
    assert started == [["w1"]]


def test_ports_the_launcher_reserves_or_an_engine_derives_are_not_checked(
    tmp_path: Path, node_script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-n N's ports are locked for this run, SLURM's come from the step: only a file's nodes are bound to check."""
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.chdir(tmp_path)
    checked: list[list[str]] = []
    started: list[list[str]] = []

    def busy_ports(nodes: list[Any], *, is_local: Any) -> list[Any]:
        checked.append([n.name for n in nodes])
        return []

    monkeypatch.setattr(run_command, "busy_ports", busy_ports)
    monkeypatch.setattr(
        run_command, "_start", recording_start(lambda config, nodes, *a: [n.name for n in nodes], started)
    )
    assert CliRunner().invoke(cli.main, ["run", "-n", "2", str(node_script)]).exit_code == 0
    settings = tmp_path / "rules.yaml"
    settings.write_text("base_port: 47000\n")
    slurm = srun_task(0, 1)
    result = CliRunner().invoke(cli.main, ["run", str(settings), str(node_script)], env=slurm)
    assert result.exit_code == 0, result.output
    assert started == [["w1", "w2"], ["localhost-0"]] and checked == []
    result = CliRunner().invoke(cli.main, ["run", str(cluster(tmp_path / "c.yaml", [1, 2])), str(node_script)])
    assert result.exit_code == 0 and checked == [["w1", "w2"]]  # a file's nodes are


def test_a_node_whose_port_was_taken_after_the_check_fails_with_one_line(tmp_path: Path, busy_port: int) -> None:
    """The race the check cannot close: the node's own bind says what is wrong, without ZeroMQ's traceback."""
    from dpwa import DpwaConnection
    from dpwa.node.transport import PortInUseError

    with pytest.raises(PortInUseError) as caught:
        DpwaConnection("w1", cluster(tmp_path / "c.yaml", [busy_port]))
    assert str(caught.value) == f"node w1: cannot bind tcp://127.0.0.1:{busy_port}: the port is already in use"
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no zmq error chained
    assert port_is_free(busy_port) is False


@pytest.mark.slow  # several seconds: kept out of the fast subset
@pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="the built-in demo needs torch")
def test_the_built_in_demo_on_a_taken_port_logs_one_error_line(tmp_path: Path, busy_port: int) -> None:
    path = cluster(tmp_path / "c.yaml", [busy_port])
    env = {**os.environ, "DPWA_NODE": "w1", "DPWA_CONFIG": str(path), "DPWA_RUN_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "dpwa.tools.demo", "--steps", "1"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(f"node w1: cannot bind tcp://127.0.0.1:{busy_port}: "
                                                   "the port is already in use")  # fmt: skip


# --------------------------------------------------------------------------- a failed node and the others


@dataclasses.dataclass
class Exited:
    name: str
    state: str

    def describe_exit(self) -> str:
        return "exit status 1" if self.state == "failed" else "exit status 0"


class ScriptedSupervisor:
    """A Supervisor stand-in: each poll() returns the next round of exits; a child runs until its exit."""

    def __init__(self, *rounds: list[Exited]) -> None:
        self.rounds = list(rounds)
        self.children = {c.name: c for r in rounds for c in r}
        self.alive = set(self.children)

    def poll(self) -> list[Exited]:
        exited = self.rounds.pop(0) if self.rounds else []
        self.alive -= {c.name for c in exited}
        return exited

    def running(self) -> list[Exited]:
        return [self.children[name] for name in sorted(self.alive)]


def test_watch_reports_a_failure_and_lets_the_others_finish_unless_told_to_stop() -> None:
    trap = SimpleNamespace(received=False)

    def script() -> ScriptedSupervisor:
        return ScriptedSupervisor([Exited("w2", "failed")], [], [Exited("w1", "ok")])

    seen: list[str] = []
    supervisor = script()
    assert _watch(supervisor, trap, None, False, lambda: None, None, seen.append) == "failed"  # type: ignore[arg-type]
    assert seen == ["w2"] and supervisor.running() == [] and supervisor.rounds == []  # w1 ran to its end
    supervisor = script()
    assert _watch(supervisor, trap, None, True, lambda: None) == "failed"  # type: ignore[arg-type]
    assert [c.name for c in supervisor.running()] == ["w1"]  # --stop-on-failure: returned at w2's failure
    # --timeout-s: w1 never ends; the failure is reported and the deadline still ends the run
    supervisor = ScriptedSupervisor([Exited("w2", "failed")], [], [])
    supervisor.children["w1"] = Exited("w1", "running")
    supervisor.alive.add("w1")
    seen.clear()
    deadline = time.monotonic() + 0.5
    assert _watch(supervisor, trap, deadline, False, lambda: None, None, seen.append) == "timeout"  # type: ignore[arg-type]
    assert seen == ["w2"]


def test_watch_reports_a_node_whose_restart_was_given_up_and_waits_for_the_others() -> None:
    """--restart-failed: a node restarted is no failure; one whose restart is given up on is, and the others run on."""
    trap = SimpleNamespace(received=False)
    started: list[str] = []
    restarter = Restarter(1, {"w1": ("127.0.0.1", 1), "w2": ("127.0.0.1", 2)}, started.append, port_wait_s=0.0,
                          port_free=lambda host, port: False)  # fmt: skip
    supervisor = ScriptedSupervisor([Exited("w2", "failed")], [], [Exited("w1", "ok")])
    seen: list[str] = []
    assert _watch(supervisor, trap, None, False, lambda: None, restarter, seen.append) == "failed"  # type: ignore[arg-type]
    assert seen == ["w2"] and started == [] and supervisor.running() == []


def write_run_dir(path: Path, ports: list[int], **launch: Any) -> Path:
    """A run directory of `dpwa run` as --resume reads it: cluster.yaml and launch.json."""
    path.mkdir()
    cluster(path / "cluster.yaml", ports, checkpoint_every=10)  # else --resume warns that nodes start over
    record = {"version": 1, "nodes": [f"w{i + 1}" for i in range(len(ports))], "command": ["python", "t.py"],
              "threads": 1, "evaluate": False, "demo": False, **launch}  # fmt: skip
    (path / "launch.json").write_text(json.dumps(record))
    return path


def test_resume_keeps_the_runs_failure_policy_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policies: list[bool] = []
    monkeypatch.setattr(run_command, "_start", recording_start(lambda *args: args[7], policies))  # stop_on_failure
    ports = free_ports(2)
    stopping = write_run_dir(tmp_path / "stopping", ports, stop_on_failure=True)
    older = write_run_dir(tmp_path / "older", ports)  # a launch.json from before the option was recorded
    for argv in (
        [str(stopping)],
        [str(stopping), "--keep-going"],
        [str(older)],
        [str(older), "--stop-on-failure"],
    ):
        result = CliRunner().invoke(cli.main, ["run", "--resume", *argv])
        assert result.exit_code == 0, result.output
    assert policies == [True, False, False, True]
    bad = write_run_dir(tmp_path / "bad", ports, stop_on_failure="yes")
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(bad)])
    assert result.exit_code == 2 and "unreadable launch record: stop_on_failure must be true or false" in result.stderr


def test_resume_checks_its_evaluate_as_a_new_run_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--resume RUN_DIR --evaluate SPEC`: a SPEC naming no file is one line and exit 2 before anything trains,
    and a demo run's resume refuses it (the demo evaluates itself). Before, the typo came out after the training,
    and a demo run was averaged instead of evaluated against its baseline."""
    specs: list[str | None] = []
    monkeypatch.setattr(run_command, "_start", recording_start(lambda *args: args[12], specs))  # average
    ports = free_ports(2)
    script_run = write_run_dir(tmp_path / "script", ports)
    demo_run = write_run_dir(tmp_path / "demo", ports, command=[sys.executable, "-m", "dpwa.tools.demo"], demo=True)
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(script_run), "--evaluate", "missing.py:evaluate"])
    assert result.exit_code == 2 and "no file missing.py" in result.stderr, result.output
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(demo_run), "--evaluate", "json:dumps"])
    assert result.exit_code == 2 and "the demo evaluates itself" in result.stderr, result.output
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(script_run), "--evaluate", "json:dumps"])
    assert result.exit_code == 0, result.output
    assert specs == ["json:dumps"]


@pytest.mark.parametrize(("field", "value"), [("threads", "Infinity"), ("command", "[]"), ("threads", "1e400")])
def test_a_corrupt_launch_record_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    """A launch.json edited by hand or half-written: one line naming it, exit 2 (threads: Infinity raised an
    OverflowError; an empty command reached Popen)."""
    monkeypatch.setattr(run_command, "_start", lambda *args: pytest.fail("started from a corrupt record"))
    run_dir = write_run_dir(tmp_path / "run", free_ports(1))
    record = (run_dir / "launch.json").read_text()
    (run_dir / "launch.json").write_text(record.replace(f'"{field}": ' + json.dumps(json.loads(record)[field]),
                                                        f'"{field}": {value}'))  # fmt: skip
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 2 and "unreadable launch record" in result.stderr, result.output


def test_a_summary_waits_for_another_launchers_lock_within_a_deadline(tmp_path: Path) -> None:
    """Launchers sharing a run directory (one per host) write summary.json under a lock on the directory: a lock
    held past the deadline is an OSError (dpwa run says it cannot write the summary), never an endless wait."""
    import fcntl
    import os

    from dpwa.launcher.rundir import _lock_within

    tmp_path.mkdir(exist_ok=True)
    holder, waiter = os.open(tmp_path, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(OSError, match="held its lock for over 0.2 s"):
            _lock_within(waiter, 0.2, tmp_path)
        os.close(holder)
        holder = -1
        _lock_within(waiter, 0.2, tmp_path)  # free now: taken at once
    finally:
        for fd in (holder, waiter):
            if fd >= 0:
                os.close(fd)


def test_resume_checks_the_ports_too(tmp_path: Path, busy_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_command, "_start", lambda *args: pytest.fail("started despite a port in use"))
    run_dir = write_run_dir(tmp_path / "run", [busy_port])
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 2
    config = run_dir / "cluster.yaml"
    line = line_of(config, f"port: {busy_port}")
    assert (
        result.stderr
        == f"error: {config}:{line}: nodes[0].port: node w1: port {busy_port} on 127.0.0.1 is already in use\n"
    )


# --------------------------------------------------------------------------- runs


def test_run_a_script_end_to_end(tmp_path: Path, node_script: Path) -> None:
    ports = free_ports(3)
    path = cluster(tmp_path / "c.yaml", ports)
    run_dir = tmp_path / "run"
    argv = ["--steps", "15", "--node", "x", "--barrier", "--sleep", "0.01"]
    proc = launch(tmp_path, str(path), "--run-dir", str(run_dir), str(node_script), *argv)
    code, out, err = finish(proc, tmp_path)
    assert code == 0, err
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "cluster.yaml", "launch.json", "summary.json",
        *(f"w{i}.{kind}" for i in (1, 2, 3) for kind in ("log", "metrics.jsonl")),
    ]  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True and summary["exit_code"] == 0
    threads = str(threads_per_node(3))
    for name in ("w1", "w2", "w3"):
        node = summary["nodes"][name]
        assert node["status"] == "ok" and node["steps"] == 15 and node["accuracy"] == 0.5
        assert node["mixes"] > 0 and node["mean_fetch_ms"] is not None
        assert len(read_metrics(run_dir / f"{name}.metrics.jsonl", missing_ok=True)) == 17  # + published, report
        log = run_dir / f"{name}.log"
        assert json.loads(log_values(log, "ARGV")[0]) == argv  # passed through untouched
        env = json.loads(log_values(log, "ENV")[0])
        assert env["DPWA_NODE"] == name and env["DPWA_RUN_DIR"] == str(run_dir)
        assert env["DPWA_CONFIG"] == str(run_dir / "cluster.yaml")
        assert all(env[v] == threads for v in THREAD_VARIABLES)
    assert parse_config((run_dir / "cluster.yaml").read_text()) == parse_config(path.read_text())
    table = out.splitlines()
    assert table[0].split()[:3] == ["node", "status", "steps"]
    assert [line.split()[:3] for line in table[1:4]] == [[f"w{i}", "ok", "15"] for i in (1, 2, 3)]
    assert table[-1] == f"run dir: {run_dir}"
    assert all(port_is_free(p) for p in ports)


@pytest.mark.parametrize("option", ["", "--keep-going", "--stop-on-failure"], ids=["default", "keep-going", "stop"])
@pytest.mark.timing
def test_a_failing_node_fails_the_run_and_shows_its_error(tmp_path: Path, node_script: Path, option: str) -> None:
    """By default (and with --keep-going, which names the default) w1 trains on to its last step after w2 failed; with
    --stop-on-failure the failure stops w1, which would otherwise run forever. The run exits 1 either way."""
    stop = option == "--stop-on-failure"
    ports = free_ports(2)
    path = cluster(tmp_path / "c.yaml", ports)
    steps = "0" if stop else "60"  # --barrier: w1 trains once w2 listens, so w2 fails at its step 3 well before
    proc = launch(tmp_path, *([option] if option else []), "-q", "--run-dir", "run", str(path), str(node_script),
                  "--steps", steps, "--fail", "w2", "--sleep", "0.02", "--barrier")  # fmt: skip
    code, out, err = finish(proc, tmp_path, 60)
    assert code == 1, err
    assert "w2 failed (exit status 1); last lines of" in err
    assert "RuntimeError: boom from w2" in err
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is False and summary["outcome"] == "failed" and summary["stop_on_failure"] is stop
    assert json.loads((run_dir / "launch.json").read_text())["stop_on_failure"] is stop  # what --resume reuses
    assert summary["nodes"]["w2"]["status"] == "failed"
    assert summary["nodes"]["w2"]["returncode"] == 1 and summary["nodes"]["w2"]["steps"] == 3
    assert [line.split()[:2] for line in out.splitlines()[1:3]] == [
        ["w1", "stopped" if stop else "ok"],
        ["w2", "failed"],
    ]
    assert not alive(summary["nodes"]["w1"]["pid"])
    if stop:
        assert summary["nodes"]["w1"]["status"] == "stopped" and "keep running" not in err
    else:
        assert summary["nodes"]["w1"]["status"] == "ok" and summary["nodes"]["w1"]["steps"] == 60
        assert "w2 failed (exit status 1); the other nodes keep running" in err
        failed_at = max(r["time"] for r in read_metrics(run_dir / "w2.metrics.jsonl", missing_ok=True))
        w1_times = [r["time"] for r in read_metrics(run_dir / "w1.metrics.jsonl", missing_ok=True) if "step" in r]
        assert sum(t > failed_at for t in w1_times) >= 10, "w1 trained on after w2 failed"


@pytest.mark.timing
def test_timeout_stops_the_run(tmp_path: Path, node_script: Path) -> None:
    path = cluster(tmp_path / "c.yaml", free_ports(1))
    proc = launch(tmp_path, "--timeout-s", "1", "-q", "--run-dir", "run", str(path), str(node_script), "--steps", "0")
    code, _, err = finish(proc, tmp_path)
    assert code == 1 and "timed out after 1 s" in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["nodes"]["w1"]["status"] == "stopped"


def test_under_slurm_a_task_starts_the_node_of_its_rank(tmp_path: Path, node_script: Path) -> None:
    path = cluster(tmp_path / "c.yaml", free_ports(2), timeout_ms=100)
    env = srun_task(1, 2, SLURM_JOB_ID="77")
    code, out, err = finish(launch(tmp_path, "-q", str(path), str(node_script), "--steps", "3", env=env), tmp_path)
    assert code == 0, err
    run_dir = tmp_path / "runs" / "slurm-77.0"
    assert out.splitlines()[-1] == f"run dir: {run_dir}"
    assert list(json.loads((run_dir / "summary.json").read_text())["nodes"]) == ["w2"]


@pytest.mark.parametrize(
    ("sig", "stubborn", "limit_s"),
    [(signal.SIGINT, "w1", 5.0), (signal.SIGTERM, "", STOP_GRACE_S)],
    ids=["sigint-node-ignores-sigterm", "sigterm"],
)
@pytest.mark.timing
def test_a_signal_stops_every_process_it_started_and_nothing_else(
    tmp_path: Path, node_script: Path, reaper: list[int], sig: signal.Signals, stubborn: str, limit_s: float
) -> None:
    """Within 5 s even when a node ignores SIGTERM; well before the grace period ends when none does."""
    ports = free_ports(3)
    path = cluster(tmp_path / "c.yaml", ports)
    run_dir = tmp_path / "run"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reaper.append(bystander.pid)
    # `stubborn` ignores SIGTERM (so it needs SIGKILL); w2 has a child process of its own
    proc = launch(tmp_path, "--run-dir", str(run_dir), str(path), str(node_script), "--steps", "0",
                  "--sleep", "0.02", "--ignore-term", stubborn, "--grandchild", "w2")  # fmt: skip
    reaper.append(proc.pid)
    try:
        logs = [run_dir / f"w{i}.log" for i in (1, 2, 3)]
        wait_until(lambda: len([v for log in logs if log.exists() for v in log_values(log, "PID")]) == 3, 30, 0.05)
        pids = [int(v) for log in logs for v in log_values(log, "PID")]
        pids += [int(v) for v in wait_until(lambda: log_values(logs[1], "CHILD"), 30, 0.05)]
        reaper.extend(pids)
        metrics = [run_dir / f"w{i}.metrics.jsonl" for i in (1, 2, 3)]
        wait_until(
            lambda: all(len(read_metrics(m, missing_ok=True)) >= 3 for m in metrics), 30, 0.05, "every node is training"
        )
        assert all(alive(pid) for pid in pids)

        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 128 + sig, (tmp_path / "launcher.err").read_text()
    assert took < limit_s, f"stopping took {took:.1f}s"
    assert [pid for pid in pids if alive(pid)] == []
    wait_until(lambda: all(port_is_free(p) for p in ports), 2, message="ports freed")
    assert bystander.poll() is None, "the launcher touched a process it did not start"
    bystander.kill()
    bystander.wait(timeout=10)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "interrupted" and summary["exit_code"] == 128 + sig
    assert {n["status"] for n in summary["nodes"].values()} == {"stopped"}
    assert all(n["steps"] >= 3 for n in summary["nodes"].values())
    assert f"interrupted by {sig.name}" in (tmp_path / "launcher.err").read_text()


@pytest.mark.timing
def test_nodes_do_not_outlive_a_killed_launcher(tmp_path: Path, node_script: Path, reaper: list[int]) -> None:
    """SIGKILL cannot be trapped: the nodes are asked (PR_SET_PDEATHSIG) to get SIGTERM when the launcher dies."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signals are Linux-only")
    ports = free_ports(2)
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, "-q", "--run-dir", str(run_dir), str(cluster(tmp_path / "c.yaml", ports)),
                  str(node_script), "--steps", "0", "--sleep", "0.02")  # fmt: skip
    reaper.append(proc.pid)
    logs = [run_dir / f"w{i}.log" for i in (1, 2)]
    wait_until(lambda: all(log.exists() and log_values(log, "PID") for log in logs), 30, 0.05, "nodes started")
    pids = [int(log_values(log, "PID")[0]) for log in logs]
    reaper.extend(pids)
    proc.kill()
    proc.wait(timeout=10)
    wait_until(lambda: not any(alive(pid) for pid in pids), 5, 0.05, "nodes gone after the launcher was killed")
    wait_until(lambda: all(port_is_free(p) for p in ports), 2, message="ports freed")


@pytest.mark.timing
def test_a_node_that_ignores_sigterm_and_what_a_node_started_do_not_outlive_a_killed_launcher(
    tmp_path: Path, node_script: Path, reaper: list[int]
) -> None:
    """The parent-death signal reaches only the direct child, and only as SIGTERM: ``w1`` ignores it and ``w2``'s
    helper never gets it. The launcher's guard process (dpwa/launcher/lifeline.py) sees the launcher die and stops
    both groups -- SIGTERM, then SIGKILL after the grace period -- then exits itself."""
    ports = free_ports(2)
    run_dir = tmp_path / "run"
    proc = launch(tmp_path, "-q", "--run-dir", str(run_dir), str(cluster(tmp_path / "c.yaml", ports)),
                  str(node_script), "--steps", "0", "--sleep", "0.02", "--ignore-term", "w1",
                  "--grandchild", "w2")  # fmt: skip
    reaper.append(proc.pid)
    logs = [run_dir / f"w{i}.log" for i in (1, 2)]
    wait_until(lambda: all(log.exists() and log_values(log, "PID") for log in logs), 30, 0.05, "nodes started")
    pids = [int(log_values(log, "PID")[0]) for log in logs]
    pids += [int(v) for v in wait_until(lambda: log_values(logs[1], "CHILD"), 30, 0.05)]
    reaper.extend(pids)
    guards = wait_until(lambda: _children_running(proc.pid, "lifeline.py"), 10, 0.05, "the guard process started")
    reaper.extend(guards)
    proc.kill()
    proc.wait(timeout=10)
    limit_s = lifeline.GRACE_S + lifeline.KILL_WAIT_S + 10.0
    wait_until(lambda: not any(alive(pid) for pid in pids), limit_s, 0.05, "nodes and helper gone")
    wait_until(lambda: not any(alive(pid) for pid in guards), 10, 0.05, "the guard exited")
    wait_until(lambda: all(port_is_free(p) for p in ports), 2, message="ports freed")
    assert "the launcher died; stopped the process groups it left" in (tmp_path / "launcher.err").read_text()


def _children_running(parent: int, needle: str) -> list[int]:
    """The pids of ``parent``'s child processes whose command line holds ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and needle.encode() in command:
            found.append(int(entry.name))
    return found


def _demo_runnable() -> bool:
    return importlib.util.find_spec("dpwa.tools.demo") is not None and importlib.util.find_spec("torch") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _demo_runnable(), reason="the built-in demo needs dpwa.tools.demo and torch")
def test_run_the_sample_cluster_with_the_built_in_demo(tmp_path: Path) -> None:
    """The sample as shipped, but on ports reserved below the ephemeral range (its 45000-45003 lie in it: an
    outgoing connection of the other test worker may take one as its source port while the nodes import torch)."""
    text = (ROOT / "samples" / "localhost.yaml").read_text()
    shipped = [node.port for node in parse_config(text).nodes]
    for old, new in zip(shipped, free_ports(len(shipped))):
        text = text.replace(f"port: {old}}}", f"port: {new}}}")
    assert [node.port for node in parse_config(text).nodes] != shipped
    sample = tmp_path / "localhost.yaml"
    sample.write_text(text)
    run_dir = tmp_path / "run"
    code, out, err = finish(launch(tmp_path, str(sample), "--steps", "30", "--run-dir", str(run_dir)), tmp_path, 120)
    assert code == 0, err
    for name in ("w1", "w2", "w3", "w4"):
        for suffix in (".log", ".metrics.jsonl", ".model.npz"):
            assert (run_dir / f"{name}{suffix}").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True
    assert all(n["steps"] == 30 and n["accuracy"] is not None for n in summary["nodes"].values())
    demo = json.loads((run_dir / "demo.json").read_text())
    assert summary["demo"]["averaged_accuracy"] == demo["averaged_accuracy"]
    assert f"averaged model accuracy {demo['averaged_accuracy']:.4f}" in out
    assert f"single-process baseline {demo['baseline_accuracy']:.4f}" in out


@pytest.mark.parametrize("ntasks", ["4", "1"])
def test_n_inside_a_slurm_job_starts_every_node_it_reserved(
    tmp_path: Path, node_script: Path, monkeypatch: pytest.MonkeyPatch, ntasks: str
) -> None:
    """``dpwa run -n 4`` in a task of a SLURM step (``srun --pty bash`` is one: SLURM_STEP_ID, SLURM_PROCID and
    SLURM_NTASKS set) starts its 4 nodes: SLURM_PROCID picks a node of a cluster file only. Before, it started w1
    alone (SLURM_NTASKS=4) or exited 2 (SLURM_NTASKS=1: "the file has 4 nodes"). Each such run gets a run
    directory of its own: its nodes are this launcher's alone, so the step's shared runs/slurm-<job>.<step> would
    have the second run remove the first's node files."""
    for name, value in srun_task(0, int(ntasks), SLURM_JOB_ID="5").items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    started: list[tuple[list[str], Path]] = []
    record = recording_start(
        lambda config, nodes, command, directory, *a: ([n.name for n in nodes], directory.path), started
    )
    monkeypatch.setattr(run_command, "_start", record)
    for _ in range(2):
        result = CliRunner().invoke(cli.main, ["run", "-n", "4", str(node_script)])
        assert result.exit_code == 0, result.output
    assert [names for names, _ in started] == [["w1", "w2", "w3", "w4"]] * 2
    first, second = [path for _, path in started]
    assert first != second and first.parent == tmp_path / "runs" and not first.name.startswith("slurm-"), started


def test_default_run_directories_are_new_even_in_the_same_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call makes a directory of its own with an exclusive mkdir: two launches in one second never share
    one (the second's RunDir would remove the first's node files; before, both passed an exists() check). In an
    srun step, the step's shared name, not made."""
    import datetime

    from dpwa.launcher import rundir

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Frozen:
            return cls(2026, 11, 28, 20, 15, 0)

    monkeypatch.setattr(rundir._dt, "datetime", Frozen)
    made = [default_run_dir(tmp_path / "runs", env={}) for _ in range(3)]
    assert [p.name for p in made] == ["20261128-201500", "20261128-201500-2", "20261128-201500-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    assert default_run_dir(tmp_path / "runs", env={}, prefix="sim-").name == "sim-20261128-201500"
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}
    slurm = default_run_dir(tmp_path / "runs", env=step, step_shared=True)
    assert slurm == tmp_path / "runs" / "slurm-7.2" and not slurm.exists()
    batch = default_run_dir(tmp_path / "runs", env={"SLURM_JOB_ID": "7"}, step_shared=True)  # sbatch's shell
    assert batch.name == "20261128-201500-4" and batch.is_dir()  # not a slurm-7 that two runs there would share
    own = default_run_dir(tmp_path / "runs", env=step)  # a run whose nodes are its own alone (-n, a simulation)
    assert own.name == "20261128-201500-5" and own.is_dir()


def test_a_restart_that_cannot_start_is_given_up_and_the_run_goes_on() -> None:
    """A restart whose process cannot be started (fork fails, its log cannot be written) used to raise out of the
    supervision loop and stop every node; now that node is given up, as one whose port stayed busy."""

    def cannot_start(name: str) -> None:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    restarter = Restarter(1, {"w1": ("127.0.0.1", 1)}, cannot_start, port_free=lambda host, port: True)
    assert restarter.handle(SimpleNamespace(name="w1", state="failed", describe_exit=lambda: "exit 1"))  # type: ignore[arg-type]
    assert restarter.tick() == ["w1"] and restarter.pending == {}


def test_only_a_port_in_use_holds_a_restart_back() -> None:
    """EADDRINUSE is a busy port; an address not on this machine or a host that does not resolve is not (the node's
    own start then says what is wrong, where the restart used to wait 30 s and blame the port)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not restarts.port_is_free("127.0.0.1", port)
    assert restarts.port_is_free("127.0.0.1", port)
    assert restarts.port_is_free("192.0.2.1", port)  # TEST-NET-1: on no interface here (EADDRNOTAVAIL)
    assert restarts.port_is_free("no-such-host.invalid", port)


def test_the_signal_trap_records_a_closed_terminal() -> None:
    """SIGHUP (the ssh session or terminal closed) stops the nodes as SIGTERM does, instead of killing the launcher
    and leaving them to their parent-death signal."""
    with SignalTrap() as trap:
        os.kill(os.getpid(), signal.SIGHUP)
        wait_until(lambda: trap.received == [signal.SIGHUP], 5.0, message="SIGHUP recorded")


def test_a_helper_that_outlives_its_node_and_ignores_sigterm_is_killed(tmp_path: Path, monkeypatch) -> None:
    """A node that exits leaving a helper in its group (a data-loader worker that ignores SIGTERM): the supervisor
    SIGTERMs the group and, once the grace period is over, SIGKILLs it, instead of leaving it running until the
    whole run stops; until it is gone, the node counts as left behind (a restart waits)."""
    monkeypatch.setattr(supervisor_module, "STOP_GRACE_S", 0.3)
    ready = tmp_path / "helper.ready"
    script = (
        "import os, signal, sys, time\n"
        "if os.fork() == 0:\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"    open({str(ready)!r}, 'w').close()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        f"while not os.path.exists({str(ready)!r}): time.sleep(0.01)\n"
        "sys.exit(3)\n"
    )
    sup = supervisor_module.Supervisor()
    child = sup.start("w1", [sys.executable, "-c", script], env=dict(os.environ), log_path=tmp_path / "w1.log")
    try:
        wait_until(lambda: bool(sup.poll()) or child.returncode is not None, 10.0, message="node exited")
        assert sup.left_behind("w1")  # the helper ignored the SIGTERM poll() sent
        wait_until(lambda: not sup.poll() and not sup.left_behind("w1"), 10.0, message="helper SIGKILLed")
    finally:
        sup.stop(grace_s=0.5, kill_wait_s=5.0)
        sup.close()
    assert not sup.left_behind("w1") and child.returncode == 3


def test_a_restart_waits_until_nothing_of_the_failed_node_runs() -> None:
    started: list[str] = []
    alive = {"w1": True}
    restarter = Restarter(1, {"w1": ("127.0.0.1", 1)}, started.append, port_free=lambda host, port: True,
                          gone=lambda name: not alive[name])  # fmt: skip
    assert restarter.handle(SimpleNamespace(name="w1", state="failed", describe_exit=lambda: "exit 1"))  # type: ignore[arg-type]
    assert restarter.tick() == [] and started == []  # its helper still runs: not yet
    alive["w1"] = False
    assert restarter.tick() == [] and started == ["w1"]


def test_two_launchers_cannot_run_one_node_in_one_run_directory(tmp_path: Path) -> None:
    """Two launchers sharing a run directory whose node names overlap (two `-n 2` runs): the second cleared the
    first's live logs, metrics and checkpoints and rewrote its cluster.yaml. Now the first holds a lock per node
    until it ends, and the second is refused, holding nothing; the lock files go with the first's release."""
    run_dir = RunDir(tmp_path / "run")
    first = run_dir.claim(["w1", "w2"])
    try:
        with pytest.raises(OSError, match="node w2 is run by another launcher"):
            run_dir.claim(["w3", "w2"])
        run_dir.claim(["w3"]).release()  # w3 was not kept by the refused claim
    finally:
        first.release()
    assert list(run_dir.path.iterdir()) == []
    run_dir.claim(["w1", "w2"]).release()


def test_an_interrupt_before_the_launcher_traps_signals_exits_130() -> None:
    """Ctrl-C while `dpwa run` still looks up hosts or checks ports (before its own signal handling) printed
    click's "Aborted!" and exited 1; the documented status of an interrupted run is 130."""
    group = LazyGroup(name="dpwa")

    @group.command()
    def slow() -> None:
        raise KeyboardInterrupt

    result = CliRunner().invoke(group, ["slow"])
    assert result.exit_code == EXIT_INTERRUPTED == 130 and "Aborted" not in result.output
