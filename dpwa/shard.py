"""This node's part of the training data: ``dpwa.shard(n_items, partition)`` -> the indices it trains on.

Every node calls it with the same arguments and gets its own, disjoint part; together the parts cover the data
set (``classes:K`` covers it when ``nodes * K >= classes``). The split is the one the built-in demo, the
benchmarks and the simulator use (:func:`dpwa.utils.partition.partition_indices`):

``iid``
    node ``r`` of ``n`` gets items ``r, r+n, r+2n, ...`` (no labels needed);
``dirichlet:ALPHA``
    each node's class proportions drawn from ``Dir(ALPHA * p)``, equal sizes (needs ``labels``);
``classes:K``
    each node holds ``K`` classes (needs ``labels``).

``seed`` must be the same on every node (the split is a pure function of the labels, the node count, the
partition and the seed). The rank and the node count come from :func:`dpwa.world.whereami` (``dpwa run``,
SLURM, torchrun, or ``name=`` / ``config=``), or are given as ``rank=`` / ``world_size=``.

Example::

    import dpwa
    mine = dpwa.shard(len(x_train), "classes:3", labels=y_train)
    x, y = x_train[mine], y_train[mine]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from dpwa.config import ClusterConfig
from dpwa.utils.partition import Partition, parse_partition, partition_indices
from dpwa.world import whereami

__all__ = ["shard"]


def shard(
    n_items: int,
    partition: str | Partition = "iid",
    *,
    labels: Sequence[int] | np.ndarray | None = None,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    name: str | None = None,
    config: ClusterConfig | str | os.PathLike[str] | None = None,
) -> np.ndarray:
    """The sorted int64 indices in ``[0, n_items)`` of this node's items under ``partition`` (see the module).

    ``labels`` (one integer class per item) is needed by ``dirichlet:ALPHA`` and ``classes:K``. ValueError for a
    bad partition, labels of another length, or a split that leaves a node without items; WorldError
    (:mod:`dpwa.world`) when the rank is not given and nothing says it.
    """
    part = parse_partition(partition)
    if isinstance(n_items, bool) or not isinstance(n_items, (int, np.integer)) or n_items < 1:
        raise ValueError(f"shard(): n_items must be a positive integer, got {n_items!r}")
    if (rank is None) != (world_size is None):
        raise ValueError("shard(): give both rank= and world_size=, or neither")
    if rank is None or world_size is None:
        here = whereami(name, config)
        rank, world_size = here.rank, here.size
    if not 0 <= rank < world_size:
        raise ValueError(f"shard(): rank {rank} is not in [0, {world_size})")
    if labels is None:
        if part.kind != "iid":
            raise ValueError(f"shard(): partition {part} splits by class, so it needs labels= (one class per item)")
        classes = np.zeros(int(n_items), dtype=np.int64)
    else:
        classes = np.asarray(labels)
        if classes.ndim != 1 or classes.size != n_items:
            raise ValueError(f"shard(): labels has shape {classes.shape}, expected ({n_items},)")
        if classes.size and (not np.issubdtype(classes.dtype, np.integer) or classes.min() < 0):
            raise ValueError("shard(): labels must be non-negative integers (class numbers)")
    return partition_indices(classes, world_size, part, seed)[rank]
