"""``transport: {memory: normal}``: the blocks libzmq allocates for received chunks are reused, not faulted in again
(dpwa/node/allocator.py). Each process-wide setting is tried in a process of its own."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dpwa.node import allocator
from tests.conftest import free_ports, write_cluster

PAGE = 4096

_CHUNKS = """
import ctypes, sys, threading
from dpwa.node.allocator import keep_freed_blocks
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
CHUNK, CHUNKS = 4 << 20, 10

def faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])

def receive(counts):  # as libzmq's I/O thread: a new block per chunk, filled, freed once copied out
    for _ in range(6):
        before = faults()
        blocks = []
        for _ in range(CHUNKS):
            block = libc.malloc(CHUNK)
            ctypes.memset(block, 1, CHUNK)
            blocks.append(block)
        for block in blocks:
            libc.free(block)
        counts.append(faults() - before)

print(keep_freed_blocks() if sys.argv[1] == "kept" else None)
counts = []
thread = threading.Thread(target=receive, args=(counts,))
thread.start()
thread.join()
print(*counts[3:])
"""


def chunk_faults(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", _CHUNKS, mode], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    return out[0], [int(x) for x in out[1].split()]


def test_freed_chunk_blocks_are_reused_once_kept() -> None:
    """Ten 4 MiB blocks allocated, filled and freed per round on a thread of its own (libzmq's I/O thread receiving
    a 40 MB reply): without the setting glibc maps most rounds' pages afresh (the kernel faults each in); with it,
    the last three rounds fault in fewer than 1 % of their 10,240 pages."""
    pages = 10 * (4 << 20) // PAGE
    said, plain = chunk_faults("plain")
    assert said == "None" and max(plain) > pages // 2, plain  # the cost being removed: this glibc remaps them
    said, kept = chunk_faults("kept")
    assert said == "True" and max(kept) < pages // 100, kept


@pytest.mark.parametrize(
    ("environ", "tuned"),
    [
        ({}, False),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}, True),
        ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, True),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
        ({"MALLOC_TOP_PAD_": "0"}, True),
        ({"MALLOC_MMAP_MAX_": "0"}, True),
        ({"MALLOC_ARENA_MAX": "2"}, False),  # the thresholds are not touched by that one
    ],
)
def test_a_user_who_tuned_malloc_is_left_alone(
    environ: dict[str, str], tuned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert allocator.user_tuned_malloc(environ) is tuned
    if tuned:  # the node's call then sets nothing (the cached wrapper's body, run here without its cache)
        for key in ("GLIBC_TUNABLES", *[k for k in environ if k.startswith("MALLOC_")]):
            monkeypatch.delenv(key, raising=False)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(allocator, "_function", lambda *a: pytest.fail("mallopt called"))
        assert allocator.keep_freed_blocks.__wrapped__() is False


_NODES = """
import os, sys
import numpy as np
from dpwa.node.connection import DpwaConnection
from dpwa.node import allocator

def faults():  # of libzmq's I/O threads, which allocate each message received (sending is zero-copy)
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            if not f.read().startswith("ZMQbg/IO"):
                continue
        with open(f"/proc/self/task/{task}/stat") as f:
            total += int(f.read().rsplit(")", 1)[1].split()[7])
    return total

calls = []
real = allocator.keep_freed_blocks
import dpwa.node.core as core
core.keep_freed_blocks = lambda: calls.append(1) or real()
a = DpwaConnection("w1", sys.argv[1], seed=1)
b = DpwaConnection("w2", sys.argv[1], seed=2)
try:
    x = [np.full(4_000_000, 1.0, np.float32)]
    y = [np.full(4_000_000, 2.0, np.float32)]
    counts = []
    for _ in range(14):
        b.update_send(y, 1.0)
        before = faults()
        a.update_send(x, 1.0)
        a.update_wait(1.0)
        counts.append(faults() - before)
        assert a.last_exchange["status"] == "ok", a.last_exchange
        b.update_wait(1.0)
finally:
    a.close()
    b.close()
print(len(calls), *counts[4:])
"""


@pytest.mark.parametrize("memory", ["normal", "low"])
def test_a_node_fetching_over_tcp_faults_no_page_in_per_reply(tmp_path: Path, memory: str) -> None:
    """Two nodes over TCP (shared memory off), a 16 MB model fetched 14 times: in ``memory: normal`` (the node set
    the allocator up: ``keep_freed_blocks`` called) libzmq's I/O thread faults in no page for most replies once
    warm -- the median of the last ten is under 1 % of a reply's 3,906 pages (measured: 0-1 pages; now and then a
    reply still takes one fresh 4 MiB block, 1,020 pages); ``low`` leaves the allocator alone and gives its free
    pages back after each mix, so its replies fault theirs in again (measured: 1,025-4,070 per reply)."""
    config = write_cluster(
        tmp_path / "c.yaml",
        free_ports(2),
        timeout_ms=20000,
        fetch_probability=1.0,
        transport={"shared_memory": "off", "memory": memory},
    )
    out = subprocess.run(
        [sys.executable, "-c", _NODES, str(config)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    calls, counts = int(out[0]), [int(x) for x in out[1:]]
    pages = 4_000_000 * 4 // PAGE
    assert len(counts) == 10
    if memory == "normal":
        assert calls >= 1 and statistics.median(counts) < pages // 100, counts
    else:
        assert calls == 0 and statistics.median(counts) > pages // 4, counts
