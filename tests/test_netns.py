"""Multi-host for real: three nodes in three network namespaces, a partition and its healing.

Topology (addresses exist only inside the namespaces, see tests/netns.py)::

    a  --ab/ba (tbf 5 Mbit/s from a)--  b  --bc/cb--  c
    .1                          .2   .5 (b routes)    .6

Each namespace runs one tests/fault_worker.py node (a 20 ms step that also pulls
its parameters toward a target of its own, so that nodes that stop talking drift
apart). The test checks that the nodes gossip across the links (every node
fetched from every other, a <-> c through b's routing), then sets ``bc`` down:
{a, b} and {c} keep training (steps advance, update_wait stays bounded) and the
halves drift apart; then sets it up again, and the spread between the halves
falls back to near what it was before the cut (90 % of the gap closed). The nodes
share one machine but no network namespace: they are not co-located, and every
snapshot travels over TCP (no shared memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import netns
import numpy as np
import pytest
import yaml
from test_faults import SLACK_MS, FaultNode

REASON = netns.unavailable()
# timing: every step's wait is held to timeout_ms + SLACK_MS (as in test_faults), which a stall of the other test
# worker would break
pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timing,
    pytest.mark.skipif(REASON is not None, reason=str(REASON)),
]

TIMEOUT_MS = 300
PORT = 47000


@pytest.fixture
def lab() -> Iterator[netns.Lab]:
    netns.remove_orphans()
    lab = netns.Lab()
    try:
        yield lab
    finally:
        lab.close()
        assert lab.leftovers() == [], "namespaces left behind"


def build_chain(lab: netns.Lab) -> dict[str, str]:
    """a - b - c, b routing between its two links; returns each node's namespace by node name."""
    a, b, c = lab.namespace("a"), lab.namespace("b"), lab.namespace("c")
    n = lab.subnet
    lab.veth(a, "ab", f"{n}.1/30", b, "ba", f"{n}.2/30")
    lab.veth(b, "bc", f"{n}.5/30", c, "cb", f"{n}.6/30")
    lab.forwarding(b)
    lab.route(a, f"{n}.4/30", f"{n}.2")
    lab.route(c, f"{n}.0/30", f"{n}.5")
    lab.rate_limit(a, "ab")
    return {"a": a, "b": b, "c": c}


def spread_between(halves: tuple[list[np.ndarray], list[np.ndarray]]) -> float:
    """RMS distance between the mean parameters of two groups of nodes."""
    left, right = (np.mean(h, axis=0) for h in halves)
    return float(np.sqrt(np.mean((left - right) ** 2)))


