"""Shared memory between co-located nodes (dpwa/node/sharedmem.py): a fetch answered with the server's segment.

What is checked: the protocol (a co-located fetch reads the segment, the socket carries only headers, the loan
is given back; ``transport: {shared_memory: off}`` and a differing co-location identity go over the socket); no
torn read while the server publishes as fast as it can; a segment of the wrong size, token or generation is
refused and counted, never mixed; segments leave nothing behind (a clean close closes them; a SIGKILLed node's
memory is gone once its restarted self is fetched from); and a wrong-layout reply is refused as on the socket.
Nodes in two network namespaces are tested in tests/test_netns.py (they fetch over TCP).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (
    NodeProcess,
    collector_paused,
    free_ports,
    in_threads,
    mixed_whole,
    pool_publishing_flat_out,
    publishing_flat_out,
    wait_until,
    write_cluster,
)
from test_hostile import FakePeers

from dpwa import DpwaConnection
from dpwa.node import serving, sharedmem, wire
from dpwa.node.inbox import PushReceiver
from dpwa.node.loans import Loans
from dpwa.node.serving import lends_to, serve
from dpwa.node.sharedmem import HEADER_BYTES, Segment, SegmentReader, host_identity
from dpwa.node.snapshots import SnapshotPool
from dpwa.node.stats import NodeStats
from dpwa.node.transfers.fetcher import loan_holds_until
from dpwa.node.transport import Transport
from dpwa.node.transport.shared import SharedReplies
from dpwa.node.wire import Layout, SharedRef, WireError

pytestmark = pytest.mark.skipif(not sharedmem.supported(), reason="needs memfd_create and /proc (Linux)")


def memfds(pid: int, tag: str) -> dict[int, int]:
    """fd -> inode of ``pid``'s open memory files named ``dpwa-<tag>``."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:dpwa-{tag} "):
                out[int(fd)] = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except OSError:  # closed meanwhile
            continue
    return out


def mapped_inodes(pid: int) -> set[int]:
    """The inodes of the memory files ``pid`` maps (its /proc/PID/maps)."""
    inodes = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "/memfd:dpwa-" in line:
                inodes.add(int(parts[4]))
    return inodes


def pair(tmp_path: Path, **settings: object) -> tuple[DpwaConnection, DpwaConnection]:
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant", **settings)
    return DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)


def steps(conn: DpwaConnection, x: np.ndarray, n: int, before: Callable[[int], None] | None = None) -> list[float]:
    factors = []
    for i in range(n):
        if before is not None:
            before(i)
        conn.update_send([x], 1.0)
        factors.append(conn.update_wait(1.0))
    return factors


def step_until_fetched(a: DpwaConnection, b: DpwaConnection, xa: np.ndarray, xb: np.ndarray, n: int) -> None:
    """Both trainers step until each node has ``n`` good fetches, within 30 s (how many of a fixed number of
    free-running steps find the peer published and answering in time depends on how the threads run)."""

    def fetched() -> bool:
        return all(conn.stats()["fetches_ok"] >= n for conn in (a, b))

    def train(i: int) -> None:
        conn, x = ((a, xa), (b, xb))[i]
        deadline = time.monotonic() + 30.0
        while not fetched():
            assert time.monotonic() < deadline, (a.stats()["fetches_ok"], b.stats()["fetches_ok"])
            steps(conn, x, 1)

    in_threads(2, train, timeout=60)


# --------------------------------------------------------------------------- the segment and its reader


def test_host_identity_is_stable_and_names_the_namespaces() -> None:
    ident = host_identity()
    assert len(ident) == 32 and int(ident, 16) >= 0
    assert host_identity() == ident


def identity_of_a_child(*unshare: str) -> str:
    """The co-location identity a child process computes (under ``unshare`` with the flags given, if any)."""
    code = "from dpwa.node.sharedmem import host_identity; print(host_identity())"
    command = [*(["unshare", *unshare, "--fork"] if unshare else []), sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.exists("/proc/self/ns/time"),
    reason="needs root, unshare(1) and time namespaces (Linux >= 5.6)",
)
def test_a_process_in_another_time_namespace_is_not_co_located() -> None:
    """A loan ends at a CLOCK_MONOTONIC deadline, which a time namespace offsets: a node in another one must
    fetch over the socket. A child in this process's namespaces is co-located; one in a new time namespace is
    not."""
    assert identity_of_a_child() == host_identity()
    assert identity_of_a_child("--time") not in ("", host_identity())


def test_a_reader_refuses_a_segment_of_another_size_token_or_generation() -> None:
    segment = Segment("t", 4096)
    try:
        segment.set_gen(7)
        reader = SegmentReader()
        ref = segment.ref(7, 1e9)
        mapped = reader.open("p", ref, 4096, 7)
        assert mapped.payload.nbytes == 4096 and int(mapped.gen[0]) == 7 and not mapped.payload.flags.writeable
        assert int(mapped.checked[0]) == 0  # set_gen without checked: nothing attested
        with pytest.raises(WireError) as size:
            SegmentReader().open("p", ref, 4096 + 64, 7)
        assert size.value.reason == "shm-size"
        forged = SharedRef(pid=ref.pid, fd=ref.fd, token="0" * 32, until=ref.until)
        with pytest.raises(WireError) as token:
            SegmentReader().open("p", forged, 4096, 7)
        assert token.value.reason == "shm-token"
        with pytest.raises(WireError) as gen_:
            reader.open("p", ref, 4096, 8)
        assert gen_.value.reason == "shm-gen"
        fifo = Path(tempfile.mkdtemp()) / "fifo"
        os.mkfifo(fifo)
        held = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a forged reply naming a FIFO: never blocks the reader
        try:
            with pytest.raises(WireError) as not_a_file:
                SegmentReader().open("p", SharedRef(pid=ref.pid, fd=held, token=ref.token, until=1e9), 4096, 7)
            assert not_a_file.value.reason == "shm-token"
        finally:
            os.close(held)
        gone = SharedRef(pid=ref.pid, fd=10**6, token=ref.token, until=ref.until)
        with pytest.raises(WireError) as missing:
            SegmentReader().open("p", gone, 4096, 7)
        assert missing.value.reason == "shm-open"
    finally:
        segment.close()


