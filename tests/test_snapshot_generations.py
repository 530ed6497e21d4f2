"""Snapshot generations (dpwa/node/snapshots.py): what a requester uses to tell a repeat from a new snapshot."""

from __future__ import annotations

import numpy as np

from dpwa.node.snapshots import GEN_START_BOUND, SnapshotPool
from dpwa.node.wire import Layout


def test_each_publish_is_a_new_generation_and_a_new_pool_starts_elsewhere() -> None:
    """+1 per publish; a pool (a node, or the same node restarted) starts at a random generation, so a restarted
    peer's first snapshots are not taken for the ones fetched before it died."""
    arrays = [np.zeros(4, np.float32)]
    pools = [SnapshotPool(Layout.of(arrays)) for _ in range(2)]
    gens = []
    for pool in pools:
        first = pool.publish(arrays, 1.0, 0.5, {})
        second = pool.publish(arrays, 2.0, 0.5, {})
        assert first is not None and second is not None
        assert 1 <= first.gen <= GEN_START_BOUND and second.gen == first.gen + 1
        gens.append(first.gen)
    assert gens[0] != gens[1]  # two draws from [1, 2^62]: equal once in 4.6e18
