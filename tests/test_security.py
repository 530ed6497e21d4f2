"""CurveZMQ security (``security: {curve: true, keys: DIR}``): keys, config checks, and what a node admits.

* ``dpwa keys generate`` writes key pairs zmq.auth can read, the secret one 0600 whatever the umask,
  and never overwrites without ``--force``.
* Config errors name file:line:key; the config round-trips through ``dpwa validate``.
* Two CURVE nodes gossip and mix, and a TCP tap between them sees neither parameters nor headers.
* A client without a listed key -- a random key pair, a plain (NULL) DEALER, a real dpwa node with an
  unlisted key, a node with the wrong server key -- gets no byte back and is never served.
* Without CURVE a non-loopback bind logs one warning; closing leaves no thread behind.
* An unauthenticated client's 2,000 x 64,000-byte request costs the node no memory (the CURVE/ZAP
  handshake comes before libzmq reads any message; compare test_hostile's strict xfail without CURVE).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
import zmq
import zmq.auth
from click.testing import CliRunner
from conftest import free_ports, port_is_free, rss_mib, wait_until, write_cluster
from zmq.utils.garbage import GarbageCollectorThread
from zmq.utils.monitor import recv_monitor_message

from dpwa import ConfigError, DpwaConnection, load_config
from dpwa.cli import main
from dpwa.config import ClusterConfig, NodeSpec, SecurityConfig
from dpwa.node import wire
from dpwa.node.wire import Kind, Layout
from dpwa.security.keyfiles import read_key_file, write_key_pair
from dpwa.security.keys import generate_keys
from dpwa.utils.endpoints import is_loopback

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_MS = 400
NO_REPLY_S = 1.0
"""How long a refused client listens for a reply after its refusal was observed (it must get none)."""


def secure_cluster(
    path: Path, ports: list[int], names: list[str] | None = None, keys: str = "keys", generate: bool = True
) -> Path:
    """A cluster file at ``path`` with CURVE on and ``keys`` relative to it; fresh keys unless not ``generate``."""
    names = names or [f"w{i + 1}" for i in range(len(ports))]
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "nodes": [{"name": n, "host": "127.0.0.1", "port": p} for n, p in zip(names, ports)],
        "timeout_ms": TIMEOUT_MS,
        "security": {"curve": True, "keys": keys},
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    if generate:
        generate_keys(names, path.parent / keys)
    return path


def params(value: float) -> list[np.ndarray]:
    """Two arrays whose bytes are distinctive (a tap searches the wire for them)."""
    return [
        (np.arange(1000, dtype=np.float32) * np.float32(np.pi) + np.float32(value)),
        np.full((3, 7), value, np.float64),
    ]


def exchange(*nodes: tuple[DpwaConnection, list[np.ndarray]]) -> list[float]:
    """One round, node after node: each publishes, then waits and mixes; the factors.

    In turn, not all publishing first: a node's fetch starts with its ``update_send``, so a peer that had
    not published yet would serve the snapshot this node already mixed (a skipped repeat, factor 0.0).
    In turn, every node fetches what the others published since its own last step."""
    factors = []
    for conn, p in nodes:
        conn.update_send(p, 1.0)
        factors.append(conn.update_wait(1.0))
    return factors


def fetch_request(arrays: list[np.ndarray], req: int = 7) -> bytes:
    """A valid FETCH for a node publishing ``arrays`` (right layout fingerprint), single-message reply."""
    return wire.encode_fetch("w1", req, Layout.of(arrays).fingerprint)


class Client:
    """A raw DEALER in its own context, with a monitor: CURVE with ``keys`` (public, secret) and
    ``server_key``, or plain (NULL mechanism) when ``keys`` is None.

    Sends block at most SEND_TIMEOUT_MS: a DEALER whose only connection the node has already refused has
    no pipe to queue a message on, and a send without a timeout would then block forever."""

    SEND_TIMEOUT_MS = 5000

    def __init__(self, endpoint: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, self.SEND_TIMEOUT_MS)
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keys
            self.sock.curve_serverkey = server_key
        self.monitor = self.sock.get_monitor_socket()
        self.events: list[int] = []
        self.sock.connect(endpoint)

    def offer(self, frames: list[bytes]) -> bool:
        """Queue ``frames`` as one message; False when the socket had no connection left to queue it on
        within SEND_TIMEOUT_MS (the node closed it during the handshake: nothing can reach the node then)."""
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            return False
        return True

    def saw(self, *wanted: int) -> bool:
        """Take the monitor events that arrived; True once any of ``wanted`` was among them."""
        while self.monitor.poll(0):
            self.events.append(recv_monitor_message(self.monitor)["event"])
        return any(e in self.events for e in wanted)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def client_factory() -> Iterator[Any]:
    made: list[Client] = []

    def make(*args: Any, **kwargs: Any) -> Client:
        made.append(Client(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


# --------------------------------------------------------------------------- dpwa keys generate


def keys_cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["keys", "generate", *args])


def test_generate_writes_key_pairs_zmq_auth_reads_with_a_0600_secret_whatever_the_umask(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    old = os.umask(0)  # the modes must not depend on it
    try:
        result = keys_cli("w1", "w2", "--dir", str(directory))
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    publics = set()
    for name in ("w1", "w2"):
        public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
        assert str(public) in result.output and str(secret) in result.output
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(public.stat().st_mode) == 0o644
        pub, none = zmq.auth.load_certificate(public)
        pub2, sec = zmq.auth.load_certificate(secret)
        assert none is None and sec is not None and pub == pub2
        assert zmq.curve_public(sec) == pub, "the secret key belongs to the public key"
        assert read_key_file(secret, secret=True) == (pub, sec)
        publics.add(pub)
    assert len(publics) == 2
    assert sorted(p.name for p in directory.iterdir()) == ["w1.key", "w1.key_secret", "w2.key", "w2.key_secret"]


def test_generate_refuses_to_overwrite_unless_forced(tmp_path: Path) -> None:
    assert keys_cli("w1", "--dir", str(tmp_path)).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = keys_cli("w3", "w1", "--dir", str(tmp_path))  # one new name, one existing: nothing is written
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "w1.key" in result.output and "--force" in result.output
    assert len(result.output.splitlines()) == 1 and "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    result = keys_cli("w1", "--dir", str(tmp_path), "--force")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "w1.key_secret").read_bytes() != before["w1.key_secret"]
    assert stat.S_IMODE((tmp_path / "w1.key_secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w1.key", "w1.key_secret"], "no temporary file left"


@pytest.mark.parametrize("names", [["../evil"], ["a/b"], [".hidden"], [""], ["w1", "bad name"], ["w1", "w1"]])
def test_generate_rejects_bad_names_with_exit_2_and_writes_nothing(tmp_path: Path, names: list[str]) -> None:
    directory = tmp_path / "keys"
    result = keys_cli(*names, "--dir", str(directory))
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and len(result.output.splitlines()) == 1
    assert not directory.exists() and not (tmp_path / "evil.key").exists()


def test_generate_needs_a_name() -> None:
    assert keys_cli().exit_code == 2


# --------------------------------------------------------------------------- config


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


TWO_NODES = "nodes:\n  - {name: w1, host: 127.0.0.1, port: 5001}\n  - {name: w2, host: 127.0.0.1, port: 5002}\n"


@pytest.mark.parametrize(
    ("security", "key", "reason"),
    [
        ("security: true", "security", "must be a map like {curve: true, keys: DIR}"),
        ("security: {curve: true, keys: keys, cruve: 1}", "security.cruve", "(did you mean 'curve'?)"),
        ("security: {curve: 1, keys: keys}", "security.curve", "must be true or false, got 1"),
        ("security: {curve: 'true', keys: keys}", "security.curve", "must be true or false"),
        ("security: {curve: true}", "security.keys", "missing; `curve: true` needs `keys: DIR`"),
        ("security: {curve: true, keys: 5}", "security.keys", "must be a directory path, got 5"),
        ("security: {curve: true, keys: nowhere}", "security.keys", "key directory"),
    ],
)
def test_bad_security_settings_name_file_line_and_key(tmp_path: Path, security: str, key: str, reason: str) -> None:
    generate_keys(["w1", "w2"], tmp_path / "keys")
    path = write(tmp_path / "c.yaml", TWO_NODES + "timeout_ms: 100\n" + security + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.file, info.value.line, info.value.key) == (str(path), 5, key)
    assert reason in info.value.reason


def test_a_missing_bad_or_shared_public_key_is_a_config_error_at_security_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(["w1", "w2"], keys)
    path = write(tmp_path / "c.yaml", TWO_NODES + "security:\n  curve: true\n  keys: keys\n")
    assert load_config(path).security == SecurityConfig(True, str(keys))
    (keys / "w2.key").unlink()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.line, info.value.key) == (6, "security.keys")
    assert "no public key w2.key" in info.value.reason and f"dpwa keys generate w2 --dir {keys}" in info.value.reason
    (keys / "w2.key").write_text('curve\n    public-key = "too short"\n')
    with pytest.raises(ConfigError, match=r"w2\.key: public-key is not a 40-character Z85 CurveZMQ key"):
        load_config(path)
    shutil.copy(keys / "w1.key", keys / "w2.key")
    with pytest.raises(ConfigError, match="nodes 'w1' and 'w2' have the same public key"):
        load_config(path)


def test_node_names_must_name_files_with_curve_or_without(tmp_path: Path) -> None:
    """A node's name names its key files, and its log, metrics and model files in a run directory: ``a/b`` would
    name a path outside them (tests/data/configs/bad/node_name_*.yaml: more cases)."""
    text = "nodes:\n  - {name: w1, host: 127.0.0.1, port: 5001}\n  - {name: a/b, host: 127.0.0.1, port: 5002}\n"
    for name, extra in (("plain.yaml", ""), ("c.yaml", "security: {curve: true, keys: k}\n")):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path / name, text + extra))
        assert (info.value.line, info.value.key) == (3, "nodes[1].name")
        assert "it names the node's files" in info.value.reason


def test_security_off_needs_no_keys_and_is_left_out_of_the_written_config(tmp_path: Path) -> None:
    config = load_config(write(tmp_path / "c.yaml", TWO_NODES + "security: {curve: false, keys: nowhere}\n"))
    assert config.security == SecurityConfig(False, str(tmp_path / "nowhere"))
    assert "security" not in load_config(write(tmp_path / "d.yaml", TWO_NODES)).to_dict()
    assert load_config(tmp_path / "d.yaml").security == SecurityConfig()


def test_the_config_round_trips_through_validate_with_an_absolute_key_directory(tmp_path: Path) -> None:
    path = secure_cluster(tmp_path / "conf" / "c.yaml", [5001, 5002])
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "security: {curve: true, keys: " + str(tmp_path / "conf" / "keys") + "}" in result.output
    assert result.output.splitlines()[-1].endswith(", security curve")
    elsewhere = write(tmp_path / "elsewhere.yaml", result.output)  # another directory: keys still found
    assert load_config(elsewhere) == load_config(path)
    assert load_config(elsewhere).to_dict() == load_config(path).to_dict()


def test_validate_exits_2_with_one_line_for_a_missing_key(tmp_path: Path) -> None:
    path = secure_cluster(tmp_path / "c.yaml", [5001, 5002])
    (tmp_path / "keys" / "w1.key").unlink()
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("keys:"))
    assert result.output.startswith(f"error: {path}:{line}: security.keys: no public key w1.key")
    assert len(result.output.splitlines()) == 1


def test_the_secure_sample_needs_generated_keys(tmp_path: Path) -> None:
    sample = ROOT / "samples" / "secure-localhost.yaml"
    copy = write(tmp_path / sample.name, sample.read_text())
    with pytest.raises(ConfigError) as info:
        load_config(copy)
    assert info.value.key == "security.keys" and "dpwa keys generate w1 w2 w3 w4" in info.value.reason
    assert "dpwa keys generate w1 w2 w3 w4 --dir samples/keys" in sample.read_text(), "its header says how"
    generate_keys(["w1", "w2", "w3", "w4"], tmp_path / "keys")
    assert load_config(copy).security == SecurityConfig(True, str(tmp_path / "keys"))


@pytest.mark.integration
def test_a_node_checks_its_own_secret_key_when_it_starts(tmp_path: Path) -> None:
    ports = free_ports(2)
    path = secure_cluster(tmp_path / "c.yaml", ports)
    keys = tmp_path / "keys"
    (keys / "w1.key_secret").unlink()
    config = load_config(path)  # loads: a machine that runs only w2 has no w1.key_secret
    threads = dpwa_threads()
    with pytest.raises(ConfigError) as info:
        DpwaConnection("w1", config)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip().startswith("keys:"))
    assert (info.value.file, info.value.line, info.value.key) == (str(path), line, "security.keys")
    assert "w1.key_secret: no such key file" in info.value.reason
    # a consistent key pair, but w1.key (the key every peer admits as w1) is another one
    public, secret = zmq.curve_keypair()
    write_key_pair(keys, "w1", public, secret, replace=True)
    generate_keys(["w9"], keys)
    shutil.copy(keys / "w9.key", keys / "w1.key")
    with pytest.raises(ConfigError, match="w1.key_secret does not belong to .*w1.key"):
        DpwaConnection("w1", load_config(path))
    assert dpwa_threads() == threads and port_is_free(ports[0])
    with DpwaConnection("w2", config):  # w2 has what it needs
        pass


def test_in_memory_config_checks_keys_too(tmp_path: Path) -> None:
    nodes = (NodeSpec("w1", "127.0.0.1", 5001),)
    with pytest.raises(ConfigError, match="key directory"):
        ClusterConfig(nodes=nodes, security=SecurityConfig(True, str(tmp_path / "none")))
    generate_keys(["w1"], tmp_path / "k")
    assert ClusterConfig(nodes=nodes, security=SecurityConfig(True, str(tmp_path / "k"))).security.curve


# --------------------------------------------------------------------------- on the wire


class TcpTap:
    """Listens on ``port`` and forwards every connection to ``target``, recording the bytes both ways."""

    def __init__(self, port: int, target: int) -> None:
        self.target = target
        self.data = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", port))
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            if select.select([self._listener], [], [], 0.05)[0]:
                inbound, _ = self._listener.accept()
                try:
                    outbound = socket.create_connection(("127.0.0.1", self.target))
                except OSError:  # the target has closed (a node's leave announcement after its peer went)
                    inbound.close()
                    continue
                t = threading.Thread(target=self._pump, args=(inbound, outbound), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self._stop.is_set():
                for s in select.select(list(peers), [], [], 0.05)[0]:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        return
                    with self._lock:
                        self.data += chunk
                    peers[s].sendall(chunk)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self.data)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        self._listener.close()


@pytest.mark.integration
@pytest.mark.parametrize("curve", [True, False])
@pytest.mark.timing
def test_two_curve_nodes_gossip_and_the_wire_shows_no_parameters(tmp_path: Path, curve: bool) -> None:
    """w1 reaches w2 through a tap. With CURVE the nodes mix exactly as without, and the tapped bytes hold
    neither w2's parameters nor any header text; without CURVE (the control) they hold both."""
    p1, p2, tap_port = free_ports(3)
    # w2 binds p2; w1's copy of the cluster file says w2 is at the tap (same names, same keys).
    direct = secure_cluster(tmp_path / "w2.yaml", [p1, p2]) if curve else write_cluster(tmp_path / "w2.yaml", [p1, p2])
    doc = yaml.safe_load(direct.read_text())
    doc["transport"] = {"shared_memory": "off"}  # the snapshots go through the tap, not shared memory
    direct.write_text(yaml.safe_dump(doc, sort_keys=False))
    doc["nodes"][1]["port"] = tap_port
    doc.update(timeout_ms=TIMEOUT_MS, fetch_probability=1.0)
    tapped = write(tmp_path / "w1.yaml", yaml.safe_dump(doc))
    tap = TcpTap(tap_port, p2)
    try:
        x1, x2 = params(0.0), params(1.0)
        with DpwaConnection("w1", tapped, seed=1) as w1, DpwaConnection("w2", direct, seed=2) as w2:
            served = x2[0].copy()
            w2.update_send(x2, 1.0)  # its fetch finds w1 not ready yet: factor 0
            assert w2.update_wait(1.0) == 0.0
            w1.update_send(x1, 1.0)
            assert w1.update_wait(1.0) == 0.5
            np.testing.assert_allclose(x1[1], 0.5)
            np.testing.assert_allclose(x1[0], (params(0.0)[0] + params(1.0)[0]) / 2, rtol=1e-6)
            assert exchange((w2, x2), (w1, x1)) == [0.5, 0.5]  # w2 first: w1 mixed w2's first snapshot already
            s1, s2 = w1.stats(), w2.stats()
            assert s1["fetches_ok"] == 2 and s2["fetches_ok"] == 1 and s2["auth_denied"] == 0
        seen = tap.seen()
    finally:
        tap.close()
    assert len(seen) > served.nbytes, "the fetches went through the tap"
    window = served.tobytes()[400:432]  # 32 bytes of w2's parameters as published
    if curve:
        assert window not in seen and b'"clock"' not in seen and wire.MAGIC not in seen
    else:
        assert window in seen and b'"clock"' in seen


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[DpwaConnection, list[np.ndarray], Path]]:
    """A CURVE node w2 (cluster w1, w2) that has published its parameters."""
    path = secure_cluster(tmp_path / "c.yaml", free_ports(2))
    x = params(2.0)
    with DpwaConnection("w2", path, seed=2) as node:
        node.update_send(x, 1.0)
        node.update_wait(1.0)  # w1 is not running: a timeout, factor 0
        yield node, x, tmp_path / "keys"


