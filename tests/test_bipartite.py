"""AD-PSGD's bipartite split (``adpsgd: {bipartite: true}``): active nodes start every exchange, with a passive peer.

The roles are a pure function of a node's name and the cluster file's order (:func:`dpwa.rules.adpsgd.is_active`);
flow control picks an active node's peer among the passive members alone; a passive node never fetches and so
allocates no receive buffer, an active node is never pushed to and allocates no inbox. Checked here without
sockets (the roles, the schedule, flow control, the config), in the simulator (every exchange joins an active and a
passive node and the models' mean is kept), and on the network: four nodes in ``memory: low``, each with one
exchange buffer, keep the mean of their models.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import free_ports, port_is_free, wait_until, write_cluster
from fakes import FakePeer
from test_membership import FAST, Trainers, fetched_ok, flat, joiner
from test_push import close_all, quiesce, run_threads, start_params

from dpwa.config import ClusterConfig, ConfigError, JoinAddress, NodeSpec, load_config
from dpwa.node import wire
from dpwa.node.connection import DpwaConnection
from dpwa.node.contact import file_roster
from dpwa.node.members import JoinRefused, Member
from dpwa.node.peers import FlowControl
from dpwa.rules import NodeState, make_rule
from dpwa.rules.adpsgd import AdpsgdSettings, is_active
from dpwa.rules.outer import OuterSchedule
from dpwa.rules.schedules import BipartiteSchedule, RandomSchedule, Round, make_schedule
from dpwa.tools.sim.runner import SimOptions, simulate
from dpwa.tools.simulation import Simulation

NAMES = ("w1", "w2", "w3", "w4", "w5")


def rnd(me: str, names: tuple[str, ...] = NAMES, index: int = 0) -> Round:
    return Round(me, names, index, NodeState(me))


# --------------------------------------------------------------------------- roles and the schedule


def test_roles_alternate_in_file_order_and_a_joiner_takes_one_by_its_name() -> None:
    assert [is_active(n, NAMES) for n in NAMES] == [True, False, True, False, True]
    assert [is_active(n, ("b", "a")) for n in ("a", "b")] == [False, True]  # the file's order, not the names'
    joiners = [f"joiner-{i}" for i in range(40)]
    roles = [is_active(n, NAMES) for n in joiners]
    assert roles == [is_active(n, NAMES[:2]) for n in joiners]  # the same whatever the file holds
    assert 0 < sum(roles) < len(roles)  # both roles among joiners


def test_an_active_node_lets_flow_control_pick_among_the_passive_and_a_passive_one_fetches_nobody() -> None:
    schedule = make_schedule("random", AdpsgdSettings(bipartite=True), NAMES)
    assert isinstance(schedule, BipartiteSchedule)
    for me in NAMES:
        active = is_active(me, NAMES)
        assert schedule.fetches(me, NAMES) is active and schedule.fetched(me, NAMES) is not active
        if active:
            assert schedule.targets(rnd(me)) is None
            assert schedule.candidates(rnd(me)) == {"w2", "w4"}
        else:
            assert schedule.targets(rnd(me)) == []
    # a member that joined is placed by its name; one that left takes no place from the others
    joined = ("w1", "w2", "w3", "w5", "zed")
    assert schedule.candidates(rnd("w1", joined)) == {"w2"} | ({"zed"} if not is_active("zed", NAMES) else set())
    # without a roster (a simulation), the members of the round are the roster
    bare = make_schedule("random", AdpsgdSettings(bipartite=True))
    assert bare.candidates(rnd("a", ("a", "w1", "b"))) == bare.candidates(rnd("b", ("a", "w1", "b"))) == {"w1"}
    assert bare.targets(rnd("w1", ("a", "w1", "b"))) == []


def test_without_bipartite_every_node_fetches_and_is_fetched() -> None:
    plain = make_schedule("random", AdpsgdSettings())
    assert isinstance(plain, RandomSchedule)
    assert plain.candidates(rnd("w1")) is None and plain.fetches("w2", NAMES) and plain.fetched("w1", NAMES)


def test_bipartite_takes_only_random_peers_and_the_config_says_where() -> None:
    with pytest.raises(ValueError, match="peers random"):
        make_schedule("exponential", AdpsgdSettings(bipartite=True), NAMES)


def test_a_cluster_file_with_bipartite_on_another_schedule_names_the_key_and_line_a_joining_one_loads(
    tmp_path: Path,
) -> None:
    path = write_cluster(tmp_path / "c.yaml", [1, 2], interpolation="adpsgd", peers="exponential")
    path.write_text(path.read_text() + "adpsgd:\n  bipartite: true\n")
    line = path.read_text().splitlines().index("  bipartite: true") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.key, info.value.line) == ("adpsgd.bipartite", line)
    assert "peers random" in info.value.reason
    joining = tmp_path / "j.yaml"
    joining.write_text("join: 127.0.0.1:5000\ninterpolation: adpsgd\nadpsgd:\n  bipartite: true\n")
    assert load_config(joining).settings == AdpsgdSettings(bipartite=True)
    joining.write_text(joining.read_text() + "peers: ring\n")
    with pytest.raises(ConfigError) as info:
        load_config(joining)
    assert (info.value.key, info.value.line) == ("adpsgd.bipartite", 4)


def test_a_joining_node_places_everyone_by_name_until_it_adopts_the_files_order() -> None:
    """Before its JOIN is answered a joining node knows no file order: every role comes from the name (its own is
    the one the cluster gives it); then the file's order places the file's nodes, whatever their names' order."""
    schedule = make_schedule("random", AdpsgdSettings(bipartite=True), ())
    assert schedule.splits_roles() and not make_schedule("random", AdpsgdSettings()).splits_roles()
    names = ("b", "a", "c", "j4")
    by_name = {n: is_active(n, ()) for n in names}
    assert {n: schedule.fetches(n, names) for n in names} == by_name
    schedule.adopt_roster(("b", "a", "c"))
    assert {n: schedule.fetches(n, names) for n in names} == {"b": True, "a": False, "c": True, "j4": by_name["j4"]}
    assert schedule.candidates(rnd("b", names)) == {"a"} | ({"j4"} if not by_name["j4"] else set())
    outer = OuterSchedule(make_schedule("random", AdpsgdSettings(bipartite=True), ()), every=2)
    outer.adopt_roster(("a", "b"))
    assert outer.splits_roles() and outer.fetches("a", ("a", "b")) and not outer.fetches("b", ("a", "b"))


