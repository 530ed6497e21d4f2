"""The built-in demo job of ``dpwa run`` (no SCRIPT): gossip-train a small classifier on generated data.

Node mode (``dpwa run`` starts one per node; name, cluster file and run directory come from
``DPWA_NODE`` / ``DPWA_CONFIG`` / ``DPWA_RUN_DIR``, torch threads from ``DPWA_TORCH_THREADS``)::

    python -m dpwa.tools.demo [--steps N] [--batch-size B] [--lr LR] [--momentum M] [--seed S] [--partition P]

Evaluation mode (after the nodes are done)::

    python -m dpwa.tools.demo --evaluate RUN_DIR

Both log to stderr at ``DPWA_LOG_LEVEL`` (default INFO); ``--evaluate`` prints its result on stdout.

The data (:mod:`~dpwa.tools.demo.data`)
    A 10-class Gaussian mixture in 32 features, generated from ``--seed`` (no download): every
    class owns 4 random centres, a sample is a centre plus Gaussian noise (features have unit
    variance).  Classes overlap: the Bayes-optimal classifier scores 94-95% on the held-out split
    (seeds 0-3), a linear model about 60%, the demo's MLP about 92% with the defaults.  40,000
    training and 10,000 held-out samples.

The shards (:mod:`~dpwa.tools.demo.data`)
    ``--partition`` (default ``iid``) splits the training set between the nodes; node ``i`` of ``n`` is
    its index in the cluster file's ``nodes``. ``iid``: samples ``i, i+n, i+2n, ...`` (a random shard:
    the samples are in random order); ``dirichlet:ALPHA``: class proportions drawn per node from
    ``Dir(ALPHA * p)`` (0.1: one or two classes dominate each node); ``classes:K``: ``K`` classes per
    node (:mod:`dpwa.utils.partition`). Shards are disjoint: no two nodes train on the same sample.
    Each node writes its class histogram to ``<run_dir>/<node>.data.json``.

The node (:mod:`~dpwa.tools.demo.training`, :mod:`~dpwa.tools.demo.node`)
    The same 32-64-64-10 ReLU MLP everywhere (same seed, so every node starts from the same
    weights), SGD with momentum 0.9 (``--momentum``; :mod:`~dpwa.tools.demo.sgd`: torch's SGD bit for bit,
    without the 2 s of CPU torch's optimizer class costs a process at its first use) and a cosine
    learning-rate decay over
    ``--steps``, indexed by ``adapter.progress``: the node's own step, or the furthest node's if one is
    ahead. Asynchronous nodes drift apart (100-250 steps of 3,000 on 2 shared cores); indexed by its own
    step, a node that lags takes steps several times larger than its peers' near the end, and with data
    split by class its classes win the final average (2-14 points lost on ``classes:3``).
    Before the first batch it waits (at most ``PEERS_WAIT_S``) until every peer's node
    is up, so that nodes started together also start training together.  Around every batch:
    ``update_send(previous loss)``, one SGD step, ``update_wait(loss)``.  At the end
    it reports its own held-out accuracy (``conn.report(accuracy=..., final_loss=...)``), writes
    ``<run_dir>/<node>.model.npz`` (parameters, buffers and a ``__meta__`` JSON string; no pickle;
    :mod:`~dpwa.tools.demo.modelfiles`) and keeps serving its final parameters while peers still fetch
    them (``close(linger=...)``), so peers that are still training do not wait on a closed node.

Restarts
    With ``checkpoint_every: K`` in the cluster file the adapter checkpoints model, optimizer and
    gossip state every K steps (and the demo once more at the end).  Started by ``dpwa run
    --resume`` or restarted by ``--restart-failed``, a node first calls ``adapter.restore()``: it
    resumes from its checkpoint's step (same batches and learning rates as an uninterrupted run)
    and copies a peer's model if that peer is ahead, then trains on to ``--steps``.

The evaluation (:mod:`~dpwa.tools.demo.evaluation`)
    Averages every ``<node>.model.npz`` of the run, evaluates that averaged model, and trains a
    *baseline*: one process, all the training data, the same model, optimizer, initial weights,
    batch size, learning rate and schedule, for as many samples as all nodes together.  Both
    held-out accuracies go to ``<run_dir>/demo.json`` and stdout.

The modules, each importing only those above it: :mod:`~dpwa.tools.demo.config` (:class:`TrainConfig`
and the defaults), :mod:`~dpwa.tools.demo.data`, :mod:`~dpwa.tools.demo.sgd` (the optimizer),
:mod:`~dpwa.tools.demo.training` (model, optimizer, training loop), :mod:`~dpwa.tools.demo.modelfiles`,
:mod:`~dpwa.tools.demo.node` (one node's run and the environment it reads), :mod:`~dpwa.tools.demo.evaluation`,
:mod:`~dpwa.tools.demo.cli` (the command line; ``__main__`` runs it).  This package re-exports their public names,
so ``demo.X`` works for any.
"""

from dpwa.tools.demo.cli import configure_logging, main, parse_args
from dpwa.tools.demo.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_SEED,
    DEFAULT_STEPS,
    HIDDEN,
    MOMENTUM,
    TrainConfig,
)
from dpwa.tools.demo.data import (
    DATA_SUFFIX,
    BatchStream,
    Dataset,
    DataSpec,
    make_dataset,
    node_indices,
    shard_indices,
    write_data_file,
)
from dpwa.tools.demo.evaluation import DEMO_JSON, EVALUATE_THREADS, evaluate_run, headline
from dpwa.tools.demo.modelfiles import META_KEY, MODEL_SUFFIX, average_states, load_model_file, save_model
from dpwa.tools.demo.node import (
    ENV_CONFIG,
    ENV_LOG_LEVEL,
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_THREADS,
    LINGER_IDLE_S,
    LINGER_MAX_S,
    PEERS_WAIT_S,
    linger_idle_s,
    run_node,
    set_threads,
)
from dpwa.tools.demo.sgd import MomentumSGD, OptimizerLike
from dpwa.tools.demo.training import (
    FINAL_LOSS_WINDOW,
    Exchange,
    NoExchange,
    TrainResult,
    build_model,
    evaluate,
    lr_at,
    make_optimizer,
    train,
)

__all__ = [
    "DATA_SUFFIX",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_LR",
    "DEFAULT_SEED",
    "DEFAULT_STEPS",
    "DEMO_JSON",
    "ENV_CONFIG",
    "ENV_LOG_LEVEL",
    "ENV_NODE",
    "ENV_RUN_DIR",
    "ENV_THREADS",
    "EVALUATE_THREADS",
    "FINAL_LOSS_WINDOW",
    "HIDDEN",
    "LINGER_IDLE_S",
    "LINGER_MAX_S",
    "linger_idle_s",
    "META_KEY",
    "MODEL_SUFFIX",
    "MOMENTUM",
    "MomentumSGD",
    "PEERS_WAIT_S",
    "BatchStream",
    "DataSpec",
    "Dataset",
    "Exchange",
    "NoExchange",
    "OptimizerLike",
    "TrainConfig",
    "TrainResult",
    "average_states",
    "build_model",
    "configure_logging",
    "evaluate",
    "evaluate_run",
    "headline",
    "load_model_file",
    "lr_at",
    "main",
    "make_dataset",
    "make_optimizer",
    "node_indices",
    "parse_args",
    "run_node",
    "save_model",
    "set_threads",
    "shard_indices",
    "train",
    "write_data_file",
]