def test_a_value_found_invalid_while_the_segment_was_rewritten_is_a_torn_read_not_a_bad_value() -> None:
    """A copy out of a segment that finds a NaN counts as ``non-finite`` only if the segment still holds the
    generation the reply named; rewritten meanwhile (here: generation 6 where 5 was named, a NaN half-written) it
    is ``shm-torn``, the owner's race, not a bad value from the peer."""
    from dpwa.node.frames import copy_segment
    from dpwa.node.wire.payload import PayloadReader

    layout = Layout.of([np.zeros(1024, np.float32)])
    segment = Segment("torn", layout.total_bytes)
    try:
        values = segment.payload[: layout.total_bytes].view(np.float32)
        values[:] = 1.0
        values[7] = np.nan
        segment.set_gen(5)
        mapped = SegmentReader().open("p", segment.ref(5, 1e9), layout.total_bytes, 5)
        buffer = layout.allocate()
        views = layout.views(buffer)
        with pytest.raises(WireError) as bad:
            copy_segment(mapped, 5, PayloadReader(layout, layout), buffer, views, layout.frame_bounds())
        assert bad.value.reason == "non-finite"  # the generation named: the peer's value
        segment.set_gen(6)
        with pytest.raises(WireError) as torn:
            copy_segment(mapped, 5, PayloadReader(layout, layout), buffer, views, layout.frame_bounds())
        assert torn.value.reason == "shm-torn"
    finally:
        segment.close()


def test_a_pool_that_cannot_make_all_its_segments_closes_the_ones_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The third segment fails (out of descriptors): the two made are closed and unmapped before the error
    propagates. Before, they stayed open until the garbage collector found them."""
    from dpwa.node import snapshots

    made: list[Segment] = []

    def segment(tag: str, payload_bytes: int) -> Segment:
        if len(made) == 2:
            raise OSError(24, "Too many open files")
        made.append(Segment(tag, payload_bytes))
        return made[-1]

    monkeypatch.setattr(snapshots, "Segment", segment)
    with pytest.raises(OSError, match="Too many open files"):
        SnapshotPool(Layout.of([np.zeros(100, np.float32)]), shared=True, name="emfile")
    assert len(made) == 2 and all(s.closed and s.payload.nbytes == 0 for s in made)
    # a snapshot whose plain buffer cannot be had (a 16-bit wire: the segment holds the wire's; ENOMEM) unmaps the
    # segment made for it too
    made.clear()
    layout = Layout.of([np.zeros(100, np.float32)])
    monkeypatch.setattr(Layout, "allocate", lambda self: (_ for _ in ()).throw(MemoryError("no memory")))
    with pytest.raises(MemoryError):
        SnapshotPool(layout, shared=True, name="enomem", wire=layout.on_wire("bfloat16"))
    assert len(made) == 1 and made[0].closed and made[0].payload.nbytes == 0


def test_a_segment_cannot_change_size_under_its_readers_and_an_unsealed_file_is_refused() -> None:
    """Another process of the same user that opens a segment through /proc and truncates it would end every reader
    that maps it with SIGBUS: the segment is sealed once sized, so that fails; and a reader refuses a memory file
    whose size is not sealed (``shm-seals``), however right its header is."""
    segment = Segment("sealed", 4096)
    unsealed = os.memfd_create("dpwa-unsealed", os.MFD_CLOEXEC)
    try:
        segment.set_gen(3)
        for length in (0, HEADER_BYTES, HEADER_BYTES + 8192):
            with open(f"/proc/{os.getpid()}/fd/{segment.fd}", "r+b") as other:
                with pytest.raises(PermissionError):
                    os.ftruncate(other.fileno(), length)
        assert os.fstat(segment.fd).st_size == HEADER_BYTES + 4096
        assert SegmentReader().open("p", segment.ref(3, 1e9), 4096, 3).payload.nbytes == 4096
        os.ftruncate(unsealed, HEADER_BYTES + 4096)  # the same header and size, no seals
        os.pwrite(unsealed, os.pread(segment.fd, HEADER_BYTES, 0), 0)
        forged = SharedRef(pid=os.getpid(), fd=unsealed, token=segment.token.hex(), until=1e9)
        with pytest.raises(WireError) as refused:
            SegmentReader().open("p", forged, 4096, 3)
        assert refused.value.reason == "shm-seals"
        # a file on disk (or any descriptor but a dpwa memfd) is refused from what its /proc link names, before it
        # is opened: opening a FIFO, a device or a file on a hung mount can block or act; and a memfd of another name
        another = os.memfd_create("other", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            with tempfile.TemporaryFile(dir=Path(__file__).parent) as on_disk:
                for fd in (on_disk.fileno(), another):
                    named = SharedRef(pid=os.getpid(), fd=fd, token=segment.token.hex(), until=1e9)
                    with pytest.raises(WireError, match="is not a dpwa memory file") as not_ours:
                        SegmentReader().open("p", named, 4096, 3)
                    assert not_ours.value.reason == "shm-token"
        finally:
            os.close(another)
    finally:
        os.close(unsealed)
        segment.close()


def test_a_member_that_went_has_its_segments_unmapped_by_every_reader() -> None:
    """A peer that leaves or dies is forgotten by the member table; its segments (a model each) must not stay
    mapped in its co-located peers until 64 others push them out: the fetcher's reader (TX thread), and the
    inbox's (RX thread, at its next tick) drop them. A view still held (a loan being mixed) stays readable."""
    layout = Layout.of([np.zeros(256, np.float32)])
    segment = Segment("gone", layout.total_bytes)
    try:
        segment.set_gen(5)
        reader = SegmentReader()
        held = reader.open("w2", segment.ref(5, 1e9), layout.total_bytes, 5).payload
        assert reader.mapped() == 1 and reader.forget("w9") == 0 and reader.mapped() == 1
        assert reader.forget("w2") == 1 and reader.mapped() == 0 and held.nbytes == layout.total_bytes
        assert reader.forget("w2") == 0

        replies = SharedReplies("w1", lambda event, n: None)  # the fetcher's side
        replies._segments.open("w2", segment.ref(5, 1e9), layout.total_bytes, 5)
        replies.forget("w2")
        assert replies._segments.mapped() == 0

        inbox = PushReceiver(  # the pushes' side: w2 pushes through its segment
            "w1",
            ["w1", "w2"],
            lambda: (layout, layout),
            1,
            30.0,
            lambda k, n: None,
            print,
            lambda s: None,
            per_sender=1,
            host_id=host_identity(),
        )
        inbox.allocate(layout)
        push = wire.encode_push(
            "w2",
            1,
            clock=1.0,
            loss=1.0,
            extras={"w_given": 0.5},
            layout=layout,
            host=host_identity(),
            gen=5,
            shm=segment.ref(5, 1e9),
        )
        answer = inbox.begin(b"id", wire.decode_message(push), None)
        assert answer is not None and wire.decode_message(answer).kind is wire.Kind.ACK
        assert inbox.segments.mapped() == 1
        inbox.set_senders(["w1", "w2", "w3"])  # a member came: nothing to unmap
        inbox.expire(time.monotonic())
        assert inbox.segments.mapped() == 1
        inbox.set_senders(["w1", "w3"])  # w2 went
        assert inbox.segments.mapped() == 1  # unmapped by the RX thread, at its tick
        inbox.expire(time.monotonic())
        assert inbox.segments.mapped() == 0
    finally:
        segment.close()


