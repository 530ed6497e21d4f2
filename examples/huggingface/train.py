"""A Hugging Face ``Trainer`` run that gossips: only a callback is added (dpwa.adapters.huggingface).

    dpwa run -n 2 examples/huggingface/train.py --steps 200

The model is built in code (a small MLP returning ``{"loss", "logits"}`` as Trainer models do; nothing is
downloaded) and fits one generated regression problem (the same data set on every node), each node on its own shard (the
callback replaces the Trainer's sampler with one over this node's part) from its own random start.
``trainer_state.json`` in ``<run_dir>/hf/<node>/`` has ``dpwa/factor``, ``dpwa/fetch_ms``, ... beside every
logged loss. At the end each node reports four fixed random projections of its parameters (``params_0..3``,
to compare the models) to its metrics file.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import dpwa
from dpwa.adapters.huggingface import DpwaTrainerCallback


class Regression(nn.Module):
    """y = x @ w with an MLP; ``forward(x, labels)`` returns the loss as a Trainer model does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = nn.functional.mse_loss(out, labels)
        return result


class Report(TrainerCallback):
    """Before the gossip callback closes the node: report a fingerprint of the model."""

    def __init__(self, gossip: DpwaTrainerCallback) -> None:
        self.gossip = gossip

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step < state.max_steps or self.gossip.adapter is None or self.gossip.exchange is None:
            return
        params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        probes = torch.randn(4, params.numel(), generator=torch.Generator().manual_seed(0))
        self.gossip.adapter.report(
            exchanges=self.gossip.exchange.exchanges,
            mixes=self.gossip.adapter.stats()["mixes"],
            **{f"params_{i}": float(v) for i, v in enumerate(probes @ params)},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    node = os.environ.get("DPWA_NODE", "w1")
    seed = zlib.crc32(node.encode())
    torch.manual_seed(seed)
    x = torch.randn(32 * args.steps * dpwa.world_size(), 6, generator=torch.Generator().manual_seed(0))
    y = x @ (torch.arange(1.0, 7.0).unsqueeze(1) / 6)
    data = [{"x": xi, "labels": yi} for xi, yi in zip(x, y)]
    gossip = DpwaTrainerCallback(wait_for_peers_s=30.0)  # start training together with the peer
    training = TrainingArguments(
        output_dir=os.path.join(os.environ.get("DPWA_RUN_DIR", "."), "hf", node),
        max_steps=args.steps,
        per_device_train_batch_size=32,
        learning_rate=args.lr,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=seed % 2**31,
    )
    trainer = Trainer(model=Regression(), args=training, train_dataset=data, callbacks=[gossip])
    trainer.add_callback(Report(gossip))  # runs after the gossip callback's on_step_end
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