@pytest.mark.integration
@pytest.mark.timing
def test_clients_without_a_listed_key_get_no_byte_back(server: Any, client_factory: Any) -> None:
    node, x, keys = server
    before = node.stats()
    request = fetch_request(x)
    server_key = read_key_file(keys / "w2.key")[0]

    stranger = client_factory(node.endpoint, zmq.curve_keypair(), server_key)
    stranger.offer([request])
    wait_until(lambda: stranger.saw(zmq.EVENT_HANDSHAKE_FAILED_AUTH), 10, message="ZAP refused the random key")
    wait_until(lambda: node.stats()["auth_denied"] > before["auth_denied"], 5)

    plain = client_factory(node.endpoint)  # no CURVE at all (NULL mechanism)
    plain.offer([request])
    failed = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED)
    wait_until(lambda: plain.saw(*failed), 10, message="the plain client's handshake failed")

    assert stranger.sock.poll(int(NO_REPLY_S * 1000)) == 0, "a client with an unlisted key got a reply"
    assert plain.sock.poll(int(NO_REPLY_S * 1000)) == 0, "a plain client got a reply"
    after = node.stats()
    assert after["served"] == before["served"] and after["requests_rejected"] == before["requests_rejected"]
    assert after["bytes_out"] == before["bytes_out"]

    # Control: the same request with w1's listed key pair is answered with w2's parameters.
    listed = read_key_file(keys / "w1.key_secret", secret=True)
    friend = client_factory(node.endpoint, listed, server_key)
    assert friend.offer([request])
    assert friend.sock.poll(10_000), "a listed client got no reply"
    frames = friend.sock.recv_multipart()
    assert wire.decode_message(frames[0]).kind is Kind.STATE
    assert b"".join(frames[1:])[:4000] == x[0].tobytes()
    # the RX thread counts a reply once its send returned, which may be after the client holds it: wait for it
    wait_until(lambda: node.stats()["served"] > before["served"], 5, message="the listed client's reply counted")
    assert node.stats()["served"] == before["served"] + 1


