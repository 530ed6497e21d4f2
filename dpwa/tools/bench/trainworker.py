"""One worker process of ``dpwa bench train``: the same process trains with dpwa's rules, then with DDP (or
the reverse).

Started by :mod:`dpwa.tools.bench.train` as ``python -m dpwa.tools.bench.trainworker SPEC RANK``, one per node,
under ``dpwa.launcher.placement.node_env`` (so ``DPWA_TORCH_THREADS`` sizes torch's threads).  ``SPEC`` is
the JSON file :func:`dpwa.tools.bench.train.run_scenario` wrote: the demo's ``TrainConfig``, the number of
nodes, the straggler, the phase order, each dpwa phase's cluster file and sample counter, and the gloo
rendezvous port.

Per phase, the worker writes into ``<run_dir>/<phase>/``:

* ``<node>.timeline.npz`` -- ``time`` (Unix seconds, float64) and ``loss`` (float32) of every batch;
* ``<node>.json`` -- start and end time of its training loop, steps, samples, sleep, exchange counters;
* ``<node>.model.npz`` -- its final model (:func:`dpwa.tools.demo.save_model`).

Every phase uses the demo's data, shard (``node_indices``: ``--partition``), batch stream seed, initial weights,
optimizer and peak learning rate; the learning rate follows the demo's cosine, as a function of the
fraction of the *total* sample budget done (all nodes together), so every phase sees the same
schedule per sample.

* ``dpwa-<rule>``: a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter` (the phase's cluster file:
  its rule) around every batch.  No barrier between steps: every node trains until the nodes together
  have trained the budget (``nodes * steps * batch_size`` samples), counted in a shared
  memory-mapped file of one int64 per node; a fast node trains more batches than a slow one.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, ``steps`` synchronous steps
  (the same budget): the gradients are all-reduced, so every rank waits for the slowest.

The straggler (``--straggler K`` > 1, the last rank) sleeps ``(K - 1) x`` the median duration of its
own recent steps (sleep excluded) after every step: its steps take K times as long while the CPU
stays free for the others.  A gloo barrier (outside the timed loop) lines the workers up before each
phase.  Exit status 0 when every phase completed.
"""

from __future__ import annotations

import collections
import datetime as _dt
import json
import logging
import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dpwa.tools import demo
from dpwa.tools.bench.fingerprint import SUFFIX, ParamRecorder
from dpwa.tools.bench.procs import worker_start
from dpwa.utils.atomic import write_atomically
from dpwa.utils.exiting import exit_now
from dpwa.utils.partition import class_histogram

__all__ = [
    "LINGER_IDLE_S",
    "LINGER_S",
    "DDP",
    "STRAGGLER_MIN_WINDOW",
    "STRAGGLER_WINDOW",
    "WARMUP_STEPS",
    "SharedCounter",
    "Straggler",
    "Timeline",
    "Worker",
    "main",
]

log = logging.getLogger("dpwa.tools.bench.trainworker")

DDP = "ddp"
WARMUP_STEPS = 30  # untimed steps on a throw-away model: torch's lazy initialisation happens here
STRAGGLER_WINDOW = 25  # the straggler's sleep follows the median of its last this-many steps ...
STRAGGLER_MIN_WINDOW = 5  # ... once it has this many (the minimum before)
LINGER_S = 10.0  # a dpwa node that is done keeps serving peers still in their last step ...
LINGER_IDLE_S = 0.5  # ... until nobody fetched for this long


class SharedCounter:
    """Samples trained per node, in a memory-mapped file of ``nodes`` int64 slots (one writer each).

    The bench creates the file zeroed before the workers start (a missing file is created here).

    Aligned 8-byte stores and loads are atomic on the platforms dpwa runs on, so :meth:`total`
    never sees a torn slot; it may miss the very latest increment of another node, which only
    lets that node's last batch overshoot the budget (counted: the samples are what was trained).
    """

    def __init__(self, path: Path, nodes: int, rank: int) -> None:
        size = 8 * nodes
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=np.int64, count=nodes)
        self._rank = rank

    def add(self, samples: int) -> None:
        self._slots[self._rank] += samples

    def total(self) -> int:
        return int(self._slots.sum())

    def close(self) -> None:
        del self._slots
        self._map.close()


