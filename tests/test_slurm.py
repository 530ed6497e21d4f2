"""SLURM without a controller: what srun hands a task (its environment), parsed into the step's node list.

A real SLURM (slurmctld + slurmd) is not started by this suite yet: these tests check the host-list and
tasks-per-node parsing against real-world forms, the block layout every task computes alone, and the one-line
errors for layouts dpwa cannot derive.
"""

from __future__ import annotations

import collections
import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import port_is_free

from dpwa.config import load_config
from dpwa.engines.slurm import (
    DERIVED_PORTS,
    PORT_BLOCK,
    SlurmError,
    derived_base_port,
    expand_hostlist,
    expand_tasks_per_node,
    in_slurm_step,
    slurm_nodes,
)
from dpwa.metrics import read_metrics


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node001", ["node001"]),
        ("gpu[01-04,07],cpu9", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu9"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("x[000-002]", ["x000", "x001", "x002"]),
        ("a[1,3],b[5-6]", ["a1", "a3", "b5", "b6"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("node-1,node-2", ["node-1", "node-2"]),
        ("127.0.0.[2-3]", ["127.0.0.2", "127.0.0.3"]),
        ("c[1-2].cluster.org", ["c1.cluster.org", "c2.cluster.org"]),
    ],
)
def test_host_lists_expand_as_slurm_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "host list is empty"),
        ("gpu[01-", "'[' without ']'"),
        ("gpu01]", "']' without '['"),
        ("gpu[[1]]", "nested '['"),
        ("gpu[a-b]", "'a-b' is not a number or a range"),
        ("gpu[3-1]", "range '3-1' runs backwards"),
        ("a,,b", "an empty name"),
        ("gp u1", "a character a host name cannot have"),
        # sizes checked before expanding: these ran out of memory (or time) before
        ("n[0-9999999999]", "more than 100000 hosts"),
        ("a[0-999]b[0-999]", "more than 100000 hosts"),
    ],
)
def test_malformed_host_lists_are_one_clear_error(text: str, says: str) -> None:
    with pytest.raises(SlurmError, match=None) as info:
        expand_hostlist(text)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "counts"), [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1(x2)", [1, 1]), ("3,2(x2)", [3, 2, 2])]
)
def test_tasks_per_node_expand(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


def test_a_tasks_per_node_of_too_many_hosts_is_refused_before_it_is_expanded() -> None:
    with pytest.raises(SlurmError, match="more than 100000 hosts"):
        expand_tasks_per_node("1(x9999999999)")


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "x", "2(3)", "2(x3", "-1"])
def test_malformed_tasks_per_node_are_refused(text: str) -> None:
    with pytest.raises(SlurmError, match="is not N or N\\(xM\\)"):
        expand_tasks_per_node(text)


BATCH_SHELL = {
    "SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2",
}  # fmt: skip
"""What ``sbatch -n 2`` sets in the batch script's own shell (read from a real SLURM, tests/test_slurm_real.py):
the task variables, each 0, but no SLURM_STEP_ID, which srun sets in every task of a step."""


def step_env(procid: int, hosts: str = "127.0.0.[2-3]", tasks: str = "2(x2)", **more: str) -> dict[str, str]:
    """The variables srun sets for task ``procid`` of a block step of 2 hosts x 2 tasks."""
    counts = expand_tasks_per_node(tasks)
    nodeid, localid, left = 0, procid, procid
    while left >= counts[nodeid]:
        left -= counts[nodeid]
        nodeid += 1
    localid = left
    env = {
        "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NODELIST": hosts, "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_STEP_NUM_TASKS": str(sum(counts)),
    }  # fmt: skip
    env.update(more)
    return env


def test_every_task_computes_the_same_block_ordered_list_and_finds_itself() -> None:
    lists = set()
    for procid in range(4):
        nodes, mine = slurm_nodes(step_env(procid), 45000, use_scontrol=False)
        lists.add(nodes)
        assert mine == nodes[procid].name
    (nodes,) = lists
    assert [(n.name, n.host, n.port) for n in nodes] == [
        ("127.0.0.2-0", "127.0.0.2", 45000), ("127.0.0.2-1", "127.0.0.2", 45001),
        ("127.0.0.3-0", "127.0.0.3", 45000), ("127.0.0.3-1", "127.0.0.3", 45001),
    ]  # fmt: skip
    assert in_slurm_step(step_env(0)) and not in_slurm_step({"SLURM_PROCID": "0"})
    assert not in_slurm_step(BATCH_SHELL)  # sbatch's own shell is no task of a step


