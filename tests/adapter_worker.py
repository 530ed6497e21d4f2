"""A DpwaPyTorchAdapter training a small model in its own process, driven line by line over stdin.

    python adapter_worker.py --name w1 --config c.yaml --seed 1 --data 1

At start-up it prints {"ready": endpoint}. Commands (one per line), each answered by one JSON line:
    train N     N steps of real training on this node's own data, gossiping around every step
                -> {"steps": N, "mixed": number of steps with factor > 0, "loss": last loss}
    state       the model's floating state (parameters and BatchNorm statistics) -> {"state": {name: [...]}}
    stats       adapter.stats()
    quit        close the adapter and exit 0 -> {"closed": true}

The model, data and training step are importable, so a test can train the same model alone.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from worker_loop import serve

from dpwa.tools.demo.sgd import MomentumSGD, OptimizerLike
from dpwa.utils.exiting import exit_now

IN_FEATURES = 8


def make_model(seed: int) -> nn.Module:
    """A small MLP with BatchNorm, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


class NodeData:
    """Node ``index``'s own regression task: y = x @ w_index + noise, a fresh batch per step."""

    def __init__(self, index: int, batch: int = 32) -> None:
        self.generator = torch.Generator().manual_seed(1000 + index)
        self.weights = torch.randn(IN_FEATURES, 1, generator=self.generator)
        self.batch = batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch, IN_FEATURES, generator=self.generator)
        noise = 0.1 * torch.randn(self.batch, 1, generator=self.generator)
        return x, x @ self.weights + noise


def make_optimizer(model: nn.Module) -> MomentumSGD:
    """Plain SGD with a small step: two gossiping nodes then stay within about one step of each other (the demo's
    SGD, torch's bit for bit without the torch._dynamo import torch's optimizer costs a process)."""
    return MomentumSGD(model.parameters(), lr=0.005)


def train_step(model: nn.Module, optimizer: OptimizerLike, data: NodeData) -> torch.Tensor:
    """One SGD step on the next batch; returns the loss as a 0-dim tensor."""
    x, y = data.next()
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def floating_state(model: nn.Module) -> dict[str, list[float]]:
    """Every floating tensor of the state dict, flattened."""
    return {k: v.detach().reshape(-1).double().tolist() for k, v in model.state_dict().items() if v.is_floating_point()}


def main() -> int:
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    model = make_model(args.seed)
    optimizer = make_optimizer(model)
    data = NodeData(args.data)
    adapter = DpwaPyTorchAdapter(model, args.name, args.config, seed=args.seed)

    loss = torch.tensor(1.0)

    def train(words: list[str]) -> dict[str, float]:
        nonlocal loss
        steps, mixed = int(words[0]), 0
        for _ in range(steps):
            adapter.update_send(loss)
            loss = train_step(model, optimizer, data)
            mixed += adapter.update_wait(loss) > 0.0
        return {"steps": steps, "mixed": mixed, "loss": loss.item()}

    return serve(
        {"ready": adapter.connection.endpoint},
        {
            "train": train,
            "state": lambda words: {"state": floating_state(model)},
            "stats": lambda words: adapter.stats(),
        },
        adapter.close,
    )


if __name__ == "__main__":
    exit_now(main())  # its adapter closed: no teardown of torch's modules (about 1 s of CPU)
