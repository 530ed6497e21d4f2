"""Mix workers (dpwa/rules/workers.py): a large mix split over threads gives the serial mix's bits, every range runs
once, an error in any range is raised after all have ended, and a closed pool leaves the work to the caller."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, write_cluster

from dpwa import DpwaConnection
from dpwa.config import ConfigError, load_config, parse_config, yaml12
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


class CountingWorkers(MixWorkers):
    """Mix workers that count the ranges handed to a worker thread (so a test knows the mix was split)."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.handed = 0

    def submit(self, fn):  # type: ignore[no-untyped-def]
        future = super().submit(fn)
        self.handed += future is not None
        return future


@pytest.fixture(scope="module")
def workers() -> CountingWorkers:
    pool = CountingWorkers(3)
    yield pool
    pool.close()


def _arrays(n: int, dtype: str, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if dtype == "bfloat16":
        return from_float32(values, np.empty(n, BFLOAT16))
    return values.astype(dtype)


def _both(kernel, workers: CountingWorkers, x: list[np.ndarray], *rest: list[np.ndarray]) -> tuple[list, list]:
    """``kernel`` on copies of the arrays, on one thread and then split over ``workers`` (checked to be split)."""
    serial, split = [a.copy() for a in x], [a.copy() for a in x]
    kernel(serial, *[[b.copy() for b in r] for r in rest])
    handed = workers.handed
    with workers.active():
        kernel(split, *[[b.copy() for b in r] for r in rest])
    assert workers.handed > handed  # a worker thread did mix part of it
    return serial, split


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("f", [0.5, 0.3])
def test_a_split_interpolation_gives_the_serial_bits(workers: CountingWorkers, n: int, dtype: str, f: float) -> None:
    x, peer = [_arrays(n, dtype, 1), _arrays(1000, dtype, 2)], [_arrays(n, dtype, 3), _arrays(1000, dtype, 4)]
    serial, split = _both(lambda a, b: interpolate_(a, b, f), workers, x, peer)
    for s, p, before in zip(serial, split, x):
        assert not np.array_equal(s.view(np.uint8), before.view(np.uint8))  # the mix did move x
        assert np.array_equal(s.view(np.uint8), p.view(np.uint8))


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_split_mix_with_a_narrower_peer_gives_the_serial_bits(workers: CountingWorkers, wire: str) -> None:
    n = SIZES[1]
    for f in (0.5, 0.25):
        serial, split = _both(
            lambda a, b, f=f: interpolate_(a, b, f), workers, [_arrays(n, "float32", 5)], [_arrays(n, wire, 6)]
        )
        assert np.array_equal(serial[0].view(np.uint32), split[0].view(np.uint32))


def test_a_split_mean_keeps_the_overflow_fallback_in_every_range(workers: CountingWorkers) -> None:
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
def test_the_other_split_kernels_give_the_serial_bits(workers: CountingWorkers, dtype: str) -> None:
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


def test_the_ranges_run_once_each_on_the_caller_and_the_workers(workers: CountingWorkers) -> None:
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


def test_an_error_in_a_range_is_raised_once_every_range_has_ended(workers: CountingWorkers) -> None:
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


def test_a_split_kernel_keeps_the_callers_numpy_error_state(workers: CountingWorkers) -> None:
    """An overflow in a worker's range raises as it would on the caller's thread when the caller asked numpy to
    raise (a worker thread's own error state is numpy's default: a warning)."""
    n = SIZES[1]
    x, reference = _arrays(n, "float32", 30), np.zeros(n, np.float32)
    x[-3] = 3e38  # in the last range: a worker's
    for threads in (None, workers):
        with np.errstate(over="raise"), pytest.raises(FloatingPointError):
            with threads.active() if threads is not None else contextlib.nullcontext():
                scale_motion_([x.copy()], [reference], 1.7)


def test_an_interrupted_wait_still_waits_for_every_range(workers: CountingWorkers) -> None:
    """A Ctrl-C while the caller waits for a worker's range is raised only once that range ended: the caller's
    cleanup (the peers' buffers given back, a leave's mix) never runs beside a worker still writing."""
    ended: list[float] = []
    last = split_ranges(SIZES[1], workers.threads, BLOCK)[-1][0]

    def body(lo: int, hi: int) -> None:
        if lo == last:
            time.sleep(0.5)  # seconds: the range waited for last still runs when the interrupt comes
        ended.append(time.monotonic())

    timer = threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with workers.active(), pytest.raises(KeyboardInterrupt):
        run_ranges(SIZES[1], BLOCK, body)
    raised = time.monotonic()
    timer.join(5.0)
    assert len(ended) == 3 and max(ended) <= raised


def test_a_mix_at_interpreter_exit_runs_on_the_caller(tmp_path: Path) -> None:
    """A node closed at exit (its finalizer) still mixes: once the interpreter stops taking new work for threads,
    the ranges run on the caller, with the serial bits."""
    script = tmp_path / "exit_mix.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit, numpy as np
            from dpwa.rules.mixing import interpolate_
            from dpwa.rules.workers import MixWorkers
            n = {SIZES[0]}
            rng = np.random.default_rng(1)
            x, p = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            expected = x.copy()
            interpolate_([expected], [p.copy()], 0.3)  # a writable peer is the kernel's scratch
            workers = MixWorkers(2)
            def at_exit():
                with workers.active():
                    interpolate_([x], [p], 0.3)
                print("same" if np.array_equal(x.view(np.uint32), expected.view(np.uint32)) else "differs")
            atexit.register(at_exit)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "same"


def test_a_dumped_transport_map_leaves_out_the_keys_at_their_default() -> None:
    """``mix_threads: auto`` (and ``memory: normal``) stay out of a dumped cluster file (``dpwa validate``, a run
    directory's copy), so a file written by this dpwa still loads in one that predates the key."""
    nodes = "nodes: [{name: a, host: 127.0.0.1, port: 5000}]\n"
    dumped = parse_config(nodes + "transport: {shared_memory: off}\n").to_dict()
    assert dumped["transport"] == {"shared_memory": "off"}
    dumped = parse_config(nodes + "transport: {shared_memory: off, mix_threads: 2, memory: low}\n").to_dict()
    assert dumped["transport"] == {"shared_memory": "off", "memory": "low", "mix_threads": 2}
    assert parse_config(yaml12.dump(dumped)).transport.mix_threads == 2