class Straggler:
    """After each step, sleep ``(factor - 1) x`` the median of the last steps' own durations (sleep excluded)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.recent: collections.deque[float] = collections.deque(maxlen=STRAGGLER_WINDOW)
        self.slept = 0.0

    def after_step(self, busy_s: float) -> None:
        if self.factor <= 1.0:
            return
        self.recent.append(busy_s)
        # the first steps can be slow for reasons of their own (a peer still starting): min until the window fills
        typical = statistics.median(self.recent) if len(self.recent) >= STRAGGLER_MIN_WINDOW else min(self.recent)
        pause = (self.factor - 1.0) * typical
        time.sleep(pause)
        self.slept += pause


class Timeline:
    """Wall time and loss of every batch, appended to preallocated-by-doubling numpy arrays."""

    def __init__(self, capacity: int = 4096) -> None:
        self.time = np.empty(capacity, dtype=np.float64)
        self.loss = np.empty(capacity, dtype=np.float32)
        self.n = 0

    def add(self, t: float, loss: float) -> None:
        if self.n == len(self.time):
            self.time = np.resize(self.time, 2 * self.n)
            self.loss = np.resize(self.loss, 2 * self.n)
        self.time[self.n] = t
        self.loss[self.n] = loss
        self.n += 1

    def save(self, path: Path) -> None:
        write_atomically(path, lambda h: np.savez(h, time=self.time[: self.n], loss=self.loss[: self.n]))


def _step(model: nn.Module, optimizer: demo.OptimizerLike, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def _flat(model: nn.Module) -> np.ndarray:
    return nn.utils.parameters_to_vector(model.parameters()).detach().numpy()


def _set_lr(optimizer: demo.OptimizerLike, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class Worker:
    """One rank: its data shard, the spec, and the phases."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.nodes = int(spec["nodes"])
        self.name = spec["names"][rank]
        self.config = demo.TrainConfig.from_dict(spec["config"])
        self.run_dir = Path(spec["run_dir"])
        self.budget = self.nodes * self.config.steps * self.config.batch_size
        self.factor = float(spec["straggler"]) if rank == self.nodes - 1 else 1.0
        self.data = demo.make_dataset(self.config.seed, self.config.data)
        self.indices = demo.node_indices(self.config, self.data, rank, self.nodes)
        histogram = class_histogram(self.data.y_train.numpy(), self.indices, self.config.data.classes)
        demo.write_data_file(self.run_dir, self.name, self.config, histogram)
        self.stream_seed = (self.config.seed, rank + 1)

    def warm_up(self) -> None:
        """A few untimed steps: autograd warms its caches."""
        model = demo.build_model(self.config)
        optimizer = demo.make_optimizer(model, self.config)
        stream = demo.BatchStream(self.indices, self.config.batch_size, (self.config.seed, 99, self.rank))
        for _ in range(WARMUP_STEPS):
            batch = next(stream)
            _step(model, optimizer, self.data.x_train[batch], self.data.y_train[batch])

    def first_loss(self, model: nn.Module) -> float:
        """The loss the demo's train() passes to the first update_send: the first batch, before training."""
        batch = next(demo.BatchStream(self.indices, self.config.batch_size, self.stream_seed))
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(self.data.x_train[batch]), self.data.y_train[batch]))

    def run_phase(self, phase: str) -> None:
        out = self.run_dir / phase
        out.mkdir(parents=True, exist_ok=True)
        model = demo.build_model(self.config)
        optimizer = demo.make_optimizer(model, self.config)
        recorder = None  # DDP's ranks hold the same model: rank 0 records it
        if phase != DDP or self.rank == 0:
            size = sum(p.numel() for p in model.parameters())
            recorder = ParamRecorder(out / f"{self.name}{SUFFIX}", size, int(self.spec["record_every"]))
        cpu = time.process_time()
        try:
            if phase != DDP:
                info = self.train_dpwa(model, optimizer, out, recorder, phase)
            else:
                info = self.train_ddp(model, optimizer, recorder)
        finally:
            if recorder is not None:
                recorder.close()
        info["cpu_s"] = time.process_time() - cpu
        timeline: Timeline = info.pop("timeline")
        timeline.save(out / f"{self.name}.timeline.npz")
        info.update(node=self.name, rank=self.rank, phase=phase, straggler=self.factor)
        (out / f"{self.name}.json").write_text(json.dumps(info, indent=1) + "\n")
        meta = {"node": self.name, "index": self.rank, "nodes": self.nodes, "samples": info["samples"]}
        demo.save_model(out / f"{self.name}{demo.MODEL_SUFFIX}", model, {**meta, "config": self.config.to_dict()})
        log.info(
            "%s %s: %d steps, %d samples in %.2f s (%.0f samples/s), slept %.2f s",
            phase,
            self.name,
            info["steps"],
            info["samples"],
            info["end"] - info["start"],
            info["samples"] / max(1e-9, info["end"] - info["start"]),
            info["slept_s"],
        )

    def train_dpwa(
        self, model: nn.Module, optimizer: demo.OptimizerLike, out: Path, recorder: ParamRecorder | None, phase: str
    ) -> dict[str, Any]:
        """Train with the adapter (``phase``'s cluster file) until the nodes together reached the budget."""
        from dpwa.adapters.pytorch import DpwaPyTorchAdapter

        cfg, x, y = self.config, self.data.x_train, self.data.y_train
        counter = SharedCounter(Path(self.spec["counters"][phase]), self.nodes, self.rank)
        stream = demo.BatchStream(self.indices, cfg.batch_size, self.stream_seed)
        straggler, timeline = Straggler(self.factor), Timeline()
        prev_loss, steps = self.first_loss(model), 0
        seed = cfg.seed * 1000 + self.rank
        adapter = DpwaPyTorchAdapter(model, self.name, self.spec["clusters"][phase], seed=seed, run_dir=out)
        try:
            dist.barrier()  # every node is bound and serving (it answers "not ready" until its first publish)
            start = time.time()
            if recorder is not None:
                recorder.record(0, _flat(model))
            while (done := counter.total()) < self.budget:
                t0 = time.perf_counter()
                _set_lr(optimizer, demo.lr_at(cfg, done, self.budget))
                adapter.update_send(prev_loss)
                batch = next(stream)
                prev_loss = _step(model, optimizer, x[batch], y[batch])
                adapter.update_wait(prev_loss)
                counter.add(cfg.batch_size)
                steps += 1
                timeline.add(time.time(), prev_loss)
                if recorder is not None:
                    recorder.maybe_record(steps, _flat(model))
                straggler.after_step(time.perf_counter() - t0)
            end = time.time()
            if recorder is not None:
                recorder.record(steps, _flat(model))
            stats = adapter.stats()
            adapter.close(linger=LINGER_S, idle=LINGER_IDLE_S)
        finally:
            adapter.close()
            counter.close()
        return {
            "start": start,
            "end": end,
            "steps": steps,
            "samples": steps * cfg.batch_size,
            "slept_s": straggler.slept,
            "mixes": stats["mixes"],
            "fetches_timed_out": stats["fetches_timed_out"],
            "fetches_refused": stats["fetches_refused"],
            "mean_fetch_ms": stats["mean_fetch_ms"],
            "timeline": timeline,
        }

    def train_ddp(
        self, model: nn.Module, optimizer: demo.OptimizerLike, recorder: ParamRecorder | None
    ) -> dict[str, Any]:
        """``steps`` synchronous DDP steps (gradients all-reduced over gloo)."""
        from torch.nn.parallel import DistributedDataParallel

        cfg, x, y = self.config, self.data.x_train, self.data.y_train
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights: identical anyway (same seed)
        stream = demo.BatchStream(self.indices, cfg.batch_size, self.stream_seed)
        straggler, timeline = Straggler(self.factor), Timeline()
        per_step = self.nodes * cfg.batch_size
        dist.barrier()
        start = time.time()
        if recorder is not None:
            recorder.record(0, _flat(model))
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            _set_lr(optimizer, demo.lr_at(cfg, step * per_step, self.budget))
            batch = next(stream)
            loss = _step(ddp, optimizer, x[batch], y[batch])
            timeline.add(time.time(), loss)
            if recorder is not None:
                recorder.maybe_record(step + 1, _flat(model))
            straggler.after_step(time.perf_counter() - t0)
        end = time.time()
        if recorder is not None and cfg.steps % recorder.every:
            recorder.record(cfg.steps, _flat(model))
        return {
            "start": start,
            "end": end,
            "steps": cfg.steps,
            "samples": cfg.steps * cfg.batch_size,
            "slept_s": straggler.slept,
            "timeline": timeline,
        }


def main(argv: list[str] | None = None) -> int:
    spec, rank = worker_start("train", argv)
    worker = Worker(spec, rank)
    log.info(
        "%s: rank %d of %d, straggler factor %g, phases %s, %d torch thread(s)",
        worker.name,
        rank,
        worker.nodes,
        worker.factor,
        ",".join(spec["phases"]),
        torch.get_num_threads(),
    )
    worker.warm_up()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['master_port']}",
        rank=rank,
        world_size=worker.nodes,
        timeout=_dt.timedelta(seconds=float(spec["collective_timeout_s"])),
    )
    try:
        for phase in spec["phases"]:
            worker.run_phase(phase)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # its adapter closed, its files written: no teardown
