"""The data splits of --partition: disjoint, seeded, and as heterogeneous as each one says."""

from __future__ import annotations

import numpy as np
import pytest

from dpwa.utils.partition import Partition, class_histogram, describe, parse_partition, partition_indices

CLASSES = 10


def labels(n: int = 20_000, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CLASSES, size=n)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("iid", Partition()),
        ("dirichlet:0.1", Partition("dirichlet", alpha=0.1)),
        ("classes:3", Partition("classes", k=3)),
    ],
)
def test_parse_round_trips(text: str, expected: Partition) -> None:
    assert parse_partition(text) == expected
    assert str(parse_partition(text)) == text


@pytest.mark.parametrize("text", ["", "iid:2", "dirichlet", "dirichlet:0", "dirichlet:-1", "dirichlet:nan",
                                  "dirichlet:inf", "classes:0", "classes:x", "classes:1.5", "shards:2"])  # fmt: skip
def test_parse_rejects_with_the_expected_forms(text: str) -> None:
    with pytest.raises(ValueError, match="iid|dirichlet:ALPHA|classes:K"):
        parse_partition(text)


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.1", "dirichlet:1", "classes:1", "classes:3", "classes:10"])
@pytest.mark.parametrize("nodes", [1, 4, 7])
def test_every_split_is_disjoint_and_deterministic(spec: str, nodes: int) -> None:
    y = labels()
    shards = partition_indices(y, nodes, spec, seed=5)
    assert len(shards) == nodes
    flat = np.concatenate(shards)
    assert np.unique(flat).size == flat.size, "a sample on two nodes"
    assert flat.min() >= 0 and flat.max() < y.size
    again = partition_indices(y, nodes, spec, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again))
    if spec != "iid" and nodes > 1:
        other = partition_indices(y, nodes, spec, seed=6)
        assert any(not np.array_equal(a, b) for a, b in zip(shards, other)), "the seed changes nothing"


def test_iid_is_the_strided_shard() -> None:
    y = labels(1003)
    shards = partition_indices(y, 4, "iid", seed=0)
    for i, shard in enumerate(shards):
        assert np.array_equal(shard, np.arange(i, 1003, 4))


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_gives_equal_covering_shards(alpha: float) -> None:
    y = labels(20_003)
    shards = partition_indices(y, 4, f"dirichlet:{alpha}", seed=1)
    assert sorted(s.size for s in shards) == [5000, 5001, 5001, 5001]  # 20003 = 3 * 5001 + 5000
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(y.size))


def test_small_alpha_concentrates_and_large_alpha_spreads() -> None:
    """Dir(0.1 p) puts almost all of a node's data on one or two classes (the two largest classes' share, over
    the first four of eight nodes -- the ones that draw before the pools run dry -- and ten seeds: 0.98 on
    these labels), Dir(10 p) spreads it (0.47); Dir(1000 p) stays near the data's mix (each share's sd is
    sqrt(0.1 * 0.9 / 1001) = 0.0095: the bound 0.05 is five of them)."""
    y = labels()

    def top_two(alpha: float) -> float:
        shares = []
        for seed in range(10):
            for shard in partition_indices(y, 8, f"dirichlet:{alpha}", seed)[:4]:
                h = sorted(class_histogram(y, shard, CLASSES))
                shares.append(sum(h[-2:]) / sum(h))
        return float(np.mean(shares))

    assert top_two(0.1) > 0.9
    assert top_two(10) < 0.6
    for shard in partition_indices(y, 8, "dirichlet:1000", 0):
        share = np.array(class_histogram(y, shard, CLASSES)) / shard.size
        assert np.all(np.abs(share - 0.1) < 0.05), share


@pytest.mark.parametrize(("nodes", "k"), [(4, 3), (5, 2), (10, 1), (3, 4), (4, 10)])
def test_classes_k_gives_every_node_exactly_k_classes(nodes: int, k: int) -> None:
    y = labels()
    shards = partition_indices(y, nodes, f"classes:{k}", seed=2)
    held = [set(np.unique(y[s]).tolist()) for s in shards]
    assert all(len(h) == k for h in held), held
    counts = np.bincount([c for h in held for c in h], minlength=CLASSES)
    assert counts.max() - counts.min() <= 1, "classes not spread as evenly as they can be"
    if nodes * k >= CLASSES:
        assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(y.size)), "not covering"


def test_impossible_splits_are_refused() -> None:
    y = labels(100)
    with pytest.raises(ValueError, match="only 10 classes"):
        partition_indices(y, 2, "classes:11", seed=0)
    with pytest.raises(ValueError, match="without samples"):
        partition_indices(y[:3], 4, "iid", seed=0)
    with pytest.raises(ValueError, match="at least one node"):
        partition_indices(y, 0, "iid", seed=0)


def test_histogram_and_its_label() -> None:
    y = np.array([0, 1, 1, 2, 2, 2])
    assert class_histogram(y, np.arange(6), 4) == [1, 2, 3, 0]
    assert describe([100, 0, 3, 50]) == "0,3"
    assert describe([10, 10, 10]) == "all 3"
    assert describe([0, 0]) == "-"
