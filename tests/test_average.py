"""A run's models: the model file (dpwa/modelfile.py), the adapter's save_model, `dpwa average RUN_DIR`
(dpwa/tools/average.py) with --evaluate and --baseline, and close() leaving the model as the trainer saw it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import free_ports, wait_until

from dpwa.cli.app import main as cli
from dpwa.config import ClusterConfig, NodeSpec
from dpwa.modelfile import AVERAGED_MODEL, ModelFile, average_models, disagreement, read_model, write_model
from dpwa.node.connection import DpwaConnection
from dpwa.node.states import SlotState
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32


def bf16(values: list[float]) -> np.ndarray:
    return from_float32(np.array(values, np.float32), np.empty(len(values), np.uint16)).view(BFLOAT16)


def test_the_average_is_push_sums_weighted_mean_in_every_dtype_and_integers_come_from_the_first() -> None:
    a = ModelFile("a", {"w": np.array([1.0, 2.0]), "h": np.array([1, 2], np.float16), "b": bf16([1.0, 4.0]),
                        "n": np.array(7)}, weight=3.0)  # fmt: skip
    b = ModelFile("b", {"w": np.array([5.0, 6.0]), "h": np.array([5, 6], np.float16), "b": bf16([5.0, 8.0]),
                        "n": np.array(9)}, weight=1.0)  # fmt: skip
    mean = average_models([a, b])
    assert mean["w"].tolist() == [2.0, 3.0] and mean["w"].dtype == np.float64  # (3*1 + 5) / 4, (3*2 + 6) / 4
    assert mean["h"].tolist() == [2.0, 3.0] and mean["h"].dtype == np.float16
    assert mean["b"].dtype == BFLOAT16 and to_float32(mean["b"], np.empty(2, np.float32)).tolist() == [2.0, 5.0]
    assert int(mean["n"]) == 7
    equal = average_models([ModelFile("a", a.arrays), ModelFile("b", b.arrays)])
    assert equal["w"].tolist() == [3.0, 4.0]  # weights 1: the plain mean
    with pytest.raises(ValueError, match="different entries"):
        average_models([a, ModelFile("c", {"w": np.zeros(2)})])
    with pytest.raises(ValueError, match="w: c has float64\\(3,\\)"):
        average_models([a, ModelFile("c", {**a.arrays, "w": np.zeros(3)})])


def test_the_disagreement_is_the_relative_distance_to_the_mean() -> None:
    models = [ModelFile("a", {"w": np.array([1.0, 0.0])}), ModelFile("b", {"w": np.array([3.0, 0.0])})]
    spread = disagreement(models, average_models(models))  # mean [2, 0]: each model 1 away, |mean| 2
    assert spread.overall == pytest.approx(0.5) and spread.nodes == pytest.approx({"a": 0.5, "b": 0.5})
    same = [ModelFile("a", {"w": np.ones(3)}), ModelFile("b", {"w": np.ones(3)})]
    assert disagreement(same, average_models(same)).overall == 0.0


def test_a_model_file_round_trips_any_dtype_and_refuses_what_is_not_one(tmp_path: Path) -> None:
    arrays = {"w": np.arange(4.0, dtype=np.float32), "b": bf16([1.5, -2.0]), "n": np.array(3, np.int64)}
    path = write_model(tmp_path / "x.model.npz", arrays, node="x", weight=0.5, step=9, user={"k": 1})
    back = read_model(path)
    assert (back.node, back.weight, back.step, dict(back.user)) == ("x", 0.5, 9, {"k": 1})
    assert back.arrays["b"].dtype == BFLOAT16 and all(np.array_equal(back.arrays[k], a) for k, a in arrays.items())
    with pytest.raises(ValueError, match="weight"):
        write_model(tmp_path / "y.model.npz", arrays, node="y", weight=-1.0)
    handed = ModelFile("h", {"w": np.ones(2)}, weight=0.0)  # a push-sum node that handed its mass away
    assert write_model(tmp_path / "h.model.npz", handed.arrays, node="h", weight=0.0).exists()
    with pytest.raises(ValueError, match="every model's weight is 0"):
        average_models([handed])


def test_the_adapter_saves_its_model_with_its_weight(tmp_path: Path) -> None:
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    (port,) = free_ports(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).to(torch.bfloat16)
    config = ClusterConfig(nodes=(NodeSpec("solo", "127.0.0.1", port),), interpolation="pushsum")
    with DpwaPyTorchAdapter(model, "solo", config, run_dir=tmp_path) as adapter:
        adapter.update_send(1.0)
        adapter.update_wait(1.0)
        path = adapter.save_model(meta={"epoch": 1})
    saved = read_model(path)
    assert path == tmp_path / "solo.model.npz"
    assert (saved.step, saved.weight, dict(saved.user)) == (1, 1.0, {"epoch": 1})
    for name, tensor in model.state_dict().items():
        array = saved.arrays[name]
        if tensor.dtype == torch.bfloat16:
            assert array.dtype == BFLOAT16 and np.array_equal(array.view(np.int16), tensor.view(torch.int16).numpy())
        else:
            assert np.array_equal(array, tensor.numpy())


def run_dir_of(tmp_path: Path, name: str, models: dict[str, tuple[list[float], float]]) -> Path:
    run_dir = tmp_path / name
    for node, (values, weight) in models.items():
        write_model(run_dir / f"{node}.model.npz", {"w": np.array(values)}, node=node, weight=weight)
    return run_dir


EVALUATION = """
def evaluate(state_dict):
    w = state_dict["w"]
    return {"first": float(w[0]), "norm": float(w.norm())}
