"""Launchers sharing a run directory each record their nodes in launch.json, and ``dpwa run --resume`` run in a
launcher's place starts that launcher's nodes (dpwa/launcher/launchrecord.py).

Before, each launcher overwrote launch.json with its own nodes: under ``srun dpwa run`` (one launcher per task,
one run directory) every task's ``--resume`` started the last writer's node, and the other nodes never came back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import free_ports
from test_launcher import recording_start, write_run_dir
from test_slurm import step_env

from dpwa.cli import app as cli
from dpwa.cli import run as run_command
from dpwa.launcher.launchrecord import launcher_key, merge_launch, nodes_to_resume, threads_to_resume
from dpwa.launcher.rundir import RunDir

RECORD = {"version": 1, "command": ["python", "t.py"], "threads": 1, "evaluate": False, "demo": False}


def launched(nodes: list[str], **more: Any) -> dict[str, Any]:
    return {**RECORD, "nodes": nodes, **more}


def test_a_launcher_is_its_srun_task_inside_a_step_and_its_host_outside() -> None:
    assert launcher_key(step_env(3), "node-7") == "slurm task 3"
    batch_shell = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert launcher_key(batch_shell, "node-7") == "host node-7"  # sbatch's own shell: no SLURM_STEP_ID
    assert launcher_key({}, "node-7") == "host node-7"


def test_launchers_merge_their_nodes_and_a_launcher_run_again_replaces_only_its_own() -> None:
    first = merge_launch(None, launched(["a0", "a1"]), "host a")
    both = merge_launch(first, launched(["b0"]), "host b")
    assert both["nodes"] == ["a0", "a1", "b0"]
    assert both["started_by"] == {"a0": "host a", "a1": "host a", "b0": "host b"}
    again = merge_launch(both, launched(["a1"]), "host a")  # host a now runs a1 alone: a0 is no longer its
    assert again["started_by"] == {"b0": "host b", "a1": "host a"}
    moved = merge_launch(again, launched(["b0"]), "host c")  # b0 started elsewhere now: the latest launcher's
    assert moved["started_by"] == {"a1": "host a", "b0": "host c"} and moved["command"] == RECORD["command"]
    damaged = merge_launch(launched(["x"], started_by=["x"]), launched(["a0"]), "host a")
    assert damaged["started_by"] == {"a0": "host a"}


def test_each_launcher_resumes_with_the_threads_it_gave_its_nodes() -> None:
    """A host of 3 nodes gave each 10 threads, one of 1 node 32: the last writer's `threads` must not be every
    launcher's (3 x 32 threads on 32 cores)."""
    record = merge_launch(merge_launch(None, launched(["a0", "a1", "a2"], threads=10), "host a"),
                          launched(["b0"], threads=32), "host b")  # fmt: skip
    assert record["threads_of"] == {"host a": 10, "host b": 32}
    assert threads_to_resume(record, "host a") == 10 and threads_to_resume(record, "host b") == 32
    assert threads_to_resume(launched(["a0"], threads=4), "host a") == 4  # an older record
    gone = merge_launch(record, launched(["a0", "a1", "a2", "b0"], threads=8), "host a")  # a runs them all now
    assert gone["threads_of"] == {"host a": 8}


def test_resume_starts_the_launchers_own_nodes_or_all_of_a_single_launchers_run() -> None:
    record = merge_launch(merge_launch(None, launched(["a0", "a1"]), "slurm task 0"), launched(["b0"]), "slurm task 1")
    assert nodes_to_resume(record, "slurm task 0") == ["a0", "a1"]
    assert nodes_to_resume(record, "slurm task 1") == ["b0"]
    with pytest.raises(ValueError, match=r"2 launchers \(slurm task 0: a0, a1; slurm task 1: b0\), none of them"):
        nodes_to_resume(record, "host elsewhere")
    single = merge_launch(None, launched(["a0", "a1"]), "host old-name")
    assert nodes_to_resume(single, "host new-name") == ["a0", "a1"]  # one launcher's run resumes anywhere
    assert nodes_to_resume(launched(["a0", "a1"]), "host any") == ["a0", "a1"]  # a record from before started_by
    with pytest.raises(ValueError, match="started_by must map node names to launchers"):
        nodes_to_resume(launched(["a0"], started_by={"a0": 3}), "host any")


def test_launchers_writing_one_run_directory_keep_each_others_nodes(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.write_launch(launched(["w1", "w2"]), "slurm task 0")
    run_dir.write_launch(launched(["w3"]), "slurm task 1")
    record = json.loads(run_dir.launch_path.read_text())
    assert record["nodes"] == ["w1", "w2", "w3"] and record["started_by"]["w3"] == "slurm task 1"
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["launch.json"]  # no lock file left behind


def test_resume_in_each_srun_task_starts_that_tasks_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``srun dpwa run --resume RUN_DIR``: each task gets the nodes it started; a launcher that started none of
    a several-launcher run is told where to resume, exit 2."""
    started: list[list[str]] = []
    monkeypatch.setattr(run_command, "_start", recording_start(lambda *args: [n.name for n in args[1]], started))
    run_dir = write_run_dir(tmp_path / "run", free_ports(3), started_by={"w1": "slurm task 0", "w2": "slurm task 1",
                                                                         "w3": "slurm task 1"})  # fmt: skip
    for procid in (1, 0):
        for name, value in step_env(procid).items():
            monkeypatch.setenv(name, value)
        result = CliRunner().invoke(cli.main, ["run", "--resume", str(run_dir)])
        assert result.exit_code == 0, result.output
    assert started == [["w2", "w3"], ["w1"]]
    monkeypatch.setenv("SLURM_PROCID", "2")
    result = CliRunner().invoke(cli.main, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 2 and "none of them this one (slurm task 2)" in result.stderr, result.output
    assert "Traceback" not in result.output and len(started) == 2
