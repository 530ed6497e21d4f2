"""The member table (dpwa/node/members.py): merging converges, permanent members stay, memory stays bounded."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpwa.config import NodeSpec
from dpwa.node.members import (
    FILE_LEAVE_JUMP,
    MAX_VERSION,
    STATES,
    TABLE_BUDGET_BYTES,
    JoinRefused,
    Member,
    MemberTable,
    entry_bytes,
    newer,
)
from dpwa.node.membership import MAX_CLASHES_LOGGED, Membership
from dpwa.node.wire import Fetch, MemberNews, Members, State, encode_members

FILE = [NodeSpec("w1", "127.0.0.1", 4001), NodeSpec("w2", "127.0.0.1", 4002)]

members = st.builds(
    Member,
    name=st.sampled_from(["w1", "w2", "j1", "j2", "j3", "bad name", ""]),
    host=st.sampled_from(["127.0.0.1", "10.0.0.9", ""]),
    port=st.sampled_from([4001, 4002, 5000, 0, 70000]),
    state=st.sampled_from([*STATES, "zombie"]),
    version=st.one_of(st.integers(0, 5), st.just(-1), st.just(2**60)),
)


def table(capacity: int = 8) -> MemberTable:
    return MemberTable(FILE, capacity=capacity, forget_after_s=10.0)


def snapshot(t: MemberTable) -> list[Member]:
    return t.members()


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(members, max_size=30), seed=st.integers(0, 2**32 - 1))
def test_merging_in_any_order_and_twice_gives_the_same_table(entries: list[Member], seed: int) -> None:
    """Without a capacity limit the merge is order-independent and idempotent, so gossip converges."""
    a, b = table(capacity=100), table(capacity=100)
    a.merge(entries, now=0.0)
    shuffled = entries[:]
    random.Random(seed).shuffle(shuffled)
    b.merge(shuffled, now=0.0)
    b.merge(shuffled, now=0.0)
    assert snapshot(a) == snapshot(b)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(members, max_size=60))
def test_a_flood_never_moves_or_removes_a_permanent_member_and_stays_bounded(entries: list[Member]) -> None:
    t = table(capacity=2)
    t.merge(entries, now=0.0)
    t.expire(now=1e9)
    for node in FILE:
        entry = t.get(node.name)
        assert entry is not None and (entry.host, entry.port) == (node.host, node.port)
    assert t.joined() <= 2 and len(t) <= 4
    assert all(m.state in STATES and 0 <= m.version <= 2**53 and m.name and " " not in m.name for m in t.members())


def test_a_suspicion_spreads_until_the_member_refutes_it_with_a_higher_version() -> None:
    t = table()
    j = Member("j1", "127.0.0.1", 5000, "alive", 3)
    assert t.merge([j], now=0.0) == [j]
    assert t.suspect("j1", now=1.0) == Member("j1", "127.0.0.1", 5000, "suspected", 3)
    assert t.merge([j], now=2.0) == []  # the old "alive" does not undo the suspicion
    refuted = Member("j1", "127.0.0.1", 5000, "alive", 4)
    assert t.merge([refuted], now=3.0) == [refuted] and t.get("j1") == refuted
    left = Member("j1", "127.0.0.1", 5000, "left", 4)
    assert t.merge([left], now=4.0) == [left] and [m.name for m in t.alive()] == ["w1", "w2"]
    assert newer(left, refuted) and not newer(refuted, left)


def test_joined_members_down_for_forget_after_s_are_forgotten_permanent_ones_never() -> None:
    t = table()
    t.merge([Member("j1", "127.0.0.1", 5000), Member("j2", "127.0.0.1", 5001)], now=0.0)
    t.suspect("j1", now=5.0)
    t.suspect("w1", now=5.0)
    t.merge([Member("j2", "127.0.0.1", 5001, "left", 0)], now=6.0)
    assert t.expire(now=14.9) == []
    assert t.expire(now=15.0) == ["j1"] and t.expire(now=16.0) == ["j2"]
    assert [m.name for m in t.members()] == ["w1", "w2"] and t.get("w1").state == "suspected"  # type: ignore[union-attr]


def test_over_capacity_new_names_are_refused_and_counted() -> None:
    t = table(capacity=1)
    t.merge([Member("j1", "127.0.0.1", 5000), Member("j2", "127.0.0.1", 5001)], now=0.0)
    assert [m.name for m in t.members()] == ["j1", "w1", "w2"] and t.refused == 1
    t.merge([Member("w1", "10.6.6.6", 4001, "alive", 9)], now=0.0)  # a forged address for a file member
    assert t.get("w1") == Member("w1", "127.0.0.1", 4001) and t.refused == 2


def test_two_claims_of_one_name_and_version_resolve_the_same_way_everywhere() -> None:
    x, y = Member("j1", "127.0.0.1", 5000), Member("j1", "10.0.0.9", 5000)
    a, b = table(), table()
    a.merge([x, y], now=0.0)
    b.merge([y, x], now=0.0)
    assert a.get("j1") == b.get("j1") == x  # ("127.0.0.1", 5000) > ("10.0.0.9", 5000)


def test_schedules_order_is_the_file_order_then_joined_members_by_name_without_those_that_left() -> None:
    t = MemberTable([NodeSpec("w2", "127.0.0.1", 4002), NodeSpec("w1", "127.0.0.1", 4001)], 8, 10.0)
    t.merge([Member("zz", "127.0.0.1", 5001), Member("aa", "127.0.0.1", 5000), Member("mm", "127.0.0.1", 5002)], 0.0)
    assert t.order() == ("w2", "w1", "aa", "mm", "zz")
    t.merge([Member("mm", "127.0.0.1", 5002, "left", 1), Member("w1", "127.0.0.1", 4001, "left", 1)], 1.0)
    t.suspect("zz", 1.0)  # suspected members stay (they may answer)
    assert t.order() == ("w2", "w1", "aa", "zz")  # a file node is never dropped, even said to have left


def test_a_forgotten_member_is_not_gossiped_back_only_a_new_incarnation_returns() -> None:
    t = table()
    t.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=0.0)
    assert t.expire(now=10.0) == ["j1"] and t.get("j1") is None
    assert t.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=11.0) == []  # a laggard's gossip
    assert t.merge([Member("j1", "127.0.0.1", 5000, "alive", 2)], now=11.0) == []
    assert t.admit("j1", "127.0.0.1", 5009, now=12.0).version == 4  # a new join outbids the tombstone
    t2 = table()
    t2.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=0.0)
    t2.expire(now=10.0)
    assert t2.expire(now=20.0) == [] and t2.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=21.0)


def test_joins_are_refused_for_file_names_and_taken_names_and_a_restart_is_the_next_incarnation() -> None:
    t = table()
    with pytest.raises(JoinRefused, match="node of the cluster file"):
        t.admit("w1", "127.0.0.1", 4001, now=0.0)
    assert t.admit("j1", "127.0.0.1", 5000, now=0.0).version == 0
    with pytest.raises(JoinRefused, match="taken by the member at 127.0.0.1:5000"):
        t.admit("j1", "127.0.0.1", 5001, now=0.0)
    assert t.admit("j1", "127.0.0.1", 5000, now=1.0).version == 1  # the same address: a restart
    with pytest.raises(JoinRefused, match="not a valid member"):
        t.admit("bad name", "127.0.0.1", 5002, now=0.0)
    full = table(capacity=1)
    full.admit("j1", "127.0.0.1", 5000, now=0.0)
    with pytest.raises(JoinRefused, match="table is full"):
        full.admit("j2", "127.0.0.1", 5001, now=0.0)


@pytest.mark.parametrize("n", [8, 32])
def test_a_join_reaches_every_node_in_o_log_n_fetch_rounds(n: int) -> None:
    """Every round each node fetches one random peer, exchanging member news as the node does (the digest,
    the whole table when digests differ, both ways): a join at one node is known everywhere within
    ``3 * log2(n)`` rounds, over 10 seeds; afterwards the nodes only exchange digests."""
    nodes = [NodeSpec(f"w{i}", "127.0.0.1", 4000 + i) for i in range(n)]
    for seed in range(10):
        rng = random.Random(seed)
        views = [Membership(spec, nodes, 16, 60.0, lambda: None) for spec in nodes]
        views[0].admit("j1", "127.0.0.1", 5000)
        rounds = 0
        while not all(v.get("j1") is not None for v in views):
            rounds += 1
            for i, me in enumerate(views):
                j = rng.choice([k for k in range(n) if k != i])
                peer = views[j]
                news = me.news_for(peer.me.name)
                request = fetch_with(me.me.name, news)
                peer.observe(request)
                reply_news = peer.reply_news(request)
                peer_header = state_with(peer.me.name, reply_news)
                me.observe(peer_header)
        assert rounds <= 3 * math.log2(n), (n, seed, rounds)
        assert len({v.snapshot()["members_digest"] for v in views}) == 1
        quiet = [v.news_for(views[(i + 1) % n].me.name) for i, v in enumerate(views)]
        assert sum(q.members is not None for q in quiet) <= n  # at most one more full table to each neighbour


def _tuple(members):
    return None if members is None else tuple(members)


def fetch_with(node: str, news: MemberNews) -> Fetch:
    """A FETCH from ``node`` carrying ``news`` as a decoded one does (its table a tuple)."""
    return Fetch(node=node, req=0, fingerprint="", news=MemberNews(news.digest, _tuple(news.members)))


def state_with(node: str, news: MemberNews) -> State:
    """A STATE reply from ``node`` carrying ``news`` as a decoded one does (no payload: only its news matters)."""
    return State(
        node=node, req=0, fingerprint="", clock=0.0, loss=0.0, extras={}, total=0, chunk=0, nframes=0,
        news=MemberNews(news.digest, _tuple(news.members)),
    )  # fmt: skip


def test_entries_with_hosts_zeromq_cannot_connect_to_or_long_names_are_refused() -> None:
    """The cluster file's rule for hosts (HostName), no other: a host the file takes is taken from the network,
    or its node's own entries would be refused and its membership off (``worker_1`` and ``example.org.`` were)."""
    t = table(capacity=100)
    bad = [Member("e1", host, 5000) for host in ("bad/host", "h@x", "a,b", "-x", "x" * 254, "h:1", "999.1.1.1")]
    assert t.merge([*bad, Member("n" * 129, "127.0.0.1", 5000)], now=0.0) == [] and t.refused == len(bad) + 1
    hosts = ("10.0.0.1", "node-7.example.org", "localhost", "worker_1", "_gateway", "example.org.")
    good = [Member(f"e{i + 2}", host, 5000 + i) for i, host in enumerate(hosts)]
    assert len(t.merge(good, now=0.0)) == len(hosts) and t.refused == len(bad) + 1