"""


@pytest.mark.slow  # several seconds: kept out of the fast subset
def test_dpwa_average_writes_the_average_and_evaluates_it_beside_the_nodes_and_a_baseline(tmp_path: Path) -> None:
    run_dir = run_dir_of(tmp_path, "run", {"w1": ([1.0, 0.0], 1.0), "w2": ([3.0, 0.0], 1.0)})
    baseline = run_dir_of(tmp_path, "one", {"w1": ([2.5, 0.0], 1.0)})
    (tmp_path / "my_eval.py").write_text(EVALUATION)
    done = subprocess.run(
        [sys.executable, "-m", "dpwa.cli", "average", str(run_dir), "--evaluate", "my_eval:evaluate",
         "--baseline", str(baseline)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("disagreement: 50 % ") and "w1 50 %" in lines[1]
    assert lines[2] == "first: averaged model 2.0000 (nodes: w1 1.0000, w2 3.0000)"
    assert lines[3].endswith("2.5000; difference 0.5000 (baseline - averaged)")
    assert read_model(run_dir / AVERAGED_MODEL).arrays["w"].tolist() == [2.0, 0.0]
    result = json.loads((run_dir / "average.json").read_text())
    assert result["averaged"] == {"first": 2.0, "norm": 2.0} and result["baseline"]["first"] == 2.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--evaluate", "nowhere:evaluate"], "cannot import nowhere"),
        (["--evaluate", "evaluate"], "expected MODULE:FUNCTION"),
        (["--baseline", "."], "--baseline needs --evaluate"),
    ],
)
def test_dpwa_average_refuses_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    run_dir = run_dir_of(tmp_path, "run", {"w1": ([1.0], 1.0)})
    result = CliRunner().invoke(cli, ["average", str(run_dir), *args])
    assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(cli, ["average", str(empty)])
    assert result.exit_code == 2 and "no <node>.model.npz files" in result.output


def test_dpwa_average_refuses_two_files_of_one_node_weights_summing_to_infinity_and_an_unwritable_directory(
    tmp_path: Path,
) -> None:
    """Each in one line, exit 2. Before: a copied file was averaged twice (its figures merged in the report);
    weights of 1e308 averaged to zeros and the write raised; a directory it cannot write printed a traceback."""
    copied = run_dir_of(tmp_path, "copied", {"w1": ([1.0], 1.0), "w2": ([3.0], 1.0)})
    write_model(copied / "w3.model.npz", {"w": np.array([5.0])}, node="w1", weight=1.0)  # w1's, renamed
    huge = run_dir_of(tmp_path, "huge", {"w1": ([1.0], 1e308), "w2": ([3.0], 1e308)})
    blocked = run_dir_of(tmp_path, "blocked", {"w1": ([1.0], 1.0)})
    (blocked / AVERAGED_MODEL).mkdir()  # the averaged model's path is taken by a directory
    for run_dir, message in (
        (copied, "w1.model.npz and w3.model.npz are both node w1's model"),
        (huge, "weights sum to inf"),
        (blocked, f"cannot write {AVERAGED_MODEL}"),
    ):
        result = CliRunner().invoke(cli, ["average", str(run_dir)])
        assert result.exit_code == 2 and message in result.output and len(result.output.splitlines()) == 1, (
            result.output
        )


def two_nodes(interpolation: str, size: int) -> tuple[dict[str, DpwaConnection], dict[str, list[np.ndarray]]]:
    """w1 (zeros) and w2 (ones) of ``size`` float64 each, every peer up; the caller closes them."""
    ports = free_ports(2)
    config = ClusterConfig(
        nodes=tuple(NodeSpec(f"w{i + 1}", "127.0.0.1", p) for i, p in enumerate(ports)), interpolation=interpolation,
        timeout_ms=2000.0 if interpolation == "pushsum" else 1000.0,
    )  # fmt: skip
    params = {"w1": [np.zeros(size)], "w2": [np.ones(size)]}
    conns = {name: DpwaConnection(name, config, seed=i, params=params[name]) for i, name in enumerate(params)}
    assert all(all(c.wait_for_peers(10.0).values()) for c in conns.values())
    return conns, params


def round_of(conns: dict[str, DpwaConnection], params: dict[str, list[np.ndarray]], name: str) -> None:
    conns[name].update_send(params[name], 1.0)
    conns[name].update_wait(1.0)


def joint_round(conns: dict[str, DpwaConnection], params: dict[str, list[np.ndarray]]) -> None:
    """One round of both nodes at once (each one's update_wait waits for the other's round)."""
    threads = [threading.Thread(target=round_of, args=(conns, params, name)) for name in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@pytest.mark.parametrize("final_mix", [False, True])
def test_close_under_push_sum_leaves_the_model_as_the_trainer_saw_it_and_hands_the_mass_over(final_mix: bool) -> None:
    """w1 closes with w2's push in its inbox: the hand-off folds it in and gives the whole mass to w2 (the weights
    sum to 2 within 1e-9); w1's arrays stay bit for bit as its last update_wait left them unless final_mix."""
    conns, params = two_nodes("pushsum", 1000)
    try:
        joint_round(conns, params)
        params["w2"][0] += 1.0  # a local step: w2's next push differs from w1's model
        conns["w2"].update_send(params["w2"], 1.0)  # round 2: its push waits in w1's inbox
        wait_until(lambda: conns["w1"].stats()["pushes_received"] == 2, 10, message="w2's second push in")
        seen = params["w1"][0].copy()
        conns["w1"].close(final_mix=final_mix)
        assert conns["w1"].stats()["hand_offs"] == 1
        assert np.array_equal(params["w1"][0], seen) != final_mix
        conns["w2"].update_wait(1.0)  # folds the hand-off in
        assert float(conns["w2"].dpwa_state().extras["weight"]) == pytest.approx(2.0, abs=1e-9)
    finally:
        for c in conns.values():
            c.close()