@pytest.mark.integration
@pytest.mark.timing
def test_a_dpwa_node_whose_key_is_not_listed_is_refused(tmp_path: Path) -> None:
    """w3 (its own cluster file: w2 and w3, w2's real public key) fetches from w2, whose cluster is w1, w2.
    Both run in this process: each node's ZAP handler lives in its own context and admits only its own list."""
    p1, p2, p3 = free_ports(3)
    home = secure_cluster(tmp_path / "home" / "c.yaml", [p1, p2])
    (tmp_path / "rogue" / "keys").mkdir(parents=True)
    shutil.copy(tmp_path / "home" / "keys" / "w2.key", tmp_path / "rogue" / "keys" / "w2.key")
    generate_keys(["w3"], tmp_path / "rogue" / "keys")
    rogue = secure_cluster(tmp_path / "rogue" / "c.yaml", [p2, p3], names=["w2", "w3"], generate=False)
    x2, x3 = params(2.0), params(3.0)
    with DpwaConnection("w2", home, seed=2) as w2, DpwaConnection("w3", rogue, seed=3) as w3:
        w2.update_send(x2, 1.0)
        assert w2.update_wait(1.0) == 0.0
        for _ in range(2):
            w3.update_send(x3, 1.0)
            assert w3.update_wait(1.0) == 0.0
        assert w3.last_exchange is not None and w3.last_exchange["status"] == "timeout"
        np.testing.assert_array_equal(x3[1], 3.0)
        s2 = w2.stats()
        assert s2["auth_denied"] >= 1 and s2["served"] == 0 and s2["bytes_out"] == 0
        assert w3.stats()["fetches_ok"] == 0


