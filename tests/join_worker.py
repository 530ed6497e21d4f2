"""A node that joins a running cluster (tests/test_membership.py): ``DpwaPyTorchAdapter(model)`` with its identity
from ``dpwa run -n 1 --join`` (DPWA_NODE, DPWA_CONFIG) or from ``DPWA_JOIN`` alone; trains until it sees ``WANT``
members and has mixed 30 times (at most 60 s), then, given a GO file, writes ``ready-<name>`` beside it and
trains on until GO exists (so that no joiner leaves before the others have seen it), prints one ``RESULT``
line, and leaves cleanly.

    python tests/join_worker.py VALUE WANT [GO]
"""

import json
import sys
import time
from pathlib import Path

import torch

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.utils.exiting import exit_now

value, want = float(sys.argv[1]), int(sys.argv[2])
go = Path(sys.argv[3]) if len(sys.argv) > 3 else None
model = torch.nn.Linear(8, 1)
torch.nn.init.constant_(model.weight, value)
torch.nn.init.constant_(model.bias, value)
conn = DpwaPyTorchAdapter(model)
deadline = time.monotonic() + 60
mixed = 0
seen = 0
while time.monotonic() < deadline:
    conn.update_send(1.0)
    time.sleep(0.005)
    mixed += conn.update_wait(1.0) > 0
    seen = max(seen, conn.stats()["members_alive"])
    if seen >= want and mixed >= 30:
        if go is None or go.exists():
            break
        (go.parent / f"ready-{conn.name}").touch()
stats = conn.stats()
result = {
    "name": conn.name,
    "members": sorted(n for n, m in stats["members"].items() if m["state"] == "alive"),
    "seen": seen,
    "mixed": mixed,
    "weight": float(model.weight.detach().mean()),
    "by_peer": stats["by_peer"],
    "last": conn.connection.last_exchange,
}
sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: see tests/engine_worker.py
sys.stdout.flush()
conn.close()
exit_now(0)  # the adapter closed, the result written: no teardown of torch's modules (about 1 s of CPU)
