"""The demo's MomentumSGD: torch's SGD bit for bit, checkpoints interchangeable with it, and no torch._dynamo.

torch's ``torch.optim.SGD`` (the reference) and :class:`~dpwa.tools.demo.MomentumSGD` train the demo's model on the
same batches with the demo's changing learning rate; their parameters and momentum buffers must be equal, element
for element (``torch.equal``), not close. Then a state saved from one, through the checkpoint's own conversion
(``optimizer_parts``), resumes in the other exactly where an uninterrupted run would be.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import free_ports

from dpwa.adapters.torch_state import load_optimizer_parts, optimizer_parts
from dpwa.tools import demo
from dpwa.tools.demo import MomentumSGD

STEPS = 40
CONFIG = demo.TrainConfig(steps=STEPS, lr=0.1)  # the demo's settings (momentum 0.9) at a short schedule
DATA = demo.make_dataset(CONFIG.seed, CONFIG.data)
INDICES = demo.node_indices(CONFIG, DATA, 0, 2)


def torch_sgd(model: torch.nn.Module, config: demo.TrainConfig) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)


def ours(model: torch.nn.Module, config: demo.TrainConfig) -> MomentumSGD:
    return MomentumSGD(model.parameters(), lr=config.lr, momentum=config.momentum)


Make = Callable[[torch.nn.Module, demo.TrainConfig], demo.OptimizerLike]


def trained(make: Make, config: demo.TrainConfig) -> tuple[torch.nn.Module, demo.OptimizerLike]:
    """The demo's model and ``make``'s optimizer after the demo's ``config.steps`` steps."""
    model = demo.build_model(config)
    optimizer = make(model, config)
    demo.train(model, optimizer, DATA, INDICES, config, config.steps, (config.seed, 1), demo.NoExchange(0))
    return model, optimizer


def buffers(optimizer: demo.OptimizerLike, model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [optimizer.state.get(p, {}).get("momentum_buffer") for p in model.parameters()]


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name}: largest difference {(x - y).abs().max().item():.3g}"


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_momentum_sgd_steps_exactly_as_torchs_sgd(momentum: float) -> None:
    config = demo.TrainConfig(steps=STEPS, lr=0.1, momentum=momentum)
    reference, reference_optimizer = trained(torch_sgd, config)
    model, optimizer = trained(ours, config)
    assert_same(model, reference)
    assert not torch.equal(next(model.parameters()), next(demo.build_model(config).parameters()))  # it trained
    for mine, theirs in zip(buffers(optimizer, model), buffers(reference_optimizer, reference)):
        if momentum == 0:
            assert mine is None and theirs is None
        else:
            assert mine is not None and theirs is not None and torch.equal(mine, theirs)


def test_a_parameter_without_a_gradient_is_left_alone_and_zero_grad_in_place_matches_torch() -> None:
    models = [demo.build_model(CONFIG) for _ in range(2)]
    optimizers = [torch_sgd(models[0], CONFIG), ours(models[1], CONFIG)]
    batch = next(demo.BatchStream(INDICES, CONFIG.batch_size, (CONFIG.seed, 1)))
    for model, optimizer in zip(models, optimizers):
        for _ in range(2):
            optimizer.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(model(DATA.x_train[batch]), DATA.y_train[batch])
            loss.backward()
            model[0].bias.grad = None  # never gets a gradient: neither stepped nor given a momentum buffer
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    assert_same(models[1], models[0])
    assert torch.equal(models[1][0].bias, demo.build_model(CONFIG)[0].bias)
    assert models[1][0].bias not in optimizers[1].state and models[0][0].bias not in optimizers[0].state
    for mine, theirs in zip(models[1].parameters(), models[0].parameters()):
        assert (mine.grad is None) == (theirs.grad is None)
        assert mine.grad is None or (not mine.grad.any() and not mine.grad.requires_grad)


def resumed(make_first: Make, make_second: Make, at: int) -> torch.nn.Module:
    """``at`` steps (a schedule of ``at``) with ``make_first``'s optimizer, its state through a checkpoint's
    conversion into ``make_second``'s (and the model's into a fresh model), then steps ``at+1 .. STEPS`` of a STEPS
    schedule with that one."""
    first_model = demo.build_model(CONFIG)
    first = make_first(first_model, CONFIG)
    demo.train(first_model, first, DATA, INDICES, CONFIG, at, (CONFIG.seed, 1), demo.NoExchange(0))
    arrays, meta = optimizer_parts(first)
    model = demo.build_model(CONFIG)
    model.load_state_dict(first_model.state_dict())
    second = make_second(model, CONFIG)
    load_optimizer_parts(second, arrays, meta)
    demo.train(model, second, DATA, INDICES, CONFIG, STEPS, (CONFIG.seed, 1), demo.NoExchange(at), start_step=at)
    return model


