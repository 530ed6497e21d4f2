"""The built-in demo (dpwa/tools/demo/): its data and shards, a short 2-node run, and ``--evaluate``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_ports, processes, wait_all, write_cluster

from dpwa.tools import demo

STEPS = 150
BATCH = 16
SHORT_RUN_FLOOR = 0.45  # the floor of the networked demo run's averaged accuracy (see the test)


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """``demo.main(["--evaluate", ...])`` sets torch's thread count; give this process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_dataset_is_a_function_of_the_seed() -> None:
    a, b, c = demo.make_dataset(7), demo.make_dataset(7), demo.make_dataset(8)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert not torch.equal(a.x_train, c.x_train)
    spec = demo.DataSpec()
    assert a.x_train.shape == (spec.n_train, spec.features) and a.x_train.dtype == torch.float32
    assert a.x_test.shape == (spec.n_test, spec.features) and a.y_test.dtype == torch.int64
    assert set(a.y_train.tolist()) == set(range(spec.classes))
    assert abs(a.x_train.std().item() - 1.0) < 0.05  # unit-variance features, as documented


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_and_cover_the_training_set(count: int) -> None:
    n = 1001
    shards = [demo.shard_indices(n, i, count) for i in range(count)]
    joined = np.concatenate(shards)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        demo.shard_indices(n, count, count)


def test_batch_stream_is_reproducible_and_stays_in_its_shard() -> None:
    shard = demo.shard_indices(100, 1, 4)
    a = demo.BatchStream(shard, 8, (0, 2))
    b = demo.BatchStream(shard, 8, (0, 2))
    first = [next(a) for _ in range(10)]  # more than one epoch of 25 samples
    assert all(torch.equal(x, next(b)) for x in first)
    assert set(torch.cat(first).tolist()) <= set(shard.tolist())
    assert len(set(torch.cat(first[:3]).tolist())) == 24  # no repeats within an epoch


def test_model_file_round_trip_without_pickle(tmp_path: Path) -> None:
    config = demo.TrainConfig(steps=5)
    model = demo.build_model(config)
    path = tmp_path / "w1.model.npz"
    demo.save_model(path, model, {"node": "w1", "config": config.to_dict()})
    arrays, meta = demo.load_model_file(path)  # np.load(allow_pickle=False) inside
    assert meta["node"] == "w1" and demo.TrainConfig.from_dict(meta["config"]) == config
    assert set(arrays) == set(model.state_dict())
    assert not list(tmp_path.glob(".*.tmp"))
    averaged = demo.average_states([arrays, {k: v * 3 for k, v in arrays.items()}])
    assert torch.allclose(averaged["0.weight"], model.state_dict()["0.weight"] * 2)


def test_node_needs_its_name_and_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DPWA_NODE", raising=False)
    monkeypatch.delenv("DPWA_CONFIG", raising=False)
    assert demo.main(["--steps", "1"]) == 2


@pytest.mark.usefixtures("keep_torch_threads")
def test_evaluate_without_model_files_fails(tmp_path: Path) -> None:
    assert demo.main(["--evaluate", str(tmp_path)]) == 1
    assert not (tmp_path / "demo.json").exists()