@pytest.mark.outcome  # the partition's spread bounds were measured with nothing else running
def test_gossip_across_namespaces_survives_a_partition(
    lab: netns.Lab, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    spaces = build_chain(lab)
    n = lab.subnet
    hosts = {"a": f"{n}.1", "b": f"{n}.2", "c": f"{n}.6"}
    cfg = tmp_path / "cluster.yaml"
    doc = {"nodes": [{"name": k, "host": h, "port": PORT} for k, h in hosts.items()], "timeout_ms": TIMEOUT_MS}
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))

    nodes: dict[str, FaultNode] = {}
    try:
        for i, name in enumerate(hosts):
            nodes[name] = FaultNode(name, cfg, seed=i + 1, prefix=netns.Lab.exec_prefix(spaces[name]), drift=0.005)
            assert nodes[name].ready["ready"] == f"tcp://{hosts[name]}:{PORT}"
        everyone = list(nodes.values())

        def run(seconds: float) -> dict[str, list[list]]:
            for node in everyone:
                node.send(f"run_for {seconds}")
            return {node.name: node.read(timeout=seconds + 60)["steps"] for node in everyone}

        def params() -> dict[str, np.ndarray]:
            return {node.name: np.asarray(node.call("params")["params"]) for node in everyone}

        def halves() -> float:
            p = params()
            return spread_between(([p["a"], p["b"]], [p["c"]]))

        def settled() -> float:
            """The spread between the halves, median of three looks 0.3 s of training apart (it fluctuates)."""
            looks = [halves()]
            for _ in range(2):
                run(0.3)
                looks.append(halves())
            return float(np.median(looks))

        def by_peer() -> dict[str, dict[str, dict[str, int]]]:
            return {node.name: node.call("stats")["by_peer"] for node in everyone}

        # 1. gossip across the links: every node fetched from both others (a <-> c goes through b)
        joined = run(4.0)
        peers = by_peer()
        for name in hosts:
            for other in hosts:
                if other != name:
                    assert peers[name].get(other, {}).get("ok", 0) >= 10, (name, other, peers[name])
        for name, steps in joined.items():
            assert max(s[2] for s in steps) <= TIMEOUT_MS + SLACK_MS, name
        # one machine, three network namespaces: never co-located, so every snapshot came over TCP
        for node in everyone:
            stats = node.call("stats")
            assert stats["shm_fetched"] == 0 and stats["shm_served"] == 0, (node.name, stats)
            assert stats["bytes_in"] > 4000 * stats["fetches_ok"] > 0, (node.name, stats)  # payloads, not headers
        before = settled()

        # 2. partition: {a, b} | {c}; both halves keep training
        lab.link(spaces["b"], "bc", up=False)
        cut = run(4.0)
        for name, steps in cut.items():
            # ~45 steps/s when nobody times out; c (and b, for c) pays ~6 timeouts before flow control gives up
            assert len(steps) >= 25, (name, len(steps))
            assert max(s[2] for s in steps) <= TIMEOUT_MS + SLACK_MS, (name, max(s[2] for s in steps))
        late = lambda steps: steps[len(steps) // 2 :]  # noqa: E731 - once flow control has settled
        assert any(s[3] > 0 and s[4] == "b" for s in late(cut["a"])), "a stopped mixing with b"
        assert any(s[3] > 0 and s[4] == "a" for s in late(cut["b"])), "b stopped mixing with a"
        assert all(s[3] == 0 for s in cut["c"]), "c mixed across a cut link"
        during = halves()

        # 3. heal: c is probed back in and the halves converge to where they were
        lab.link(spaces["b"], "bc", up=True)
        lab.route(lab.prefix + "c", f"{n}.0/30", f"{n}.5")  # idempotent: survives a carrier loss anyway
        healed = run(8.0)
        assert any(s[3] > 0 for s in healed["c"]), "c never mixed again"
        c_ok = lambda stats: sum(stats["c"].get(p, {}).get("ok", 0) for p in ("a", "b"))  # noqa: E731
        assert c_ok(by_peer()) > c_ok(peers), "c fetched nothing after the link came back"
        after = settled()
        report = f"spread between halves: joined {before:.4f}, cut {during:.4f}, healed {after:.4f}"
        print(report)
        record_property("cut_over_joined", during / before)
        record_property("gap_closed", 1.0 - (after - before) / (during - before))
        assert during >= 5 * before, report  # the partition mattered
        # and healing undid it: at least 90 % of the gap the cut opened has closed. (Not after <= 2 * before: both
        # are the noise of training with drift and move with the load; a suite run read joined 0.0028, cut 0.3798,
        # healed 0.0058, a gap closed by 99 %.) 30 runs (`scripts/test.sh --stress 30` of this test, 2026-11-28):
        # gap closed mean 0.9995, sd 0.003, min 0.992; cut / joined mean 86, min 72 (asserted: >= 5).
        assert after - before <= 0.1 * (during - before), report
    finally:
        for node in nodes.values():
            node.kill()


def test_a_node_in_a_fourth_namespace_joins_the_running_cluster_and_mixes_across_the_link(
    lab: netns.Lab, tmp_path: Path
) -> None:
    """a - b - c train; d, in a namespace of its own behind b (``d --db/bd-- b``), joins through a's address
    (two hops away) with only `join:` in its file, and gossips with all three: every node lists four members,
    and d fetches from a and c through b's routing and they from d."""
    spaces = build_chain(lab)
    n = lab.subnet
    d = lab.namespace("d")
    lab.veth(d, "db", f"{n}.10/30", spaces["b"], "bd", f"{n}.9/30")
    lab.route(d, f"{n}.0/28", f"{n}.9")  # a's and c's links, through b
    lab.route(spaces["a"], f"{n}.8/30", f"{n}.2")
    lab.route(spaces["c"], f"{n}.8/30", f"{n}.5")
    spaces["d"] = d
    hosts = {"a": f"{n}.1", "b": f"{n}.2", "c": f"{n}.6"}
    cluster = tmp_path / "cluster.yaml"
    doc = {"nodes": [{"name": k, "host": h, "port": PORT} for k, h in hosts.items()], "timeout_ms": TIMEOUT_MS}
    cluster.write_text(yaml.safe_dump(doc, sort_keys=False))
    joining = tmp_path / "join.yaml"
    join_doc = {"nodes": [{"name": "d", "host": f"{n}.10", "port": PORT}], "join": f"{n}.1:{PORT}"}
    joining.write_text(yaml.safe_dump({**join_doc, "timeout_ms": TIMEOUT_MS}, sort_keys=False))

    nodes: dict[str, FaultNode] = {}
    try:
        for i, name in enumerate(hosts):
            nodes[name] = FaultNode(name, cluster, seed=i + 1, prefix=netns.Lab.exec_prefix(spaces[name]))
        for node in nodes.values():
            node.send("run_for 1.0")
        nodes["d"] = FaultNode("d", joining, seed=9, prefix=netns.Lab.exec_prefix(d))  # joins while they train
        assert nodes["d"].ready["ready"] == f"tcp://{n}.10:{PORT}"
        for name in hosts:
            nodes[name].read(timeout=60)
        everyone = list(nodes.values())
        for node in everyone:
            node.send("run_for 4.0")
        for node in everyone:
            node.read(timeout=70)
        stats = {node.name: node.call("stats") for node in everyone}
        for name, s in stats.items():
            alive = {m for m, e in s["members"].items() if e["state"] == "alive"}
            assert alive == {"a", "b", "c", "d"}, (name, s["members"])
        for other in ("a", "c"):  # two hops each way, through b
            assert stats["d"]["by_peer"].get(other, {}).get("ok", 0) >= 5, stats["d"]["by_peer"]
            assert stats[other]["by_peer"].get("d", {}).get("ok", 0) >= 5, (other, stats[other]["by_peer"])
    finally:
        for node in nodes.values():
            node.kill()
