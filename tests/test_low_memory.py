"""``transport: {memory: low}``: one snapshot buffer per node, rewritten in place (dpwa/node/snapshots.py).

What is checked: the pool waits for the sends of its one snapshot before it rewrites it, refuses new leases
meanwhile (a requester is told "not ready"), and keeps the snapshot when they outlast the wait; no lease ever sees
a half-rewritten snapshot, and no mix between two nodes takes one, over the socket or through shared memory; the
node holds one snapshot buffer and one receive buffer; with a narrower wire dtype a pull rule that reads nothing
back keeps that snapshot in the wire's dtype alone, with the bytes a converter would send; the config key. What this
saves is measured by the memory rows of ``dpwa bench exchange`` (docs/performance.md).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, mixed_whole, pool_publishing_flat_out, publishing_flat_out, wait_until, write_cluster

from dpwa import DpwaConnection
from dpwa.config import ConfigError, load_config, parse_config
from dpwa.node import core, sharedmem
from dpwa.node.snapshots import SnapshotPool
from dpwa.node.transport import rx
from dpwa.node.wire import Layout
from dpwa.rules.mixing import interpolate_
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32


def one_buffer_pool(size: int, drain_s: float, **kwargs: object) -> SnapshotPool:
    return SnapshotPool(Layout.of([np.zeros(size, np.float32)]), 1, 1, drain_s=drain_s, **kwargs)  # type: ignore


def test_a_one_buffer_pool_waits_for_the_sends_of_its_snapshot_then_rewrites_it() -> None:
    pool = one_buffer_pool(8, drain_s=10.0)
    try:
        first = pool.publish([np.full(8, 1.0, np.float32)], 1.0, 0.0, {})
        assert first is not None and len(pool) == 1
        held = pool.lease()  # a send in flight
        assert held is first
        done: list[object] = []
        writer = threading.Thread(target=lambda: done.append(pool.publish([np.full(8, 2.0, np.float32)], 2.0, 0, {})))
        writer.start()
        wait_until(lambda: pool.rewriting, 5, message="the writer waits for the send")
        assert pool.lease() is None  # no new lease while it waits: a requester is told "not ready"
        assert (held.views[0] == 1.0).all() and not done  # the leased snapshot is untouched
        pool.release(held)
        writer.join(10)
        assert done == [first] and (first.views[0] == 2.0).all() and first.gen == held.gen
        assert not pool.rewriting and pool.lease() is first and pool.skipped == 0
    finally:
        pool.close()


def test_a_one_buffer_pool_keeps_its_snapshot_when_the_sends_outlast_the_wait() -> None:
    pool = one_buffer_pool(8, drain_s=0.05)
    try:
        first = pool.publish([np.full(8, 1.0, np.float32)], 1.0, 0.0, {})
        assert first is not None
        gen = first.gen
        held = pool.lease()
        assert pool.publish([np.full(8, 2.0, np.float32)], 2.0, 0.0, {}) is None
        assert pool.skipped == 1 and not pool.rewriting
        assert (first.views[0] == 1.0).all() and first.gen == gen and first.clock == 1.0
        again = pool.lease()  # leases resume: peers keep getting the last snapshot
        assert again is first
        pool.release(again)
        pool.release(held)
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("wire", "shared", "wire_only"),
    [
        (None, False, False),
        ("float16", False, False),
        (None, True, False),
        ("bfloat16", True, True),
    ],
    ids=["float32", "float16-converter", "shared-memory", "bfloat16-wire-only-shared"],
)
def test_a_one_buffer_pool_never_lets_a_lease_see_a_half_rewritten_snapshot(
    wire: str | None, shared: bool, wire_only: bool
) -> None:
    """A writer publishes generation ``g`` as every element = v(g) as fast as it can; a reader leases the current
    snapshot, and every lease it gets holds one generation only (in the wire buffer too, which the converter
    thread rounds in the background and the reader completes, or which a wire-only pool's publish rounds into)."""
    if shared and not sharedmem.supported():
        pytest.skip("needs memfd_create and /proc (Linux)")
    layout = Layout.of([np.zeros(1 << 16, np.float32)])
    wire_layout = layout.on_wire(wire)
    pool = SnapshotPool(layout, 1, 1, wire=wire_layout, shared=shared, drain_s=10.0, name="low", wire_only=wire_only)
    checked = 0
    deadline = time.monotonic() + 30.0
    with pool_publishing_flat_out(pool, 1 << 16) as counts:
        # until the writer rewrote the buffer a few times too: how many publishes fit in the reader's 300 leases
        # is the scheduler's (the reader spins while it is refused a lease: 3 in one CI run)
        while checked < 300 or counts["published"] <= 10:
            assert time.monotonic() < deadline, f"{checked} leases, {counts['published']} publishes in 30 s"
            snapshot = pool.lease()
            if snapshot is None:  # being rewritten
                continue
            try:
                pool.complete(snapshot)
                values = snapshot.views[0] if snapshot.wire_views is None else snapshot.wire_views[0]
                assert values.min() == values.max(), "a torn snapshot"
                checked += 1
            finally:
                pool.release(snapshot)
    assert counts["published"] > 10 and counts["skipped"] == 0  # the reader's leases are short: never skipped


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_two_low_memory_nodes_never_mix_a_torn_snapshot(tmp_path: Path, shared_memory: str) -> None:
    """The writer publishes v(g) everywhere at every update_send, as fast as it can; the reader zeroes its model
    before each step, so after a mix every element holds one value -- unless it read a torn snapshot. The reader
    runs until it mixed 20 times (fetches that find the writer rewriting are declined "not ready")."""
    if shared_memory == "auto" and not sharedmem.supported():
        pytest.skip("needs memfd_create and /proc (Linux)")
    transport = {"shared_memory": shared_memory, "memory": "low"}
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant", transport=transport)
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        with publishing_flat_out(a, 1 << 18):
            x = np.zeros(1 << 18, np.float32)
            mixed = 0
            deadline = time.monotonic() + 60.0
            while mixed < 20:
                assert time.monotonic() < deadline, (mixed, b.stats())
                mixed += mixed_whole(b, x)
        for conn in (a, b):
            assert conn.stats()["snapshot_buffers"] == 1
        assert len(b._node.transfer.fetcher.slots) == 1  # and one receive buffer
        s = b.stats()
        assert s.get("shm_torn", 0) == 0 and s["fetches_rejected"] == 0
        if shared_memory == "auto":  # copied out of the segment and given back at once, never mixed from it
            assert s["shm_fetched"] == s["fetches_ok"] >= 20
            wait_until(lambda: a.stats().get("shm_released", 0) == s["shm_fetched"], 5, message="loans given back")
        else:
            assert s.get("shm_fetched", 0) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("hold_s", [30.0, 0.05], ids=["served-once-published", "declined-after-the-hold"])
def test_a_fetch_that_comes_while_the_snapshot_is_rewritten_is_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hold_s: float
) -> None:
    """``a`` waits to rewrite its one buffer (a send of it still in flight: a lease the test holds); ``b``'s FETCH
    that comes meanwhile is held back by ``a``'s RX thread, and served the new snapshot once it is published --
    or, held longer than ``HOLD_S``, declined "not ready" with the rewrite still going on."""
    monkeypatch.setattr(rx, "HOLD_S", hold_s)
    transport = {"shared_memory": "off", "memory": "low"}
    config = write_cluster(
        tmp_path / "c.yaml", free_ports(2), interpolation="constant", timeout_ms=20_000, transport=transport
    )
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        xb = np.zeros(1000, np.float32)
        b.update_send([xb], 1.0)  # b publishes; its fetch of a finds nothing yet
        b.update_wait(1.0)
        a.update_send([np.full(1000, 1.0, np.float32)], 1.0)
        a.update_wait(1.0)
        pool = a._node.pool
        assert pool is not None
        send = pool.lease()  # a send of the snapshot 1.0 in flight
        rewrite = threading.Thread(target=a.update_send, args=([np.full(1000, 3.0, np.float32)], 1.0))
        rewrite.start()
        try:
            wait_until(lambda: pool.rewriting, 10, message="a waits to rewrite its snapshot")
            xb.fill(0.0)
            b.update_send([xb], 1.0)
            wait_until(lambda: a.stats().get("fetches_held", 0) == 1, 10, message="b's fetch held back")
            if hold_s < 1:
                factor = b.update_wait(1.0)
                assert factor == 0.0 and (xb == 0).all() and b.stats()["fetches_not_ready"] >= 1
                assert b.stats()["refused_by_reason"].get("not-ready", 0) >= 1
                pool.release(send)
            else:
                pool.release(send)
                factor = b.update_wait(1.0)
                assert factor > 0 and (xb == 1.5).all()  # the new snapshot (3.0), never the one being rewritten
        finally:
            rewrite.join(30)
        a.update_wait(1.0)
    finally:
        a.close()
        b.close()


