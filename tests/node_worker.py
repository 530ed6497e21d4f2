"""A dpwa node in its own process, driven line by line over stdin for the integration tests.

Commands (one per line); every command is answered by exactly one JSON line on stdout:
    run N            N rounds of update_send / update_wait with no training   -> {"factors": [...], "wait_ms": [...]}
    params           the current parameters                                    -> {"params": [[...], ...]}
    stats            conn.stats()                                             -> {...}
    quit             close the connection and exit 0                          -> {"closed": true}
At start-up it prints {"ready": endpoint} once the connection is up.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    params = [
        rng.normal(size=(args.size,)).astype(args.dtype),
        rng.normal(size=(3, 7)).astype(args.dtype),
    ]
    conn = DpwaConnection(args.name, args.config, seed=args.seed)

    def run(words: list[str]) -> dict[str, list[float]]:
        factors, waits = [], []
        for _ in range(int(words[0])):
            conn.update_send(params, 1.0)
            t0 = time.monotonic()
            factors.append(conn.update_wait(1.0))
            waits.append((time.monotonic() - t0) * 1000.0)
        return {"factors": factors, "wait_ms": waits}

    return serve(
        {"ready": conn.endpoint},
        {
            "run": run,
            "params": lambda words: {"params": [p.ravel().astype(float).tolist() for p in params]},
            "stats": lambda words: conn.stats(),
        },
        conn.close,
    )


if __name__ == "__main__":
    sys.exit(main())