def test_an_evaluation_file_may_import_its_siblings_and_a_bad_spec_stops_dpwa_run_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = run_dir_of(tmp_path, "run", {"w1": ([4.0, 0.0], 1.0)})
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helpers_for_eval.py").write_text("def first(w):\n    return float(w[0])\n")
    (tmp_path / "sub" / "ev.py").write_text(
        "from helpers_for_eval import first\n\ndef evaluate(state_dict):\n    return first(state_dict['w'])\n"
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["average", "run", "--evaluate", "sub/ev.py:evaluate"])
    assert result.exit_code == 0 and "score: averaged model 4.0000" in result.output, result.output
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    result = CliRunner().invoke(cli, ["average", "run", "--evaluate", "broken.py:evaluate"])
    assert result.exit_code == 2 and "RuntimeError: boom" in result.output and len(result.output.splitlines()) == 1
    (tmp_path / "train.py").write_text("raise SystemExit('never started')\n")
    for spec, message in (("missing.py:evaluate", "no file missing.py"), ("ev_mod:", "expected MODULE:FUNCTION")):
        result = CliRunner().invoke(cli, ["run", "-n", "2", "--run-dir", "r", "--evaluate", spec, "train.py"])
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "r").exists()  # nothing started
    assert run_dir.is_dir()