def test_the_outer_optimizer_passes_the_roles_through() -> None:
    outer = OuterSchedule(make_schedule("random", AdpsgdSettings(bipartite=True), NAMES), every=2)
    assert outer.targets(rnd("w1", index=0)) == [] and outer.candidates(rnd("w1", index=0)) is None  # off-boundary
    assert outer.targets(rnd("w1", index=1)) is None and outer.candidates(rnd("w1", index=1)) == {"w2", "w4"}
    assert not outer.fetches("w2", NAMES) and not outer.fetched("w1", NAMES)


# --------------------------------------------------------------------------- flow control among candidates


def test_flow_control_picks_only_among_the_candidates_and_probes_only_them() -> None:
    now = [0.0]
    flow = FlowControl(["a", "b", "c", "d"], random.Random(1), now=lambda: now[0])
    picked = {p for _ in range(300) for p in flow.choose(1, {"b", "d"})}
    assert picked == {"b", "d"}
    assert flow.choose(2, {"c"}) == ["c"]  # fewer candidates than asked: only them
    assert flow.choose(1, set()) == []
    for peer in ("a", "b"):  # both down, both due for a probe
        while flow.is_up(peer):
            flow.failure(peer)
    now[0] = 1e6
    assert flow.choose(1, {"b", "c"}) == ["b"]  # the due probe among the candidates, never "a"
    assert "a" not in {p for _ in range(50) for p in flow.choose(1, {"b", "c"})}


# --------------------------------------------------------------------------- in the simulator


def test_in_the_simulator_every_exchange_joins_an_active_and_a_passive_node_and_keeps_the_mean() -> None:
    """Six nodes on quadratics with different centres (each node pulled elsewhere), no loss: the active nodes
    count only exchanges they started, the passive ones only exchanges they answered, both many; the mean of the
    models moves only by the local steps (no local steps here: it stays put to rounding)."""
    names = [f"w{i + 1}" for i in range(6)]
    rng = np.random.default_rng(3)
    start = [[rng.normal(size=4)] for _ in names]
    mean0 = np.mean([s[0] for s in start], axis=0)
    settings = AdpsgdSettings(bipartite=True)
    sim = Simulation(
        start, lambda: make_rule("adpsgd", settings, 0.0), lambda: make_schedule("random", settings), seed=4
    )
    for _ in range(300):
        sim.run_round({n: 1.0 for n in names})
    for name in names:
        rule = sim[name].rule
        if is_active(name, names):
            assert rule.active > 100 and rule.passive == 0, (name, rule.active, rule.passive)
        else:
            assert rule.passive > 50 and rule.active == 0, (name, rule.active, rule.passive)
    flats = sim.flats()
    assert np.abs(np.mean(flats, axis=0) - mean0).max() < 1e-12
    assert max(float(np.abs(x - mean0).max()) for x in flats) < 1e-6  # and they met