def test_the_table_never_outgrows_a_message_header() -> None:
    """However long the (valid) names and hosts, new entries beyond the byte budget are refused, so the
    whole table, encoded, always fits a header."""
    t = MemberTable(FILE, capacity=1024, forget_after_s=10.0)
    host = ".".join(["a" * 60] * 4)  # 243 characters: a valid host name
    t.merge([Member(f"m{i:03d}" + "x" * 120, host, 5000 + i) for i in range(1000)], now=0.0)
    assert 0 < t.joined() < 1000 and t.refused == 1000 - t.joined()
    assert t.wire_bytes() <= TABLE_BUDGET_BYTES
    encode_members("w1", 1, MemberNews(t.digest(), t.members()), permanent=["w1", "w2"], mass=1e6)


def test_a_forged_claim_at_the_largest_version_leaves_a_file_node_its_versions() -> None:
    """Without CURVE a stranger's FETCH may claim a file node is suspected at version 2**53 - 1: the table refuses
    it (beyond FILE_LEAVE_JUMP), and the node does not outbid it either. Before, it refuted at 2**53, the largest
    version, and could never refute a suspicion or announce its leave again (leave() returned None)."""
    w1 = Membership(FILE[0], FILE, 8, 10.0, lambda: None)
    w1.observe(fetch_with("mallory", MemberNews("x", (Member("w1", "127.0.0.1", 4001, "suspected", 2**53 - 1),))))
    assert w1.get("w1").version <= FILE_LEAVE_JUMP  # type: ignore[union-attr]
    # a restarted node (version 0) still outbids a claim far above its own: its former incarnation's leave
    w1.observe(fetch_with("w2", MemberNews("y", (Member("w1", "127.0.0.1", 4001, "left", 5000),))))
    assert w1.get("w1").state == "alive" and w1.get("w1").version == 5001  # type: ignore[union-attr]
    near = w1.get("w1").version + 10  # type: ignore[union-attr]
    w1.observe(fetch_with("w2", MemberNews("y", (Member("w1", "127.0.0.1", 4001, "suspected", near),))))
    assert w1.get("w1").state == "alive" and w1.get("w1").version == near + 1  # type: ignore[union-attr]
    left = w1.leave()
    assert left is not None and left.state == "left" and left.version == near + 2


