"""One node of ``dpwa bench scale``: the demo job (small MLP) behind a start barrier, recording its parameters.

Started by :mod:`dpwa.tools.bench.scale` as ``python -m dpwa.tools.bench.scaleworker SPEC RANK`` under
``dpwa.launcher.placement.node_env`` (``DPWA_RUN_DIR`` is the scale step's directory).  The node does what
``python -m dpwa.tools.demo`` does -- the demo's data, shard, model (``hidden`` from the spec), optimizer
and :func:`dpwa.tools.demo.train` loop around a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`, a
final ``report`` line in its metrics file, lingering for peers at the end -- plus:

* once built (adapter bound and serving), it writes ``<node>.ready`` (JSON: pid, parameter count,
  its RSS before the adapter existed) and waits for the bench's ``go`` file, at most
  ``start_timeout_s`` (exit status 3 after that): 32 processes importing torch on 2 cores take tens of
  seconds to start, and the measurement should begin when all of them train;
* every ``record_every`` steps (and before the first and after the last) it appends its flat
  parameters to ``<node>.params.bin`` (:mod:`dpwa.tools.bench.fingerprint`) for the spread over time;
* with churn (``joiners`` in the spec), a joiner writes its ready file at once, waits for ``go``, then
  until the first node of the file has done ``join_at`` steps (its metrics file), then joins the running
  cluster (``join``: that node's address; docs/membership.md), trains ``join_steps`` steps and leaves
  cleanly (its records span its membership only).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpwa.tools import demo
from dpwa.tools.bench.fingerprint import SUFFIX, ParamRecorder
from dpwa.tools.bench.procs import read_rss_kib, worker_start
from dpwa.utils.atomic import write_atomically
from dpwa.utils.exiting import exit_now

__all__ = [
    "EXIT_NO_GO",
    "GO_FILE",
    "GO_POLL_S",
    "LINGER_IDLE_S",
    "Job",
    "READY_SUFFIX",
    "RecordingExchange",
    "flat",
    "main",
    "run",
    "run_joiner",
    "steps_done",
    "wait_for_go",
    "wait_for_steps",
]

log = logging.getLogger("dpwa.tools.bench.scaleworker")

READY_SUFFIX = ".ready"
GO_FILE = "go"
GO_POLL_S = 0.02
LINGER_IDLE_S = 2.0
"""A node done training serves until nobody fetched for this long (flat: the figures of docs/performance.md)."""
EXIT_NO_GO = 3


def flat(model: nn.Module) -> np.ndarray:
    return nn.utils.parameters_to_vector(model.parameters()).detach().numpy()


class RecordingExchange:
    """The adapter's two calls, plus a parameter record after every ``update_wait`` that is due."""

    def __init__(self, adapter: Any, recorder: ParamRecorder, model: nn.Module) -> None:
        self.adapter = adapter
        self.recorder = recorder
        self.model = model
        self.steps = 0

    @property
    def progress(self) -> int:
        return int(self.adapter.progress)

    def update_send(self, loss: float) -> None:
        self.adapter.update_send(loss)

    def update_wait(self, loss: float) -> float:
        factor = self.adapter.update_wait(loss)
        self.steps += 1
        self.recorder.maybe_record(self.steps, flat(self.model))
        return factor


def wait_for_go(path: Path, timeout_s: float) -> bool:
    """Poll for ``path`` every 20 ms; False when ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(GO_POLL_S)
    return True


def steps_done(metrics: Path) -> int:
    """Exchange records in a node's metrics file so far (0 before it exists)."""
    try:
        with open(metrics, encoding="utf-8") as handle:
            return sum(1 for line in handle if line.endswith("\n") and '"event"' not in line)
    except FileNotFoundError:
        return 0


def wait_for_steps(metrics: Path, steps: int, timeout_s: float) -> bool:
    """Poll ``metrics`` every 20 ms until it holds ``steps`` exchange records; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while steps_done(metrics) < steps:
        if time.monotonic() >= deadline:
            return False
        time.sleep(GO_POLL_S)
    return True


@dataclass
class Job:
    """What a node of the bench trains: the demo's data, its shard, model and optimizer, built from the spec."""

    name: str
    run_dir: Path
    config: demo.TrainConfig
    data: Any
    indices: Any
    model: nn.Module
    optimizer: Any
    size: int
    rss_base: int | None

    @classmethod
    def build(cls, spec: dict[str, Any], rank: int) -> Job:
        names: list[str] = spec["names"]
        config = demo.TrainConfig.from_dict(spec["config"])
        model = demo.build_model(config)
        return cls(
            name=names[rank],
            run_dir=Path(spec["run_dir"]),
            config=config,
            data=demo.make_dataset(config.seed, config.data),
            indices=demo.shard_indices(config.data.n_train, rank, len(names)),
            model=model,
            optimizer=demo.make_optimizer(model, config),
            size=sum(p.numel() for p in model.parameters()),
            rss_base=read_rss_kib(os.getpid()),
        )