def test_the_memory_key_takes_normal_or_low(tmp_path: Path) -> None:
    nodes = "nodes: [{name: a, host: 127.0.0.1, port: 5000}]\n"
    assert parse_config(nodes).transport.memory == "normal"
    assert parse_config(nodes + "transport: {memory: low}\n").transport.memory == "low"
    path = tmp_path / "bad.yaml"
    path.write_text(nodes + "transport: {memory: tiny}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:2: transport.memory: unknown value 'tiny'; allowed: normal, low"


@pytest.mark.parametrize("shared_memory", ["off", "auto"])
def test_an_adpsgd_exchange_in_one_buffer_mixes_the_same_bits_as_with_a_pool(
    tmp_path: Path, shared_memory: str
) -> None:
    """``b`` exchanges with ``a``; ``a`` then publishes (a one-buffer ``a`` rewrites the snapshot it served, the
    exchange keeping ``push - served`` instead) and mixes its half: both ends hold the same bits as with a pool."""
    if shared_memory == "auto" and not sharedmem.supported():
        pytest.skip("needs memfd_create and /proc (Linux)")
    rng = np.random.default_rng(11)
    start = {n: [rng.standard_normal(s, dtype=np.float32) for s in (300_000, 77)] for n in "ab"}
    results = {}
    for memory in ("normal", "low"):
        transport = {"shared_memory": shared_memory, "memory": memory}
        config = write_cluster(
            tmp_path / f"{memory}.yaml", free_ports(2), timeout_ms=5000, interpolation="adpsgd", transport=transport
        )
        a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
        xa, xb = [x.copy() for x in start["a"]], [x.copy() for x in start["b"]]
        try:
            a.update_send(xa, 1.0)  # a publishes; its exchange finds b not ready
            a.update_wait(1.0)
            b.update_send(xb, 1.0)  # b's push waits in a's inbox, paired with the snapshot a serves back
            assert b.update_wait(1.0) == 0.5
            wait_until(lambda a=a: a.stats()["exchanges_committed"] == 1, 10, message="a learns the commit")
            a.update_send(xa, 1.0)  # publishes over the served snapshot (low), then a's own exchange with b
            a.update_wait(1.0)  # a's half of b's exchange, and of its own
            assert a.stats()["mixes"] == 1 and a.stats()["snapshots_skipped"] == 0
            assert a.stats()["snapshot_buffers"] == (1 if memory == "low" else 3)
        finally:
            a.close()
            b.close()
        results[memory] = xa + xb
    assert all(x.tobytes() == y.tobytes() for x, y in zip(results["low"], results["normal"]))


_RETAINED = """
import ctypes
from dpwa.node.allocator import give_back_freed
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

libc.free(libc.malloc(4 << 20))  # a freed 4 MiB block: glibc keeps the next ones (its threshold rises)
blocks = [libc.malloc(4 << 20) for _ in range(16)]
pin = libc.malloc(1 << 20)  # a live block above them (as in a real heap): the freed ones are not at its top
for block in blocks:
    ctypes.memset(block, 1, 4 << 20)
for block in blocks:
    libc.free(block)
kept = rss_kib()
went = give_back_freed()
print(went, kept - rss_kib())
"""


def test_give_back_freed_returns_the_blocks_glibc_kept_to_the_kernel() -> None:
    """What ``memory: low`` does after each mix: 16 freed 4 MiB blocks (as libzmq's chunks of a TCP reply) that
    glibc kept stay resident until :func:`give_back_freed`; after it, at least 48 of their 64 MiB are gone."""
    out = subprocess.run([sys.executable, "-c", _RETAINED], capture_output=True, text=True, timeout=60, check=True)
    went, freed_kib = out.stdout.split()
    assert went == "True" and int(freed_kib) >= 48 * 1024, out.stdout


@pytest.mark.parametrize("memory", ["normal", "low"])
def test_a_low_memory_node_gives_back_what_the_allocator_kept_after_every_mix(
    tmp_path: Path, memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memory: low`` calls :func:`~dpwa.node.allocator.give_back_freed` once per ``update_wait``; ``normal``
    never (it keeps its buffers for speed)."""
    calls = []
    monkeypatch.setattr(core, "give_back_freed", lambda: calls.append(1) or True)
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), timeout_ms=200, transport={"memory": memory})
    conn = DpwaConnection("w1", str(config), seed=1)
    try:
        x = [np.zeros(100, np.float32)]
        for _ in range(3):
            conn.update_send(x, 1.0)
            conn.update_wait(1.0)
    finally:
        conn.close()
    assert len(calls) == (3 if memory == "low" else 0)


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
def test_a_wire_only_pool_holds_the_wire_buffer_alone_with_the_bits_a_converter_rounds(wire: str) -> None:
    """A wire-only pool's snapshot is its wire buffer alone (the wire's size, no plain copy) and holds, the moment
    it is published, the very bytes a pool with a plain copy sends once its converter rounded them."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(3000).astype(np.float32), rng.standard_normal((40, 70)).astype(np.float32)]
    layout = Layout.of(arrays)
    wire_layout = layout.on_wire(wire)
    only = SnapshotPool(layout, 1, 1, wire=wire_layout, name="only", wire_only=True)
    plain = SnapshotPool(layout, 1, 1, wire=wire_layout, name="plain")
    try:
        a, b = only.publish(arrays, 1.0, 0.0, {}), plain.publish(arrays, 1.0, 0.0, {})
        assert a is not None and b is not None
        assert a.buffer.nbytes == wire_layout.total_bytes < layout.total_bytes and a.views == a.readonly == []
        assert a.ready == len(a.frames)  # whole once published: nothing left for a converter
        plain.complete(b)
        assert b"".join(bytes(f) for f in a.frames) == b"".join(bytes(f) for f in b.frames)
    finally:
        only.close()
        plain.close()
    with pytest.raises(ValueError, match="wire's dtype alone"):
        SnapshotPool(layout, 1, 1, wire=layout, wire_only=True)


@pytest.mark.parametrize(
    ("rule", "memory", "wire_only"),
    [
        ("constant", "low", True),
        ("dpsgd", "low", False),
        ("constant", "normal", False),
        ("gem", "low", False),
        ("pushsum", "low", False),
    ],
)
def test_a_low_memory_pull_node_keeps_its_snapshot_in_a_narrower_wire_dtype_alone(
    tmp_path: Path, rule: str, memory: str, wire_only: bool
) -> None:
    """``memory: low`` and a 16-bit wire: a pull rule that never reads what it published keeps its one snapshot (and
    its receive buffer) in the wire's dtype alone (GEM and D-PSGD read it, push-sum returns refused mass from it: a
    plain copy stays, as in the default mode); two such nodes mix each other's rounded model, whole."""
    transport = {"shared_memory": "off", "memory": memory}
    # timeout_ms 500: push-sum's one step waits that long for the push of w1, which only publishes
    config = write_cluster(
        tmp_path / "c.yaml",
        free_ports(2),
        interpolation=rule,
        transport=transport,
        wire_dtype="bfloat16",
        timeout_ms=500,
    )
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        with publishing_flat_out(a, 4096):
            x = np.zeros(4096, np.float32)
            if rule == "constant":  # it mixes the peer whole; D-PSGD's, GEM's and push-sum's moves vary
                deadline = time.monotonic() + 30.0
                while not mixed_whole(b, x):
                    assert time.monotonic() < deadline, b.stats()
            else:  # one step: the node's pool is set up
                b.update_send([x], 1.0)
                b.update_wait(1.0)
        for conn in (a, b):
            pool = conn._node.pool
            assert pool is not None and pool.wire_only is wire_only
            assert all(s.buffer.nbytes == (8192 if wire_only else 16384) for s in pool._all)
            # and so does what it receives (the mix widens it): a rule reading its snapshot back receives float32
            assert all(buf.nbytes == (8192 if wire_only else 16384) for buf, _ in conn._node.transfer.fetcher.slots)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("shared_memory", ["off", "auto"])
def test_a_low_memory_node_receives_a_16_bit_wire_in_its_dtype_and_mixes_the_widened_bits(
    tmp_path: Path, wire: str, shared_memory: str
) -> None:
    """``memory: low``, a 16-bit wire, a rule that reads nothing back: the receive buffer is in the wire's dtype
    (half a float32 model), and the mix widens it as it reads: ``y <- (1-f)*y + f*widen(round(v))`` to the bit,
    over the socket and through shared memory; in the default mode the buffer stays float32."""
    n = 3 * 65536 + 5  # several mixing blocks and a partial one
    transport = {"shared_memory": shared_memory, "memory": "low"}
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), transport=transport, wire_dtype=wire)
    rng = np.random.default_rng(7)
    v, y0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    if wire == "float16":
        rounded = v.astype(np.float16).astype(np.float32)
    else:
        rounded = to_float32(from_float32(v, np.empty(n, BFLOAT16)), np.empty(n, np.float32))
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        a.update_send([v.copy()], 1.0)  # a publishes v once and never again: what b fetches stays round(v)
        deadline = time.monotonic() + 30.0
        while True:
            y = y0.copy()
            b.update_send([y], 1.0)
            f = b.update_wait(1.0)
            if f > 0:
                break
            assert time.monotonic() < deadline, b.stats()
        buffers = b._node.transfer.fetcher.slots
        wire_bytes = b._node.wire_layout.total_bytes
        assert buffers and all(buffer.nbytes == wire_bytes < 4 * n for buffer, _ in buffers), "not in 16 bits"
        expected = [y0.copy()]
        interpolate_(expected, [rounded], f)
        np.testing.assert_array_equal(y.view(np.uint32), expected[0].view(np.uint32))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("arrays", "wire", "wire_only", "narrower", "receives_in_wire"),
    [
        ([np.float32, np.float32], "bfloat16", True, True, True),
        ([np.float32, np.float32], "float16", True, True, True),
        ([np.float32, np.float32], "bfloat16", True, False, False),  # the rule mixes through another kernel
        ([np.float32, np.float32], "bfloat16", False, True, False),  # a plain copy beside the wire (gem's)
        ([np.float32, np.float64], "bfloat16", True, True, False),  # float64 travels narrowed: no kernel widens it
        ([np.float32, np.float32], "int8", True, True, False),  # int8 travels with its scales
    ],
)
def test_the_receive_layout_is_the_wires_only_where_every_array_can_be_mixed_from_it(
    arrays: list[type], wire: str, wire_only: bool, narrower: bool, receives_in_wire: bool
) -> None:
    from dpwa.node.snapshots import receive_layout

    layout = Layout.of([np.zeros(64, dtype) for dtype in arrays])
    pool = SnapshotPool(layout, 1, 1, wire=layout.on_wire(wire), wire_only=wire_only)
    try:
        assert receive_layout(pool, narrower) is (pool.wire if receives_in_wire else pool.layout)
    finally:
        pool.close()