def whole_run(at: int) -> torch.nn.Module:
    """What :func:`resumed` computes, with torch's optimizer throughout and no hand-over."""
    model = demo.build_model(CONFIG)
    optimizer = torch_sgd(model, CONFIG)
    demo.train(model, optimizer, DATA, INDICES, CONFIG, at, (CONFIG.seed, 1), demo.NoExchange(0))
    demo.train(model, optimizer, DATA, INDICES, CONFIG, STEPS, (CONFIG.seed, 1), demo.NoExchange(at), start_step=at)
    return model


@pytest.mark.parametrize(("first", "second"), [(ours, torch_sgd), (torch_sgd, ours), (ours, ours)])
def test_a_checkpointed_state_resumes_in_either_optimizer_exactly(first: Make, second: Make) -> None:
    expected = whole_run(15)
    assert_same(resumed(first, second, 15), expected)


def test_a_state_that_does_not_fit_is_refused() -> None:
    model, optimizer = trained(ours, CONFIG)
    state = optimizer.state_dict()
    other = demo.build_model(demo.TrainConfig(hidden=CONFIG.hidden + 1))
    with pytest.raises(ValueError, match="shape"):
        MomentumSGD(other.parameters(), lr=0.1, momentum=0.9).load_state_dict(state)
    with pytest.raises(ValueError, match="groups of"):
        MomentumSGD(list(model.parameters())[:2], lr=0.1, momentum=0.9).load_state_dict(state)
    nesterov = {**state, "param_groups": [{**state["param_groups"][0], "nesterov": True}]}
    with pytest.raises(ValueError, match="nesterov"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(nesterov)
    stray = {**state, "state": {**state["state"], 99: state["state"][0]}}
    with pytest.raises(ValueError, match="99"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(stray)
    rmsprop = torch.optim.RMSprop(model.parameters(), lr=0.01)  # momentum 0, and settings of its own
    with pytest.raises(ValueError, match="alpha"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(rmsprop.state_dict())
    extra = {**state, "state": {0: {**state["state"][0], "square_avg": state["state"][0]["momentum_buffer"]}}}
    with pytest.raises(ValueError, match="square_avg"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(extra)
    no_lr = {**state, "param_groups": [{k: v for k, v in state["param_groups"][0].items() if k != "lr"}]}
    with pytest.raises(ValueError, match="lr"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(no_lr)
    kept = MomentumSGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError):
        kept.load_state_dict(nesterov)
    assert kept.state == {} and kept.param_groups[0]["lr"] == 0.1  # a refused state changed nothing
    foreach_off = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)  # the same arithmetic
    kept.load_state_dict(foreach_off.state_dict())
    with pytest.raises(ValueError, match="momentum"):
        MomentumSGD(model.parameters(), lr=0.1, momentum=1.0)


NO_DYNAMO = """
import sys
from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.config import ClusterConfig, NodeSpec
from dpwa.tools import demo

config = demo.TrainConfig(steps=5)
data = demo.make_dataset(config.seed, config.data)
model = demo.build_model(config)
optimizer = demo.make_optimizer(model, config)
cluster = ClusterConfig(nodes=(NodeSpec("w1", "127.0.0.1", int(sys.argv[1])),))
with DpwaPyTorchAdapter(model, "w1", cluster, optimizer=optimizer) as conn:
    demo.train(model, optimizer, data, demo.node_indices(config, data, 0, 1), config, 5, (0, 1), conn)
    conn.save_checkpoint(sys.argv[2])
demo.evaluate(model, data.x_test, data.y_test)
assert "torch._dynamo" not in sys.modules, "the demo's node imported torch._dynamo"
import torch
torch.optim.SGD(model.parameters(), lr=0.1)  # the control: torch's optimizer does import it, and the check sees it
assert "torch._dynamo" in sys.modules, "the control did not import torch._dynamo"
print("ok")
"""


@pytest.mark.integration
def test_a_demo_node_never_imports_torch_dynamo(tmp_path: Path) -> None:
    """The demo's steps through a one-node adapter, a checkpoint and the evaluation, in a fresh interpreter."""
    argv = [sys.executable, "-c", NO_DYNAMO, str(free_ports(1)[0]), str(tmp_path / "w1.ckpt.npz")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