@pytest.mark.integration
@pytest.mark.timing
def test_a_node_with_the_wrong_server_key_cannot_fetch(tmp_path: Path) -> None:
    """w1 holds its real key pair but a wrong w2.key: the handshake fails, the fetch times out. The same w1
    with the right w2.key mixes (the control)."""
    ports = free_ports(2)
    right = secure_cluster(tmp_path / "right" / "c.yaml", ports)
    wrong_keys = tmp_path / "wrong" / "keys"
    shutil.copytree(tmp_path / "right" / "keys", wrong_keys)
    public, secret = zmq.curve_keypair()
    (wrong_keys / "w2.key").unlink()
    (wrong_keys / "w2.key_secret").unlink()
    write_key_pair(wrong_keys, "w2", public, secret)
    wrong = secure_cluster(tmp_path / "wrong" / "c.yaml", ports, generate=False)
    x1, x2 = params(1.0), params(2.0)
    with DpwaConnection("w2", right, seed=2) as w2:
        w2.update_send(x2, 1.0)
        with DpwaConnection("w1", wrong, seed=1) as w1:
            for _ in range(2):
                w1.update_send(x1, 1.0)
                assert w1.update_wait(1.0) == 0.0
            assert w1.stats()["fetches_ok"] == 0 and w1.stats()["by_peer"]["w2"] == {"timeout": 2}
        assert w2.stats()["served"] == 0
        np.testing.assert_array_equal(x1[1], 1.0)
        with DpwaConnection("w1", right, seed=1) as w1:
            w1.update_send(x1, 1.0)
            assert w1.update_wait(1.0) == 0.5
        assert w2.stats()["served"] == 1