def test_a_member_takes_the_clusters_word_that_a_node_it_suspects_left_however_far_its_versions_went() -> None:
    """w2 restarted (it knows w1 at version 0) and finds w1 down: the others' "left" of w1 at version 5000 (w1's
    former incarnation refuted many suspicions) is taken. Before, it was refused as beyond FILE_LEAVE_JUMP for good:
    w2 probed w1 forever and its table never matched the others'. A forged claim at the largest version is still
    refused (w1 could never outbid it)."""
    w2 = Membership(FILE[1], FILE, 8, 10.0, lambda: None)
    w2.suspect("w1")
    assert w2.get("w1").state == "suspected"  # type: ignore[union-attr]
    w2.observe(fetch_with("mallory", MemberNews("x", (Member("w1", "127.0.0.1", 4001, "left", 2**53 - 1),))))
    assert w2.get("w1").state == "suspected"  # type: ignore[union-attr]
    w2.observe(fetch_with("w3", MemberNews("y", (Member("w1", "127.0.0.1", 4001, "left", 5000),))))
    assert w2.get("w1").state == "left" and "w1" not in w2.order()  # type: ignore[union-attr]


def test_a_file_node_is_left_only_on_its_own_word_and_a_restarted_one_outbids_the_old_claim() -> None:
    me = NodeSpec("w1", "127.0.0.1", 4001)
    w2 = Membership(FILE[1], FILE, 8, 10.0, lambda: None)
    forged = fetch_with("mallory", MemberNews("x", (Member("w1", "127.0.0.1", 4001, "left", 5),)))
    w2.observe(forged)
    assert w2.get("w1").state == "alive"  # type: ignore[union-attr]  # relayed: not taken
    own = Members(node="w1", req=0, news=MemberNews("x", (Member("w1", "127.0.0.1", 4001, "left", 1),)))
    w2.observe(own, authenticated=True)
    assert w2.get("w1").state == "left" and "w1" not in w2.order()  # type: ignore[union-attr]
    restarted = Membership(me, FILE, 8, 10.0, lambda: None)  # back, at version 0, alive
    news = w2.news_for("w1")
    restarted.observe(state_with("w2", MemberNews(news.digest, tuple(news.members or ()))))
    assert restarted.get("w1") == Member("w1", "127.0.0.1", 4001, "alive", 2)  # outbids "left" at 1
    back = restarted.news_for("w2")
    w2.observe(fetch_with("w1", MemberNews(back.digest, tuple(back.members or ()))))
    assert w2.get("w1").state == "alive" and "w1" in w2.order()  # type: ignore[union-attr]


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(members, max_size=40), later=st.lists(members, max_size=20))
def test_the_running_size_and_count_match_the_table_through_merges_and_expiry(entries, later) -> None:
    t = table(capacity=6)
    t.merge(entries, now=0.0)
    t.expire(now=10.0)
    t.merge(later, now=11.0)
    assert t.wire_bytes() == sum(entry_bytes(m) for m in t.members())
    assert t.joined() == sum(m.name not in ("w1", "w2") for m in t.members())