def test_push_sum_models_saved_after_close_count_every_unit_of_mass_once(tmp_path: Path) -> None:
    """w1 ends first and hands its mass to w2 as it leaves; w2 trains on and ends. Saved after close, the files'
    weights sum to the cluster's mass (2, within 1e-9) whether or not the hand-off was taken, so `dpwa average`
    is push-sum's consensus point (saved before close, w1's mass would count twice: weights summing to ~3)."""
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter
    from dpwa.modelfile import run_models

    ports = free_ports(2)
    config = ClusterConfig(
        nodes=tuple(NodeSpec(f"w{i + 1}", "127.0.0.1", p) for i, p in enumerate(ports)), interpolation="pushsum",
        timeout_ms=1000.0,
    )  # fmt: skip
    models = {name: torch.nn.Linear(1, 1, bias=False) for name in ("w1", "w2")}
    with torch.no_grad():
        models["w1"].weight.fill_(0.0)
        models["w2"].weight.fill_(1.0)
    adapters = {
        name: DpwaPyTorchAdapter(model, name, config, run_dir=tmp_path, seed=i)
        for i, (name, model) in enumerate(models.items())
    }
    try:
        assert all(all(a.wait_for_peers(10.0).values()) for a in adapters.values())

        def steps(name: str, k: int) -> None:
            for _ in range(k):
                adapters[name].update_send(1.0)
                with torch.no_grad():
                    models[name].weight.add_(0.1)  # a local step
                adapters[name].update_wait(1.0)

        threads = [threading.Thread(target=steps, args=(name, 5)) for name in adapters]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        adapters["w1"].close()
        adapters["w1"].save_model()
        steps("w2", 3)  # folds the hand-off, if w1's was taken
        adapters["w2"].close()
        adapters["w2"].save_model()
    finally:
        for adapter in adapters.values():
            adapter.close()
    saved = {m.node: m for m in run_models(tmp_path)}
    weights = {name: m.weight for name, m in saved.items()}
    assert sum(weights.values()) == pytest.approx(2.0, abs=1e-9), weights
    mean = average_models(list(saved.values()))["weight"]
    expected = sum(m.weight * m.arrays["weight"] for m in saved.values()) / 2.0
    assert np.allclose(mean, expected)


def served_exchanges_settled(conn: DpwaConnection) -> bool:
    """No exchange this node served waits for its fetcher's SETTLE (committed ones are mixed at the next wait)."""
    return conn._node.transfer.inbox.slots_in(SlotState.SERVED) == 0


def test_an_adpsgd_node_that_lingers_takes_no_exchange_it_would_never_apply() -> None:
    """w1 ends training and lingers while w2 goes on: w2's exchanges with it are declined (busy), so no half-applied
    exchange moves the pair's sum, which AD-PSGD keeps (1e-12)."""
    conns, params = two_nodes("adpsgd", 10)
    try:
        joint_round(conns, params)
        # the SETTLE of an exchange w1 served may come after the round: w1's next update_wait must find it
        wait_until(lambda: served_exchanges_settled(conns["w1"]), 10, message="w1's served exchange settled")
        params["w1"][0] += 1.0  # w1's last local step
        round_of(conns, params, "w1")
        # and w2's three rounds mix what it served w1 (if w2's snapshot was still unpaired)
        wait_until(lambda: all(map(served_exchanges_settled, conns.values())), 10, message="served exchanges settled")
        assert conns["w1"]._node.transfer.inbox.slots_in(SlotState.COMMITTED) == 0  # all mixed
        closer = threading.Thread(target=lambda: conns["w1"].close(linger=3.0, idle=2.0))
        closer.start()
        wait_until(lambda: conns["w1"]._node.transfer.inbox.closing, 10, message="w1 lingering")
        for _ in range(3):
            round_of(conns, params, "w2")
        closer.join(timeout=30)
        # 0 + 1 at the start, plus w1's local step: every exchange applied on both sides (without the refusal w2
        # applied its half of exchanges w1 took and never mixed: 3.375)
        assert float(params["w1"][0][0] + params["w2"][0][0]) == pytest.approx(2.0, abs=1e-12)
        assert conns["w2"].stats()["fetches_busy"] >= 1 and conns["w2"].stats()["fetches_failed"] == 0
        assert conns["w1"].stats()["exchanges_unmixed"] == 0
    finally:
        for c in conns.values():
            c.close()