# --------------------------------------------------------------------------- the warning, threads


def exposure_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "without CURVE" in r.getMessage()]


@pytest.mark.integration
def test_a_non_loopback_bind_without_curve_logs_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_ports(1)[0]
    cluster = "nodes:\n  - {name: w1, host: %s, port: %d}\n"
    caplog.set_level(logging.WARNING)
    with DpwaConnection("w1", write(tmp_path / "any.yaml", cluster % ("0.0.0.0", port))) as node:
        node.update_send(params(0.0), 1.0)
        node.update_wait(1.0)
    messages = exposure_warnings(caplog.records)
    assert len(messages) == 1, messages
    assert f"tcp://0.0.0.0:{port}" in messages[0] and "anyone who can reach this port can read the model" in messages[0]
    caplog.clear()
    for i, host in enumerate(("127.0.0.1", "localhost", "127.0.0.2")):
        with DpwaConnection("w1", write(tmp_path / f"lo{i}.yaml", cluster % (host, port))):
            pass
    generate_keys(["w1"], tmp_path / "keys")
    secure = cluster % ("0.0.0.0", port) + "security: {curve: true, keys: keys}\n"
    with DpwaConnection("w1", write(tmp_path / "secure.yaml", secure)):
        pass
    assert exposure_warnings(caplog.records) == []


