"""dpwa.node_name / rank / world_size (dpwa/world.py) from every engine's environment, dpwa.shard (dpwa/shard.py)
and the DpwaSampler built on it (adapters/sampler.py). SLURM and torchrun cannot run here as engines for these:
what they hand a process (its environment) is what is tested, as the variables their documentation lists."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_slurm import step_env

import dpwa
from dpwa.adapters.sampler import DpwaSampler, node_sampler
from dpwa.utils.partition import partition_indices

ENGINE_PREFIXES = ("DPWA_", "SLURM_")
ENGINE_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts outside any engine (the test runner may itself run under one)."""
    for name in list(os.environ):
        if name.startswith(ENGINE_PREFIXES) or name in ENGINE_NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n" + "".join(f"  - {{name: n{i}, host: 127.0.0.1, port: {47000 + i}}}\n" for i in range(3)))
    return path


def test_under_dpwa_run_the_rank_is_the_index_in_the_cluster_file(
    monkeypatch: pytest.MonkeyPatch, cluster: Path
) -> None:
    monkeypatch.setenv("DPWA_NODE", "n2")
    monkeypatch.setenv("DPWA_CONFIG", str(cluster))
    assert (dpwa.node_name(), dpwa.rank(), dpwa.world_size()) == ("n2", 2, 3)
    assert dpwa.whereami().source == "DPWA_NODE/DPWA_CONFIG"


def test_a_name_and_a_cluster_file_given_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, cluster: Path
) -> None:
    monkeypatch.setenv("DPWA_NODE", "n2")
    monkeypatch.setenv("DPWA_CONFIG", str(cluster))
    assert dpwa.rank("n0", cluster) == 0
    with pytest.raises(dpwa.WorldError, match="n9"):
        dpwa.rank("n9", cluster)


