"""Checkpoints (dpwa/checkpoint.py, adapters/torch_state.py): the format, atomic writes, and the adapter's round trip.

* the file format round-trips arrays (bfloat16 included) and JSON, refuses damaged or foreign files, never unpickles;
* a write that fails between writing and renaming leaves the previous checkpoint, and no temporary file;
* a writer process SIGKILLed at random points, again and again, never leaves a checkpoint that fails to load:
  the file on disk is always the last one committed (or the one being committed when the kill came);
* through the adapter: model (BatchNorm buffers too), SGD momentum buffers and the gossip state come back, and
  training goes on exactly as if it had never stopped; push-sum's weight and GEM's proxy come back too.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import collector_paused, free_ports, port_is_free, processes, write_cluster
from torch import nn

from dpwa import DpwaConnection
from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.adapters.torch_state import load_optimizer_parts
from dpwa.checkpoint import (
    CheckpointError,
    DpwaState,
    checkpoint_path,
    load_latest,
    previous_path,
    read_checkpoint,
    remove_checkpoints,
    write_checkpoint,
)
from dpwa.config import ConfigError, load_config, parse_config
from dpwa.metrics import read_metrics
from dpwa.utils.bfloat16 import BFLOAT16, is_bfloat16

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the file format


def test_round_trip_keeps_arrays_dtypes_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "w1.ckpt.npz"
    bf16 = np.array([0x3F80, 0xC000, 0x7F80], dtype=np.uint16).view(BFLOAT16)
    arrays = {
        "model/w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model/n": np.array(7, dtype=np.int64),
        "model/h": bf16,
        "model/empty": np.zeros((0, 3), dtype=np.float64),
    }
    write_checkpoint(path, arrays, {"node": "w1", "dpwa": {"step": 3}})
    loaded = read_checkpoint(path)
    assert set(loaded.arrays) == set(arrays) and loaded.meta["node"] == "w1" and loaded.meta["dpwa"] == {"step": 3}
    for key, a in arrays.items():
        assert loaded.arrays[key].dtype == a.dtype and loaded.arrays[key].shape == a.shape
        assert np.array_equal(loaded.arrays[key], a), key
    assert is_bfloat16(loaded.arrays["model/h"].dtype)
    assert loaded.section("model").keys() == {"w", "n", "h", "empty"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["w1.ckpt.npz"]  # no temporary file left

    write_checkpoint(path, {"model/w": arrays["model/w"] + 1}, {"node": "w1", "dpwa": {"step": 4}})
    assert read_checkpoint(path).meta["dpwa"]["step"] == 4
    assert read_checkpoint(previous_path(path)).meta["dpwa"]["step"] == 3  # the previous one is kept
    assert sorted(p.name for p in path.parent.iterdir()) == ["w1.ckpt.npz", "w1.ckpt.npz.prev"]


def test_what_cannot_be_written_is_refused_before_anything_changes(tmp_path: Path) -> None:
    path = tmp_path / "w1.ckpt.npz"
    write_checkpoint(path, {"a": np.ones(3)}, {"step": 1})
    with pytest.raises(ValueError, match="Python objects"):
        write_checkpoint(path, {"a": np.array([object()])}, {})
    with pytest.raises(ValueError, match="may not set"):
        write_checkpoint(path, {"a": np.ones(3)}, {"arrays": 1})
    with pytest.raises(ValueError):
        write_checkpoint(path, {"a": np.ones(3)}, {"loss": float("nan")})  # JSON has no NaN
    assert read_checkpoint(path).meta["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w1.ckpt.npz"]


def test_a_refused_checkpoint_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """A torn file (a zip cut short), an empty one and a damaged array are refused with the file closed, even while
    the caller still holds the error (a log, a retry loop): np.load left its own descriptor of a torn zip open in
    the traceback's frames, closed only when the error went (with a ResourceWarning)."""
    path = tmp_path / "w1.ckpt.npz"
    write_checkpoint(path, {"x": np.arange(4096.0)}, {"step": 1})
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[good.index(np.arange(4096.0).tobytes()[:64]) + 1000] ^= 0xFF

    def open_here() -> list[str]:
        return [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == str(path)]

    with collector_paused():
        for content in (good[: len(good) // 2], b"", bytes(damaged)):
            path.write_bytes(content)
            with pytest.raises(CheckpointError) as refused:
                read_checkpoint(path)
            assert not open_here(), (len(content), refused.value)


def test_a_damaged_latest_checkpoint_is_moved_aside_so_the_next_write_keeps_the_good_previous_one(
    tmp_path: Path,
) -> None:
    """step 2 is damaged; resuming loads step 1 and moves step 2 aside (.damaged). The next write (step 3) then
    keeps nothing as .prev in step 1's place: were step 3 damaged in turn, step 1 still loads. Before, the write
    hard-linked the damaged step 2 over step 1's .prev, and no checkpoint loaded."""
    path = tmp_path / "w1.ckpt.npz"
    for step in (1, 2):
        write_checkpoint(path, {"x": np.full(64, float(step))}, {"step": step})
    path.write_bytes(path.read_bytes()[:-10])  # step 2 damaged
    assert load_latest(path).meta["step"] == 1
    aside = tmp_path / "w1.ckpt.npz.damaged"
    assert aside.exists() and not path.exists()
    write_checkpoint(path, {"x": np.full(64, 3.0)}, {"step": 3})
    assert read_checkpoint(previous_path(path)).meta["step"] == 1
    path.write_bytes(path.read_bytes()[:-10])  # step 3 damaged too
    assert load_latest(path).meta["step"] == 1
    assert sorted(p.name for p in remove_checkpoints(path)) == ["w1.ckpt.npz.damaged", "w1.ckpt.npz.prev"]


def test_damaged_torn_and_foreign_files_are_refused_and_the_previous_one_is_used(tmp_path: Path) -> None:
    path = tmp_path / "w1.ckpt.npz"
    data = np.random.default_rng(0).normal(size=4096)
    write_checkpoint(path, {"x": data}, {"step": 1})
    write_checkpoint(path, {"x": data * 2}, {"step": 2})
    good = path.read_bytes()

    damaged = bytearray(good)
    at = good.index(np.asarray(data * 2).tobytes()[:64]) + 1000  # inside the array's bytes
    damaged[at] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError):
        read_checkpoint(path)
    assert load_latest(path).meta["step"] == 1  # falls back to the previous checkpoint

    for torn in (good[: len(good) // 2], good[:-10], b""):
        path.write_bytes(torn)
        with pytest.raises(CheckpointError):
            read_checkpoint(path)
        assert load_latest(path).meta["step"] == 1

    with open(path, "wb") as handle:  # a pickled member: never loaded
        np.savez(handle, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        read_checkpoint(path)
    np.savez(tmp_path / "plain.npz", x=np.ones(2))  # an npz without dpwa metadata
    with pytest.raises(CheckpointError, match="no __meta__"):
        read_checkpoint(tmp_path / "plain.npz")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "missing.ckpt.npz")
    previous_path(path).unlink()  # the latest damaged and no previous one: an error, not a start from step 0
    with pytest.raises(CheckpointError, match="no checkpoint of .* loads .*move the damaged files aside"):
        load_latest(path)
    assert path.exists()  # left for a person to look at
    assert load_latest(tmp_path / "missing.ckpt.npz") is None  # none at all: a first start


def test_a_failure_between_write_and_rename_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w1.ckpt.npz"
    write_checkpoint(path, {"x": np.zeros(10)}, {"step": 1})
    real_replace = os.replace

    def crash(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst) == path:  # the commit rename (the .prev link still works)
            raise OSError("injected crash before the rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="injected"):
        write_checkpoint(path, {"x": np.ones(10)}, {"step": 2})
    monkeypatch.undo()
    loaded = read_checkpoint(path)
    assert loaded.meta["step"] == 1 and not loaded.arrays["x"].any()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dpwa.checkpoint import write_checkpoint
    path, seq = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    while True:
        seq += 1
        write_checkpoint(path, {"a": np.full(200_000, seq, np.float64), "b": np.full(1000, -seq, np.int32)},
                         {"seq": seq})
        print(seq, flush=True)
    """
)


@pytest.mark.slow  # several seconds: kept out of the fast subset
@pytest.mark.timing
def test_a_writer_killed_at_random_points_never_leaves_an_unloadable_checkpoint(tmp_path: Path) -> None:
    """12 writer processes in turn, each SIGKILLed after a random 0-150 ms of writing 1.6 MB checkpoints."""
    path = tmp_path / "checkpoints" / "w1.ckpt.npz"
    rng = random.Random(1234)
    seq = 0
    torn = 0  # rounds killed while writing: their temporary file is left behind
    with processes() as procs:
        for round_ in range(12):
            proc = subprocess.Popen(
                [sys.executable, "-c", WRITER, str(path), str(seq)], stdout=subprocess.PIPE, text=True, cwd=ROOT
            )
            procs[f"writer{round_}"] = proc
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.15))  # the kill lands at a random point of the writing loop
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            torn += any(path.parent.glob(f".{path.name}.{proc.pid}.*.tmp"))
            committed = [int(line) for line in proc.stdout.read().split()]
            last_acknowledged = max(committed, default=seq)
            if not path.exists():  # killed before its first write finished, and nothing was written before
                assert seq == 0
                continue
            loaded = read_checkpoint(path)  # the file itself, not the fallback: never torn
            got = loaded.meta["seq"]
            # the last acknowledged write, or the one whose rename happened just before the kill
            assert got in (last_acknowledged, last_acknowledged + 1), (got, last_acknowledged)
            assert np.all(loaded.arrays["a"] == got) and np.all(loaded.arrays["b"] == -got)
            assert load_latest(path).meta["seq"] == got
            seq = got
    assert seq > 0 and torn >= 3, (seq, torn)  # the kills did land in the middle of writes
    assert sum(p.name.endswith(".tmp") for p in path.parent.iterdir()) <= 2  # each writer removes the last one's


# --------------------------------------------------------------------------- through the adapter


class Batches:
    """The same regression batches for every model that asks, by step index."""

    def __init__(self, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(64, 16, 5, generator=g).to(dtype)
        self.y = torch.randn(64, 16, 3, generator=g).to(dtype)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> float:
        loss = nn.functional.mse_loss(model(self.x[i]), self.y[i])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.item())


def small(seed: int, dtype: torch.dtype) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(adapter: DpwaPyTorchAdapter, model: nn.Module, opt: torch.optim.Optimizer, data: Batches, n: int) -> None:
    loss = 1.0
    for _ in range(n):
        adapter.update_send(loss)
        loss = data.step(model, opt, adapter.step)
        adapter.update_wait(loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_adapter_checkpoint_round_trip_restores_model_optimizer_and_node(tmp_path: Path, dtype: torch.dtype) -> None:
    cluster = write_cluster(tmp_path / "c.yaml", free_ports(2), fetch_probability=0.0, checkpoint_every=4)
    run_dir = tmp_path / "run"
    data = Batches(dtype)
    model, opt = small(1, dtype)
    with DpwaPyTorchAdapter(model, "w1", cluster, run_dir=run_dir, optimizer=opt) as adapter:
        train(adapter, model, opt, data, 8)  # checkpoints after steps 4 and 8
        path = adapter.checkpoint_path
        assert path == checkpoint_path(run_dir, "w1") and path.is_file()
        saved_state = {k: v.clone() for k, v in model.state_dict().items()}
        adapter.save_checkpoint(tmp_path / "explicit.ckpt.npz", meta={"epoch": 3})
        momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        clock = adapter.connection.clock
        train(adapter, model, opt, data, 3)  # the original goes on: steps 9-11 (no checkpoint before 12)
        expected = {k: v.clone() for k, v in model.state_dict().items()}

    other, other_opt = small(99, dtype)  # different weights, no momentum yet
    with DpwaPyTorchAdapter(other, "w1", cluster, run_dir=run_dir, optimizer=other_opt) as adapter:
        pointers = [t.data_ptr() for t in adapter.tensors]
        restored = adapter.restore(resume=True, bootstrap=False)
        assert restored.step == 8 and restored.checkpoint == path and restored.peer is None
        assert adapter.step == 8 and adapter.connection.clock == clock
        assert [t.data_ptr() for t in adapter.tensors] == pointers  # loaded in place: the views stay valid
        for key, value in saved_state.items():
            assert torch.equal(other.state_dict()[key], value), key  # BatchNorm running stats and counter too
        for p, buf in zip(other.parameters(), momentum):
            assert torch.equal(other_opt.state[p]["momentum_buffer"], buf)
        train(adapter, other, other_opt, data, 3)  # the same steps 9-11 from the checkpoint
        for key, value in expected.items():
            assert torch.equal(other.state_dict()[key], value), key  # bit for bit: nothing was lost
        explicit = adapter.load_checkpoint(tmp_path / "explicit.ckpt.npz")
        assert explicit is not None and explicit.meta == {"epoch": 3} and adapter.step == 8
    events = [r for r in read_metrics(run_dir / "w1.metrics.jsonl") if r.get("event") == "resume"]
    assert events == [{"time": events[0]["time"], "node": "w1", "event": "resume", "step": 8, "checkpoint": str(path)}]


def test_restore_without_a_checkpoint_starts_at_step_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = write_cluster(tmp_path / "c.yaml", free_ports(2), fetch_probability=0.0)
    model, opt = small(1, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with DpwaPyTorchAdapter(model, "w1", cluster, run_dir=tmp_path / "run", optimizer=opt) as adapter:
        restored = adapter.restore(resume=True, bootstrap=False)
        assert (restored.step, restored.checkpoint, restored.peer) == (0, None, None)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    monkeypatch.delenv("DPWA_RUN_DIR", raising=False)
    with DpwaPyTorchAdapter(model, "w1", cluster, optimizer=opt) as adapter:
        assert adapter.checkpoint_path is None
        with pytest.raises(ValueError, match="no run directory"):
            adapter.save_checkpoint()


def test_pushsum_weight_and_gem_proxy_come_back(tmp_path: Path) -> None:
    ports = free_ports(2)
    pushsum = write_cluster(tmp_path / "p.yaml", ports, fetch_probability=0.0, interpolation="pushsum")
    with DpwaConnection("w1", pushsum) as conn:
        conn.restore_state(DpwaState(clock=7.5, step=7, loss=0.25, rule="pushsum", extras={"weight": 0.375}))
        state = conn.dpwa_state()
        assert (state.clock, state.step, state.loss, state.extras) == (7.5, 7, 0.25, {"weight": 0.375})
        conn.restore_state(DpwaState(clock=1.0, step=1, rule="pushsum", extras={"bogus": 5.0}))
        assert conn.dpwa_state().extras == {"weight": 0.375}  # only the rule's own numbers are taken

    gem = write_cluster(tmp_path / "g.yaml", ports, fetch_probability=0.0, interpolation="gem")
    params = [np.zeros(6, np.float32), np.zeros((2, 3), np.float64)]
    with DpwaConnection("w1", gem) as conn:
        for step in range(3):
            conn.update_send(params, 1.0)
            params[0] += step + 1  # a local step: GEM's proxy follows it
            params[1] -= 0.5
            conn.update_wait(1.0)
        saved = conn.dpwa_state()
    assert set(saved.arrays) == {"gem_m/0", "gem_m/1"} and saved.arrays["gem_m/0"].any()
    with DpwaConnection("w1", gem) as conn:
        conn.restore_state(saved, params)
        again = conn.dpwa_state()
        assert again.clock == 3 and again.step == 3
        assert all(
            np.array_equal(again.arrays[k], v) and again.arrays[k].dtype == v.dtype for k, v in saved.arrays.items()
        )


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("checkpoint_every: -1", "checkpoint_every: must be an integer >= 0, got -1"),
        ("checkpoint_every: 2.5", "checkpoint_every: must be an integer >= 0, got 2.5"),
        ("bootstrap: always", "bootstrap: unknown value 'always'; allowed: none, peer"),
        ("bootstrap_timeout_s: 0", "bootstrap_timeout_s: must be a number in (0, 86400], got 0"),
        ("bootstrap_gap: -5", "bootstrap_gap: must be a number >= 0, got -5"),
    ],
)
def test_restart_settings_are_validated_with_file_and_line(line: str, says: str) -> None:
    text = "nodes:\n  - {name: w1, host: localhost, port: 45000}\n" + line + "\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, "c.yaml")
    assert str(err.value) == f"c.yaml:3: {says}"
    ok = parse_config(text.replace(line, "checkpoint_every: 5\nbootstrap: peer"), "c.yaml")
    assert (ok.checkpoint_every, ok.bootstrap, ok.bootstrap_timeout_s, ok.bootstrap_gap) == (5, "peer", 10.0, 100.0)


def sgd_checkpoint(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    """(cluster file, checkpoint) of node w1 of a two-node file, fetching nothing, after ``steps`` steps of the
    small model with its SGD (momentum): what the tests of a checkpoint that does not fit load."""
    cluster = write_cluster(tmp_path / "c.yaml", free_ports(2), fetch_probability=0.0)
    data = Batches(torch.float32)
    model, opt = small(1, torch.float32)
    with DpwaPyTorchAdapter(model, "w1", cluster, run_dir=tmp_path / "run", optimizer=opt) as adapter:
        train(adapter, model, opt, data, steps)
        adapter.save_checkpoint()
        return cluster, adapter.checkpoint_path


def test_a_checkpoint_that_does_not_fit_the_optimizer_changes_nothing(tmp_path: Path) -> None:
    """A checkpoint whose optimizer state does not fit (here: two parameter groups where it holds one) is refused
    before anything is loaded: the model keeps its own weights and the node its step. Before, the model was
    overwritten first, then the optimizer raised: weights of the checkpoint, step and clock of the fresh node."""
    cluster, path = sgd_checkpoint(tmp_path, 4)
    other, _ = small(99, torch.float32)
    params = list(other.parameters())
    two_groups = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.05, momentum=0.9)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with DpwaPyTorchAdapter(other, "w1", cluster, run_dir=tmp_path / "run", optimizer=two_groups) as adapter:
        with pytest.raises(ValueError, match="parameter group"):
            adapter.load_checkpoint(path)
        assert adapter.step == 0
        assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_a_checkpoint_of_another_optimizer_is_refused_and_the_optimizer_is_as_it_was(tmp_path: Path) -> None:
    """SGD with momentum saved, Adam resumed (an edited script): before, torch's load_state_dict took SGD's groups
    and state into the Adam, then Adam's own check raised KeyError('step'): a half-loaded optimizer."""
    cluster, path = sgd_checkpoint(tmp_path, 3)
    other, _ = small(1, torch.float32)
    adam = torch.optim.Adam(other.parameters(), lr=0.01)
    before = copy.deepcopy(adam.state_dict())
    with DpwaPyTorchAdapter(other, "w1", cluster, run_dir=tmp_path / "run", optimizer=adam) as adapter:
        with pytest.raises(ValueError, match="it holds a SGD's state, this optimizer is a Adam"):
            adapter.load_checkpoint(path)
        assert adapter.step == 0
    assert adam.state_dict() == before
    meta = load_latest(path).meta["optimizer"]  # a checkpoint of an older dpwa names no kind
    del meta["kind"]
    with pytest.raises(ValueError, match="does not fit this optimizer: KeyError"):
        load_optimizer_parts(adam, load_latest(path).section("optim"), meta)
    assert adam.state_dict() == before


def test_an_optimizer_setting_no_checkpoint_can_hold_is_refused_when_the_adapter_is_built(tmp_path: Path) -> None:
    """A tensor learning rate (torch allows one) cannot go into a checkpoint: with checkpoint_every set, building the
    adapter says so, where the K-th update_wait used to raise after its step had counted."""
    cluster = write_cluster(tmp_path / "c.yaml", free_ports(2), fetch_probability=0.0, checkpoint_every=5)
    model, _ = small(1, torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        DpwaPyTorchAdapter(model, "w1", cluster, run_dir=tmp_path / "run", optimizer=opt)
    assert port_is_free(load_config(cluster).nodes[0].port)


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "c.yaml", free_ports(2), fetch_probability=0.0)
    model, opt = small(1, torch.float32)
    with DpwaPyTorchAdapter(model, "w1", cluster, run_dir=tmp_path / "run", optimizer=opt) as adapter:
        adapter.save_checkpoint()
        path = adapter.checkpoint_path
    wider = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with DpwaPyTorchAdapter(wider, "w1", cluster, run_dir=tmp_path / "run") as adapter:
        with pytest.raises(ValueError, match=r"0\.weight has shape \(7, 5\), not \(8, 5\)"):
            adapter.load_checkpoint(path)
    assert all(torch.equal(wider.state_dict()[k], v) for k, v in before.items())