@pytest.mark.timing  # counts of fetches in a run of real threads; 30 runs: no failure
def test_a_pool_never_rewrites_a_leased_segment_while_a_reader_checks_it() -> None:
    """The torn-read check at the pool: a writer publishes generation ``g`` as every element = v(g), as fast as it
    can; a reader leases the current snapshot, reads it through its segment and finds one generation only."""
    layout = Layout.of([np.zeros(1 << 18, np.float32)])
    pool = SnapshotPool(layout, shared=True, name="torn")
    reader = SegmentReader()
    checked = 0
    with pool_publishing_flat_out(pool, 1 << 18) as counts:
        for _ in range(300):
            snapshot = pool.lease()
            assert snapshot is not None and snapshot.segment is not None
            try:
                ref = snapshot.segment.ref(snapshot.gen, 1e9)
                values = layout.views(reader.open("w", ref, layout.total_bytes, snapshot.gen).payload)[0]
                assert values.min() == values.max(), "a torn snapshot"
                checked += 1
            finally:
                pool.release(snapshot)
    assert checked == 300 and counts["published"] > 10


# --------------------------------------------------------------------------- nodes


def test_co_located_nodes_fetch_through_shared_memory(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    try:
        xa, xb = np.ones(100_000, np.float32), np.zeros(100_000, np.float32)
        step_until_fetched(a, b, xa, xb, 15)
        assert np.ptp(xa) == 0 and np.ptp(xb) == 0  # every mix took the whole of one snapshot
        for mine, theirs in ((a, b), (b, a)):
            fetched = mine.stats()
            assert fetched["fetches_ok"] == fetched["shm_fetched"] >= 15
            assert fetched["bytes_in"] < 1000 * fetched["fetches_ok"]  # headers only: 400 kB per snapshot stayed put
            # the server counts a lent reply once its send returned, which may be after the reader had it
            done = fetched["shm_fetched"]
            wait_until(lambda t=theirs, n=done: t.stats()["shm_served"] == n, 5, message="lent replies counted")
        wait_until(lambda: a.stats()["shm_released"] == b.stats()["shm_fetched"], 5, message="loans given back")
        assert a.stats().get("shm_loans_expired", 0) == 0
        for conn in (a, b):  # each mixed straight from the segment, and measured how long it held the loan
            assert 0.0 < conn._node.transfer.fetcher.longest_hold_s < 5.0
    finally:
        a.close()
        b.close()


def test_a_lent_reply_is_mixed_only_with_room_for_twice_the_longest_hold() -> None:
    """A loan is read in place until the rule is done, and the server may reuse the buffer once it ends: a reply
    is mixed only with more than a second left plus twice the longest the node has held a loan (a model of a few
    GB takes seconds to mix; a fixed second would let the server rewrite it under the mix)."""
    assert loan_holds_until(10.0, 8.9, 0.0) and not loan_holds_until(10.0, 9.1, 0.0)
    assert not loan_holds_until(10.0, 7.0, 1.5)  # 3 s left, but the node has held a loan 1.5 s
    assert loan_holds_until(10.0, 5.9, 1.5)


def test_before_its_first_loan_a_node_assumes_its_mix_reads_a_gb_a_second(tmp_path: Path) -> None:
    """The first lent reply must outlast the mix too: before any loan was held, the hold assumed is the model's
    bytes at FIRST_MIX_BYTES_PER_S (a 4 GB model: 4 s), not 0 (a fixed second of margin)."""
    from dpwa.node.transfers.fetcher import FIRST_MIX_BYTES_PER_S

    a, b = pair(tmp_path)
    try:
        fetcher = a._node.transfer.fetcher
        assert fetcher.longest_hold_s == 0.0
        b.update_send([np.ones(2_500_000, np.float32)], 1.0)
        a.update_send([np.zeros(2_500_000, np.float32)], 1.0)  # 10 MB: the buffers are allocated
        assert fetcher.longest_hold_s == pytest.approx(1e7 / FIRST_MIX_BYTES_PER_S, rel=0.01)
        # ... until a mix of a lent reply is measured, which replaces it (not a floor: a large model's estimate
        # would copy every reply out for good)
        fetcher.longest_hold_s = 1e6  # as a model of 1 PB would estimate: the reply is copied out, and measured
        assert a.update_wait(1.0) == 0.5 and a.stats()["shm_loans_copied"] == 1
        assert fetcher.longest_hold_s < 60.0
    finally:
        a.close()
        b.close()


def test_shared_memory_off_fetches_over_the_socket(tmp_path: Path) -> None:
    a, b = pair(tmp_path, transport={"shared_memory": "off"})
    try:
        xa, xb = np.ones(1000, np.float32), np.zeros(1000, np.float32)
        step_until_fetched(a, b, xa, xb, 3)
        for conn in (a, b):
            s = conn.stats()
            assert s["fetches_ok"] >= 3 and s.get("shm_fetched", 0) == 0 and s["bytes_in"] > 4000 * s["fetches_ok"]
    finally:
        a.close()
        b.close()


@pytest.mark.timing  # counts of fetches in a run of real threads; 30 runs: no failure
def test_a_fetch_never_mixes_a_torn_snapshot_while_the_server_publishes_flat_out(tmp_path: Path) -> None:
    """The writer publishes v(g) everywhere at every update_send, as fast as it can; the reader zeroes its model
    before each step, so after a mix every element holds the same value -- unless it read a torn snapshot."""
    a, b = pair(tmp_path)
    try:
        with publishing_flat_out(a, 1 << 20):
            x = np.zeros(1 << 20, np.float32)
            mixed = sum(mixed_whole(b, x) for _ in range(60))
        assert mixed >= 30 and b.stats()["shm_fetched"] >= 30
        assert b.stats().get("shm_torn", 0) == 0
    finally:
        a.close()
        b.close()


def test_a_reply_naming_a_bad_segment_is_refused_counted_and_never_mixed(tmp_path: Path) -> None:
    """A fake co-located peer answers with a segment of the wrong size, then one whose token does not match:
    both rejected under their reason, the parameters untouched; a wrong layout is refused as on the socket."""
    ports = free_ports(2)
    config = write_cluster(tmp_path / "c.yaml", ports, interpolation="constant")
    fake = FakePeers({"w2": ports[1]})
    conn = DpwaConnection("w1", str(config), seed=1)
    arrays = [np.full(1000, 5.0, np.float32)]
    layout = Layout.of(arrays)
    segment = Segment("fake", layout.total_bytes + 64)  # the wrong size
    good = Segment("fake", layout.total_bytes)
    cases = iter(["size", "token", "layout"])
    case = ["size"]

    def respond(peer: str, frames: list[bytes]) -> list[list[bytes]]:
        request = wire.decode_message(frames[0])
        if not isinstance(request, wire.Fetch):
            return []
        assert request.host == host_identity()
        if case[0] == "size":
            segment.set_gen(3)
            ref = segment.ref(3, 1e12)
        else:
            good.set_gen(3)
            ref = good.ref(3, 1e12)
            if case[0] == "token":
                ref = SharedRef(pid=ref.pid, fd=ref.fd, token="f" * 32, until=ref.until)
        shown = layout if case[0] != "layout" else Layout.of([np.zeros(999, np.float32)])
        head = wire.encode_state(peer, request.req, clock=1.0, loss=1.0, extras={}, layout=shown, gen=3, shm=ref)
        return [[head]]

    fake.respond = respond
    try:
        x = np.zeros(1000, np.float32)
        for expected in cases:
            case[0] = expected
            conn.update_send([x], 1.0)
            assert conn.update_wait(1.0) == 0.0
            assert not x.any()
        rejected = conn.stats()["rejected_by_reason"]
        assert rejected.get("shm-size") == 1 and rejected.get("shm-token") == 1 and rejected.get("layout") == 1
        assert not fake.errors
        releases = [f for _, f in fake.requests if wire.decode_message(f[0]).kind is wire.Kind.RELEASE]
        assert len(releases) == 2  # a refused loan is given back at once
    finally:
        conn.close()
        fake.close()
        segment.close()
        good.close()


def own_segments(conn: DpwaConnection) -> dict[int, int]:
    """fd -> inode of the segments ``conn``'s node made (its pool's), as long as each descriptor is open."""
    pool = conn._node.pool
    assert pool is not None
    return {s.segment.fd: os.fstat(s.segment.fd).st_ino for s in pool._all if s.segment is not None}


@pytest.mark.parametrize(("rule", "read"), [("constant", "shm_fetched"), ("pushsum", "shm_pushes_taken")])
def test_a_clean_close_unmaps_every_segment_without_the_garbage_collector(tmp_path: Path, rule: str, read: str) -> None:
    """close() closes the descriptor of every segment its node made before it returns, and frees the memory of
    every segment its node made or mapped (a fetch's, or a push's: the inbox's) while the nodes are still
    referenced, with the cyclic garbage collector off: the node's objects hold reference cycles, and a collector
    that runs late (or is busy in another thread, where ``gc.collect()`` returns at once) would keep them all. The
    one exception: the snapshot last published by a rule that reads it (push-sum) stays with the rule, so with the
    node. The wait (10 s at most) is for a reply sent without copying, which ZeroMQ's release thread lets go of
    once the context ended."""

    def inodes() -> set[int]:  # of every memory file of w1's and w2's open in this process
        return set(memfds(os.getpid(), "w1").values()) | set(memfds(os.getpid(), "w2").values())

    before = inodes()
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation=rule, timeout_ms=30000)
    xa, xb = np.ones(1000, np.float32), np.zeros(1000, np.float32)
    a, b = (DpwaConnection(f"w{i + 1}", str(config), seed=i, params=[x]) for i, x in enumerate((xa, xb)))
    pairs = [(a, xa), (b, xb)]
    assert all(a.wait_for_peers(30).values()) and all(b.wait_for_peers(30).values())
    deadline = time.monotonic() + 30

    def train(i: int) -> None:  # at least 5 steps, then until each node read the other's segment once (30 s)
        done = 0
        while done < 5 or (min(c.stats().get(read, 0) for c in (a, b)) < 1 and time.monotonic() < deadline):
            done += len(steps(*pairs[i], 1))

    in_threads(2, train, timeout=60)
    assert a.stats().get(read, 0) >= 1 and b.stats().get(read, 0) >= 1  # each mapped the other's segments
    own = own_segments(a) | own_segments(b)
    assert len(own) >= 4
    made = inodes() - before
    assert set(own.values()) <= made

    pools = [c._node.pool for c in (a, b) if c._node.rule.reads_published()]
    inode_of = {id(s): os.fstat(s.segment.fd).st_ino for pool in pools for s in pool._all}  # type: ignore[union-attr]
    assert len(pools) == (2 if rule == "pushsum" else 0)
    kept: set[int] = set()  # the segments the rules hold: each pool's current one once closed (a leave publishes)

    def held() -> dict[str, set[int]]:
        return {"open": inodes() & made - kept, "mapped": mapped_inodes(os.getpid()) & made - kept}

    with collector_paused():
        a.close()
        b.close()
        open_now = memfds(os.getpid(), "w1") | memfds(os.getpid(), "w2")
        still = {fd: ino for fd, ino in own.items() if open_now.get(fd) == ino}
        assert not still, f"close() left these segment descriptors open: {still}"
        kept.update(inode_of.get(id(pool._current), 0) for pool in pools)  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while any((left := held()).values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(left.values()), f"closed nodes still hold segments (inodes): {left}"
    assert a.closed and b.closed  # both still referenced: nothing above waited for them to be collected


def test_a_node_closed_between_update_send_and_update_wait_unmaps_the_reply_it_was_lent(tmp_path: Path) -> None:
    """w1 fetches w2's snapshot, lent in w2's segment, and closes before its update_wait (a Ctrl-C in the batch):
    with the collector off, its map of w2's segment is gone once close() returns, though the reply was never
    given back; then update_send, update_wait and bootstrap on the closed node raise instead of writing into freed
    memory."""
    earlier = set(memfds(os.getpid(), "w2").values())  # an earlier test's w2, not yet collected: not this one's

    def references() -> Counter[int]:  # of each of this w2's segments in this process
        return Counter(ino for ino in memfds(os.getpid(), "w2").values() if ino not in earlier)

    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant", timeout_ms=30000)
    x1, x2 = np.ones(1000, np.float32), np.zeros(1000, np.float32)
    w1, w2 = (DpwaConnection(f"w{i + 1}", str(config), seed=i, params=[x]) for i, x in enumerate((x1, x2)))
    try:
        w2.update_send([x2], 1.0)  # published: w1's fetch finds a snapshot
        assert all(w1.wait_for_peers(30).values())
        w1.update_send([x1], 1.0)
        fetcher = w1._node.transfer.fetcher
        job = fetcher.pending
        assert job is not None and job.done.wait(30)
        assert [t.loan is not None for t in job.targets] == [True]  # a lent reply, not given back
        # each of w2's segments is open twice in w2 (its descriptor, its map's); the one lent, a third time (w1's map)
        assert sorted(references().values())[-2:] == [2, 3]
        with collector_paused():
            w1.close()
            assert set(references().values()) == {2}, "w1 still maps w2's segment"
        for call in (lambda: w1.update_send([x1], 1.0), lambda: w1.update_wait(1.0), lambda: w1.bootstrap([x1], 1)):
            with pytest.raises(RuntimeError, match="closed"):
                call()
    finally:
        w1.close()
        w2.close()


def test_an_interrupt_while_the_threads_are_joined_still_closes_the_segments(tmp_path: Path) -> None:
    """A Ctrl-C that lands in close() while the RX and TX threads are joined propagates, and the node's segment
    descriptors are closed all the same (the pool is closed in a finally)."""

    class InterruptedJoin(Transport):
        def close(self) -> bool:
            super().close()
            raise KeyboardInterrupt

    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation="constant")
    conn = DpwaConnection("w1", str(config), seed=1, transport=InterruptedJoin)
    conn.update_send([np.ones(1000, np.float32)], 1.0)
    own = own_segments(conn)
    assert own
    with pytest.raises(KeyboardInterrupt):
        conn.close()
    open_now = memfds(os.getpid(), "w1")
    assert not {fd for fd, ino in own.items() if open_now.get(fd) == ino}


