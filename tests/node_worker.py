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
import json
import sys
import time

import numpy as np

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

    def answer(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": conn.endpoint})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "run":
            factors, waits = [], []
            for _ in range(int(words[1])):
                conn.update_send(params, 1.0)
                t0 = time.monotonic()
                factors.append(conn.update_wait(1.0))
                waits.append((time.monotonic() - t0) * 1000.0)
            answer({"factors": factors, "wait_ms": waits})
        elif words[0] == "params":
            answer({"params": [p.ravel().astype(float).tolist() for p in params]})
        elif words[0] == "stats":
            answer(conn.stats())
        elif words[0] == "quit":
            conn.close()
            answer({"closed": True})
            return 0
        else:
            answer({"error": f"unknown command {words[0]!r}"})
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
