"""Elastic membership on the network: joining, leaving cleanly, dying, push-sum mass, forged tables, CURVE joins.

Nodes run in this process (one trainer thread each), on free ports of 127.0.0.1; every wait is on a
condition with a deadline. "Killed" nodes stop without a word (``close(announce=False)`` on the node
underneath: its threads end and its port closes, exactly what its peers see of a SIGKILL).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import free_ports, port_is_free, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_push import quiesce

from dpwa.config import ClusterConfig, NodeSpec, SecurityConfig
from dpwa.node import wire
from dpwa.node.connection import DpwaConnection
from dpwa.node.members import JoinRefused, Member
from dpwa.security.keys import generate_keys

pytestmark = [pytest.mark.integration]

FAST = {"timeout_ms": 1000.0, "forget_after_s": 2.0}


class Trainers:
    """One thread per connection running update_send / a short step / update_wait until stopped."""

    def __init__(self) -> None:
        self.stops: dict[str, threading.Event] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.params: dict[str, list[np.ndarray]] = {}
        self.errors: list[BaseException] = []

    def start(self, conn: DpwaConnection, value: float, step_s: float = 0.004, linear: bool = False) -> None:
        """``linear``: the layout of ``torch.nn.Linear(8, 1)`` (tests/join_worker.py), else two float64 arrays."""
        if linear:
            params = [np.full((1, 8), value, np.float32), np.full(1, value, np.float32)]
        else:
            params = [np.full(64, value), np.full((3, 3), value)]
        self.params[conn.name] = params
        stop = self.stops[conn.name] = threading.Event()

        def loop() -> None:
            try:
                while not stop.is_set():
                    conn.update_send(params, 1.0)
                    time.sleep(step_s)
                    conn.update_wait(1.0)
            except BaseException as exc:  # surfaced by halt()
                self.errors.append(exc)

        thread = threading.Thread(target=loop, name=f"trainer-{conn.name}")
        self.threads[conn.name] = thread
        thread.start()

    def halt(self, names: Sequence[str] | None = None) -> None:
        """Stop the trainers (``names``, else all) and wait for them."""
        names = list(self.threads) if names is None else names
        for name in names:
            self.stops[name].set()
        for name in names:
            self.threads[name].join(timeout=30)
            assert not self.threads[name].is_alive(), f"trainer {name} hung"
        assert not self.errors, self.errors


def founders(n: int, ports: Sequence[int], **settings: Any) -> tuple[ClusterConfig, list[DpwaConnection]]:
    nodes = tuple(NodeSpec(f"w{i + 1}", "127.0.0.1", p) for i, p in enumerate(ports[:n]))
    cfg = ClusterConfig(nodes=nodes, **{**FAST, **settings})
    return cfg, [DpwaConnection(node.name, cfg, seed=i) for i, node in enumerate(nodes)]


def joiner(name: str, port: int, via: int, **settings: Any) -> DpwaConnection:
    """A node named ``name`` on ``port`` that joins through ``via``; seeded from its name, the same in every run
    (``hash`` of a string changes with each interpreter)."""
    cfg = ClusterConfig(nodes=(NodeSpec(name, "127.0.0.1", port),), **{"join": f"127.0.0.1:{via}", **FAST, **settings})
    return DpwaConnection(name, cfg, seed=zlib.crc32(name.encode()) % 1000)


def states(conn: DpwaConnection) -> dict[str, str]:
    return {name: m["state"] for name, m in conn.stats()["members"].items()}


def fetched_ok(conn: DpwaConnection, peer: str) -> int:
    return conn.stats()["by_peer"].get(peer, {}).get("ok", 0)


def flat(params: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel() for a in params])


def close_all(conns: Sequence[DpwaConnection]) -> None:
    for c in conns:
        c.close()


# --------------------------------------------------------------------------- joining


def test_two_nodes_join_a_running_cluster_every_node_lists_five_and_mixes_with_them() -> None:
    ports = free_ports(5)
    _, conns = founders(3, ports)
    trainers = Trainers()
    joiners: list[DpwaConnection] = []
    try:
        for i, c in enumerate(conns):
            trainers.start(c, float(i))
        wait_until(lambda: all(fetched_ok(c, p) > 5 for c in conns for p in ("w1", "w2", "w3") if p != c.name), 20)
        joiners = [joiner("j1", ports[3], via=ports[0]), joiner("j2", ports[4], via=ports[2])]
        for j, value in zip(joiners, (100.0, -100.0)):
            trainers.start(j, value)
        everyone = conns + joiners
        names = {"w1", "w2", "w3", "j1", "j2"}
        wait_until(
            lambda: all(set(states(c)) == names and set(states(c).values()) == {"alive"} for c in everyone),
            20,
            message="every node lists all five alive",
        )
        wait_until(
            lambda: all(fetched_ok(c, j.name) > 0 for c in conns for j in joiners), 20, message="mixed with joiners"
        )
        # the joiners started 100 away from the cluster; they end up within its spread
        wait_until(
            lambda: np.ptp([flat(trainers.params[c.name]).mean() for c in everyone]) < 1.0,
            30,
            message="joiners reach the cluster's spread",
        )
        trainers.halt()
        assert all(c.stats()["members_alive"] == 5 for c in everyone)
        digests = {c.stats()["members_digest"] for c in everyone}
        assert len(digests) == 1  # one table everywhere
    finally:
        trainers.halt()
        close_all(joiners + conns)


def test_a_name_clash_and_a_file_nodes_name_are_refused_with_the_reason() -> None:
    ports = free_ports(4)
    _, conns = founders(2, ports)
    try:
        first = joiner("j1", ports[2], via=ports[0])
        try:
            with pytest.raises(JoinRefused, match="name 'j1' is taken by the member at 127.0.0.1"):
                joiner("j1", ports[3], via=ports[0])
            with pytest.raises(JoinRefused, match="'w2' is a node of the cluster file"):
                joiner("w2", ports[3], via=ports[0])
        finally:
            first.close()
        # j1 left cleanly: its name is free again, at any address, as its next incarnation
        wait_until(lambda: states(conns[1]).get("j1") == "left", 10)
        again = joiner("j1", ports[3], via=ports[1])
        try:
            assert again.stats()["members"]["j1"]["version"] == 2  # joined 0, left 1, joined again 2
        finally:
            again.close()
        assert port_is_free(ports[2]) and port_is_free(ports[3])
    finally:
        close_all(conns)


def test_joining_nowhere_times_out_with_a_clear_error() -> None:
    (port, nobody) = free_ports(2)
    with pytest.raises(TimeoutError, match=r"no answer to its JOIN from 127\.0\.0\.1:\d+ in 1 s"):
        joiner("j1", port, via=nobody, join_timeout_s=1.0)
    assert port_is_free(port)


class SlowAnswers(threading.Thread):
    """A proxy before a sponsor: a joiner's requests pass at once, each answer comes back ``delay_s`` late (a
    sponsor whose RX thread waits for the trainer's mix, or a long round trip). One joiner at a time."""

    def __init__(self, port: int, sponsor_port: int, delay_s: float) -> None:
        super().__init__(name="slow-answers", daemon=True)
        self.ctx = zmq.Context()
        self.front, self.back = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.DEALER)
        self.front.bind(f"tcp://127.0.0.1:{port}")
        self.back.connect(f"tcp://127.0.0.1:{sponsor_port}")
        self.delay_s, self.stop_flag = delay_s, threading.Event()

    def run(self) -> None:
        identity, held = b"", []  # held: (due, frames) in arrival order
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self.stop_flag.is_set():
            for sock, _ in poller.poll(10):
                if sock is self.front:
                    identity, *frames = self.front.recv_multipart()
                    self.back.send_multipart(frames)
                else:
                    held.append((time.monotonic() + self.delay_s, self.back.recv_multipart()))
            while held and held[0][0] <= time.monotonic():
                self.front.send_multipart([identity, *held.pop(0)[1]])

    def close(self) -> None:
        self.stop_flag.set()
        self.join(5.0)
        self.front.close(linger=0)
        self.back.close(linger=0)
        self.ctx.term()


