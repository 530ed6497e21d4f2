"""One real node training a simulator's problem: ``dpwa run CLUSTER path/to/worker.py --model logistic ...``.

Node ``i`` (its index in the cluster file) trains :func:`~dpwa.tools.sim.problems.make_problem`'s model on its own
shard with its own batch stream -- the very draws the simulator's node ``i`` makes -- around a
:class:`~dpwa.DpwaConnection` (numpy, no torch): ``update_send``, the local step at the cosine rate, a sleep up to
``--step-ms`` (the compute a real step would take), ``update_wait``. Every step's record (the connection's
``last_exchange`` with ``time``, ``loss``, ``compute_ms`` and ``sent_at``, the time of its ``update_send``) goes to
``<run_dir>/<node>.metrics.jsonl``; the parameters every ``--record-every`` steps to
``<run_dir>/<node>.params.npz``, for :mod:`dpwa.tools.sim.validation` to compare with a simulation of the same run."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from dpwa import DpwaConnection
from dpwa.config import load_config
from dpwa.metrics import MetricsWriter
from dpwa.tools.sim.problems import MODELS, make_problem

__all__ = ["PARAMS_SUFFIX", "main"]

PARAMS_SUFFIX = ".params.npz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="logistic")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--record-every", type=int, default=10)
    args = parser.parse_args(argv)
    name, config_path = os.environ["DPWA_NODE"], os.environ["DPWA_CONFIG"]
    run_dir = Path(os.environ.get("DPWA_RUN_DIR", "."))
    names = [node.name for node in load_config(config_path).nodes]
    index = names.index(name)
    problem = make_problem(args.model, len(names), args.partition, args.seed, args.batch_size)
    lr = args.lr if args.lr is not None else problem.default_lr
    flat = problem.initial().astype(np.float32)
    arrays = problem.views(flat)
    recorded: dict[str, np.ndarray] = {}
    loss = float("nan")
    conn = DpwaConnection(name, config_path, seed=args.seed * 1000 + index)
    try:
        with MetricsWriter(run_dir / f"{name}.metrics.jsonl") as metrics:
            conn.wait_for_peers(30.0)
            for k in range(args.steps):
                sent_at = time.time()
                conn.update_send(arrays, 0.0 if math.isnan(loss) else loss)
                started = time.perf_counter()
                step_lr = np.float32(0.5 * lr * (1.0 + math.cos(math.pi * k / args.steps)))
                loss = problem.step(index, flat, float(step_lr))
                left = args.step_ms / 1000.0 - (time.perf_counter() - started)
                if left > 0:
                    time.sleep(left)
                compute_ms = 1000.0 * (time.perf_counter() - started)
                conn.update_wait(loss)
                if (k + 1) % args.record_every == 0 or k + 1 == args.steps:
                    recorded[str(k + 1)] = flat.copy()
                exchange = dict(conn.last_exchange or {})
                metrics.write({**exchange, "time": time.time(), "node": name, "step": k + 1, "loss": float(loss),
                               "compute_ms": compute_ms, "sent_at": sent_at})  # fmt: skip
    finally:
        conn.close()
    np.savez(run_dir / f"{name}{PARAMS_SUFFIX}", **recorded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
