"""A worker of the engine tests (SLURM, torchrun, PyTorchJob): ``DpwaPyTorchAdapter(model)`` with no name and
no file, so the engine's variables give the node list; 40 steps once every peer is bound; one ``RESULT`` line.

    python tests/engine_worker.py [FAIL_UNTIL]   # rank 1 exits 3 while TORCHELASTIC_RESTART_COUNT < FAIL_UNTIL
"""

import json
import os
import socket
import sys
import time

import torch

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.utils.exiting import exit_now

rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])
model = torch.nn.Linear(8, 1)
torch.nn.init.constant_(model.weight, float(rank))
conn = DpwaPyTorchAdapter(model)
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if restart < int(sys.argv[1] if len(sys.argv) > 1 else 0) and rank == 1:
    sys.exit(3)  # a failure TorchElastic answers by restarting every worker
deadline = time.monotonic() + 60
for peer in conn.connection.config.peers_of(conn.name):  # train once every peer is bound
    while True:
        try:
            socket.create_connection((peer.host, peer.port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"{peer.name} never bound"
            time.sleep(0.02)
mixed = 0
for _ in range(40):
    conn.update_send(1.0)
    time.sleep(0.005)
    mixed += conn.update_wait(1.0) > 0
nodes = [n.name for n in conn.connection.config.nodes]
result = {"name": conn.name, "rank": rank, "restart": restart, "mixed": mixed, "nodes": nodes}
# One write of the whole line: torchrun's and srun's workers share one pipe, and under PYTHONUNBUFFERED (set
# on this machine) print() issues the text and its newline as two write(2) calls, between which another
# worker's line can land (seen once: two results on one line).
sys.stdout.write("RESULT " + json.dumps(result) + "\n")
sys.stdout.flush()
conn.close(linger=2.0, idle=0.5)
exit_now(0)  # the adapter closed, the result written: no teardown of torch's modules (about 1 s of CPU)