def test_the_event_simulator_gives_its_own_members_their_roles(tmp_path: Path) -> None:
    """``dpwa simulate`` names its members w1..wN whatever the file's nodes: they are the roster (w1, w3 active)."""
    config = ClusterConfig(interpolation="adpsgd", timeout_ms=100.0, rule_settings={"adpsgd": AdpsgdSettings(True)})
    simulate(SimOptions(config, nodes=4, steps=40), tmp_path)
    for i in range(4):
        lines = (tmp_path / f"w{i + 1}.metrics.jsonl").read_text().splitlines()
        last = [r for r in map(json.loads, lines) if "event" not in r][-1]
        started, answered = last["exchanges_active"], last["exchanges_passive"]
        assert (started > 0 and answered == 0) if i % 2 == 0 else (started == 0 and answered > 0), (i, last)


# --------------------------------------------------------------------------- on the network


@pytest.mark.integration
def test_four_low_memory_nodes_keep_one_exchange_buffer_each_and_the_mean(tmp_path: Path) -> None:
    """``memory: low`` and one inbox slot: an active node has one receive buffer and no inbox slot, a passive one
    no receive buffer and one slot; whatever the timing, no active node answers an exchange and no passive node
    starts one, exchanges commit, and the mean of the models is kept (1e-6: each committed exchange moves the
    two ends by opposite amounts, an aborted one moves nothing)."""
    cfg = load_config(
        write_cluster(
            tmp_path / "c.yaml",
            free_ports(4),
            interpolation="adpsgd",
            adpsgd={"bipartite": True},
            transport={"memory": "low"},
            inbox_slots=1,
            inbox_per_sender=1,
            timeout_ms=3000,
        )
    )
    conns = [DpwaConnection(f"w{i + 1}", cfg, seed=i) for i in range(4)]
    try:
        params = start_params(4, seed=7)
        mean0 = [np.mean([p[j] for p in params], axis=0) for j in range(2)]
        jitter = random.Random(5)
        run_threads(conns, params, 120, lambda i, k: jitter.random() * 0.003)
        quiesce(conns)
        mean1 = [np.mean([p[j] for p in params], axis=0) for j in range(2)]
        assert max(float(np.abs(a - b).max()) for a, b in zip(mean0, mean1)) < 1e-6
        committed = 0
        for conn in conns:
            node, stats = conn._node, conn.stats()
            active = is_active(conn.name, [n.name for n in cfg.nodes])
            assert len(node.transfer.fetcher.slots) == int(active), conn.name
            assert len(node.transfer.inbox._slots) == int(not active), conn.name
            if active:
                assert node.rule.passive == 0 and stats.get("exchanges_committed", 0) == 0, conn.name
            else:
                assert node.rule.active == 0 and stats.get("fetches_started", 0) == 0, conn.name
                committed += stats.get("exchanges_committed", 0)
        assert committed > 0
    finally:
        close_all(conns)


def bipartite_cluster(tmp_path: Path, **settings: object) -> Path:
    return write_cluster(
        tmp_path / "c.yaml", free_ports(2), interpolation="adpsgd", adpsgd={"bipartite": True}, **settings
    )


@pytest.mark.timing  # the bootstrap waits for the peer's answer (20 s at most)
def test_a_passive_node_that_bootstraps_takes_a_receive_buffer_then_and_copies_the_peer(tmp_path: Path) -> None:
    """A passive node allocates no receive buffer at its first publish, but a bootstrap (``dpwa run --resume``
    asks for one whatever the file says) fetches: it takes its one buffer then."""
    cfg = load_config(bipartite_cluster(tmp_path, fetch_probability=0.0))
    with DpwaConnection("w1", cfg, seed=1) as ahead, DpwaConnection("w2", cfg, seed=2) as passive:
        theirs, mine = start_params(2)
        for _ in range(3):
            ahead.update_send(theirs, 1.0)
            ahead.update_wait(1.0)
        assert passive.bootstrap(mine, timeout_s=20) == "w1"
        assert all(np.array_equal(m, t) for m, t in zip(mine, theirs))
        assert len(passive._node.transfer.fetcher.slots) == 1
        passive.update_send(mine, 1.0)  # then it trains, fetching nobody
        passive.update_wait(1.0)
        assert passive.stats().get("fetches_started", 0) == 1  # the bootstrap's


