"""One node of the network consensus-point test, run by ``dpwa run CLUSTER quadratic_worker.py ...``.

Node ``i`` (its index in the cluster file) minimizes ``f_i(x) = 1/2 ||x - c_i||^2``, the centres ``c``
drawn from ``--seed`` (the same on every node): between update_send and update_wait the local step
``x <- x - eta_t * (x - c_i)``, ``eta_t = eta0 / (1 + t / T)``. At the end it writes
``<run dir>/<node>.x.json``: ``x`` (before close), the centres, and the rule's last record. After its last step it
keeps serving its peers until they stop fetching (``close(linger=...)``), as a real run's nodes do.
No torch: the node and the arithmetic are numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dpwa import DpwaConnection
from dpwa.config import load_config

LINGER_S = 10.0
LINGER_IDLE_S = 0.5


def centres(n_nodes: int, dim: int, seed: int) -> np.ndarray:
    """The nodes' centres: standard normal, one row per node."""
    return np.random.default_rng(seed).normal(size=(n_nodes, dim))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=3)
    parser.add_argument("--eta0", type=float, default=0.5)
    parser.add_argument("--decay-steps", type=float, default=20.0)
    parser.add_argument("--step-ms", type=float, default=0.0, help="a step's compute time (a sleep)")
    args = parser.parse_args()

    name, config_path = os.environ["DPWA_NODE"], os.environ["DPWA_CONFIG"]
    run_dir = Path(os.environ.get("DPWA_RUN_DIR", "."))
    names = [node.name for node in load_config(config_path).nodes]
    index = names.index(name)
    c = centres(len(names), args.dim, args.seed)
    x = np.zeros(args.dim, np.float32)
    conn = DpwaConnection(name, config_path, seed=args.seed * 1000 + index)
    try:
        conn.wait_for_peers(30.0)  # the nodes start training together (a short run, else partly alone)
        for t in range(args.steps):
            loss = 0.5 * float(np.sum((x - c[index]) ** 2))
            conn.update_send([x], loss)
            eta = args.eta0 / (1.0 + t / args.decay_steps)
            x -= np.float32(eta) * (x - c[index].astype(np.float32))
            if args.step_ms > 0:
                time.sleep(args.step_ms / 1000.0)  # the time a real step computes: exchanges overlap it
            conn.update_wait(loss)
        record = dict(conn.last_exchange or {})
        out = {"x": x.astype(float).tolist(), "centres": c.tolist(), "index": index, "record": record}
    finally:
        # serve the peers still training for up to LINGER_S (until nobody fetched for LINGER_IDLE_S): a node that
        # steps slower than the others would otherwise train its last steps alone, pulled to its own centre
        conn.close(linger=LINGER_S, idle=LINGER_IDLE_S)
    (run_dir / f"{name}.x.json").write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
