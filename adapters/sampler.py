"""DpwaSampler: a ``torch.utils.data.Sampler`` over this node's shard of a data set (:func:`dpwa.shard`).

::

    from dpwa.adapters.sampler import DpwaSampler

    loader = DataLoader(dataset, batch_size=64, sampler=DpwaSampler(dataset))          # iid
    loader = DataLoader(dataset, batch_size=64, sampler=DpwaSampler(dataset, "classes:3"))  # labels: .targets

Like ``DistributedSampler``, but the rank and node count come from ``dpwa run`` / SLURM / torchrun (or are
given), the split is any of dpwa's partitions, and the shards are disjoint and cover the data set (no padding,
no repeated items): node sizes may differ by one (``iid``) or more (``classes:K``). Each epoch visits this
node's items once, in a seeded random order that changes with the epoch (``shuffle=False``: in index order).
The epoch is the one ``set_epoch`` gave (Lightning and accelerate call it), else the count of ``iter()`` calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dpwa.config import ClusterConfig
from dpwa.shard import shard
from dpwa.utils.partition import Partition, parse_partition

__all__ = ["DpwaSampler", "dataset_labels", "node_sampler"]

_SEED_SALT = 0x5A3D


def dataset_labels(dataset: Any) -> np.ndarray | None:
    """The class of every item of ``dataset`` when it says: a ``targets`` or ``labels`` attribute (torchvision,
    many others), a ``label`` / ``labels`` column (Hugging Face ``datasets``), or the last tensor of a
    ``TensorDataset``; None otherwise."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        for column in ("label", "labels"):
            if column in columns:
                return np.asarray(dataset[column])
    for attribute in ("targets", "labels"):
        value = getattr(dataset, attribute, None)
        if value is not None and not callable(value):
            return np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) >= 2 and isinstance(tensors[-1], torch.Tensor):
        return tensors[-1].cpu().numpy()
    return None


class DpwaSampler(torch.utils.data.Sampler[int]):
    """The items of this node's shard of ``data_source`` (a sized data set, or its length), see the module.

    ``labels``: one class per item, for ``dirichlet:ALPHA`` / ``classes:K`` (default: :func:`dataset_labels`).
    ``seed``: the same on every node (it fixes the split and the orders). ``rank`` / ``world_size`` / ``name`` /
    ``config``: as :func:`dpwa.shard`.
    """

    def __init__(
        self,
        data_source: Any,
        partition: str | Partition = "iid",
        *,
        labels: Sequence[int] | np.ndarray | None = None,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        name: str | None = None,
        config: ClusterConfig | str | os.PathLike[str] | None = None,
    ) -> None:
        n_items = data_source if isinstance(data_source, int) else len(data_source)
        self.partition = parse_partition(partition)
        if labels is None and self.partition.kind != "iid" and not isinstance(data_source, int):
            labels = dataset_labels(data_source)
            if labels is None:
                raise ValueError(
                    f"DpwaSampler: partition {self.partition} needs each item's class; pass labels= (the data set "
                    "has no targets / labels attribute)"
                )
        self.indices = shard(
            n_items, self.partition, labels=labels, seed=seed, rank=rank, world_size=world_size, name=name,
            config=config,
        )  # fmt: skip
        self.seed, self.shuffle = int(seed), shuffle
        self._epoch: int | None = None
        self._iterations = 0

    def set_epoch(self, epoch: int) -> None:
        """Order the next epoch's items by ``epoch`` (the same epoch, the same order)."""
        self._epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        epoch = self._epoch if self._epoch is not None else self._iterations
        self._iterations += 1
        if not self.shuffle:
            return iter(self.indices.tolist())
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, _SEED_SALT])
        return iter(rng.permutation(self.indices).tolist())

    def __len__(self) -> int:
        return int(self.indices.size)

    def __repr__(self) -> str:
        return f"DpwaSampler({self.partition}, {len(self)} items)"


def _is_default(sampler: Any, dataset: Any) -> bool:
    """A framework's default sampler: every item of ``dataset`` once per epoch, in order or shuffled (a
    SequentialSampler, or a RandomSampler -- accelerate's SeedableRandomSampler too -- without replacement nor a
    sample count of its own)."""
    if getattr(sampler, "data_source", None) is not dataset:
        return False
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return True
    return (
        isinstance(sampler, torch.utils.data.RandomSampler)
        and not sampler.replacement
        and (sampler._num_samples is None or sampler.num_samples == len(dataset))
    )


def node_sampler(
    sampler: Any,
    dataset: Any,
    partition: str | Partition,
    *,
    seed: int,
    framework: str,
    name: str | None = None,
    config: ClusterConfig | str | os.PathLike[str] | None = None,
) -> DpwaSampler | None:
    """What a framework callback puts in place of a training loader's ``sampler``: None when it is a DpwaSampler
    already (left alone); a DpwaSampler over ``dataset`` (shuffled as the sampler was) when it is the framework's
    default RandomSampler / SequentialSampler over the whole data set; ValueError for any other sampler -- a
    DistributedSampler, a RandomSampler with replacement or its own sample count, the user's own choice of
    items -- naming it and what to do instead."""
    if isinstance(sampler, DpwaSampler):
        return None
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        raise ValueError(
            f"{framework}: the training data loader already has a DistributedSampler (rank {sampler.rank} of "
            f"{sampler.num_replicas}), but dpwa splits the data between its nodes itself; build the loader without it "
            "(the callback puts a DpwaSampler in place), or pass partition=None to the callback to keep yours"
        )
    if _is_default(sampler, dataset):
        shuffle = not isinstance(sampler, torch.utils.data.SequentialSampler)
        return DpwaSampler(dataset, partition, seed=seed, shuffle=shuffle, name=name, config=config)
    raise ValueError(
        f"{framework}: the training data loader has its own sampler ({type(sampler).__name__}), so the callback "
        "cannot put this node's shard in place; pass partition=None to the callback and choose this node's items "
        "yourself (dpwa.shard, or DpwaSampler)"
    )