@pytest.mark.timing  # counts of fetches in a run of real threads; 30 runs: no failure
def test_a_killed_nodes_segments_are_gone_once_its_restart_is_fetched_from(
    tmp_path: Path, nodes: Callable[..., NodeProcess]
) -> None:
    """w2 runs in a process, w1 here fetches from it through its segments; SIGKILL w2: nothing of it is in
    /dev/shm (its segments have no name); restart it: once w1 fetched from the new process, no process maps the
    killed one's segments any more (the kernel has freed them)."""
    ports = free_ports(2)
    config = write_cluster(tmp_path / "c.yaml", ports, interpolation="constant", timeout_ms=500)
    w2 = nodes("w2", config, seed=2)
    w1 = DpwaConnection("w1", str(config), seed=1)
    try:
        x = [np.zeros(1000, np.float32), np.zeros((3, 7), np.float32)]
        w2.send("run 1000")

        def fetched_from(pid: int) -> bool:
            w1.update_send(x, 1.0)
            w1.update_wait(1.0)
            return bool(memfds(pid, "w2")) and bool(set(memfds(pid, "w2").values()) & mapped_inodes(os.getpid()))

        wait_until(lambda: fetched_from(w2.proc.pid), 30, message="w1 maps a segment of w2")
        old = set(memfds(w2.proc.pid, "w2").values())
        before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        w2.kill()
        assert not any("dpwa" in n for n in (set(os.listdir("/dev/shm")) - before if before else ()))
        w2 = nodes("w2", config, seed=2)
        w2.send("run 1000")
        wait_until(lambda: fetched_from(w2.proc.pid), 30, message="w1 maps a segment of the restarted w2")
        assert not old & mapped_inodes(os.getpid()), "the killed node's segments are still mapped"
        assert not old & set(memfds(w2.proc.pid, "w2").values())
    finally:
        w1.close()
        w2.kill()


