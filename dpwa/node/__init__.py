"""One gossip node, torch-free: numpy arrays in, numpy arrays mixed in place.

Usage::

    from dpwa.node import DpwaConnection

    with DpwaConnection("w1", "cluster.yaml") as conn:
        for batch in data:
            conn.update_send(params, loss)   # clock += 1; publish a copy of params; maybe start a fetch
            loss = train(batch)              # the trainer changes params in place
            conn.update_wait(loss)           # mix what arrived into params; returns the factor

The modules, by role:

* :mod:`~dpwa.node.connection` -- :class:`DpwaConnection`, the public facade;
* :mod:`~dpwa.node.core` -- the node itself: state, snapshots, one exchange, what its threads call;
* :mod:`~dpwa.node.transport` -- the only owner of ZeroMQ sockets: the RX server and TX fetcher threads;
* :mod:`~dpwa.node.wire` -- encoding, decoding and validating messages (no sockets);
* :mod:`~dpwa.node.snapshots` -- the pool of published snapshot buffers, served zero-copy;
* :mod:`~dpwa.node.peers` -- flow control: scores, down peers, probing;
* :mod:`~dpwa.node.recovery` -- checkpoint state, bootstrap and far-behind catch-up (policy);
* :mod:`~dpwa.node.stats` -- thread-safe counters and log-once.

The rules it mixes with are :mod:`dpwa.rules`; CurveZMQ is :mod:`dpwa.security`.
"""

from dpwa.node.connection import DpwaConnection

__all__ = ["DpwaConnection"]
