"""Flow-control peer selection , with a seeded rng and a fake clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dpwa.node.peers import JITTER, FlowControl


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(peers=("a", "b", "c"), seed=0, clock=None, **kw) -> FlowControl:
    return FlowControl(list(peers), random.Random(seed), now=clock or FakeClock(), **kw)


def win_probability(score_a: float, score_b: float) -> float:
    """Exact P(a beats b) for score + U{10..1000} each, ties broken by a fair coin."""
    lo, hi = JITTER
    n = hi - lo + 1
    p = 0.0
    for d in range(-(n - 1), n):  # d = U_a - U_b, with n - |d| ways out of n^2
        total = score_a - score_b + d
        p += (n - abs(d)) * (1.0 if total > 0 else 0.5 if total == 0 else 0.0)
    return p / n**2


# ------------------------------------------------------------------ scores


def test_score_arithmetic_and_clamping():
    fc = make(down_after=100)
    assert fc.scores() == {"a": 1000, "b": 1000, "c": 1000}
    fc.success("a")
    assert fc.scores()["a"] == 1000  # clamped at the ceiling
    fc.failure("a")
    assert fc.scores()["a"] == 900
    fc.success("a")
    assert fc.scores()["a"] == 910
    for _ in range(20):
        fc.failure("b")
    assert fc.scores()["b"] == 10  # clamped at the floor
    fc.success("b")
    assert fc.scores()["b"] == 20
    assert fc.scores()["c"] == 1000


def test_custom_parameters():
    fc = make(peers=["a"], initial=500, floor=0, ceiling=600, reward=50, penalty=300, down_after=9)
    fc.success("a")
    fc.success("a")
    fc.success("a")
    assert fc.scores() == {"a": 600}
    fc.failure("a")
    fc.failure("a")
    fc.failure("a")
    assert fc.scores() == {"a": 0}


def test_constructor_and_unknown_peer_errors():
    with pytest.raises(ValueError, match="duplicate"):
        make(peers=["a", "a"])
    with pytest.raises(ValueError, match="floor <= initial <= ceiling"):
        make(initial=2000)
    with pytest.raises(ValueError, match="down_after"):
        make(down_after=0)
    with pytest.raises(ValueError, match="probe_backoff"):
        make(probe_backoff=(5.0, 1.0))
    with pytest.raises(ValueError, match="reward and penalty"):
        make(penalty=-1)
    fc = make()
    with pytest.raises(ValueError, match="k must be"):
        fc.choose(-1)


def test_members_come_and_go_and_a_verdict_on_a_removed_peer_is_ignored() -> None:
    """Membership changes while fetches are in flight: a late verdict on a removed peer changes nothing."""
    fc = make(peers=["a", "b"])
    fc.add("c")
    fc.add("c")  # known already: unchanged
    assert set(fc.scores()) == {"a", "b", "c"} and fc.is_up("c")
    fc.remove("a")
    fc.success("a")
    fc.failure("a")
    assert set(fc.scores()) == {"b", "c"} and not fc.is_up("a")
    assert "a" not in {p for _ in range(50) for p in fc.choose(2)}
    assert fc.admit(["a", "b", "zz"]) == ["b"]


# --------------------------------------------------------------- selection


def frequencies(fc: FlowControl, draws: int) -> Counter:
    return Counter(fc.choose()[0] for _ in range(draws))


def test_equal_scores_are_chosen_uniformly():
    fc = make(peers=["a", "b", "c", "d"], seed=1)
    draws = 40_000
    counts = frequencies(fc, draws)
    assert set(counts) == {"a", "b", "c", "d"}
    for name in "abcd":
        assert counts[name] / draws == pytest.approx(0.25, abs=0.015)


def test_floor_peer_is_essentially_never_chosen_while_up():
    fc = make(seed=2, down_after=1000)
    for _ in range(10):
        fc.failure("c")
    assert fc.scores()["c"] == 10 and fc.is_up("c")
    counts = frequencies(fc, 20_000)
    # c wins only on an exact tie 10+1000 == 1000+10 against both others: about 1e-6 per draw.
    assert counts["c"] <= 1
    assert counts["a"] / 20_000 == pytest.approx(0.5, abs=0.02)


def test_higher_score_is_chosen_more_often_at_the_expected_rate():
    fc = make(peers=["hi", "lo"], seed=3, down_after=1000)
    for _ in range(3):
        fc.failure("lo")  # 700
    draws = 40_000
    counts = frequencies(fc, draws)
    expect = win_probability(1000, 700)
    assert 0.74 < expect < 0.77  # sanity: about 1 - 691^2 / (2 * 991^2)
    assert counts["hi"] / draws == pytest.approx(expect, abs=0.012)


def test_choose_k_returns_distinct_up_peers():
    fc = make(peers=list("abcde"), seed=4)
    for _ in range(200):
        chosen = fc.choose(3)
        assert len(chosen) == 3 and len(set(chosen)) == 3
    assert sorted(fc.choose(10)) == list("abcde")  # fewer when fewer are up
    assert fc.choose(0) == []


def test_same_seed_same_choices():
    a, b = make(seed=5), make(seed=5)
    assert [a.choose(2) for _ in range(50)] == [b.choose(2) for _ in range(50)]


def test_no_peers():
    fc = make(peers=[])
    assert fc.choose() == [] and fc.up_peers() == [] and fc.scores() == {}


# ------------------------------------------------------------ down and probes


def test_down_after_consecutive_failures_only():
    fc = make()
    fc.failure("a")
    fc.failure("a")
    fc.success("a")  # resets the run
    fc.failure("a")
    fc.failure("a")
    assert fc.is_up("a")
    fc.failure("a")
    assert not fc.is_up("a")
    assert fc.up_peers() == ["b", "c"]
    assert "a" in fc.scores()  # never dropped


def test_probe_timing_backoff_doubles_and_caps():
    clock = FakeClock(100.0)
    fc = make(clock=clock, seed=6)
    for _ in range(3):
        fc.failure("a")  # down at t=100, first probe due at 101
    backoff = 1.0
    for expected in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0):
        assert backoff == expected
        start = clock.t
        clock.t = start + expected - 1e-6
        for _ in range(20):
            assert "a" not in fc.choose(3)  # not due yet
        clock.t = start + expected
        chosen = fc.choose()
        assert chosen == ["a"]  # the probe takes the first (here the only) slot
        assert "a" not in fc.choose(3)  # a probe in flight is not repeated
        fc.failure("a")  # failed probe: backoff doubles, from now
        backoff = min(60.0, backoff * 2)
        assert not fc.is_up("a")


def test_probe_comes_first_and_others_fill_the_rest():
    clock = FakeClock()
    fc = make(peers=list("abcd"), clock=clock)
    for _ in range(3):
        fc.failure("b")
    clock.t = 1.0
    chosen = fc.choose(3)
    assert chosen[0] == "b"
    assert len(chosen) == 3 and len(set(chosen)) == 3


def test_at_most_one_probe_per_call_most_overdue_first():
    clock = FakeClock()
    fc = make(peers=list("abcd"), clock=clock)
    for _ in range(3):
        fc.failure("c")
    clock.t = 0.5
    for _ in range(3):
        fc.failure("a")
    clock.t = 10.0  # both due; c has waited longer
    first = fc.choose(4)
    assert first[0] == "c" and "a" not in first
    assert sorted(first) == ["b", "c", "d"]
    second = fc.choose(4)
    assert second[0] == "a" and "c" not in second


def test_recovery_is_at_full_score_and_resets_backoff():
    clock = FakeClock()
    fc = make(clock=clock)
    for _ in range(3):
        fc.failure("a")
    clock.t = 1.0
    assert fc.choose() == ["a"]
    fc.failure("a")  # backoff now 2
    assert fc.scores()["a"] == 600
    clock.t = 3.0
    assert fc.choose() == ["a"]
    fc.success("a")
    assert fc.is_up("a") and fc.scores()["a"] == 1000
    assert fc.up_peers() == ["a", "b", "c"]
    for _ in range(3):
        fc.failure("a")  # down again: the backoff starts over at 1 s
    clock.t = 3.999
    assert "a" not in fc.choose(3)
    clock.t = 4.0
    assert fc.choose()[0] == "a"


def test_all_down():
    clock = FakeClock()
    fc = make(clock=clock)
    for name in "abc":
        for _ in range(3):
            fc.failure(name)
    assert fc.up_peers() == []
    assert fc.choose(2) == []  # nobody up, nobody due
    clock.t = 1.0
    assert fc.choose(2) == ["a"]  # one probe per call
    assert fc.choose(2) == ["b"]
    assert fc.choose(2) == ["c"]
    assert fc.choose(2) == []


def test_a_dead_peer_keeps_being_probed_forever():
    clock = FakeClock()
    fc = make(peers=["a"], clock=clock)
    for _ in range(3):
        fc.failure("a")
    probes = 0
    while clock.t < 3600:
        clock.t += 0.5
        if fc.choose() == ["a"]:
            probes += 1
            fc.failure("a")
    # backoffs 1, 2, 4, ..., 32 (63 s), then one probe a minute.
    assert 60 <= probes <= 64


def test_admit_keeps_up_peers_and_due_probes_only():
    clock = [0.0]
    fc = FlowControl(["a", "b", "c"], random.Random(0), now=lambda: clock[0], down_after=1)
    fc.failure("b")  # down, probe due after 1 s
    assert fc.admit(["a", "b", "c"]) == ["a", "c"]
    clock[0] = 1.0
    assert fc.admit(["b", "a"]) == ["b", "a"]  # due: admitted once as a probe
    assert fc.admit(["b"]) == []  # the probe in flight is not repeated
    fc.success("b")
    assert fc.admit(["b"]) == ["b"]