def test_a_forged_own_leave_of_a_file_node_at_a_version_it_could_never_outbid_is_refused() -> None:
    """Without CURVE a MEMBERS message's sender is only its word: "w1 left at 2^53", sent as w1's own
    announcement, was taken and w1 could never outbid it (gone from every schedule for good). Now a file node's
    own leave is taken only within FILE_LEAVE_JUMP of its known version; the real one (version + 1) still is."""
    w2 = Membership(FILE[1], FILE, 8, 10.0, lambda: None)
    for version in (MAX_VERSION, FILE_LEAVE_JUMP + 1):
        forged = Members(node="w1", req=0, news=MemberNews("x", (Member("w1", "127.0.0.1", 4001, "left", version),)))
        w2.observe(forged, authenticated=True)  # what a node without CURVE makes of it
        assert w2.get("w1").state == "alive" and "w1" in w2.order()  # type: ignore[union-attr]
    real = Members(node="w1", req=0, news=MemberNews("x", (Member("w1", "127.0.0.1", 4001, "left", 1),)))
    w2.observe(real, authenticated=True)
    assert w2.get("w1").state == "left"  # type: ignore[union-attr]


def test_a_forgotten_members_return_refused_for_the_byte_budget_keeps_its_tombstone() -> None:
    """A new incarnation of a forgotten member, refused because the table's bytes are spent, leaves the tombstone
    in place: once room is made, older gossip of the forgotten incarnation is still not taken. Before, the
    tombstone was dropped before the check, and that gossip brought the forgotten member back."""
    t = MemberTable(FILE, capacity=4000, forget_after_s=10.0)
    t.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=0.0)
    assert t.expire(now=10.0) == ["j1"]
    long_host = "h" * 250
    for host in (long_host, "10.0.0.1"):  # fill the byte budget: long entries while they fit, then short ones
        n = 0
        while t.merge([Member(f"f-{len(host)}-{n}", host, 6000)], now=0.0):
            n += 1
    refused = t.refused
    assert t.merge([Member("j1", long_host, 5000, "alive", 4)], now=10.0) == [] and t.refused == refused + 1
    for m in [m for m in t.members() if m.name.startswith("f")]:  # make room: the fillers, down since t=1, go
        t.merge([Member(m.name, m.host, m.port, "left", 1)], now=1.0)
    assert len(t.expire(now=15.0)) > 100  # j1's tombstone (from t=10) stays until t=20
    assert t.merge([Member("j1", "127.0.0.1", 5000, "left", 3)], now=15.0) == []  # the forgotten one's gossip
    assert t.get("j1") is None


