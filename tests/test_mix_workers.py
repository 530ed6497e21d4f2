"""Mix workers (dpwa/rules/workers.py): a large mix split over threads gives the serial mix's bits, every range runs
once, an error in any range is raised after all have ended, and a closed pool leaves the work to the caller."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, write_cluster

from dpwa import DpwaConnection
from dpwa.config import ConfigError, load_config, parse_config
from dpwa.rules.mixing import (
    BLOCK,
    add_differences_,
    interpolate_,
    scale_motion_,
    scale_motion_and_interpolate_,
)
from dpwa.rules.workers import PARALLEL_MIN, MixWorkers, current_workers, run_ranges, split_ranges
from dpwa.utils.bfloat16 import BFLOAT16, from_float32
from dpwa.utils.cores import MAX_AUTO_MIX_THREADS, auto_threads, mix_thread_count

SIZES = (PARALLEL_MIN + 12_345, 3 * PARALLEL_MIN + BLOCK // 3)  # neither a whole number of blocks


@pytest.fixture(scope="module")
def workers() -> MixWorkers:
    pool = MixWorkers(3)
    yield pool
    pool.close()


def _arrays(n: int, dtype: str, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if dtype == "bfloat16":
        return from_float32(values, np.empty(n, BFLOAT16))
    return values.astype(dtype)


def _both(kernel, workers: MixWorkers, x: list[np.ndarray], *rest: list[np.ndarray]) -> tuple[list, list]:
    serial, split = [a.copy() for a in x], [a.copy() for a in x]
    kernel(serial, *[[b.copy() for b in r] for r in rest])
    with workers.active():
        kernel(split, *[[b.copy() for b in r] for r in rest])
    return serial, split


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("f", [0.5, 0.3])
def test_a_split_interpolation_gives_the_serial_bits(workers: MixWorkers, n: int, dtype: str, f: float) -> None:
    x, peer = [_arrays(n, dtype, 1), _arrays(1000, dtype, 2)], [_arrays(n, dtype, 3), _arrays(1000, dtype, 4)]
    serial, split = _both(lambda a, b: interpolate_(a, b, f), workers, x, peer)
    for s, p, before in zip(serial, split, x):
        assert not np.array_equal(s.view(np.uint8), before.view(np.uint8))  # the mix did move x
        assert np.array_equal(s.view(np.uint8), p.view(np.uint8))


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_split_mix_with_a_narrower_peer_gives_the_serial_bits(workers: MixWorkers, wire: str) -> None:
    n = SIZES[1]
    for f in (0.5, 0.25):
        serial, split = _both(
            lambda a, b, f=f: interpolate_(a, b, f), workers, [_arrays(n, "float32", 5)], [_arrays(n, wire, 6)]
        )
        assert np.array_equal(serial[0].view(np.uint32), split[0].view(np.uint32))


def test_a_split_mean_keeps_the_overflow_fallback_in_every_range(workers: MixWorkers) -> None:
    """A block whose sum overflows lies in a worker's range: it is halved first there too (the error state that
    catches the overflow is the worker thread's own), so the mean is finite and bit-equal to the serial one."""
    n = SIZES[1]
    x, peer = _arrays(n, "float32", 7), _arrays(n, "float32", 8)
    x[-5 * BLOCK : -4 * BLOCK] = 3e38
    peer[-5 * BLOCK : -4 * BLOCK] = 3e38
    serial, split = _both(lambda a, b: interpolate_(a, b, 0.5), workers, [x], [peer])
    assert np.all(np.isfinite(serial[0])) and serial[0][-5 * BLOCK] == np.float32(3e38)
    assert np.array_equal(serial[0].view(np.uint32), split[0].view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_other_split_kernels_give_the_serial_bits(workers: MixWorkers, dtype: str) -> None:
    n = SIZES[0]
    x, r = [_arrays(n, dtype, 9)], [_arrays(n, dtype, 10)]
    p1, p2 = [_arrays(n, dtype, 11)], [_arrays(n, dtype, 12)]
    kernels = [
        lambda a, b, c, d: add_differences_(a, [b, c], d, 0.25),
        lambda a, b, c, d: add_differences_(a, [b], None, 0.5),
        lambda a, b, c, d: scale_motion_(a, d, 1.7),
        lambda a, b, c, d: scale_motion_and_interpolate_(a, d, 1.3, b, 0.5),
        lambda a, b, c, d: scale_motion_and_interpolate_(a, d, 0.8, b, 0.3),
    ]
    for kernel in kernels:
        serial, split = _both(kernel, workers, x, p1, p2, r)
        assert np.array_equal(serial[0].view(np.uint8), split[0].view(np.uint8))


def test_split_ranges_cover_the_array_in_whole_blocks() -> None:
    assert split_ranges(0, 3, 10) == []
    assert split_ranges(5, 3, 10) == [(0, 5)]  # one block: one range
    for n, parts, block in [(100, 3, 10), (101, 4, 10), (95, 2, 10), (7 * BLOCK + 1, 5, BLOCK)]:
        ranges = split_ranges(n, parts, block)
        assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
        assert all(a % block == 0 for a, _ in ranges)
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= block


def test_the_ranges_run_once_each_on_the_caller_and_the_workers(workers: MixWorkers) -> None:
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def body(lo: int, hi: int) -> None:
        with lock:
            seen.append((lo, hi, threading.current_thread().name))

    run_ranges(PARALLEL_MIN, BLOCK, body)  # no active workers: one call on the caller
    assert seen == [(0, PARALLEL_MIN, threading.current_thread().name)]
    seen.clear()
    with workers.active():
        assert current_workers() is workers
        run_ranges(PARALLEL_MIN - 1, BLOCK, body)  # too small to split
        assert len(seen) == 1
        seen.clear()
        run_ranges(SIZES[1], BLOCK, body)
    assert current_workers() is None
    assert sorted((lo, hi) for lo, hi, _ in seen) == split_ranges(SIZES[1], 3, BLOCK)
    names = {name for _, _, name in seen}
    assert threading.current_thread().name in names and any(n.startswith("dpwa-mix") for n in names)


def test_an_error_in_a_range_is_raised_once_every_range_has_ended(workers: MixWorkers) -> None:
    ended: list[int] = []
    release = threading.Event()

    def body(lo: int, hi: int) -> None:
        if lo == 0:
            raise ValueError("range 0")
        release.wait(5.0)  # seconds: the caller's error must not return before this range ends
        ended.append(lo)

    threading.Timer(0.2, release.set).start()
    with workers.active(), pytest.raises(ValueError, match="range 0"):
        run_ranges(SIZES[1], BLOCK, body)
    assert len(ended) == 2


def test_a_closed_pool_leaves_every_range_to_the_caller() -> None:
    pool = MixWorkers(2, name="dpwa-mix-closing")
    names: list[str] = []
    with pool.active():
        run_ranges(SIZES[0], BLOCK, lambda lo, hi: names.append(threading.current_thread().name))
    started = [t for t in threading.enumerate() if t.name.startswith("dpwa-mix-closing")]
    pool.close()
    with pool.active():
        names.clear()
        run_ranges(SIZES[0], BLOCK, lambda lo, hi: names.append(threading.current_thread().name))
    assert names == [threading.current_thread().name] * 2
    assert all(not t.is_alive() for t in started)


def test_mix_workers_stop_their_threads_on_close() -> None:
    pool = MixWorkers(3, name="dpwa-mix-test-close")
    with pool.active():
        run_ranges(SIZES[1], BLOCK, lambda lo, hi: None)
    threads = [t for t in threading.enumerate() if t.name.startswith("dpwa-mix-test-close")]
    assert threads
    pool.close()
    assert all(not t.is_alive() for t in threads)
    with pytest.raises(ValueError):
        MixWorkers(0)


def test_the_mix_threads_key_takes_auto_or_a_count(tmp_path: Path) -> None:
    nodes = "nodes: [{name: a, host: 127.0.0.1, port: 5000}]\n"
    assert parse_config(nodes).transport.mix_threads == "auto"
    assert mix_thread_count(parse_config(nodes + "transport: {mix_threads: 3}\n").transport.mix_threads) == 3
    assert mix_thread_count("auto", {"DPWA_TORCH_THREADS": "2"}) == 2  # the share dpwa run gives the node
    assert mix_thread_count("auto", {"DPWA_TORCH_THREADS": "32"}) == MAX_AUTO_MIX_THREADS
    assert auto_threads({"DPWA_TORCH_THREADS": "x"}, cores=3) == 3 and auto_threads({}, cores=1) == 1
    for bad in ("0", "65", "true", "two", "1.5"):
        path = tmp_path / "bad.yaml"
        path.write_text(nodes + f"transport: {{mix_threads: {bad}}}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(f"{path}:2: transport.mix_threads: must be auto or an integer in [1, 64]")


def test_a_node_splits_its_mix_over_its_threads_and_stops_them_on_close(tmp_path: Path) -> None:
    """``w2`` (``mix_threads: 2``) fetches ``w1``'s 1.5M-float model and mixes it: the same bits as the serial
    kernel on the same two arrays, its worker thread ran, and it is gone once the node closed."""
    n = PARALLEL_MIN + PARALLEL_MIN // 2
    transport = {"shared_memory": "off", "mix_threads": 2}
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant", transport=transport)
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        theirs, start = _arrays(n, "float32", 20), _arrays(n, "float32", 21)
        a.update_send([theirs], 1.0)
        mine = start.copy()
        deadline = time.monotonic() + 60.0
        while True:
            mine[:] = start
            b.update_send([mine], 1.0)
            factor = b.update_wait(1.0)
            if factor:
                break
            assert time.monotonic() < deadline, b.stats()
        expected = [start.copy()]
        interpolate_(expected, [theirs.copy()], factor)
        assert np.array_equal(mine.view(np.uint32), expected[0].view(np.uint32))
        workers = [t for t in threading.enumerate() if t.name.startswith("dpwa-mix-w2")]
        assert len(workers) == 1
    finally:
        a.close()
        b.close()
    assert not workers[0].is_alive()
