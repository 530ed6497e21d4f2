"""`dpwa validate`: YAML + summary and exit 0 on a good file; one stderr line and exit 2 on a bad one."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import free_ports

from dpwa.cli import app as cli
from dpwa.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BAD = Path(__file__).resolve().parent / "data" / "configs" / "bad"


def sample_on_free_ports(name: str, directory: Path) -> Path:
    """``samples/<name>`` copied into ``directory`` with its ports 45000-45003 replaced by ports free now.

    `dpwa validate` checks that this machine's ports of the file are free, and the samples' ports are taken while
    another test runs the sample cluster itself (tests/test_launcher.py, on the other pytest-xdist worker), or by
    some connection's ephemeral port (45000 lies in Linux's ephemeral range): the sample as shipped failed here
    once, four tests in a row."""
    text = (ROOT / "samples" / name).read_text(encoding="utf-8")
    for shipped, free in zip(range(45000, 45004), free_ports(4)):
        text = text.replace(f"port: {shipped}}}", f"port: {free}}}")
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """samples/original-dpwa.yaml on free ports: the good file of the tests here."""
    return sample_on_free_ports("original-dpwa.yaml", tmp_path)


SUMMARY = (
    "4 nodes, interpolation constant (value=0.5, repeats=skip), fetch_probability 1, timeout_ms 2500,"
    " divergence_threshold 0.2"
)


def test_validate_prints_resolved_yaml_and_summary(good: Path) -> None:
    result = CliRunner().invoke(cli.main, ["validate", str(good)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    for name in ("w1", "w2", "w3", "w4"):
        assert f"name: {name}" in result.stdout
    assert yaml.safe_load(result.stdout) == load_config(good).to_dict()
    assert result.stdout.splitlines()[-1] == f"# {good}: {SUMMARY}"


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("fetch_probability_out_of_range.yaml", ":7: fetch_probability: must be a number in [0, 1], got 1.5"),
        ("yaml_syntax_error.yaml", ":5: invalid YAML: "),
        ("empty.yaml", ":1: file is empty"),
    ],
)
def test_validate_bad_file_prints_one_error_line_and_exits_2(name: str, where: str) -> None:
    path = BAD / name
    result = CliRunner().invoke(cli.main, ["validate", str(path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}{where}")
    assert len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.output


def test_validate_missing_file_is_a_clean_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'nope.yaml'}: cannot read cluster file: No such file or directory\n"


def test_log_level_option_is_accepted_and_checked(good: Path) -> None:
    assert CliRunner().invoke(cli.main, ["--log-level", "debug", "validate", str(good)]).exit_code == 0
    assert CliRunner().invoke(cli.main, ["--log-level", "loud", "validate", str(good)]).exit_code == 2


def test_lazy_commands_are_listed_and_imported_on_use(monkeypatch: pytest.MonkeyPatch, good: Path) -> None:
    monkeypatch.setitem(cli.COMMANDS, "check", "dpwa.cli.app:validate")
    assert "check" in CliRunner().invoke(cli.main, ["--help"]).stdout
    assert CliRunner().invoke(cli.main, ["check", str(good)]).exit_code == 0


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "dpwa.cli", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_validate_as_a_real_process_on_a_good_file(tmp_path: Path) -> None:
    path = sample_on_free_ports("localhost.yaml", tmp_path)
    proc = run_module("validate", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for name in ("w1", "w2", "w3", "w4"):
        assert f"name: {name}" in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith(f"# {path}: 4 nodes, interpolation constant")


def test_validate_as_a_real_process_on_a_bad_file() -> None:
    proc = run_module("validate", "tests/data/configs/bad/unknown_top_level_key.yaml")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    expected = (
        "error: tests/data/configs/bad/unknown_top_level_key.yaml:8: timeout: unknown key"
        " (did you mean 'timeout_ms'?); allowed: nodes, fetch_probability, timeout_ms, interpolation,"
        " divergence_threshold, peers, wire_dtype, outer, security, transport, checkpoint_every, bootstrap,"
        " bootstrap_timeout_s, bootstrap_gap, inbox_slots, inbox_per_sender, base_port, join, join_timeout_s,"
        " forget_after_s, max_members, constant, clock, loss, gem, pushsum, leader, group, adpsgd, dpsgd, gt, choco"
    )
    assert proc.stderr.splitlines() == [expected]


def test_validate_a_file_without_nodes_says_where_they_come_from(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("interpolation: pushsum\n")
    result = CliRunner().invoke(cli.main, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-2].startswith(f"# {path}: 0 nodes, interpolation pushsum (overlap=0), fetch_probability 1,")
    engines = f"`dpwa run -n N --config {path}` (local), srun (SLURM), torchrun (the adapter)"
    assert lines[-1] == f"# nodes: none in the file; they come from the engine: {engines}"
    assert "nodes" not in yaml.safe_load(result.stdout)


def test_validate_under_srun_prints_the_steps_nodes_or_why_not(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("base_port: 47000\n")
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1"}  # fmt: skip
    result = CliRunner().invoke(cli.main, ["validate", str(path)], env=env)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == (
        "# nodes: none in the file; they come from the engine: the SLURM step (3 tasks): "
        "n1-0@n1:47000, n1-1@n1:47001, n2-0@n2:47000; this task: n1-1"
    )
    result = CliRunner().invoke(cli.main, ["validate", str(path)], env={**env, "SLURM_DISTRIBUTION": "cyclic"})
    assert result.exit_code == 0 and "srun, but SLURM: SLURM_DISTRIBUTION='cyclic'" in result.stdout
    result = CliRunner().invoke(cli.main, ["run", str(path)], env={**env, "SLURM_DISTRIBUTION": "cyclic"})
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {path}: SLURM: SLURM_DISTRIBUTION='cyclic': only block placement")

    torch_env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    result = CliRunner().invoke(cli.main, ["validate", str(path)], env=torch_env)
    assert result.stdout.splitlines()[-1].endswith(
        "torchrun / PyTorchJob: a rendezvous of 3 workers in the TCPStore at 10.0.0.1:29500"
    )


def test_validate_names_a_local_nodes_port_in_use_and_leaves_other_hosts_alone(tmp_path: Path) -> None:
    """Another process's socket on a node's port: one line naming file, line, node, host and port, exit 2. The
    same port on a host of another machine (TEST-NET-1, RFC 5737) is not this machine's to check."""
    free, port = free_ports(2)  # reserved below the ephemeral range: nobody else binds them meanwhile
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        path = tmp_path / "c.yaml"
        path.write_text(
            "nodes:\n"
            f"  - {{name: w1, host: 127.0.0.1, port: {free}}}\n"
            f"  - {{name: w2, host: localhost, port: {port}}}\n"
            f"  - {{name: w3, host: 192.0.2.10, port: {port}}}\n"
        )
        result = CliRunner().invoke(cli.main, ["validate", str(path)])
        assert result.exit_code == 2
        assert result.stdout == ""
        assert result.stderr == (
            f"error: {path}:3: nodes[1].port: node w2: port {port} on localhost (127.0.0.1) is already in use\n"
        )
        proc = run_module("validate", str(path))  # the installed command: one line, no traceback
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == result.stderr
    result = CliRunner().invoke(cli.main, ["validate", str(path)])  # the socket closed: the file is fine
    assert result.exit_code == 0, result.output


def test_validate_names_every_port_in_use_on_its_one_line(tmp_path: Path) -> None:
    with socket.socket() as first, socket.socket() as second:
        for sock in (first, second):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        ports = [first.getsockname()[1], second.getsockname()[1]]
        path = tmp_path / "c.yaml"
        path.write_text("nodes:\n" + "".join(f"  - {{name: w{i + 1}, host: 127.0.0.1, port: {p}}}\n"
                                             for i, p in enumerate(ports)))  # fmt: skip
        result = CliRunner().invoke(cli.main, ["validate", str(path)])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert result.stderr == (
        f"error: {path}:2: nodes[0].port: node w1: port {ports[0]} on 127.0.0.1 is already in use; "
        f"node w2: port {ports[1]} on 127.0.0.1 is already in use\n"
    )