def test_the_segment_header_sits_before_a_64_byte_aligned_payload() -> None:
    segment = Segment("align", 1000)
    try:
        assert HEADER_BYTES % 64 == 0 and segment.payload.ctypes.data % 64 == 0 and segment.payload.nbytes == 1000
    finally:
        segment.close()


def test_a_snapshot_is_lent_only_to_a_co_located_plain_fetch_and_with_curve_to_the_authenticated_node() -> None:
    segment = Segment("lend", 64)
    try:
        snapshot = SimpleNamespace(segment=segment)
        plain = SimpleNamespace(host_id=host_identity(), security=None)
        curve = SimpleNamespace(host_id=host_identity(), security=object())
        off = SimpleNamespace(host_id="", security=None)

        def fetch(host: str = host_identity(), exchange: int = -1) -> wire.Fetch:
            return wire.Fetch(node="w1", req=1, fingerprint="x", host=host, exchange=exchange)

        assert lends_to(plain, fetch(), None, snapshot)
        assert not lends_to(plain, fetch(host=""), None, snapshot)  # the requester has it off
        assert not lends_to(plain, fetch(host="0" * 32), None, snapshot)  # another machine or namespace
        assert lends_to(plain, fetch(exchange=3), None, snapshot)  # an exchange's reply too (its push: the socket)
        assert not lends_to(off, fetch(), None, snapshot)  # this node has it off
        assert not lends_to(plain, fetch(), None, SimpleNamespace(segment=None))
        assert lends_to(curve, fetch(), "w1", snapshot)  # CURVE: authenticated as the node it names
        assert not lends_to(curve, fetch(), "w9", snapshot)
        assert not lends_to(curve, fetch(), None, snapshot)
    finally:
        segment.close()


