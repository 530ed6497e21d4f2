"""The demo's command line, ``python -m dpwa.tools.demo``: node mode (the default) or ``--evaluate RUN_DIR``.

:func:`main` parses the options (:func:`parse_args`), sets up logging to stderr (:func:`configure_logging`),
then runs one node (:func:`~dpwa.tools.demo.node.run_node`) or evaluates a finished run
(:func:`~dpwa.tools.demo.evaluation.evaluate_run`, its :func:`~dpwa.tools.demo.evaluation.headline` on
stdout).  It returns the exit status: 0 done, 1 the run failed or cannot be evaluated, 2 bad settings.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from dpwa.tools.demo.config import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_SEED, DEFAULT_STEPS, MOMENTUM, TrainConfig
from dpwa.tools.demo.evaluation import EVALUATE_THREADS, evaluate_run, headline
from dpwa.tools.demo.node import ENV_LOG_LEVEL, run_node, set_threads
from dpwa.utils.partition import PARTITION_HELP

__all__ = ["configure_logging", "main", "parse_args"]

log = logging.getLogger("dpwa.tools.demo")  # one logger for the whole demo


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dpwa.tools.demo",
        description="dpwa's built-in demo job: each node gossip-trains an MLP on its shard of generated data. "
        "Node name, cluster file and run directory come from DPWA_NODE, DPWA_CONFIG, DPWA_RUN_DIR (set by "
        "`dpwa run`). With --evaluate RUN_DIR: average the node models, train the one-process baseline, "
        "write RUN_DIR/demo.json.",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="batches per node (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="default %(default)s")
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="peak learning rate, cosine decay to 0 (default %(default)s)"
    )
    parser.add_argument(
        "--momentum", type=float, default=MOMENTUM, help="SGD momentum, in [0, 1) (default %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help="data, initial weights and batch order (default %(default)s)"
    )
    parser.add_argument("--partition", default="iid", help=PARTITION_HELP + " (default %(default)s)")
    parser.add_argument("--evaluate", metavar="RUN_DIR", type=Path, help="evaluate a finished demo run")
    return parser.parse_args(None if argv is None else list(argv))


def configure_logging() -> None:
    """Log to stderr (``dpwa run`` keeps it in ``<node>.log``) at ``DPWA_LOG_LEVEL`` (default INFO)."""
    level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        level = "INFO"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    if args.evaluate is not None:
        torch.set_num_threads(EVALUATE_THREADS)
        try:
            summary = evaluate_run(args.evaluate)
        except (OSError, ValueError, KeyError) as err:
            log.error("cannot evaluate %s: %s", args.evaluate, err)
            return 1
        print(headline(summary), flush=True)
        return 0
    set_threads()
    try:
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            momentum=args.momentum,
            partition=args.partition,
        )
    except ValueError as err:
        log.error("%s", err)
        return 2
    return run_node(config)
