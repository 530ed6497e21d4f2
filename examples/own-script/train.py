"""Your own training script under dpwa, start to finish: rank and shard, DpwaOptimizer, report, save, average.

    dpwa run -n 4 --run-dir runs/mine examples/own-script/train.py --steps 1500
    dpwa run -n 1 --run-dir runs/one examples/own-script/train.py --steps 6000       # the baseline: all data
    dpwa average runs/mine --evaluate examples/own-script/train.py:evaluate --baseline runs/one

Every node loads the same data set (here a generated 10-class problem, the built-in demo's: no download; put
your own in ``load_data``) and trains on its own part of it, ``dpwa.shard``; ``DpwaOptimizer`` wraps the
optimizer so that the training loop stays as it is; the learning rate follows ``progress`` (the furthest node's
step), so the nodes finish with the same step size; each node reports its held-out accuracy and saves its model;
``dpwa average`` averages the saved models and calls :func:`evaluate` on the average, beside every node's and the
one-process baseline's. With ``-n 4 --steps S`` against ``-n 1 --steps 4S`` both see the same number of samples.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torch import nn

import dpwa
from dpwa.adapters.optimizer import DpwaOptimizer
from dpwa.tools.mixture import DataSpec, gaussian_mixture

BATCH = 32


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): the same on every node (a fixed seed)."""
    data = gaussian_mixture(0, DataSpec())
    return tuple(torch.from_numpy(a) for a in (data.x_train, data.y_train, data.x_test, data.y_test))  # type: ignore[return-value]


def build_model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every node
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def evaluate(state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
    """Held-out accuracy and loss of a model's state dict (what ``dpwa average --evaluate`` calls)."""
    model = build_model()
    model.load_state_dict(state_dict)
    _, _, x_test, y_test = load_data()
    with torch.no_grad():
        logits = model(x_test)
    accuracy = float((logits.argmax(1) == y_test).float().mean())
    return {"accuracy": accuracy, "loss": float(nn.functional.cross_entropy(logits, y_test))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--partition", default="iid", help="iid | dirichlet:ALPHA | classes:K")
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_data()
    mine = dpwa.shard(len(y_train), args.partition, labels=y_train.numpy(), seed=0)  # this node's part
    print(f"node {dpwa.node_name()}: rank {dpwa.rank()} of {dpwa.world_size()}, {mine.size} samples", flush=True)

    model = build_model()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DpwaOptimizer(sgd, model, wait_for_peers_s=30.0)  # node and cluster from `dpwa run`
    schedule = torch.optim.lr_scheduler.LambdaLR(
        sgd, lambda _: 0.5 * (1 + math.cos(math.pi * min(optimizer.adapter.progress, args.steps) / args.steps))
    )
    order = np.random.default_rng(dpwa.rank())
    for _ in range(args.steps):
        batch = torch.from_numpy(order.choice(mine, BATCH, replace=False))
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        loss.backward()
        optimizer.step(loss=loss)
        optimizer.zero_grad()
        schedule.step()
    optimizer.finish()  # mix what the last step's exchange brought
    figures = evaluate(model.state_dict())
    optimizer.adapter.report(**figures, steps=args.steps)
    optimizer.close(linger=5.0)  # serve peers still training, then leave
    optimizer.save_model()  # <run_dir>/<node>.model.npz, for `dpwa average`


if __name__ == "__main__":
    main()