def _read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # several seconds: kept out of the fast subset
@pytest.mark.integration
@pytest.mark.outcome
@pytest.mark.usefixtures("keep_torch_threads")
def test_two_node_run_then_evaluate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Callable[[str, object], None]
) -> None:
    cluster = write_cluster(tmp_path / "cluster.yaml", free_ports(2), timeout_ms=2000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with processes() as procs:
        for name in ("w1", "w2"):
            env = {
                **os.environ,
                "DPWA_NODE": name,
                "DPWA_CONFIG": str(cluster),
                "DPWA_RUN_DIR": str(run_dir),
                "DPWA_TORCH_THREADS": "1",
            }
            with open(run_dir / f"{name}.log", "wb") as log:
                argv = [sys.executable, "-m", "dpwa.tools.demo", "--steps", str(STEPS), "--batch-size", str(BATCH)]
                procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_all(procs, run_dir)

    for name in ("w1", "w2"):
        log = (run_dir / f"{name}.log").read_text()
        assert "1 torch thread(s)" in log  # DPWA_TORCH_THREADS honoured
        records = _read_records(run_dir / f"{name}.metrics.jsonl")
        exchanges = [r for r in records if "event" not in r]
        reports = [r for r in records if r.get("event") == "report"]
        assert [r["step"] for r in exchanges] == list(range(1, STEPS + 1))
        assert exchanges[-1]["mixes"] > 0, f"{name} never mixed:\n{log}"
        assert len(reports) == 1
        assert 0.0 <= reports[0]["accuracy"] <= 1.0
        assert math.isfinite(reports[0]["final_loss"]) and reports[0]["final_loss"] > 0
        arrays, meta = demo.load_model_file(run_dir / f"{name}.model.npz")
        assert meta["node"] == name and meta["samples"] == STEPS * BATCH
        assert all(np.isfinite(a).all() for a in arrays.values())

    assert demo.main(["--evaluate", str(run_dir)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "demo.json").read_text())
    assert set(summary["node_accuracy"]) == {"w1", "w2"}
    assert summary["total_samples"] == 2 * STEPS * BATCH
    assert summary["baseline_steps"] == 2 * STEPS
    for key in ("averaged_accuracy", "baseline_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
        assert f"{summary[key]:.4f}" in out
    # What thread timing cannot change: the figures are those of the files. The averaged model is the mean of
    # the two node models (recomputed here), each figure its held-out accuracy; the baseline is a pure function
    # of the seed and the sample count (seed 0: 0.746 after 300 steps).
    config = demo.TrainConfig(steps=STEPS, batch_size=BATCH)
    data = demo.make_dataset(config.seed, config.data)
    states = {name: demo.load_model_file(run_dir / f"{name}.model.npz")[0] for name in ("w1", "w2")}
    model = demo.build_model(config)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for name, arrays in states.items():
        model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
        assert demo.evaluate(model, data.x_test, data.y_test)[0] == summary["node_accuracy"][name]
        assert any(not torch.equal(torch.from_numpy(arrays[k]), v) for k, v in start.items()), name  # trained
    model.load_state_dict(demo.average_states(list(states.values())))
    assert demo.evaluate(model, data.x_test, data.y_test)[0] == summary["averaged_accuracy"]
    assert summary["baseline_accuracy"] > 0.6
    # The gossip run's own figure depends on timing: averaged accuracy over 29 runs (--stress 30 -m outcome,
    # 2026-11-25, 2 cores): mean 0.602, sd 0.0074, min 0.593; the bound 0.45 is mean - 21 sd.
    # Chance is 0.10; one process on the same samples 0.746. Why short runs vary, and why they end below one
    # process: "Short runs" on the Mixing rules page.
    record_property("averaged_accuracy", summary["averaged_accuracy"])
    assert summary["averaged_accuracy"] > SHORT_RUN_FLOOR


@pytest.mark.outcome
def test_lock_step_gossip_of_the_demo_trains_deterministically() -> None:
    """The demo's two nodes in lock-step (the simulator: the real constant rule, no sockets, no timing): the
    same seed gives the same models bit for bit, every round mixes both nodes at 0.5, the averaged model
    learns (well above chance, 0.1), and it trains less far in 150 steps than two nodes that never mix: the
    constant rule mixes the peer's snapshot from before its step into the node's model after it, so the
    average moves by (1 - f) of each node's step (docs: "Short runs")."""
    gossip, outcomes = _lock_step_demo(mix=True)
    again, _ = _lock_step_demo(mix=True)
    alone, _ = _lock_step_demo(mix=False)
    assert all(torch.equal(a, b) for a, b in zip(gossip["w1"], again["w1"]))  # deterministic
    assert all(o.factor == 0.5 and o.peers for round_ in outcomes for o in round_.values())
    accuracy = {k: _averaged_accuracy(v) for k, v in (("gossip", gossip), ("alone", alone))}
    assert 0.45 < accuracy["gossip"] < accuracy["alone"], accuracy  # measured: 0.579 and 0.615
    assert _distance(gossip) < 0.05 * _distance(alone)  # mixing every round keeps the two together


def _lock_step_demo(mix: bool) -> tuple[dict[str, list[torch.Tensor]], list[dict]]:
    """STEPS rounds of the 2-node demo (batch BATCH) in the simulator: each node's torch model trains on the
    simulator's own arrays (shared memory), between the round's publish and mix."""
    from dpwa.rules import ConstantRule
    from dpwa.rules.schedules import RandomSchedule
    from dpwa.tools.simulation import Simulation

    config = demo.TrainConfig(steps=STEPS, batch_size=BATCH)
    data = demo.make_dataset(config.seed, config.data)
    init = [p.detach().numpy().copy() for p in demo.build_model(config).parameters()]
    sim = Simulation([init, init], ConstantRule, RandomSchedule)
    models, optimizers, streams = {}, {}, {}
    for index, name in enumerate(sim.names):
        model = demo.build_model(config)
        for p, array in zip(model.parameters(), sim[name].arrays):
            p.data = torch.from_numpy(array)  # the model trains the simulator's arrays in place
        models[name], optimizers[name] = model, demo.make_optimizer(model, config)
        indices = demo.shard_indices(config.data.n_train, index, 2)
        streams[name] = demo.BatchStream(indices, config.batch_size, (config.seed, index + 1))
    step = 0

    def train(node) -> float:
        for group in optimizers[node.name].param_groups:
            group["lr"] = demo.lr_at(config, step, STEPS)
        batch = next(streams[node.name])
        loss = torch.nn.functional.cross_entropy(models[node.name](data.x_train[batch]), data.y_train[batch])
        optimizers[node.name].zero_grad()
        loss.backward()
        optimizers[node.name].step()
        return loss.item()

    outcomes = []
    for step in range(STEPS):  # noqa: B007 - train() reads it
        outcomes.append(sim.run_round(train=train, lose=None if mix else (lambda a, b: "timeout")))
    return {n: [p.detach().clone() for p in m.parameters()] for n, m in models.items()}, outcomes


def _averaged_accuracy(params: dict[str, list[torch.Tensor]]) -> float:
    config = demo.TrainConfig(steps=STEPS, batch_size=BATCH)
    data = demo.make_dataset(config.seed, config.data)
    model = demo.build_model(config)
    with torch.no_grad():
        for p, a, b in zip(model.parameters(), params["w1"], params["w2"]):
            p.copy_((a + b) / 2)
    return demo.evaluate(model, data.x_test, data.y_test)[0]


def _distance(params: dict[str, list[torch.Tensor]]) -> float:
    return float(sum(((a - b) ** 2).sum() for a, b in zip(params["w1"], params["w2"])) ** 0.5)


def test_a_finished_node_lingers_longer_for_a_peer_that_fetches_it_seldom() -> None:
    """The idle a demo node waits after its last served fetch before it leaves: 0.5 s on the demo (4 nodes, 6 ms
    steps, about one fetch served a step), three peer-rounds of its steps with many peers, and three times the
    mean interval of the fetches it served when a straggler fetches it seldom (2 nodes: itself at 0.1 s a step,
    the peer fetching once a second)."""
    from dpwa.tools.demo import LINGER_IDLE_S, linger_idle_s

    assert linger_idle_s(3, 1.92, 300, 310) == LINGER_IDLE_S == 0.5
    assert linger_idle_s(31, 19.2, 300, 290) == pytest.approx(3 * 31 * 0.064)
    assert linger_idle_s(1, 30.0, 300, 30) == pytest.approx(3.0)
    assert linger_idle_s(1, 30.0, 300, 0) == LINGER_IDLE_S  # no fetch at all: no peer to wait for
