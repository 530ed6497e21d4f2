"""An unchanged PyTorch training loop that gossips: only the optimizer is wrapped (dpwa.adapters.optimizer).

    dpwa run -n 2 examples/optimizer/train.py --steps 300

Each node starts from its own random weights and fits the same generated regression problem (no download)
on its own draws; ``DpwaOptimizer`` mixes the models after every step, so they end together. The node name
and cluster come from ``dpwa run`` (DPWA_NODE, DPWA_CONFIG). At the end each node reports four fixed random
projections of its parameters (``params_0..3``, to compare the models) and its counters to its metrics file.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
from torch import nn

from dpwa.adapters.optimizer import DpwaOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    node = os.environ.get("DPWA_NODE", "w1")
    seed = zlib.crc32(node.encode())  # a different start per node
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DpwaOptimizer(sgd, model, wait_for_peers_s=30.0)  # start training together with the peer
    target = torch.arange(1.0, 7.0).unsqueeze(1) / 6
    data = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    for _ in range(args.steps):  # the loop any PyTorch user writes
        x = torch.randn(32, 6, generator=data)
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        optimizer.step(loss=loss)
        optimizer.zero_grad()
    params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    probes = torch.randn(4, params.numel(), generator=torch.Generator().manual_seed(0))  # the same on every node
    fingerprint = {f"params_{i}": float(v) for i, v in enumerate(probes @ params)}  # to compare the models
    stats = optimizer.adapter.stats()
    optimizer.adapter.report(final_loss=float(loss), exchanges=optimizer.exchanges, mixes=stats["mixes"], **fingerprint)
    print(f"{node}: loss {float(loss):.4f}, {stats['mixes']} mixes in {optimizer.exchanges} exchanges")
    optimizer.close(linger=2.0, idle=0.5)  # keep serving a peer that is still training, then leave


if __name__ == "__main__":
    main()