def test_a_slurm_step_gives_rank_size_and_the_engines_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the host list is expanded by dpwa itself
    for name, value in {
        "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert dpwa.whereami() == dpwa.World("gpu08-1", 3, 4, "the SLURM step")


def test_torchrun_gives_rank_and_world_size_and_the_rendezvous_name(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dpwa.whereami() == dpwa.World("127.0.0.1-1", 1, 2, "torchrun")


def test_torchrun_with_a_cluster_file_takes_node_number_rank(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in {**env, "DPWA_CONFIG": str(cluster)}.items():
        monkeypatch.setenv(name, value)
    assert (dpwa.node_name(), dpwa.rank(), dpwa.world_size()) == ("n2", 2, 3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(dpwa.WorldError, match="WORLD_SIZE=4 but .* has 3 nodes"):
        dpwa.rank()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, "not started by `dpwa run`, srun or torchrun"),
        ({"DPWA_NODE": "n1"}, r"config= \(or DPWA_CONFIG\) is missing"),
        ({"DPWA_JOIN": "127.0.0.1:47000"}, "no fixed rank"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "not below WORLD_SIZE"),
        ({"RANK": "\u00b9", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK='\u00b9'"),
        # a host name the resolver cannot encode (a TypeError traceback before)
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "\u00e9" * 70 + ".com", "MASTER_PORT": "1"}, "MASTER_ADDR="),
    ],
)
def test_outside_any_engine_or_with_bad_variables_the_error_is_one_line_saying_why(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(dpwa.WorldError, match=match) as caught:
        dpwa.rank()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("partition", ["iid", "dirichlet:0.3", "classes:2"])
@pytest.mark.parametrize("nodes", [1, 3, 4])
def test_the_shards_of_all_nodes_are_disjoint_cover_the_data_and_are_the_demos_split(
    partition: str, nodes: int
) -> None:
    labels = np.random.default_rng(0).integers(0, 5, size=503)
    shards = [dpwa.shard(labels.size, partition, labels=labels, seed=7, rank=r, world_size=nodes) for r in range(nodes)]
    together = np.concatenate(shards)
    assert np.unique(together).size == together.size  # disjoint
    if partition != "classes:2" or nodes * 2 >= 5:  # classes:K covers the data when nodes * K >= classes
        assert np.array_equal(np.sort(together), np.arange(labels.size))
    else:
        assert together.size < labels.size
    expected = partition_indices(labels, nodes, partition, 7)
    assert all(np.array_equal(a, b) for a, b in zip(shards, expected))


def test_a_shard_under_dpwa_run_is_this_nodes(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    monkeypatch.setenv("DPWA_NODE", "n1")
    monkeypatch.setenv("DPWA_CONFIG", str(cluster))
    assert dpwa.shard(10).tolist() == [1, 4, 7]


def test_a_split_by_class_needs_labels_and_labels_must_fit() -> None:
    with pytest.raises(ValueError, match="needs labels="):
        dpwa.shard(10, "classes:2", rank=0, world_size=2)
    with pytest.raises(ValueError, match="shape"):
        dpwa.shard(10, "classes:2", labels=[0, 1], rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank 2"):
        dpwa.shard(10, rank=2, world_size=2)


def test_the_sampler_visits_its_shard_once_per_epoch_in_a_seeded_order_that_changes_by_epoch() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(40, 2), torch.arange(40) % 4)
    sampler = DpwaSampler(data, "classes:1", seed=3, rank=1, world_size=4)
    mine = dpwa.shard(40, "classes:1", labels=(torch.arange(40) % 4).numpy(), seed=3, rank=1, world_size=4)
    first, second = list(sampler), list(sampler)
    assert len(sampler) == 10 and sorted(first) == sorted(second) == mine.tolist()
    assert first != second  # a new order each epoch
    sampler.set_epoch(0)
    assert list(sampler) == first  # the same epoch, the same order
    assert list(DpwaSampler(data, "classes:1", seed=3, rank=1, world_size=4, shuffle=False)) == mine.tolist()
    assert len({int(data.tensors[1][i]) for i in first}) == 1  # one class: the shard is a class's


def test_a_framework_callbacks_sampler_choice(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    monkeypatch.setenv("DPWA_NODE", "n1")
    monkeypatch.setenv("DPWA_CONFIG", str(cluster))
    data = torch.utils.data.TensorDataset(torch.zeros(12, 1), torch.arange(12) % 3)
    shuffled = node_sampler(torch.utils.data.RandomSampler(data), data, "iid", seed=0, framework="X")
    ordered = node_sampler(torch.utils.data.SequentialSampler(data), data, "iid", seed=0, framework="X")
    assert isinstance(shuffled, DpwaSampler) and shuffled.shuffle and sorted(shuffled) == [1, 4, 7, 10]
    assert isinstance(ordered, DpwaSampler) and not ordered.shuffle and list(ordered) == [1, 4, 7, 10]
    given = DpwaSampler(data, rank=0, world_size=2)
    assert node_sampler(given, data, "iid", seed=0, framework="X") is None  # already sharded: left alone
    with pytest.raises(ValueError, match="X: .*DistributedSampler \\(rank 1 of 2\\)"):
        node_sampler(torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1), data, "iid", seed=0,
                     framework="X")  # fmt: skip
    with pytest.raises(ValueError, match="its own sampler \\(WeightedRandomSampler\\)"):
        node_sampler(torch.utils.data.WeightedRandomSampler([1.0] * 12, 12), data, "iid", seed=0, framework="X")
    classes = node_sampler(torch.utils.data.RandomSampler(data), data, "classes:1", seed=0, framework="X")
    assert classes is not None and len({int(data.tensors[1][i]) for i in classes}) == 1  # labels from the data set


def test_a_node_of_a_joining_run_has_no_rank_even_when_its_file_lists_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`dpwa run -n 1 --join HOST:PORT` writes `join:` and the joiner itself into the run's cluster file."""
    path = tmp_path / "cluster.yaml"
    path.write_text("join: 127.0.0.1:45999\nnodes:\n  - {name: vm-47001, host: 127.0.0.1, port: 47001}\n")
    monkeypatch.setenv("DPWA_NODE", "vm-47001")
    monkeypatch.setenv("DPWA_CONFIG", str(path))
    with pytest.raises(dpwa.WorldError, match="joins a running cluster"):
        dpwa.rank()


def test_a_batch_scripts_own_shell_is_no_task_of_a_step(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    """``sbatch -n 2`` sets the task variables in the script's own shell (each 0) but no SLURM_STEP_ID: a process
    started there without srun is told so, not made node 0 of the file (its peers would never come)."""
    for name, value in step_env(0, "localhost", "3", SLURM_NTASKS="3").items():
        monkeypatch.setenv(name, value)
    assert dpwa.whereami(config=cluster).name == "n0"  # in a task of a step: node number SLURM_PROCID
    monkeypatch.delenv("SLURM_STEP_ID")
    with pytest.raises(dpwa.WorldError, match="does not say which node this is outside srun and torchrun"):
        dpwa.whereami(config=cluster)
    with pytest.raises(dpwa.WorldError, match="a batch script's own shell is no srun step"):
        dpwa.whereami()


def test_a_slurm_step_of_another_size_than_the_file_is_refused(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    for name, value in step_env(1, "localhost", "2", SLURM_NTASKS="2").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(dpwa.WorldError, match="the SLURM step has 2 tasks but .* has 3 nodes"):
        dpwa.whereami(config=cluster)


def test_a_users_own_random_sampler_is_not_replaced(monkeypatch: pytest.MonkeyPatch, cluster: Path) -> None:
    monkeypatch.setenv("DPWA_NODE", "n1")
    monkeypatch.setenv("DPWA_CONFIG", str(cluster))
    data = torch.utils.data.TensorDataset(torch.zeros(12, 1))
    other = torch.utils.data.TensorDataset(torch.zeros(12, 1))
    for theirs in (
        torch.utils.data.RandomSampler(data, replacement=True),
        torch.utils.data.RandomSampler(data, num_samples=5),
        torch.utils.data.RandomSampler(other),
    ):
        with pytest.raises(ValueError, match="its own sampler \\(RandomSampler\\)"):
            node_sampler(theirs, data, "iid", seed=0, framework="X")


def test_torchrun_inside_a_slurm_job_is_the_engine_of_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``srun torchrun --nproc-per-node=4 train.py`` (or torchrun in an sbatch script): each worker carries the
    SLURM task's variables and torchrun's; torchrun is the innermost launcher, so rank and size are its. Before,
    the SLURM step won: every worker of a host was rank 0 of 1 with the same name."""
    slurm = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
             "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_TASKS_PER_NODE": "1"}  # fmt: skip
    torch_env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in {**slurm, **torch_env}.items():
        monkeypatch.setenv(name, value)
    assert dpwa.whereami() == dpwa.World("127.0.0.1-1", 1, 2, "torchrun")
