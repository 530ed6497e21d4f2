"""A dpwa node that trains a toy model in its own process, for the fault and namespace tests.

Each step is ``update_send``, a simulated training step (``--step-ms`` of sleep,
then ``x += drift * (target - x)`` toward a target of its own, so that nodes
that stop talking drift apart), then ``update_wait``. Driven over stdin, one JSON
answer per command on stdout:

    run_for S   train for S seconds -> {"steps": [[t_send, t_end, wait_ms, factor, peer, status], ...]}
                (t_* are time.monotonic(): CLOCK_MONOTONIC, comparable across processes of one machine)
    params      the parameters      -> {"params": [...]}
    stats       conn.stats()
    quit        close and exit 0    -> {"closed": true}

At start-up it prints {"ready": endpoint, "pid": pid} once the connection is up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from worker_loop import serve

from dpwa import DpwaConnection


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--drift", type=float, default=0.0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    params = [rng.normal(size=(args.size,)).astype(np.float32)]
    target = np.random.default_rng(1000 + args.seed).normal(size=(args.size,)).astype(np.float32)
    conn = DpwaConnection(args.name, args.config, seed=args.seed)

    def run_for(seconds: float) -> list[list[object]]:
        steps: list[list[object]] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t_send = time.monotonic()
            conn.update_send(params, 1.0)
            time.sleep(args.step_ms / 1000.0)
            if args.drift:
                params[0] += np.float32(args.drift) * (target - params[0])
            t0 = time.monotonic()
            factor = conn.update_wait(1.0)
            t_end = time.monotonic()
            ex = conn.last_exchange or {}
            steps.append([t_send, t_end, (t_end - t0) * 1000.0, factor, ex.get("peer"), ex.get("status")])
        return steps

    return serve(
        {"ready": conn.endpoint, "pid": os.getpid()},
        {
            "run_for": lambda words: {"steps": run_for(float(words[0]))},
            "params": lambda words: {"params": params[0].astype(float).tolist()},
            "stats": lambda words: conn.stats(),
        },
        conn.close,
    )


if __name__ == "__main__":
    sys.exit(main())