def run_joiner(spec: dict[str, Any], rank: int) -> int:
    """A node that joins the running cluster mid-run, trains ``join_steps`` steps, and leaves cleanly."""
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter
    from dpwa.config import load_config

    names: list[str] = spec["names"]
    job = Job.build(spec, rank)
    name, run_dir, config, data, indices = job.name, job.run_dir, job.config, job.data, job.indices
    model, optimizer, size, rss_base = job.model, job.optimizer, job.size, job.rss_base
    write_atomically(run_dir / f"{name}{READY_SUFFIX}", json.dumps({"pid": os.getpid(), "params": size,
                                                                    "rss_base_kib": rss_base}))  # fmt: skip
    timeout_s = float(spec["start_timeout_s"])
    if not wait_for_go(run_dir / GO_FILE, timeout_s):
        return EXIT_NO_GO
    first = names[0]
    if not wait_for_steps(run_dir / f"{first}.metrics.jsonl", int(spec["join_at"]), timeout_s):
        log.error("node %s: %s never reached step %s", name, first, spec["join_at"])
        return EXIT_NO_GO
    os.environ["DPWA_JOIN"] = spec["join"]
    settings = load_config(spec["cluster"])
    with DpwaPyTorchAdapter(model, name, settings, seed=config.seed * 1000 + rank, run_dir=run_dir) as conn:
        conn.restore(resume=False, bootstrap=True)  # copy a member's model before the first step
        recorder = ParamRecorder(run_dir / f"{name}{SUFFIX}", size, int(spec["record_every"]))
        recorder.record(0, flat(model))
        cpu = time.process_time()
        exchange = RecordingExchange(conn, recorder, model)
        steps = int(spec["join_steps"])
        result = demo.train(model, optimizer, data, indices, config, steps, (config.seed, rank + 1), exchange)
        recorder.record(result.steps, flat(model))
        recorder.close()
        stats = conn.stats()
        conn.report(
            joined=True,
            steps=result.steps,
            seconds=result.seconds,
            cpu_s=time.process_time() - cpu,
            mixes_total=stats["mixes"],
            fetches_timed_out=stats["fetches_timed_out"],
            fetches_refused=stats["fetches_refused"],
            served=stats["served"],
            shm_fetched=stats["shm_fetched"],
            members_seen=stats["members_alive"],
        )
        log.info("node %s: joined, %d steps, %d mixes, leaving", name, result.steps, stats["mixes"])
    return 0


def run(spec: dict[str, Any], rank: int) -> int:
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    if spec["names"][rank] in spec.get("joiners", ()):
        return run_joiner(spec, rank)
    job = Job.build(spec, rank)
    name, run_dir, config, data, indices = job.name, job.run_dir, job.config, job.data, job.indices
    model, optimizer, size, rss_base = job.model, job.optimizer, job.size, job.rss_base
    with DpwaPyTorchAdapter(model, name, spec["cluster"], seed=config.seed * 1000 + rank, run_dir=run_dir) as conn:
        recorder = ParamRecorder(run_dir / f"{name}{SUFFIX}", size, int(spec["record_every"]))
        ready = {"pid": os.getpid(), "params": size, "rss_base_kib": rss_base}
        write_atomically(run_dir / f"{name}{READY_SUFFIX}", json.dumps(ready))
        if not wait_for_go(run_dir / GO_FILE, float(spec["start_timeout_s"])):
            log.error("node %s: no go from the bench within %s s", name, spec["start_timeout_s"])
            recorder.close()
            return EXIT_NO_GO
        recorder.record(0, flat(model))
        cpu = time.process_time()
        exchange = RecordingExchange(conn, recorder, model)
        result = demo.train(model, optimizer, data, indices, config, config.steps, (config.seed, rank + 1), exchange)
        cpu_s = time.process_time() - cpu
        recorder.record(result.steps, flat(model))
        recorder.close()
        accuracy, _ = demo.evaluate(model, data.x_test, data.y_test)
        stats = conn.stats()
        conn.report(
            accuracy=accuracy,
            final_loss=result.final_loss,
            steps=result.steps,
            seconds=result.seconds,
            cpu_s=cpu_s,
            rss_base_kib=rss_base,
            rss_end_kib=read_rss_kib(os.getpid()),
            mixes_total=stats["mixes"],
            fetches_timed_out=stats["fetches_timed_out"],
            fetches_refused=stats["fetches_refused"],
            served=stats["served"],
            shm_fetched=stats["shm_fetched"],
        )
        log.info(
            "node %s: %d steps in %.2f s, %d mixes, %d timeouts, cpu %.2f s",
            name, result.steps, result.seconds, stats["mixes"], stats["fetches_timed_out"], cpu_s,
        )  # fmt: skip
        conn.close(linger=demo.LINGER_MAX_S, idle=LINGER_IDLE_S)
    return 0


def main(argv: list[str] | None = None) -> int:
    spec, rank = worker_start("scale", argv)
    log.info("rank %d, %d torch thread(s)", rank, torch.get_num_threads())
    return run(spec, rank)


if __name__ == "__main__":
    exit_now(main())  # its adapter closed, its files written: no teardown