def test_a_lent_reply_whose_header_fails_ends_its_lease_once_and_leaves_no_loan() -> None:
    """serve() leases the snapshot, records the loan, then builds the header; when that raises (a rule's
    ``on_serve``), no reply goes out: the lease ends once and no loan is left for the deadline to end a second
    time (the lease count went to -1 before, and the pool could then rewrite a snapshot still being sent)."""
    layout = Layout.of([np.zeros(64, np.float32)])
    pool = SnapshotPool(layout, shared=True, name="fails")
    counted: list[str] = []

    class Failing:
        def on_serve(self, state: object) -> dict[str, object]:
            raise RuntimeError("a rule's bug")

    node = SimpleNamespace(
        name="w2",
        membership=SimpleNamespace(
            observe=lambda request: None, leaving=False, reply_news=lambda r: wire.MemberNews("")
        ),
        wire_layout=layout,
        pool=pool,
        loans=Loans(pool.release, lambda key, n: counted.append(key)),
        timeouts=SimpleNamespace(lend_s=10.0),
        state_lock=threading.Lock(),
        rule=Failing(),
        state=None,
        host_id=host_identity(),
        security=None,
    )
    try:
        snapshot = pool.publish([np.ones(64, np.float32)], 0.0, 0.0, {})
        assert snapshot is not None
        request = wire.Fetch(node="w1", req=5, fingerprint=layout.fingerprint, host=host_identity())
        with pytest.raises(RuntimeError, match="a rule's bug"):
            serve(node, request)
        assert snapshot.leases == 0 and node.loans.outstanding() == 0
        assert node.loans.expire(time.monotonic() + 1e6) == 0 and snapshot.leases == 0
        assert not node.loans.give_back("w1", 5) and snapshot.leases == 0
    finally:
        pool.close()