def test_a_file_nodes_relayed_leave_is_taken_once_this_node_finds_it_down_so_the_tables_converge() -> None:
    """A member that missed a file node's leave announcement kept it alive while the others held it ``left``:
    the digests never matched (whole tables on every message) and the schedules differed for good. A relayed
    ``left`` is now taken once this node itself suspects the file node (it stopped answering); while it still
    answers, a relayed claim is not (a forged one cannot drop a live file node), and it refutes a taken one."""
    t = table()
    relayed_leave = Member("w1", "127.0.0.1", 4001, "left", 1)
    assert t.merge([relayed_leave], now=0.0) == [] and t.get("w1").state == "alive"  # type: ignore[union-attr]
    t.suspect("w1", now=1.0)
    assert t.merge([relayed_leave], now=2.0) != [] and t.get("w1").state == "left"  # type: ignore[union-attr]
    back = Member("w1", "127.0.0.1", 4001, "alive", 2)  # restarted: it outbids the claim
    assert t.merge([back], now=3.0) != [] and t.get("w1") == back


def test_a_node_takes_its_name_back_from_an_old_incarnation_elsewhere_and_never_fights_a_live_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its own name at another address: suspected or left there (an old incarnation), the node takes the name back
    at its own address with the next version, and says so; before, it adopted the other address into its own
    entry and refuted suspicions with it. Alive there (another live process took the name), it does not outbid
    it -- two that did would raise their versions for ever, every table changing every round -- and says so once,
    as an error."""
    me = NodeSpec("j", "127.0.0.1", 5001)
    j = Membership(me, FILE, 8, 10.0, lambda: None)
    with caplog.at_level("WARNING", logger="dpwa.node.membership"):
        j.observe(fetch_with("w1", MemberNews("x", (Member("j", "127.0.0.1", 5000, "suspected", 1),))))
    assert j.get("j") == Member("j", "127.0.0.1", 5001, "alive", 2)
    assert "an old incarnation elsewhere; taken back at 127.0.0.1:5001" in caplog.text
    caplog.clear()
    live = Member("j", "127.0.0.1", 5000, "alive", 3)
    with caplog.at_level("WARNING", logger="dpwa.node.membership"):
        for _ in range(3):
            j.observe(fetch_with("w1", MemberNews("x", (live,))))
    assert j.get("j") == live  # not outbid
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "another live process holds this name at 127.0.0.1:5000" in errors[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpwa.node.membership"):  # a flood of claims, each at a new address
        for version in range(4, 4 + 10 * MAX_CLASHES_LOGGED):
            j.observe(fetch_with("w1", MemberNews("x", (Member("j", "127.0.0.1", 10000 + version, "alive", version),))))
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == MAX_CLASHES_LOGGED and len(j._clashes) == MAX_CLASHES_LOGGED + 1  # bounded, as its log
    assert "further ones are not logged" in errors[-1].getMessage()


def test_two_live_processes_under_one_name_settle_instead_of_outbidding_each_other() -> None:
    """Two processes both joined as j, at two addresses, gossiping through w1: the tables settle on one entry
    within a few rounds (versions stop rising), where taking the name back on both sides never settled."""
    a = Membership(NodeSpec("j", "127.0.0.1", 5001), FILE, 8, 10.0, lambda: None)
    b = Membership(NodeSpec("j", "127.0.0.1", 5002), FILE, 8, 10.0, lambda: None)
    w1 = Membership(FILE[0], FILE, 8, 10.0, lambda: None)
    a.observe(fetch_with("w1", MemberNews("x", (Member("j", "127.0.0.1", 5001, "alive", 1),))))
    versions = []
    for _ in range(20):
        for side in (a, b):
            news = side.full_news()
            w1.observe(fetch_with("j", MemberNews(news.digest, tuple(news.members or ()))))
            back = w1.full_news()
            side.observe(fetch_with("w1", MemberNews(back.digest, tuple(back.members or ()))))
        versions.append(w1.get("j").version)  # type: ignore[union-attr]
    assert versions[-1] == versions[5] and a.get("j") == b.get("j") == w1.get("j"), versions


def test_a_forged_suspicion_cannot_open_the_way_to_a_leave_no_file_node_could_refute() -> None:
    """A relayed leave of a file node is taken once it is suspected; a forged suspicion at 2^53 followed by a
    forged leave at 2^53 would then have removed it for good (it cannot outbid 2^53). Any claim that a file node
    is down is capped at FILE_LEAVE_JUMP above the known version, so each stays refutable."""
    w2 = Membership(FILE[1], FILE, 8, 10.0, lambda: None)
    for state in ("suspected", "left"):
        w2.observe(fetch_with("mallory", MemberNews("x", (Member("w1", "127.0.0.1", 4001, state, MAX_VERSION),))))
    assert w2.get("w1") == Member("w1", "127.0.0.1", 4001, "alive", 0)


def test_a_joiner_takes_a_departed_file_nodes_leave_from_its_sponsors_answer_at_any_version() -> None:
    """A joiner knows every file node at version 0; a file node that left at a version above FILE_LEAVE_JUMP
    (after many refutations) is taken as left from the JOIN's answer, not kept alive while the others agree."""
    j = Membership(NodeSpec("j", "127.0.0.1", 5000), (), 8, 10.0, lambda: None)
    gone = Member("w1", "127.0.0.1", 4001, "left", FILE_LEAVE_JUMP + 50)
    own = j.adopt(FILE, [gone, Member("w2", "127.0.0.1", 4002), Member("j", "127.0.0.1", 5000, "alive", 0)])
    assert own.state == "alive" and j.get("w1") == gone and "w1" not in j.order()