def test_loopback_addresses() -> None:
    for endpoint in ("tcp://127.0.0.1:1", "tcp://127.200.3.4:5", "tcp://[::1]:5", "tcp://localhost:5"):
        assert is_loopback(endpoint), endpoint
    for endpoint in ("tcp://0.0.0.0:1", "tcp://10.0.0.7:5", "tcp://[::]:5", "tcp://example.org:5"):
        assert not is_loopback(endpoint), endpoint


def dpwa_threads() -> set[threading.Thread]:
    """Live threads, less pyzmq's process-wide zero-copy collector (started once by the first copy=False send)."""
    return {t for t in threading.enumerate() if not isinstance(t, GarbageCollectorThread)}


@pytest.mark.integration
@pytest.mark.timing
def test_no_thread_or_port_is_left_after_close(tmp_path: Path, client_factory: Any) -> None:
    ports = free_ports(2)
    path = secure_cluster(tmp_path / "c.yaml", ports)
    before = dpwa_threads()
    x1, x2 = params(1.0), params(2.0)
    with DpwaConnection("w1", path, seed=1) as w1, DpwaConnection("w2", path, seed=2) as w2:
        names = {t.name for t in dpwa_threads() - before}
        assert {"dpwa-zap-w1", "dpwa-zap-w2", "dpwa-rx-w1", "dpwa-tx-w2"} <= names, names
        assert exchange((w1, x1), (w2, x2))[0] == 0.0  # w1's first fetch finds w2 not published yet
        assert exchange((w1, x1), (w2, x2)) == [0.5, 0.5]
        stranger = client_factory(w1.endpoint, zmq.curve_keypair(), read_key_file(tmp_path / "keys" / "w1.key")[0])
        wait_until(lambda: stranger.saw(zmq.EVENT_HANDSHAKE_FAILED_AUTH), 10)
    assert dpwa_threads() == before
    assert port_is_free(ports[0]) and port_is_free(ports[1])