@pytest.mark.parametrize("final_mix", [False, True])
def test_an_exchange_committed_after_the_last_update_wait_is_mixed_by_close_with_final_mix(final_mix: bool) -> None:
    """w2 exchanges with w1 after w1's last update_wait (w2 mixed its half: 1 -> 0.5). Closing, w1 mixes its half
    with final_mix (0 -> 0.5: the pair's sum stays 1); without, its arrays stay as the trainer saw them and the
    exchange is counted in exchanges_unmixed."""
    conns, params = two_nodes("adpsgd", 10)
    try:
        round_of(conns, params, "w1")  # publishes w1's snapshot (its own fetch finds w2 not ready)
        round_of(conns, params, "w2")  # fetches w1's snapshot, carrying its own
        assert params["w2"][0][0] == 0.5
        wait_until(lambda: conns["w1"].stats()["exchanges_committed"] == 1, 10, message="w2's commit in")
        conns["w1"].close(final_mix=final_mix)
        assert float(params["w1"][0][0]) == (0.5 if final_mix else 0.0)
        assert conns["w1"].stats()["exchanges_unmixed"] == (0 if final_mix else 1)
    finally:
        for c in conns.values():
            c.close()


@pytest.mark.parametrize("final_mix", [False, True])
def test_a_node_closed_with_its_own_exchange_in_flight_mixes_or_counts_it(final_mix: bool) -> None:
    """w2 (at 1) starts an exchange with w1 (at 0) and closes before its update_wait: the reply comes and is
    committed, so w1 mixes its half at its next wait (0 -> 0.5). w2 waits for its own exchange and mixes its half
    with final_mix (1 -> 0.5: the pair's sum stays 1), or counts it in exchanges_unmixed. Before, without final_mix
    it was neither: the commit went out as the node closed, and the half was lost unseen."""
    conns, params = two_nodes("adpsgd", 10)
    try:
        round_of(conns, params, "w1")  # publishes w1's snapshot (its own fetch finds w2 not ready)
        conns["w2"].update_send(params["w2"], 1.0)  # its exchange with w1, in flight
        conns["w2"].close(final_mix=final_mix)
        assert float(params["w2"][0][0]) == (0.5 if final_mix else 1.0)
        assert conns["w2"].stats()["exchanges_unmixed"] == (0 if final_mix else 1)
        wait_until(lambda: conns["w1"].stats()["exchanges_committed"] == 1, 10, message="w2's commit in")
        round_of(conns, params, "w1")  # mixes its half of w2's exchange
        assert float(params["w1"][0][0]) == 0.5
    finally:
        for c in conns.values():
            c.close()


def test_dpwa_average_of_named_nodes_leaves_other_files_out(tmp_path: Path) -> None:
    run_dir = run_dir_of(tmp_path, "run", {"w1": ([1.0], 1.0), "w2": ([2.0], 1.0), "w3": ([9.0], 1.0)})  # w3: stale
    result = CliRunner().invoke(cli, ["average", str(run_dir), "--node", "w1", "--node", "w2"])
    assert result.exit_code == 0 and read_model(run_dir / AVERAGED_MODEL).arrays["w"].tolist() == [1.5]
    result = CliRunner().invoke(cli, ["average", str(run_dir), "--node", "w4"])
    assert result.exit_code == 2 and "no model file of w4" in result.output