@pytest.mark.timing  # the refusal is awaited (10 s at most)
def test_an_active_node_refuses_a_peers_exchange_as_unsupported_and_keeps_its_params(tmp_path: Path) -> None:
    """A member that runs the plain rule (another file) and starts an exchange with an active node: refused
    ``unsupported`` and counted; the active node's parameters never see the push."""
    bipartite = load_config(bipartite_cluster(tmp_path, fetch_probability=0.0))  # w1 starts no exchange itself
    plain = load_config(write_cluster(tmp_path / "p.yaml", [n.port for n in bipartite.nodes], interpolation="adpsgd"))
    with DpwaConnection("w1", bipartite, seed=1) as active, DpwaConnection("w2", plain, seed=2) as other:
        mine, theirs = start_params(2)
        before = [a.copy() for a in mine]
        active.update_send(mine, 1.0)  # publishes
        for _ in range(3):
            other.update_send(theirs, 1.0)
            other.update_wait(1.0)
        wait_until(lambda: active.stats().get("pushes_unsupported", 0) >= 1, 10, message="an exchange refused")
        active.update_wait(1.0)  # a push taken would be mixed here
        assert all(np.array_equal(a, b) for a, b in zip(mine, before))
        assert len(active._node.transfer.inbox._slots) == 0


# --------------------------------------------------------------------------- joining a bipartite cluster

ROLES = {"interpolation": "adpsgd", "rule_settings": {"adpsgd": AdpsgdSettings(bipartite=True)}}


def joining(name: str, port: int, via: int, **settings: object) -> DpwaConnection:
    """Node ``name`` joins through the member on ``via`` with a file of its own (``ROLES`` unless overridden)."""
    return joiner(name, port, via, **{**ROLES, **settings})


@pytest.mark.integration
def test_nodes_joining_a_bipartite_cluster_take_the_roles_of_their_names_and_the_mean_is_kept() -> None:
    """The file's nodes b, a, c (file order is not the names' order: b and c active, a passive) and two joiners
    whose files say ``bipartite: true``, one active and one passive by the CRC-32 of their names. A joiner learns
    the file's order from its JOIN's answer; each takes its role: an active node fetches passive members only and
    allocates no inbox, a passive one fetches nobody and allocates no receive buffer. Every exchange joins an
    active and a passive node, so the mean of the five models is kept (1e-6; nobody trains). A joiner whose file
    takes no roles is refused, with the reason."""
    ports = free_ports(6)
    roster = ("b", "a", "c")
    nodes = tuple(NodeSpec(n, "127.0.0.1", p) for n, p in zip(roster, ports))
    cfg = ClusterConfig(nodes=nodes, **{**ROLES, **FAST})  # type: ignore[arg-type]
    conns = [DpwaConnection(name, cfg, seed=i) for i, name in enumerate(roster)]
    candidates = [f"j{i}" for i in range(16)]
    active, passive = (next(n for n in candidates if is_active(n, ()) is role) for role in (True, False))
    trainers = Trainers()
    try:
        for i, conn in enumerate(conns):
            trainers.start(conn, float(i))
        with pytest.raises(JoinRefused, match="must say bipartite: true"):
            joining("plain", ports[5], via=ports[0], rule_settings={})
        conns.append(joining(active, ports[3], via=ports[1]))
        conns.append(joining(passive, ports[4], via=ports[3]))  # through a node that joined itself
        trainers.start(conns[3], 100.0)
        trainers.start(conns[4], -100.0)
        by_name = {c.name: c for c in conns}
        wait_until(  # 20 of its exchanges: one with a node it took for passive by mistake would show
            lambda: (
                fetched_ok(by_name[active], "a") + fetched_ok(by_name[active], passive) >= 20
                and min(fetched_ok(by_name[active], "a"), fetched_ok(by_name[active], passive)) > 0
                and fetched_ok(by_name["b"], passive) + fetched_ok(by_name["c"], passive) > 0
            ),
            30,
            message="the active joiner fetched both passive nodes 20 times, a file node the passive joiner",
        )
        trainers.halt()
        quiesce(conns)
        mean = np.mean([flat(trainers.params[c.name]) for c in conns])
        assert abs(mean - (0 + 1 + 2 + 100 - 100) / 5) < 1e-6
        for conn in conns:
            node, stats = conn._node, conn.stats()
            assert node.names[:3] == roster, conn.name  # the file's order, on the joiners too
            if is_active(conn.name, roster):
                tried = {p for p, counts in stats["by_peer"].items() if any(counts.values())}
                assert tried <= {"a", passive}, (conn.name, stats["by_peer"])  # never an active node
                assert stats.get("pushes_unsupported", 0) == 0, conn.name  # so none refused an exchange
                assert node.rule.passive == 0 and len(node.transfer.inbox._slots) == 0, conn.name
            else:
                assert stats.get("fetches_started", 0) == 0 and len(node.transfer.fetcher.slots) == 0, conn.name
                assert node.rule.active == 0 and node.rule.passive > 0, conn.name
    finally:
        trainers.halt()
        close_all(conns)


