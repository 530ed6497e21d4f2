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
* :mod:`~dpwa.node.core` -- the node itself: state, snapshots, the step, what its threads call;
* :mod:`~dpwa.node.transfers` -- how models travel (pull, push, exchange), one class per pattern;
* :mod:`~dpwa.node.serving` -- what the RX thread answers (a FETCH, JOIN / MEMBERS);
* :mod:`~dpwa.node.following` -- the node follows its member table;
* :mod:`~dpwa.node.report` -- what ``stats()`` shows;
* :mod:`~dpwa.node.states` -- every state as an Enum, its transitions and flow-control effects;
* :mod:`~dpwa.node.timeouts` -- every time limit, computed once;
* :mod:`~dpwa.node.transport` -- the only owner of ZeroMQ sockets: the RX and TX threads, the control plane;
* :mod:`~dpwa.node.wiring` -- the node as its transport sees it, and building the transport;
* :mod:`~dpwa.node.contact` -- JOIN, waiting for peers, announcing a leave;
* :mod:`~dpwa.node.wire` -- encoding, decoding and validating messages (no sockets);
* :mod:`~dpwa.node.snapshots` -- the pool of published snapshot buffers, served zero-copy;
* :mod:`~dpwa.node.peers` -- flow control: scores, down peers, probing;
* :mod:`~dpwa.node.recovery` -- checkpoint state, bootstrap and far-behind catch-up (policy);
* :mod:`~dpwa.node.stats` -- thread-safe counters and log-once.

The rules it mixes with are :mod:`dpwa.rules`; CurveZMQ is :mod:`dpwa.security`.
"""

from dpwa.node.connection import DpwaConnection

__all__ = ["DpwaConnection"]