def test_without_a_base_port_each_job_and_step_gets_a_block_of_its_own() -> None:
    """No ``base_port`` in the file: every task of a step derives the same one from SLURM_JOB_ID.SLURM_STEP_ID, a
    block start in 10000-19999; other jobs and steps get other blocks (before: 45000 for all, so a second job on
    a shared host could not bind). Over 2,000 jobs the blocks spread: every one of the 156 is used, none by more than
    2.5x its share (deterministic: a hash of the IDs). More than 64 tasks on a host need a base_port."""
    job = {"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0"}
    lists = {slurm_nodes(step_env(procid, **job), use_scontrol=False)[0] for procid in range(4)}
    (nodes,) = lists  # every task, the same list
    base = derived_base_port(job)
    assert (
        DERIVED_PORTS[0] <= base
        and base + PORT_BLOCK - 1 <= DERIVED_PORTS[1]
        and (base - DERIVED_PORTS[0]) % PORT_BLOCK == 0
    )
    assert [n.port for n in nodes] == [base, base + 1, base, base + 1]
    assert derived_base_port({"SLURM_JOB_ID": "81235", "SLURM_STEP_ID": "0"}) != base  # the next job
    assert derived_base_port({"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "1"}) != base  # a second step of it
    counts = collections.Counter(derived_base_port({"SLURM_JOB_ID": str(j), "SLURM_STEP_ID": "0"}) for j in range(2000))
    blocks = (DERIVED_PORTS[1] - DERIVED_PORTS[0] + 1) // PORT_BLOCK
    assert len(counts) == blocks == 156 and max(counts.values()) <= 2.5 * 2000 / blocks, counts.most_common(3)
    crowded = step_env(0, hosts="n1", tasks=str(PORT_BLOCK + 1), **job)
    with pytest.raises(SlurmError, match="more than 64 tasks on a host"):
        slurm_nodes(crowded, use_scontrol=False)
    assert len(slurm_nodes(crowded, 45000, use_scontrol=False)[0]) == PORT_BLOCK + 1  # with a base_port, fine
    assert slurm_nodes(step_env(0, **job), 45000, use_scontrol=False)[0][0].port == 45000  # a given one is kept


def test_job_variables_stand_in_for_the_steps_and_uneven_hosts_work() -> None:
    env = step_env(3, hosts="n[1-2]", tasks="3,1")
    for name in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE"):
        env[name.replace("STEP_", "JOB_") if "NODELIST" in name else "SLURM_TASKS_PER_NODE"] = env.pop(name)
    nodes, mine = slurm_nodes(env, 5000, use_scontrol=False)
    assert [n.name for n in nodes] == ["n1-0", "n1-1", "n1-2", "n2-0"] and mine == "n2-0"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"SLURM_PROCID": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "1"}, "SLURM_PROCID=2 is not task 1 of host 0"),
        # every task refuses, also one a cyclic layout puts where block order would (a half-started cluster else)
        ({"SLURM_DISTRIBUTION": "cyclic"}, "SLURM_DISTRIBUTION='cyclic': only block placement"),
        ({"SLURM_DISTRIBUTION": "plane=2"}, "SLURM_DISTRIBUTION='plane=2': only block placement"),
        ({"SLURM_HET_SIZE": "2"}, "SLURM_HET_SIZE='2': a heterogeneous job"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "gives 3 hosts but SLURM_STEP_NODELIST has 2"),
        ({"SLURM_STEP_NUM_TASKS": "5"}, "SLURM_STEP_NUM_TASKS='5' but SLURM_STEP_TASKS_PER_NODE='2(x2)' sums to 4"),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: not set"),
        ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x': expected a non-negative integer"),
        ({"SLURM_NODEID": "7"}, "SLURM_NODEID=7 / SLURM_LOCALID=1: no such task"),
        # a digit str.isdigit takes and int() does not (a ValueError traceback before)
        ({"SLURM_PROCID": "\u00b9"}, "SLURM_PROCID='\u00b9': expected a non-negative integer"),
        # a host no cluster file takes (a ConfigError traceback before)
        ({"SLURM_STEP_NODELIST": ".n[1-2]"}, "SLURM_STEP_NODELIST='.n[1-2]': must be letters, digits"),
    ],
)
def test_layouts_dpwa_cannot_derive_are_one_line_naming_the_variable(change: dict[str, str], says: str) -> None:
    env = step_env(1)
    env.update(change)
    with pytest.raises(SlurmError) as info:
        slurm_nodes(env, use_scontrol=False)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("distribution", ["block", "block,Pack", "*:block", "block:cyclic", ""])
def test_a_distribution_that_is_block_in_effect_is_taken(distribution: str) -> None:
    """The hosts' level of the distribution decides: ``block,Pack`` and ``*:block`` were refused before."""
    env = step_env(3, SLURM_DISTRIBUTION=distribution)
    nodes, mine = slurm_nodes(env, 5000, use_scontrol=False)
    assert len(nodes) == 4 and mine == nodes[3].name


def test_a_step_of_more_tasks_than_a_member_table_carries_is_one_engine_error() -> None:
    """1,000 tasks on hosts of long names: the step's cluster is refused as a file's would be, one line (a
    ConfigError traceback out of dpwa run and dpwa validate before)."""
    from dpwa.config import ClusterConfig
    from dpwa.engines import EngineError, engine_nodes

    env = step_env(0, hosts="gpu-node-of-the-cluster-[0001-1000]", tasks="1(x1000)")
    with pytest.raises(EngineError, match="SLURM: the step's 1000 tasks: 1000 nodes take") as info:
        engine_nodes(ClusterConfig(base_port=5000), env)
    assert "\n" not in str(info.value)


