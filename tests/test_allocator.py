"""The blocks libzmq allocates for received chunks: reused in ``transport: {memory: normal}``, not faulted in again;
unmapped when freed in ``low``, none kept (dpwa/node/allocator.py). Each process-wide setting is tried in a process
of its own."""

from __future__ import annotations

import os
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
from dpwa.node.allocator import set_up_allocator
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

print(set_up_allocator("normal") if sys.argv[1] == "kept" else None)
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


_TOP = """
import ctypes, sys, threading
from dpwa.node.allocator import set_up_allocator
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
CHUNK = 4 << 20

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

def receive():  # two chunks at a time, as a thread receiving a push of two chunks, three times
    for _ in range(3):
        blocks = [libc.malloc(CHUNK) for _ in range(2)]
        for block in blocks:
            ctypes.memset(block, 1, CHUNK)
        for block in blocks:
            libc.free(block)

print(set_up_allocator("low") if sys.argv[1] == "low" else None)
before = rss_kib()
thread = threading.Thread(target=receive)
thread.start()
thread.join()
libc.malloc_trim(0)  # what a low node does after each mix
print(rss_kib() - before)
"""


def test_a_low_memory_process_keeps_no_freed_chunk() -> None:
    """Two 4 MiB chunks received and freed on a thread of its own: without the setting glibc keeps them at the top
    of that thread's heap, 8 MiB out of ``malloc_trim``'s reach; set up for ``memory: low`` it unmaps each when
    freed: under 1 MiB more resident afterwards."""
    runs = {}
    for mode in ("plain", "low"):
        out = subprocess.run(
            [sys.executable, "-c", _TOP, mode], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        runs[mode] = (out[0], int(out[1]))
    assert runs["plain"][0] == "None" and runs["plain"][1] > 7 * 1024, runs  # the cost being removed
    assert runs["low"][0] == "True" and runs["low"][1] < 1024, runs


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
    if tuned:  # a node then sets nothing (as in a fresh process: nothing set up yet)
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(allocator, "_applied", None)
        called = []
        monkeypatch.setattr(allocator, "_function", lambda *a: lambda *b: called.append(b) or 1)
        assert allocator.set_up_allocator("normal") is False
        assert allocator.set_up_allocator("low") is False and called == []


def test_the_first_mode_set_up_holds_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process's allocator is set up once, for its first node's mode: a later node of the other mode is told so
    (False, and a warning), one of the same mode is not set up again."""
    for key in [k for k in os.environ if k.startswith("MALLOC_")] + ["GLIBC_TUNABLES"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(allocator, "_applied", None)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(allocator, "_function", lambda *a: lambda *b: calls.append(b) or 1)
    assert allocator.set_up_allocator("low") is True
    assert calls == [(-3, allocator.LOW_THRESHOLD), (-1, allocator.LOW_THRESHOLD)]
    assert allocator.set_up_allocator("low") is True and len(calls) == 2
    assert allocator.set_up_allocator("normal") is False and len(calls) == 2


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
real = allocator.set_up_allocator
import dpwa.node.core as core
core.set_up_allocator = lambda memory: calls.append(memory) or real(memory)
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
print(",".join(calls), *counts[4:])
"""


@pytest.mark.parametrize("memory", ["normal", "low"])
def test_a_node_fetching_over_tcp_faults_no_page_in_per_reply(tmp_path: Path, memory: str) -> None:
    """Two nodes over TCP (shared memory off), a 16 MB model fetched 14 times, each node setting the allocator up
    for its mode: in ``memory: normal`` libzmq's I/O thread faults in no page for most replies once warm -- the
    median of the last ten is under 1 % of a reply's 3,906 pages (measured: 0-1 pages; now and then a reply still
    takes one fresh 4 MiB block, 1,020 pages); in ``low`` every chunk's block is unmapped when freed, so each reply
    faults its pages in again."""
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
    calls, counts = out[0].split(","), [int(x) for x in out[1:]]
    pages = 4_000_000 * 4 // PAGE
    assert len(counts) == 10
    assert calls == [memory, memory], calls  # both nodes, at their first update_send
    if memory == "normal":
        assert statistics.median(counts) < pages // 100, counts
    else:
        assert statistics.median(counts) > pages * 9 // 10, counts
