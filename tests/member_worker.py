"""A numpy-only node that joins a running cluster and trains until it is killed (tests/test_membership.py):

    python tests/member_worker.py NAME PORT JOIN_PORT TIMEOUT_MS [INTERPOLATION]

It joins the member at 127.0.0.1:JOIN_PORT as NAME on 127.0.0.1:PORT, prints ``READY`` once joined, and
trains (the two float64 arrays of the tests' trainers, a 4 ms step) for at most 120 s, then leaves cleanly:
a test that means to kill it has that long to do so.
"""

import sys
import time

import numpy as np

from dpwa.config import ClusterConfig, NodeSpec
from dpwa.node.connection import DpwaConnection

name, port, join_port, timeout_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rule = sys.argv[5] if len(sys.argv) > 5 else "constant"
node = NodeSpec(name, "127.0.0.1", port)
config = ClusterConfig(nodes=(node,), join=f"127.0.0.1:{join_port}", timeout_ms=timeout_ms, interpolation=rule)
conn = DpwaConnection(name, config)
sys.stdout.write("READY\n")
sys.stdout.flush()
params = [np.zeros(64), np.zeros((3, 3))]  # the layout of tests/test_membership.py's trainers
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    conn.update_send(params, 1.0)
    time.sleep(0.004)
    conn.update_wait(1.0)
conn.close()