def test_a_cyclic_layout_of_one_task_per_host_is_block_and_taken() -> None:
    env = step_env(1, hosts="127.0.0.[2-3]", tasks="1(x2)", SLURM_DISTRIBUTION="cyclic")
    assert slurm_nodes(env, 5000, use_scontrol=False)[1] == "127.0.0.3-0"


def test_scontrol_expands_the_host_list_when_it_is_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "alpha\\nbeta\\n"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    nodes, _ = slurm_nodes(step_env(0, hosts="whatever[1-2]", tasks="1(x2)"))
    assert [n.host for n in nodes] == ["alpha", "beta"]  # scontrol's answer, not our parser's
    nodes, _ = slurm_nodes(step_env(0, hosts="whatever[1-2]", tasks="1(x2)"), use_scontrol=False)
    assert [n.host for n in nodes] == ["whatever1", "whatever2"]


# --------------------------------------------------------------------------- tasks as srun would start them

ENGINE_WORKER = Path(__file__).resolve().parent / "engine_worker.py"


def free_base_port(hosts: list[str], tasks: int) -> int:
    """A base port with ``tasks`` consecutive ports bindable on every host, from 10000-19999 (a range neither
    the OS's ephemeral ports nor `dpwa run -n` use)."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10000, 20000 - tasks)
        if all(port_is_free(port, host) for host in hosts for port in range(base, base + tasks)):
            return base
    raise RuntimeError("no free base port in 10000-19999")


@pytest.mark.slow  # several seconds: kept out of the fast subset
@pytest.mark.integration
def test_srun_python_train_py_tasks_find_each_other_through_the_adapter(tmp_path: Path) -> None:
    """3 tasks on one host alias (127.0.0.4), started as `srun -n 3 python train.py` would: each adapter builds
    the same 3-node list from the step's variables alone and they mix."""
    pytest.importorskip("torch")
    script = ENGINE_WORKER
    base = free_base_port(["127.0.0.4"], 3)
    settings = tmp_path / "rules.yaml"
    settings.write_text(f"timeout_ms: 1000\nbase_port: {base}\n")
    procs = []
    for procid in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPWA_"))}
        env.update(step_env(procid, hosts="127.0.0.4", tasks="3"), DPWA_CONFIG=str(settings))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        outs.append(json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:]))
    names = ["127.0.0.4-0", "127.0.0.4-1", "127.0.0.4-2"]
    assert [o["name"] for o in outs] == names and all(o["nodes"] == names for o in outs)
    assert all(o["mixed"] > 0 for o in outs), outs  # how many: the CPU share's


@pytest.mark.slow
@pytest.mark.integration
def test_srun_dpwa_run_on_a_two_host_allocation_mixes_all_four_nodes(tmp_path: Path) -> None:
    """`srun -n 4 dpwa run rules.yaml node.py` on 2 hosts x 2 tasks (loopback aliases 127.0.0.2 and .3): four
    launchers, each given only its task's variables, start one node each and all four mix; then
    `srun -n 4 dpwa run --resume RUN_DIR` starts each task's node again (launch.json says which task started it;
    before, every task took the last writer's node)."""
    from test_launcher import NODE_SCRIPT

    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    hosts = ["127.0.0.2", "127.0.0.3"]
    base = free_base_port(hosts, 2)
    settings = tmp_path / "rules.yaml"
    settings.write_text(f"timeout_ms: 1000\nbase_port: {base}\n")
    run_dir = tmp_path / "run"

    def srun(*args: str) -> None:
        procs = []
        for procid in range(4):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPWA_"))}
            env.update(step_env(procid), SLURM_JOB_ID="77", SLURM_NTASKS="4")
            argv = [sys.executable, "-m", "dpwa.cli", "run", "-q", *args]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err

    srun(str(settings), "--run-dir", str(run_dir), str(script), "--steps", "20", "--barrier", "--sleep", "0.01")
    names = [f"{h}-{i}" for h in hosts for i in range(2)]
    resolved = [n.name for n in load_config(run_dir / "cluster.yaml").nodes]
    assert resolved == names
    for name in names:
        steps = [r for r in read_metrics(run_dir / f"{name}.metrics.jsonl") if "event" not in r]
        assert len(steps) == 20 and steps[-1]["mixes"] > 0, (name, steps[-1])
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["started_by"] == {name: f"slurm task {i}" for i, name in enumerate(names)}, record
    srun("--resume", str(run_dir))
    for name in names:  # each node ran again, appending to its metrics
        assert len([r for r in read_metrics(run_dir / f"{name}.metrics.jsonl") if "event" not in r]) == 40, name
