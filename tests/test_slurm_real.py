"""A real SLURM on this machine: munged, slurmctld and slurmd started by the test, then ``srun -O -n 4 dpwa run``
and ``srun -O -n 3 python train.py`` with cluster files that list no nodes.

Needs root and Debian's ``slurmctld slurmd slurm-client munge`` (``.ci/run`` installs them through
``scripts/install-slurm.sh``); skipped with its reason otherwise. The one slurmd is node ``localhost``
(``slurmd -N localhost``, NodeAddr 127.0.0.1), so every dpwa node binds loopback whatever this machine's
host name resolves to. Every daemon the fixture starts, it stops by pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_ports, wait_until
from test_launcher import NODE_SCRIPT
from test_slurm import BATCH_SHELL, ENGINE_WORKER, free_base_port

from dpwa.config import load_config
from dpwa.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DAEMONS = ("munged", "munge", "slurmctld", "slurmd", "srun", "sinfo")
STARTUP_S = 60.0


def _missing() -> str | None:
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing; scripts/install-slurm.sh installs it)"
    if os.geteuid() != 0:
        return "a test SLURM runs its daemons as root"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _cpus() -> int:
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"CPUs=(\d+)", out)
    return int(match.group(1)) if match else 1


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon (its own process group), SIGKILL after 10 s; reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM; yields the environment srun needs (SLURM_CONF)."""
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge.sock"
    ctld_port, d_port = free_ports(2)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join([
            "ClusterName=dpwatest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            f"AuthInfo=socket={socket_path}", "CredType=cred/munge", f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}", f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}", f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SelectType=select/linear", "MpiDefault=none", "ReturnToService=2",
            "SwitchType=switch/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={_cpus()} RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
        ]) + "\n"
    )  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], log: str) -> None:
        with open(root / "log" / log, "wb") as out:
            started.append(
                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )

    try:
        start([_which("munged"), "-F", "-f", f"--key-file={key}", f"--socket={socket_path}",
               f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
               f"--seed-file={root / 'munged.seed'}"], "munged.out")  # fmt: skip
        wait_until(socket_path.exists, STARTUP_S, 0.05, "munged's socket")
        start([_which("slurmctld"), "-D", "-f", str(conf)], "slurmctld.out")
        start([_which("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], "slurmd.out")

        def idle() -> bool:
            got = subprocess.run(
                [_which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
            )
            assert all(p.poll() is None for p in started), (root / "log").iterdir()
            return got.stdout.strip() == "idle"

        wait_until(idle, STARTUP_S, 0.2, "the SLURM node is idle")
        yield {"SLURM_CONF": str(conf)}
    finally:
        for proc in reversed(started):
            _stop(proc)


def _task_env(slurm: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPWA_"))}
    return {**env, **slurm}


def test_srun_dpwa_run_with_a_file_without_nodes(slurm: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    base = free_base_port(["127.0.0.1"], 4)
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"timeout_ms: 1000\nbase_port: {base}\n")
    run_dir = tmp_path / "run"
    argv = [_which("srun"), "-O", "-n", "4", sys.executable, "-m", "dpwa.cli", "run", str(rules)]
    argv += ["--run-dir", str(run_dir), "-q", str(script), "--steps", "20", "--barrier", "--sleep", "0.01"]
    done = subprocess.run(argv, env=_task_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [f"localhost-{i}" for i in range(4)]
    assert [n.name for n in load_config(run_dir / "cluster.yaml").nodes] == names
    for name in names:
        steps = [r for r in read_metrics(run_dir / f"{name}.metrics.jsonl") if "event" not in r]
        assert len(steps) == 20 and steps[-1]["mixes"] > 0, (name, steps[-1])


def test_srun_python_train_py_with_the_adapter_alone(slurm: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = ENGINE_WORKER
    base = free_base_port(["127.0.0.1"], 3)
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"timeout_ms: 1000\nbase_port: {base}\n")
    env = {**_task_env(slurm), "DPWA_CONFIG": str(rules)}
    argv = [_which("srun"), "-O", "-n", "3", sys.executable, str(script)]
    started = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    names = [f"localhost-{i}" for i in range(3)]
    assert sorted(r["name"] for r in got) == names and all(r["nodes"] == names for r in got)
    assert all(r["mixed"] > 0 for r in got), got  # how many: the CPU share's
    assert time.monotonic() - started < 180


def test_dpwa_run_in_a_batch_scripts_own_shell_starts_every_node_and_a_run_directory_each_time(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """``sbatch -n 2`` a script that calls `dpwa run cluster.yaml` twice, without srun: its shell has
    SLURM_PROCID=0 and SLURM_NTASKS=2 but no SLURM_STEP_ID (recorded here: tests/test_slurm.py's BATCH_SHELL is
    this), so each run starts both nodes of the file and gets a run directory of its own. Before, each started
    node 0 alone (its peer never came) and both wrote into runs/slurm-<job>."""
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    ports = free_ports(2)
    nodes = "".join(f"  - {{name: w{i + 1}, host: 127.0.0.1, port: {p}}}\n" for i, p in enumerate(ports))
    (tmp_path / "cluster.yaml").write_text(f"timeout_ms: 1000\nnodes:\n{nodes}")
    run = f"{sys.executable} -m dpwa.cli run -q cluster.yaml node.py --steps 5 --barrier --sleep 0.01"
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/bash\nset -e\nenv | grep ^SLURM_ > batch.env\n{run}\n{run}\n")
    argv = [_which("sbatch"), "--wait", "-n", "2", "-o", str(tmp_path / "job.out"), str(batch)]
    done = subprocess.run(argv, env=_task_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, (done.stderr[-2000:], output[-3000:])
    shell = dict(line.split("=", 1) for line in (tmp_path / "batch.env").read_text().splitlines())
    recorded = {name: shell.get(name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS")}
    assert recorded == {name: BATCH_SHELL[name] for name in recorded} and "SLURM_STEP_ID" not in shell, shell
    run_dirs = sorted(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert len(run_dirs) == 2 and not any(p.name.startswith("slurm-") for p in run_dirs), run_dirs
    for run_dir in run_dirs:
        assert sorted(json.loads((run_dir / "summary.json").read_text())["nodes"]) == ["w1", "w2"]
        for name in ("w1", "w2"):
            steps = [r for r in read_metrics(run_dir / f"{name}.metrics.jsonl") if "event" not in r]
            assert len(steps) == 5 and steps[-1]["mixes"] > 0, (run_dir, name, steps[-1:])