def test_a_join_whose_answers_come_after_the_next_join_still_succeeds() -> None:
    """Every answer reaches the joiner only after it sent its next JOIN (answers 1.5 x the retry interval late):
    the joiner takes the answer to any JOIN it sent. Before, it took only the latest one's, dropped every answer
    as stale and timed out, although the sponsor had admitted it."""
    ports = free_ports(4)
    _, conns = founders(2, ports)
    proxy = SlowAnswers(ports[3], ports[0], delay_s=1.5 * FAST["timeout_ms"] / 1000.0)
    proxy.start()
    try:
        j1 = joiner("j1", ports[2], via=ports[3], join_timeout_s=6.0)
        try:
            assert states(j1).get("w1") == "alive" and states(j1).get("j1") == "alive"
        finally:
            j1.close()
    finally:
        proxy.close()
        close_all(conns)


JOIN_WORKER = Path(__file__).with_name("join_worker.py")


@pytest.mark.slow
@pytest.mark.outcome
def test_a_dpwa_run_joiner_and_an_adapter_joiner_join_train_and_leave(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Three nodes train; `dpwa run -n 1 --join` and a script with only DPWA_JOIN join them (separate
    processes), every node lists five and mixes with both, the joiners reach the cluster, and leave cleanly."""
    ports = free_ports(3)
    _, conns = founders(3, ports)
    trainers = Trainers()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPWA_", "RANK", "MASTER_"))}
    try:
        for i, c in enumerate(conns):
            trainers.start(c, float(i), linear=True)
        settings = tmp_path / "settings.yaml"
        settings.write_text("timeout_ms: 1000\nforget_after_s: 2\n")
        run_dir = tmp_path / "run"
        go = tmp_path / "go"
        with open(tmp_path / "run.out", "wb") as out, open(tmp_path / "adapter.out", "wb") as adapter_out:
            by_run = subprocess.Popen(
                [sys.executable, "-m", "dpwa.cli", "run", "-n", "1", "--join", f"127.0.0.1:{ports[0]}", "--config",
                 str(settings), "--run-dir", str(run_dir), "-q", str(JOIN_WORKER), "50", "5", str(go)],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
            )  # fmt: skip
            by_adapter = subprocess.Popen(
                [sys.executable, str(JOIN_WORKER), "-50", "5", str(go)],
                stdout=adapter_out, stderr=subprocess.STDOUT, cwd=tmp_path,
                env={**env, "DPWA_JOIN": f"127.0.0.1:{ports[2]}", "DPWA_CONFIG": str(settings)},
            )  # fmt: skip
            try:
                wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, 90, message="both joiners saw five")
                go.touch()
                assert by_run.wait(timeout=120) == 0, (tmp_path / "run.out").read_text()
                assert by_adapter.wait(timeout=120) == 0, (tmp_path / "adapter.out").read_text()
            finally:
                for proc in (by_run, by_adapter):
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(timeout=10)
        (joined_log,) = run_dir.glob("*.log")
        results = [json.loads(line.split(" ", 1)[1]) for line in
                   [*joined_log.read_text().splitlines(), *(tmp_path / "adapter.out").read_text().splitlines()]
                   if line.startswith("RESULT ")]  # fmt: skip
        assert len(results) == 2, results
        names = {r["name"] for r in results}
        for r in results:
            assert r["seen"] == 5 and r["mixed"] >= 30, r
        # they started at +50 and -50, the founders at 0, 1, 2: all five now agree (the cluster's spread)
        founders_now = [float(flat(trainers.params[c.name]).mean()) for c in conns]
        record_property("ptp", float(np.ptp([*founders_now, *(r["weight"] for r in results)])))
        assert np.ptp([*founders_now, *(r["weight"] for r in results)]) < 1.0, (founders_now, results)
        for c in conns:  # every founder fetched from both joiners, and knows they left
            assert all(fetched_ok(c, name) > 0 for name in names), (c.name, c.stats()["by_peer"])
        wait_until(lambda: all(states(c).get(n) in ("left", None) for c in conns for n in names), 5)
        for c in conns:
            assert all(c.stats()["by_peer"].get(n, {}).get("timeout", 0) == 0 for n in names)
        metrics = [json.loads(line) for line in next(run_dir.glob("*.metrics.jsonl")).read_text().splitlines()]
        events = [(m["state"], m["member"]) for m in metrics if m.get("event") == "member"]
        assert events[0][0] == "started" and ("joined", results[0]["name"]) in events or events
        assert any(state == "left" for state, _ in events)  # its own leave is the last record
    finally:
        trainers.halt()
        close_all(conns)


# --------------------------------------------------------------------------- leaving and dying


def test_a_clean_leave_is_known_everywhere_and_nobody_times_out_on_it() -> None:
    ports = free_ports(4)
    _, conns = founders(3, ports)
    trainers = Trainers()
    leaver = joiner("j1", ports[3], via=ports[1])
    try:
        for i, c in enumerate([*conns, leaver]):
            trainers.start(c, float(i))
        wait_until(lambda: all(fetched_ok(c, "j1") > 3 for c in conns), 20, message="everyone fetches j1")
        trainers.halt(["j1"])
        leaver.close()
        wait_until(lambda: all(states(c).get("j1") in ("left", None) for c in conns), 5, message="j1 left everywhere")
        # a fetch of j1 in flight as it left ends refused ("left", or "not a member"): two fetches started since
        # mean it has its verdict, counted before the one below
        started = {c.name: c.stats()["fetches_started"] for c in conns}
        wait_until(lambda: all(c.stats()["fetches_started"] >= started[c.name] + 2 for c in conns), 10)
        before = {c.name: dict(c.stats()["by_peer"].get("j1", {})) for c in conns}
        time.sleep(0.5)  # the others keep training: none may ask j1 again
        trainers.halt()
        for c in conns:
            after = c.stats()["by_peer"].get("j1", {})
            assert after == before[c.name], f"{c.name} still fetched j1 after it left"
            assert after.get("timeout", 0) == 0, f"{c.name} timed out on j1"
            assert "j1" not in c.stats()["scores"]
    finally:
        trainers.halt()
        close_all(conns)


MEMBER_WORKER = Path(__file__).with_name("member_worker.py")


def test_a_sigkilled_member_is_suspected_then_forgotten_and_probing_stops() -> None:
    """A joined node in its own process is SIGKILLed: the others time out on it until flow control marks it down,
    suspect it (everywhere, through gossip), forget it after forget_after_s, and never ask it again."""
    ports = free_ports(4)
    _, conns = founders(3, ports, timeout_ms=300.0, forget_after_s=1.0)
    trainers = Trainers()
    victim = subprocess.Popen(
        [sys.executable, str(MEMBER_WORKER), "j9", str(ports[3]), str(ports[0]), "300"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "READY\n"
        for i, c in enumerate(conns):
            trainers.start(c, float(i))
        wait_until(lambda: all(states(c).get("j9") == "alive" and fetched_ok(c, "j9") > 0 for c in conns), 15)
        victim.kill()  # SIGKILL: no leave, no word
        victim.wait(timeout=10)
        wait_until(lambda: all(states(c).get("j9") == "suspected" for c in conns), 15, message="suspected everywhere")
        wait_until(lambda: all("j9" not in states(c) for c in conns), 15, message="forgotten everywhere")
        time.sleep(1.2)  # an observation window: a down peer is probed every second or more often
        for c in conns:  # never asked again: nothing is kept of it (its outcome counts went with it)
            assert "j9" not in c.stats()["scores"] and "j9" not in c.stats()["by_peer"], c.stats()["by_peer"]
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=10)
        victim.stdout.close()  # type: ignore[union-attr]
        trainers.halt()
        close_all(conns)


# --------------------------------------------------------------------------- push-sum mass


def weight(conn: DpwaConnection) -> float:
    return float(conn.dpwa_state().extras["weight"])


def test_pushsum_mass_stays_exact_across_a_join_and_a_clean_leave() -> None:
    """A joiner brings one unit; a leaver hands its whole mass to a member: sum(w) == members admitted (1e-9)."""
    ports = free_ports(5)
    _, conns = founders(3, ports, interpolation="pushsum")
    trainers = Trainers()
    joiners: list[DpwaConnection] = []
    try:
        for i, c in enumerate(conns):
            trainers.start(c, float(i))
        wait_until(lambda: all(c.stats()["pushes_delivered"] > 10 for c in conns), 20)
        joiners = [
            joiner("j1", ports[3], via=ports[0], interpolation="pushsum"),
            joiner("j2", ports[4], via=ports[1], interpolation="pushsum"),
        ]
        for j in joiners:
            trainers.start(j, 10.0)
        everyone = conns + joiners
        wait_until(lambda: all(c.stats()["pushes_delivered"] > 10 for c in joiners), 20, message="joiners push")
        wait_until(lambda: all(c.stats()["pushes_received"] > 5 for c in joiners), 20, message="joiners receive")
        trainers.halt()
        quiesce(everyone)
        assert math.fsum(weight(c) for c in everyone) == pytest.approx(5.0, abs=1e-9)
        # j1 idles while the others push to it (its inbox fills), then leaves cleanly while they train on:
        # it folds everything it took, hands its mass to a member, and their pushes still open to it settle
        # from its announcement -- nothing is lost
        rest = conns + joiners[1:]
        for i, c in enumerate(rest):
            trainers.start(c, float(i))
        wait_until(lambda: joiners[0].stats()["inbox_occupied"] >= 2, 20, message="j1's inbox holds pushes")
        joiners[0].close()
        assert weight(joiners[0]) == 0.0 and joiners[0].stats()["hand_offs"] == 1
        wait_until(lambda: all(states(c).get("j1") == "left" for c in rest), 5)
        trainers.halt()
        quiesce(rest)
        assert math.fsum(weight(c) for c in rest) == pytest.approx(5.0, abs=1e-9)
    finally:
        trainers.halt()
        close_all(joiners + conns)


def test_pushsum_a_killed_member_is_suspected_from_its_pushes_and_a_later_leave_still_hands_off() -> None:
    """Push-sum nodes never fetch: a member that dies is found out from pushes it no longer answers (then
    suspected and forgotten, its unanswered push abandoned), and a clean leave after that still hands its mass
    to a live member, within its bound."""
    ports = free_ports(5)
    _, conns = founders(3, ports, interpolation="pushsum", timeout_ms=300.0, forget_after_s=1.0)
    trainers = Trainers()
    victim = subprocess.Popen(
        [sys.executable, str(MEMBER_WORKER), "j9", str(ports[3]), str(ports[0]), "300", "pushsum"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    leaver: DpwaConnection | None = None
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "READY\n"
        # its own timeout_ms longer than the founders': its hand-off (2 timeout_ms less the announcement's 0.3 s)
        # must get a training member's ACK on a loaded machine
        leaver = joiner("j1", ports[4], via=ports[1], interpolation="pushsum", timeout_ms=1000.0, forget_after_s=1.0)
        for i, c in enumerate([*conns, leaver]):
            trainers.start(c, float(i))
        wait_until(lambda: all(c.stats()["pushes_received"] > 5 for c in conns), 15)
        victim.kill()
        victim.wait(timeout=10)
        wait_until(lambda: all("j9" not in states(c) for c in [*conns, leaver]), 20, message="j9 forgotten")
        trainers.halt(["j1"])
        started = time.monotonic()
        leaver.close()
        assert leaver.stats()["hand_offs"] == 1 and weight(leaver) == 0.0
        assert time.monotonic() - started < 2 * 1.0 + 0.5 + 0.5  # its bound: 2 timeout_ms + the announcement
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=10)
        victim.stdout.close()  # type: ignore[union-attr]
        trainers.halt()
        if leaver is not None:
            leaver.close()
        close_all(conns)


# --------------------------------------------------------------------------- hostile tables

entries = st.builds(
    Member,
    name=st.one_of(st.sampled_from(["w1", "w2", "j1"]), st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True)),
    host=st.sampled_from(["127.0.0.1", "10.66.0.1", "evil.example"]),
    port=st.integers(1, 65535),
    state=st.sampled_from(["alive", "suspected", "left"]),
    version=st.one_of(st.integers(0, 3), st.just(2**53), st.integers(2**40, 2**53)),
)


@pytest.fixture(scope="module")
def target() -> Any:
    """A two-node cluster (w1 is attacked) with a small table: at most 8 joined members."""
    ports = free_ports(2)
    _, conns = founders(2, ports, max_members=8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{ports[0]}")
    yield conns, sock, ports
    sock.close(linger=0)
    ctx.term()
    close_all(conns)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flood=st.lists(st.lists(entries, min_size=1, max_size=40), min_size=1, max_size=5))
def test_forged_tables_cost_bounded_memory_and_never_move_or_remove_a_file_node(target: Any, flood: Any) -> None:
    conns, sock, ports = target
    w1 = conns[0]
    for i, batch in enumerate(flood):
        news = wire.MemberNews("0" * 16, batch)
        kind = i % 2
        message = (
            wire.encode_members("mallory", i, news)
            if kind
            else wire.encode_fetch("mallory", i, "fp", news=news)  # a FETCH carrying a forged table
        )
        sock.send(message)
    sock.send(wire.encode_members("mallory", 10**6, wire.MemberNews("0" * 16, [])))
    wait_until(lambda: sock.poll(0) or sock.poll(50), 10, message="the node answered the last message")
    while sock.poll(0):
        sock.recv_multipart()
    table = w1.stats()["members"]
    assert len(table) <= 2 + 8  # the file's nodes + max_members
    assert table["w1"]["host"] == "127.0.0.1" and table["w1"]["port"] == ports[0]
    assert table["w2"]["host"] == "127.0.0.1" and table["w2"]["port"] == ports[1]
    assert table["w1"]["state"] == "alive"  # a forged "w1 left" is refuted at once by w1 itself
    assert "w2" in w1.stats()["scores"]  # a file node stays a peer, whatever a forged entry says of it
    assert all(len(name) <= 128 for name in table)
    assert w1.stats()["rx_alive"] and w1.stats()["tx_alive"]


def members_frame(body: dict[str, Any]) -> bytes:
    """A MEMBERS header frame with ``body`` as its JSON object, whatever it holds."""
    prefix = wire.MAGIC + wire.PROTOCOL_VERSION.to_bytes(2, "little") + bytes([wire.Kind.MEMBERS])
    return prefix + json.dumps(body).encode()


def test_member_lists_of_the_wrong_shape_are_dropped_as_malformed() -> None:
    good = wire.encode_members("w1", 1, wire.MemberNews("ab" * 8, [Member("j1", "127.0.0.1", 5000, "alive", 3)]))
    header = wire.decode_message(good)
    assert header.members == (Member("j1", "127.0.0.1", 5000, "alive", 3),) and header.digest == "ab" * 8
    for raw in (
        {"node": "x", "req": 1, "members": [["j1", "h", 1, "alive"]]},  # four fields
        {"node": "x", "req": 1, "members": [["j1", "h", "1", "alive", 0]]},  # a port as text
        {"node": "x", "req": 1, "members": [["j1", "h", 1, "alive", True]]},  # a bool version
        {"node": "x", "req": 1, "members": "all"},
        {"node": "x", "req": 1, "members": [], "md": 7},
    ):
        with pytest.raises(wire.WireError):
            wire.decode_message(members_frame(raw))
    with pytest.raises(wire.WireError, match="without members"):
        wire.decode_message(members_frame({"node": "x", "req": 1}))


# --------------------------------------------------------------------------- CURVE


def test_with_curve_the_key_directory_is_the_membership_list(tmp_path: Path) -> None:
    """A joiner whose key is not in the directory is never admitted; once its key file is there, it joins."""
    keys = tmp_path / "keys"
    generate_keys(["w1", "w2"], keys)
    ports = free_ports(3)
    security = SecurityConfig(True, str(keys))
    _, conns = founders(2, ports, security=security)
    outsider_keys = tmp_path / "outsider"
    generate_keys(["j1"], outsider_keys)
    for name in ("w1", "w2"):  # the outsider knows the members' public keys, not the other way round
        (outsider_keys / f"{name}.key").write_text((keys / f"{name}.key").read_text())
    try:
        with pytest.raises(TimeoutError, match="is j1.key in every member's key directory"):
            joiner(
                "j1",
                ports[2],
                via=ports[0],
                join=f"w1@127.0.0.1:{ports[0]}",
                join_timeout_s=1.5,
                security=SecurityConfig(True, str(outsider_keys)),
            )
        assert conns[0].stats()["auth_denied"] > 0 and "j1" not in states(conns[0])
        (keys / "j1.key").write_text((outsider_keys / "j1.key").read_text())  # now listed
        j1 = joiner(
            "j1",
            ports[2],
            via=ports[0],
            join=f"w1@127.0.0.1:{ports[0]}",
            security=SecurityConfig(True, str(outsider_keys)),
        )
        try:
            assert states(conns[0])["j1"] == "alive"
        finally:
            j1.close()
    finally:
        close_all(conns)


def test_a_flood_of_refused_joins_is_counted_each_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A stranger's JOINs under ever new names, each refused (its file splits AD-PSGD's roles, the cluster's does
    not): every one is counted and answered, one WARNING says so (then DEBUG), so a flood cannot fill the log.
    Before, each refusal was a WARNING naming the stranger's name."""
    (port,) = free_ports(1)
    config = ClusterConfig(nodes=(NodeSpec("w1", "127.0.0.1", port),))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    with DpwaConnection("w1", config) as member, caplog.at_level("DEBUG", logger="dpwa"):
        sock.connect(member.endpoint)
        try:
            for i in range(30):
                sock.send(wire.encode_join(f"x{i}", i, "127.0.0.1", 9, bipartite=True))
                assert sock.poll(5000), "no answer"
                answer = wire.decode_message(sock.recv_multipart()[0])
                assert isinstance(answer, wire.Error) and answer.code == wire.ErrorCode.JOIN_REFUSED.value
        finally:
            sock.close(linger=0)
        assert member.stats()["joins_refused"] == 30
    refusals = [r for r in caplog.records if "refused a join" in r.getMessage()]
    assert len(refusals) == 30 and [r.levelname for r in refusals].count("WARNING") == 1
