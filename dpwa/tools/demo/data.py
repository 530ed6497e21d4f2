"""The demo's data: the generated problem as torch tensors, each node's shard of it, and its mini-batches.

* :func:`make_dataset` -- a 10-class Gaussian mixture in 32 features (:mod:`dpwa.tools.mixture`), a pure
  function of the seed: 40,000 training and 10,000 held-out samples, no download.
* :func:`shard_indices` / :func:`node_indices` -- which training samples a node gets: every ``count``-th,
  or as ``TrainConfig.partition`` says (:mod:`dpwa.utils.partition`). Shards are disjoint.
* :func:`write_data_file` -- ``<run_dir>/<node>.data.json``, the node's class histogram.
* :class:`BatchStream` -- endless seeded mini-batches over a shard, a fresh permutation every epoch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dpwa.tools.demo.config import TrainConfig
from dpwa.tools.mixture import DataSpec, gaussian_mixture
from dpwa.utils.atomic import write_atomically
from dpwa.utils.partition import partition_indices

__all__ = [
    "DATA_SUFFIX",
    "BatchStream",
    "DataSpec",
    "Dataset",
    "make_dataset",
    "node_indices",
    "shard_indices",
    "write_data_file",
]

DATA_SUFFIX = ".data.json"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Training and held-out splits as torch tensors (float32 features, int64 labels)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def make_dataset(seed: int, spec: DataSpec | None = None) -> Dataset:
    """The Gaussian-mixture problem of ``spec`` (default ``DataSpec()``), a pure function of ``seed``
    (:func:`~dpwa.tools.mixture.gaussian_mixture`)."""
    data = gaussian_mixture(seed, spec if spec is not None else DataSpec())
    return Dataset(*(torch.from_numpy(a) for a in (data.x_train, data.y_train, data.x_test, data.y_test)))


def shard_indices(n: int, index: int, count: int) -> np.ndarray:
    """Node ``index`` of ``count``'s training samples: ``index, index+count, ...`` (disjoint, covering)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} not in [0, {count})")
    return np.arange(index, n, count)


def node_indices(config: TrainConfig, data: Dataset, index: int, count: int) -> np.ndarray:
    """Node ``index`` of ``count``'s training samples under ``config.partition`` (seeded by ``config.seed``)."""
    labels = data.y_train.numpy()
    return partition_indices(labels, count, config.partition, config.seed, config.data.classes)[index]


def write_data_file(run_dir: Path, name: str, config: TrainConfig, histogram: Sequence[int]) -> Path:
    """``<run_dir>/<name>.data.json``: the partition, the node's sample count and its class histogram."""
    record = {"node": name, "partition": config.partition, "samples": int(sum(histogram)), "classes": list(histogram)}
    path = run_dir / f"{name}{DATA_SUFFIX}"
    write_atomically(path, json.dumps(record) + "\n")
    return path


class BatchStream:
    """Endless mini-batches of indices from ``indices``: a fresh seeded permutation every epoch."""

    def __init__(self, indices: np.ndarray, batch_size: int, seed: Sequence[int]) -> None:
        if batch_size > len(indices):
            raise ValueError(f"batch size {batch_size} exceeds the {len(indices)} samples available")
        self.indices = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(int(np.random.SeedSequence(list(seed)).generate_state(1)[0]))
        self.order = self.indices
        self.pos = len(self.indices)  # start with a new epoch

    def __next__(self) -> torch.Tensor:
        if self.pos + self.batch_size > len(self.indices):
            self.order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
            self.pos = 0
        batch = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch
