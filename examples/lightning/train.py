"""A PyTorch Lightning training that gossips: only a callback is added (dpwa.adapters.lightning).

    dpwa run -n 2 examples/lightning/train.py --steps 200

Each node starts from its own random weights and fits one generated regression problem (no download, the same
data set on every node) on its own shard: the callback puts a sampler over this node's part in place, so with
``dpwa.world_size()`` nodes each trains one epoch of ``--steps`` batches on a disjoint part. Lightning logs
``dpwa/factor``, ``dpwa/fetch_ms``, ... with the loss (a CSV log in the node's
run directory, ``<run_dir>/lightning/<node>/``). At the end each node reports four fixed random projections of
its parameters (``params_0..3``, to compare the models) to its metrics file.
"""

from __future__ import annotations

import argparse
import logging
import os
import zlib

import lightning
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpwa
from dpwa.adapters.lightning import DpwaCallback


class Regression(lightning.LightningModule):
    """A small MLP fitting y = x @ w."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_end(self) -> None:
        (gossip,) = [c for c in self.trainer.callbacks if isinstance(c, DpwaCallback)]
        params = torch.nn.utils.parameters_to_vector(self.parameters()).detach()
        probes = torch.randn(4, params.numel(), generator=torch.Generator().manual_seed(0))  # the same everywhere
        assert gossip.adapter is not None and gossip.exchange is not None
        gossip.adapter.report(
            exchanges=gossip.exchange.exchanges,
            mixes=gossip.adapter.stats()["mixes"],
            **{f"params_{i}": float(v) for i, v in enumerate(probes @ params)},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.WARNING)
    node = os.environ.get("DPWA_NODE", "w1")
    seed = zlib.crc32(node.encode())
    torch.manual_seed(seed)
    x = torch.randn(32 * args.steps * dpwa.world_size(), 6, generator=torch.Generator().manual_seed(0))
    y = x @ (torch.arange(1.0, 7.0).unsqueeze(1) / 6)
    data = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)  # the callback makes it this node's shard
    run_dir = os.environ.get("DPWA_RUN_DIR", ".")
    trainer = lightning.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(os.path.join(run_dir, "lightning"), name=node, version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DpwaCallback(wait_for_peers_s=30.0)],  # start training together with the peer
    )
    trainer.fit(Regression(args.lr), data)


if __name__ == "__main__":
    main()