@pytest.mark.integration
def test_a_joiner_that_takes_a_role_is_refused_by_a_cluster_without_roles() -> None:
    """The other way round: a joining file that says ``bipartite: true``, a cluster whose nodes take no roles."""
    ports = free_ports(2)
    plain = ClusterConfig(nodes=(NodeSpec("w1", "127.0.0.1", ports[0]),), interpolation="adpsgd", **FAST)
    with DpwaConnection("w1", plain, seed=0) as member:
        with pytest.raises(JoinRefused, match="take no active/passive roles"):
            joining("j1", ports[1], via=ports[0])
        assert member.stats()["joins_refused"] == 1 and port_is_free(ports[1])


def test_a_joiners_roster_is_the_answers_file_order_and_a_malformed_one_is_refused() -> None:
    """The file's nodes, in the order the answer lists them; a list that repeats a name, names a node the table
    lacks or names the joiner itself would place nodes wrongly: the join is refused, with the reason."""
    address = JoinAddress("127.0.0.1", 5000)
    table = tuple(Member(n, "127.0.0.1", 5000 + i) for i, n in enumerate(("a", "b", "c", "j4")))

    def answer(*permanent: str) -> wire.Members:
        return wire.Members(node="b", req=1, news=wire.MemberNews("0" * 16, table), permanent=permanent)

    assert [spec.name for spec in file_roster(answer("b", "a", "c"), "j4", address)] == ["b", "a", "c"]
    for wrong in (("b", "a", "b"), ("b", "zed"), ("b", "a", "j4")):
        with pytest.raises(JoinRefused, match="repeats a name, names one missing"):
            file_roster(answer(*wrong), "j4", address)
    port_zero = wire.Members(
        node="b", req=1, news=wire.MemberNews("0" * 16, (*table, Member("z", "127.0.0.1", 0))), permanent=("b", "z")
    )  # shaped right (the table's checks are the membership's), no node: a ConfigError before
    with pytest.raises(JoinRefused, match="invalid cluster-file node: .*port"):
        file_roster(port_zero, "j4", address)


@pytest.mark.integration
def test_a_joiner_that_takes_a_role_refuses_an_answer_that_does_not_confirm_the_roles() -> None:
    """A member that admits a bipartite joiner without saying its own nodes take roles (an older dpwa, whose list
    of the file's nodes is in name order): the joiner refuses to go on, with the reason, and frees its port."""
    sponsor_port, port = free_ports(2)

    def admit(header: wire.Message) -> list[list[bytes]]:
        assert isinstance(header, wire.Join) and header.bipartite
        table = (Member("w1", "127.0.0.1", sponsor_port), Member(header.node, header.host, header.port))
        news = wire.MemberNews("0" * 16, table)
        return [[wire.encode_members("w1", header.req, news, permanent=("w1",))]]

    sponsor = FakePeer(sponsor_port, admit)
    try:
        with pytest.raises(JoinRefused, match="without saying that its nodes are active or passive"):
            joining("j1", port, via=sponsor_port)
        assert len(sponsor.requests) == 1 and port_is_free(port)
    finally:
        sponsor.close()
