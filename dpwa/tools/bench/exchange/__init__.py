"""``dpwa bench exchange``: one exchange of a model through dpwa against what the transport allows.

Two local processes: this one (the *trainer*) and a peer started as
``python -m dpwa.tools.bench.exchange peer ENDPOINT PARENT_PID``, driven over a ZeroMQ PAIR control
socket. For every model size (``--floats``) and in the same run, interleaved round
by round, medians over ``--repeat`` rounds of:

* ``memcpy``: ``np.copyto`` of the model's bytes -- the trainer-side reference;
* (a) ``raw``: one zero-copy pyzmq frame of the model's float32 bytes fetched over
  loopback TCP into a preallocated buffer -- the transport's limit: what moving the
  bytes costs with no framing at all; and (a2) ``raw chunked``: the same bytes as one zero-copy message per
  4 MiB chunk (dpwa's framing, without validation), each received into its place;
* (b) ``dpwa``, per ``--wire-dtype``: the peer publishes a fresh snapshot (untimed,
  and rounded into its wire dtype -- ``peer ready ms``, the serving side's
  cost, spent during its step in training), then
  ``update_send`` (its duration), the fetch
  (``last_exchange["fetch_ms"]``, validation included), the mix
  (``last_exchange["mix_ms"]``); then, with a simulated step of ``--step-factor`` x
  the fetch between ``update_send`` and ``update_wait`` (``--step sleep``, or
  ``busy``: one thread computing numpy ``exp``, which takes one of the cores the
  exchange would use), how long ``update_wait`` waited for the fetch (``wait_ms``);
* (c) ``gloo``: ``torch.distributed.all_reduce`` of the same float32 tensor across
  the two processes (skipped when torch is missing);
* (d) ``push`` (float32 wire, in the float32 row): a second pair of nodes running ``pushsum``;
  ``(push+fold)/(fetch+mix)`` compares it with (b) float32, round by round;
* ``float32+shm``: (b) once more between nodes with shared memory on (every other pair has it off): the fetch
  reads the peer's segment; ``(fetch+mix)/memcpy`` is its target. With it, (d) once more between co-located
  nodes (the push names the pusher's segment): ``(push+fold)/memcpy``.

After the timed rows, the memory rows (:mod:`~dpwa.tools.bench.exchange.memory`, ``--no-memory`` skips them):
per rule, what a node adds beside its model at the largest size, in model sizes.

The table shows absolute figures (medians) and the ratios checked against
``TARGETS`` (per round, then the median: a round takes about a second, so load from
other jobs that changes between rounds cancels out) with a check mark:
informational, never a test. JSON goes to ``<run dir>/exchange.json``,
a bar chart to ``exchange.png`` with ``--plot``.

The peer exits when told to, when this process goes away, or after
:data:`~dpwa.tools.bench.exchange.control.PEER_IDLE_S` without a command; this process stops it (SIGTERM,
then SIGKILL) whatever happens, Ctrl-C included.

The modules, one concept each:

* :mod:`~dpwa.tools.bench.exchange.command` -- the click command, its options and :func:`run_exchange`;
* :mod:`~dpwa.tools.bench.exchange.measure` -- one model size: both sides set up, warm-up, the timed rounds;
* :mod:`~dpwa.tools.bench.exchange.table` -- a row's figures and ratios, ``TARGETS``, the two tables;
* :mod:`~dpwa.tools.bench.exchange.plot` -- the bar chart of ``--plot``;
* :mod:`~dpwa.tools.bench.exchange.memory` -- the memory rows: what a node adds beside its model, per rule;
* :mod:`~dpwa.tools.bench.exchange.control` -- the control channel and the trainer's handle on the peer;
* :mod:`~dpwa.tools.bench.exchange.peer` -- the peer process: its commands and what it holds per size;
* :mod:`~dpwa.tools.bench.exchange.pair` -- the model and the cluster file both sides build;
* one module per measurement family, each with both of its sides: :mod:`~dpwa.tools.bench.exchange.raw`
  (a, a2), :mod:`~dpwa.tools.bench.exchange.fetch` (b), :mod:`~dpwa.tools.bench.exchange.overlap` (the
  simulated step), :mod:`~dpwa.tools.bench.exchange.gloo` (c), :mod:`~dpwa.tools.bench.exchange.push` (d).

A new measurement is a module of its own with its trainer side (set up in ``measure._Size``, timed as one
more task of ``measure._Rounds``), its peer side (a command in ``peer``), and its columns in ``table``.
"""

from dpwa.tools.bench.exchange.command import WIRE_DTYPES, exchange, parse_count, run_exchange
from dpwa.tools.bench.exchange.control import STOP_GRACE_S
from dpwa.tools.bench.exchange.peer import peer_main

# STOP_GRACE_S: whoever stops the benchmark bounds its wait by it (the peer gets "quit", SIGTERM, then SIGKILL,
# this far apart).
__all__ = ["STOP_GRACE_S", "WIRE_DTYPES", "exchange", "parse_count", "peer_main", "run_exchange"]