def test_two_curve_nodes_that_authenticated_each_other_use_shared_memory(tmp_path: Path) -> None:
    from test_security import secure_cluster

    config = secure_cluster(tmp_path / "c.yaml", free_ports(2))
    a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
    try:
        xa, xb = np.ones(1000, np.float32), np.zeros(1000, np.float32)
        step_until_fetched(a, b, xa, xb, 3)  # 3 of 5 free-running steps failed once: the peer not published yet
        for conn in (a, b):
            s = conn.stats()
            assert s["fetches_ok"] >= 3 and s["shm_fetched"] == s["fetches_ok"], s
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("wire_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_fetch_through_shared_memory_mixes_bit_for_bit_what_the_socket_delivers(
    tmp_path: Path, wire_dtype: str
) -> None:
    """Co-located or not, a node mixes the same values: the segment holds the snapshot in the wire dtype (rounded,
    or quantized, as for the socket), read straight (float32) or widened into the receive buffer."""
    from test_wire_int8 import fetch_once

    rng = np.random.default_rng(5)
    shapes = [(1_200_000,), (300, 7), (5,)]  # two chunks; a partial int8 block; a tiny array
    theirs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    mine = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    results = {}
    for mode in ("auto", "off"):
        ports = free_ports(2)
        config = write_cluster(
            tmp_path / f"{mode}.yaml", ports, timeout_ms=3000, wire_dtype=wire_dtype, transport={"shared_memory": mode}
        )
        x = [m.copy() for m in mine]
        got = fetch_once(config, x, theirs)
        assert got["factor"] == 0.5, got
        assert got["stats"]["shm_fetched"] == (1 if mode == "auto" else 0)
        results[mode] = x
    assert all(a.tobytes() == b.tobytes() for a, b in zip(results["auto"], results["off"]))


def test_a_lent_reply_whose_loan_ends_before_the_mix_is_copied_out_and_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local step longer than the loan (here: a margin no loan meets): at update_wait the reply is copied into
    the receive buffer, the loan given back at once, and mixed -- the bits the socket gives. Before, it was left
    out (shm_loans_lapsed): a node whose step outlasted the loan (10 s by default) never mixed a co-located peer."""
    from dpwa.node.transfers import fetcher

    monkeypatch.setattr(fetcher, "LEND_MARGIN_S", 1e6)
    rng = np.random.default_rng(9)
    theirs = [rng.standard_normal(s, dtype=np.float32) for s in ((1_200_000,), (300, 7))]
    mine = [rng.standard_normal(s, dtype=np.float32) for s in ((1_200_000,), (300, 7))]
    results = {}
    for mode in ("auto", "off"):
        config = write_cluster(tmp_path / f"{mode}.yaml", free_ports(2), timeout_ms=3000,
                               transport={"shared_memory": mode})  # fmt: skip
        x = [m.copy() for m in mine]
        with DpwaConnection("w1", config, seed=1) as a, DpwaConnection("w2", config, seed=2) as b:
            b.update_send(theirs, 1.0)
            a.update_send(x, 1.0)
            assert a.update_wait(1.0) == 0.5, a.last_exchange
            stats = a.stats()
            copied = 1 if mode == "auto" else 0
            assert stats["shm_fetched"] == stats["shm_loans_copied"] == copied, stats
            assert stats["shm_loans_lapsed"] == stats["shm_torn"] == 0
            wait_until(lambda b=b, n=copied: b.stats()["shm_released"] == n, 5, message="the loan given back")
        results[mode] = x
    assert all(p.tobytes() == q.tobytes() for p, q in zip(results["auto"], results["off"]))


def test_a_lent_reply_never_waited_for_is_given_back_by_the_next_update_send(tmp_path: Path) -> None:
    """update_send twice without update_wait: the first fetch's reply, lent in shared memory, is given back
    (RELEASE) by the second update_send, not held for the loan's 10 s. Before, the finished job was dropped with
    its loan."""
    a, b = pair(tmp_path, timeout_ms=3000)
    try:
        xa, xb = np.ones(1000, np.float32), np.zeros(1000, np.float32)
        b.update_send([xb], 1.0)
        a.update_send([xa], 1.0)
        wait_until(lambda: a.stats()["shm_fetched"] == 1, 5, message="the reply lent")
        wait_until(lambda: not a._node.transfer.fetcher.in_flight(), 5, message="the fetch done")
        a.update_send([xa], 1.0)  # no update_wait in between
        wait_until(lambda: b.stats()["shm_released"] == 1, 5, message="the loan given back")
        assert b.stats()["shm_loans_expired"] == 0
        a.update_wait(1.0)
    finally:
        a.close()
        b.close()


def test_a_shared_memory_reply_to_a_node_that_offered_none_is_rejected(tmp_path: Path) -> None:
    """Shared memory off here: a peer answering with a segment anyway (forged, or misconfigured) is rejected
    ``shm-unasked`` before anything is opened, and the model stays as it was."""
    ports = free_ports(2)
    config = write_cluster(tmp_path / "c.yaml", ports, interpolation="constant", transport={"shared_memory": "off"})
    fake = FakePeers({"w2": ports[1]})
    conn = DpwaConnection("w1", str(config), seed=1)
    layout = Layout.of([np.zeros(1000, np.float32)])
    segment = Segment("fake", layout.total_bytes)
    segment.set_gen(3)

    def respond(peer: str, frames: list[bytes]) -> list[list[bytes]]:
        request = wire.decode_message(frames[0])
        if not isinstance(request, wire.Fetch):
            return []
        assert request.host == ""
        ref = segment.ref(3, 1e12)
        return [[wire.encode_state(peer, request.req, clock=1.0, loss=1.0, extras={}, layout=layout, gen=3, shm=ref)]]

    fake.respond = respond
    try:
        x = np.zeros(1000, np.float32)
        conn.update_send([x], 1.0)
        assert conn.update_wait(1.0) == 0.0 and not x.any()
        assert conn.stats()["rejected_by_reason"] == {"shm-unasked": 1}
    finally:
        conn.close()
        fake.close()
        segment.close()


def test_a_shared_pool_attests_the_snapshots_it_found_finite() -> None:
    """The pool's checker thread reads each new snapshot once, after the publish (off the trainer's path), and
    writes its generation into the segment's ``checked`` word only when every value is finite."""
    layout = Layout.of([np.zeros(10_000, np.float32)])
    pool = SnapshotPool(layout, shared=True, name="attest")
    reader = SegmentReader()
    try:
        quiet = pool.publish([np.ones(10_000, np.float32)], 0.0, 0.0, {})
        assert quiet is not None and quiet.attested is False  # nothing lent lately: no reader to spare a check
        pool.lent()  # the RX thread lent a snapshot: from now on each one is checked
        for value, attested in ((1.0, True), (np.nan, False), (2.0, True)):
            snapshot = pool.publish([np.full(10_000, value, np.float32)], 0.0, 0.0, {})
            assert snapshot is not None and snapshot.segment is not None
            assert pool.wait_ready(10.0)  # the checker thread has decided
            assert snapshot.attested is attested
            mapped = reader.open("w", snapshot.segment.ref(snapshot.gen, 1e9), layout.total_bytes, snapshot.gen)
            assert (int(mapped.checked[0]) == snapshot.gen) is attested
    finally:
        pool.close()
    # a pool whose layout holds an index array, or whose wire dtype differs, attests nothing (its readers check)
    indexed = Layout.of([np.zeros(10, np.float32), np.zeros(4, np.uint16)], bounds=(0, 10))
    pool = SnapshotPool(indexed, shared=True, name="attest")
    try:
        snapshot = pool.publish([np.zeros(10, np.float32), np.zeros(4, np.uint16)], 0.0, 0.0, {})
        assert snapshot is not None and snapshot.segment is not None and snapshot.attested is False
        mapped = reader.open("i", snapshot.segment.ref(snapshot.gen, 1e9), indexed.total_bytes, snapshot.gen)
        assert int(mapped.checked[0]) == 0
    finally:
        pool.close()