# --------------------------------------------------------------------------- memory


@pytest.mark.integration
@pytest.mark.timing
def test_an_unauthenticated_many_frame_request_costs_no_memory(tmp_path: Path, nodes: Any, client_factory: Any) -> None:
    """The request of test_hostile's xfail (2,000 x 64,000 bytes, ~128 MB) from clients without a listed key:
    the node's peak RSS does not move, and the request never reaches the RX thread."""
    port = free_ports(1)[0]
    path = secure_cluster(tmp_path / "c.yaml", [port])
    node = nodes("w1", path, seed=0)
    assert node.call("run 3")["factors"] == [0.0, 0.0, 0.0]
    base = rss_mib(node.proc.pid)
    frame = bytes(64_000)
    server_key = read_key_file(tmp_path / "keys" / "w1.key")[0]
    stranger = client_factory(node.ready["ready"], zmq.curve_keypair(), server_key)
    plain = client_factory(node.ready["ready"])
    for client in (stranger, plain):
        client.offer([frame] * 2000)  # queued, or refused with the connection: either way the node gets nothing
    wait_until(lambda: node.call("stats")["auth_denied"] >= 1, 30, message="the node refused the stranger")
    wait_until(lambda: plain.saw(zmq.EVENT_DISCONNECTED), 10, message="the plain client was disconnected")
    grown = rss_mib(node.proc.pid)["VmHWM"] - base["VmHWM"]
    stats = node.call("stats")
    assert stats["requests_rejected"] == 0 and stats["served"] == 0, "the request never reached the RX thread"
    assert grown < 16, f"peak RSS grew by {grown:.1f} MiB for refused 128 MB requests"
    assert node.call("run 1")["factors"] == [0.0] and node.proc.poll() is None
    node.quit()