def test_an_exchange_through_shared_memory_mixes_both_ends_bit_for_bit_as_the_socket(tmp_path: Path) -> None:
    """AD-PSGD: ``b`` exchanges with ``a`` (its push over the socket, ``a``'s reply lent in shared memory), then
    ``a`` mixes its half and exchanges back, then ``b`` exchanges again, its push now through shared memory too
    (``a`` lent it a reply: co-located); both ends hold the same bits co-located or not."""
    rng = np.random.default_rng(7)
    start = {
        n: [rng.standard_normal(1_200_000, dtype=np.float32), rng.standard_normal(77, dtype=np.float32)] for n in "ab"
    }
    results = {}
    for mode in ("auto", "off"):
        config = write_cluster(
            tmp_path / f"{mode}.yaml",
            free_ports(2),
            timeout_ms=5000,
            interpolation="adpsgd",
            transport={"shared_memory": mode},
        )
        a, b = DpwaConnection("w1", str(config), seed=1), DpwaConnection("w2", str(config), seed=2)
        xa, xb = [x.copy() for x in start["a"]], [x.copy() for x in start["b"]]
        try:
            a.update_send(xa, 1.0)  # a publishes; its exchange finds b not ready
            a.update_wait(1.0)
            b.update_send(xb, 1.0)  # b's push goes into a's inbox, a's snapshot comes back
            assert b.update_wait(1.0) == 0.5
            wait_until(lambda a=a: a.stats()["exchanges_committed"] == 1, 10, message="a learns the commit")
            a.update_send(xa, 1.0)  # a's half of b's exchange, and its own exchange with b
            a.update_wait(1.0)
            assert a.stats()["mixes"] == 1 and b.stats()["shm_fetched"] == (1 if mode == "auto" else 0)
            assert a.stats().get("shm_fetched", 0) == (1 if mode == "auto" else 0)
            wait_until(lambda b=b: b.stats()["exchanges_committed"] == 1, 10, message="b learns the commit")
            # b learns that a takes pushes through shared memory from a's ACK of b's commit (counted unmatched)
            wait_until(lambda b=b: b.stats()["acks_unmatched"] >= 1, 10, message="a's answer to b's commit")
            b.update_send(xb, 1.0)  # b's half of a's exchange, and its second exchange with a
            assert b.update_wait(1.0) == 0.5
            wait_until(lambda a=a: a.stats()["exchanges_committed"] == 2, 10, message="a learns the second commit")
            assert b.stats().get("shm_pushed", 0) == a.stats().get("shm_pushes_taken", 0) == (mode == "auto")
        finally:
            a.close()
            b.close()
        results[mode] = xa + xb
    assert all(x.tobytes() == y.tobytes() for x, y in zip(results["auto"], results["off"]))


def test_a_release_of_no_loan_held_changes_nothing_and_is_counted() -> None:
    """A RELEASE that comes after its loan expired (or names a request never lent) gives nothing back twice: counted
    ``releases_unmatched``; the loan it names, when held, is ended once (``shm_released``)."""
    released: list[object] = []
    stats = NodeStats()
    loans = Loans(released.append, stats.add)
    node = SimpleNamespace(security=None, stats=stats, loans=loans)
    snapshot = object()
    assert loans.lend("w2", 7, snapshot, time.monotonic() + 60.0)  # type: ignore[arg-type]
    for req in (7, 7, 8):
        serving.give_back(node, wire.Release(node="w2", req=req), None)  # type: ignore[arg-type]
    counts = stats.snapshot()
    assert released == [snapshot] and counts["shm_released"] == 1 and counts["releases_unmatched"] == 2
