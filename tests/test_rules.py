"""The 2017 rules (constant, clock, loss), the Rule contract and the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpwa import rules
from dpwa.rules import (
    RULES,
    ClockRule,
    ConstantRule,
    LossRule,
    MixOutcome,
    NodeState,
    PeerSnapshot,
    Rule,
    make_rule,
)
from dpwa.rules.pairwise import share


def snap(name="p", clock=0.0, loss=0.0, arrays=None, **extras) -> PeerSnapshot:
    if arrays is None:
        arrays = [np.zeros(2)]
    return PeerSnapshot(NodeState(name, clock, loss, dict(extras)), arrays)


# ------------------------------------------------------------------ factors


def test_constant_factor_and_validation():
    own, peer = NodeState("a", 5, 1.0), NodeState("b", 1, 9.0)
    assert ConstantRule().factor(own, peer) == 0.5
    assert ConstantRule(0.3).factor(own, peer) == 0.3
    assert ConstantRule(value=0).factor(own, peer) == 0.0
    assert ConstantRule(value=1).factor(own, peer) == 1.0
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="constant value"):
            ConstantRule(bad)


@pytest.mark.parametrize(
    "clock, peer_clock, expect",
    [(3.0, 1.0, 0.25), (1.0, 3.0, 0.75), (10.0, 10.0, 0.5), (0.0, 0.0, 0.5), (0.0, 4.0, 1.0), (4.0, 0.0, 0.0)],
)
def test_clock_factor(clock, peer_clock, expect):
    # f = peer_clock / (clock + peer_clock)
    assert ClockRule().factor(NodeState("a", clock=clock), NodeState("b", clock=peer_clock)) == expect


@pytest.mark.parametrize(
    "loss, peer_loss, expect",
    [
        (3.0, 1.0, 0.75),  # my loss is higher: lean on the peer
        (1.0, 3.0, 0.25),
        (0.2, 0.2, 0.5),
        (0.0, 0.0, 0.5),
        (0.0, 2.0, 0.0),
        (-1.0, 2.0, 0.0),  # negative counts as 0
        (2.0, -5.0, 1.0),
        (-1.0, -2.0, 0.5),
        (math.nan, 2.0, 1.0),  # NaN counts as +inf: a diverged node copies its peer
        (math.inf, math.inf, 0.5),
    ],
)
def test_loss_factor(loss, peer_loss, expect):
    # f = loss / (loss + peer_loss)
    assert LossRule().factor(NodeState("a", loss=loss), NodeState("b", loss=peer_loss)) == expect


any_float = st.floats(allow_nan=True, allow_infinity=True)
non_negative = st.floats(min_value=0.0, allow_infinity=False, allow_nan=False)


@given(non_negative, non_negative)
def test_share_matches_formula_for_finite_non_negative(a, b):
    f = share(a, b)
    assert 0.0 <= f <= 1.0
    if a + b > 0 and math.isfinite(a + b):
        assert f == pytest.approx(a / (a + b), rel=1e-12, abs=1e-300)
    assert f + share(b, a) == pytest.approx(1.0, rel=1e-15)


@given(any_float, any_float, any_float, any_float, st.floats(0, 1), st.floats(0, 10))
def test_all_factors_in_unit_interval(clock, peer_clock, loss, peer_loss, value, t):
    own = NodeState("a", clock, loss)
    peer = NodeState("b", peer_clock, peer_loss)
    for rule in (ConstantRule(value, t), ClockRule(t), LossRule(t)):
        raw = rule.factor(own, peer)
        assert 0.0 <= raw <= 1.0
        assert 0.0 <= rule.diverge(raw, loss) <= raw


# --------------------------------------------------------------------- mix


def test_constant_mix_hand_computed_and_clock():
    own = NodeState("a", clock=4.0, loss=1.0)
    x = [np.array([2.0, 4.0]), np.array([[1.0]], np.float32)]
    peer = snap("b", clock=8.0, arrays=[np.array([6.0, 0.0]), np.array([[5.0]], np.float32)])
    out = ConstantRule(0.25).mix(own, x, [peer])
    np.testing.assert_array_equal(x[0], [3.0, 3.0])  # 0.75*x + 0.25*peer
    np.testing.assert_array_equal(x[1], np.array([[2.0]], np.float32))
    assert own.clock == 5.0  # 0.25*8 + 0.75*4
    assert out == MixOutcome(0.25, ("b",), {"raw_factor": 0.25, "repeats_skipped": 0.0})


def test_clock_rule_uses_pre_mix_clocks_then_updates_clock():
    own = NodeState("a", clock=3.0)
    x = [np.array([0.0, 8.0])]
    out = ClockRule().mix(own, x, [snap("b", clock=1.0, arrays=[np.array([4.0, 0.0])])])
    assert out.factor == 0.25  # 1 / (3 + 1), from the clocks before mixing
    np.testing.assert_array_equal(x[0], [1.0, 6.0])
    assert own.clock == 2.5  # 0.25*1 + 0.75*3, after mixing
    assert out.peers == ("b",)


def test_loss_rule_mix():
    own = NodeState("a", clock=2.0, loss=3.0)
    x = [np.array([4.0])]
    out = LossRule().mix(own, x, [snap("b", clock=6.0, loss=1.0, arrays=[np.array([0.0])])])
    assert out.factor == 0.75
    np.testing.assert_array_equal(x[0], [1.0])
    assert own.clock == 5.0
    assert own.loss == 3.0  # mixing never rewrites the loss


@pytest.mark.parametrize(
    "rule, own_loss, peer_loss, raw, f",
    [
        (ConstantRule(0.5, divergence_threshold=0.2), 0.05, 9.0, 0.5, 0.125),  # 0.5 * 0.05/0.2
        (LossRule(divergence_threshold=0.2), 0.1, 0.3, 0.25, 0.125),  # 0.25 * 0.1/0.2
        (ConstantRule(0.5, divergence_threshold=0.2), 0.3, 9.0, 0.5, 0.5),  # loss >= t: untouched
        (ConstantRule(0.5, divergence_threshold=0.0), 0.01, 9.0, 0.5, 0.5),  # off
    ],
)
def test_divergence_applies_after_the_rule(rule, own_loss, peer_loss, raw, f):
    own = NodeState("a", clock=8.0, loss=own_loss)
    x = [np.array([8.0])]
    out = rule.mix(own, x, [snap("b", clock=0.0, loss=peer_loss, arrays=[np.array([0.0])])])
    assert out.factor == pytest.approx(f)
    assert out.metrics["raw_factor"] == pytest.approx(raw)
    assert x[0][0] == pytest.approx(8.0 * (1 - f))
    assert own.clock == pytest.approx(8.0 * (1 - f))  # the clock mixes with the damped factor


@pytest.mark.parametrize("rule", [ConstantRule(), ClockRule(), LossRule()], ids=lambda r: r.name)
def test_no_peers_mixes_nothing(rule):
    own = NodeState("a", clock=3.0, loss=1.0)
    x = [np.array([1.0, 2.0])]
    assert rule.mix(own, x, []) == MixOutcome(0.0, (), {"repeats_skipped": 0.0})
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    assert own == NodeState("a", clock=3.0, loss=1.0)


def test_pairwise_rejects_more_than_one_peer():
    own = NodeState("a", clock=3.0)
    x = [np.array([1.0, 2.0])]
    with pytest.raises(ValueError, match="one peer"):
        ConstantRule().mix(own, x, [snap("b"), snap("c")])
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    assert own.clock == 3.0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_constant_half_is_the_exact_mean(dtype):
    rng = np.random.default_rng(11)
    a = (rng.standard_normal(5000) * np.exp(rng.uniform(-6, 6, 5000))).astype(dtype)
    b = (rng.standard_normal(5000) * np.exp(rng.uniform(-6, 6, 5000))).astype(dtype)
    if dtype == np.float64:
        expect = a / 2 + b / 2  # exact halves, one rounding: the correctly rounded mean (no underflow here)
    else:
        expect = ((a.astype(np.float64) + b.astype(np.float64)) / 2).astype(dtype)
    x = [a.copy()]
    ConstantRule(0.5).mix(NodeState("a"), x, [snap("b", arrays=[b.copy()])])
    np.testing.assert_array_equal(x[0], expect)


def test_mix_rejects_layout_mismatch_without_changes():
    own = NodeState("a", clock=1.0)
    x = [np.ones(3, np.float32)]
    with pytest.raises(ValueError):
        ConstantRule().mix(own, x, [snap("b", clock=5.0, arrays=[np.zeros(3, np.float64)])])
    np.testing.assert_array_equal(x[0], np.ones(3, np.float32))
    assert own.clock == 1.0


# ------------------------------------------------------------- Rule contract


def test_rule_defaults_and_abstractness():
    with pytest.raises(TypeError):
        Rule()  # abstract: mix is required
    rule = ClockRule(divergence_threshold=0.3)
    own = NodeState("a")
    served = rule.on_serve(own)
    assert served == {}
    served["x"] = 1
    assert rule.on_serve(own) == {}  # a fresh dict per reply
    assert rule.initial_extras("a", ("a", "b")) == {}
    assert rule.on_publish(own, [np.zeros(1)]) is None
    assert rule.on_serve_failed(own, {}) is None
    assert rule.on_reply_lost(own, None) is None
    assert own == NodeState("a")
    assert rule.divergence_threshold == 0.3
    assert repr(ConstantRule(0.25, 0.1)) == "ConstantRule(divergence_threshold=0.1, repeats='skip', value=0.25)"


@pytest.mark.parametrize("t", [-1.0, math.nan, math.inf])
def test_rules_reject_bad_divergence_threshold(t):
    with pytest.raises(ValueError, match="divergence_threshold"):
        ClockRule(divergence_threshold=t)


def test_snapshot_and_outcome_are_frozen():
    s = snap()
    with pytest.raises(AttributeError):
        s.state = NodeState("x")
    with pytest.raises(AttributeError):
        MixOutcome(0.5, ("b",)).factor = 1.0
    assert MixOutcome(0.5, ("b",)).metrics == {}


# ------------------------------------------------------------------ registry


@dataclass
class ConstantSettings:
    value: float = 0.25


@dataclass
class EmptySettings:
    pass


@dataclass
class BadSettings:
    value: float = 0.5
    speed: float = 2.0


def test_registry_names_match_rules_settings_and_schedules():
    from dpwa.config import PEER_SCHEDULES
    from dpwa.rules.schedules import SCHEDULES
    from dpwa.utils.settings import Settings

    assert set(PEER_SCHEDULES) == {"auto", *SCHEDULES}
    assert {"constant": ConstantRule, "clock": ClockRule, "loss": LossRule}.items() <= RULES.items()
    for name, cls in RULES.items():
        assert cls.name == name
        assert issubclass(cls.settings_class, Settings), name
        make_rule(name, cls.settings_class(), 0.0)  # every rule builds from its settings' defaults
        assert cls.default_schedule in cls.allowed_schedules and set(cls.allowed_schedules) <= set(SCHEDULES)


def test_make_rule_from_dataclass_mapping_and_none():
    rule = make_rule("constant", ConstantSettings(), 0.2)
    assert isinstance(rule, ConstantRule)
    assert (rule.value, rule.divergence_threshold) == (0.25, 0.2)
    assert make_rule("constant", {"value": 0.75}, 0.0).value == 0.75
    assert make_rule("constant", None, 0.0).value == 0.5
    clock = make_rule("clock", EmptySettings(), 0.1)
    assert isinstance(clock, ClockRule) and clock.divergence_threshold == 0.1
    assert isinstance(make_rule("loss", None, 0.0), LossRule)


def test_make_rule_errors():
    allowed = "allowed: adpsgd, choco, clock, constant, dpsgd, gem, group, gt, leader, loss, pushsum"
    with pytest.raises(ValueError, match=allowed):
        make_rule("gem2", None, 0.0)
    with pytest.raises(ValueError, match="does not accept speed; accepted: value"):
        make_rule("constant", BadSettings(), 0.0)
    with pytest.raises(ValueError, match="does not accept value; accepted: bipartite"):
        make_rule("adpsgd", ConstantSettings(), 0.0)
    with pytest.raises(ValueError, match="global setting"):
        make_rule("clock", {"divergence_threshold": 0.1}, 0.0)
    with pytest.raises(TypeError, match="dataclass instance"):
        make_rule("constant", ConstantSettings, 0.0)  # the class, not an instance
    with pytest.raises(TypeError, match="dataclass instance"):
        make_rule("clock", 0, 0.0)
    with pytest.raises(ValueError, match="constant value"):
        make_rule("constant", {"value": 2.0}, 0.0)
    with pytest.raises(ValueError, match="divergence_threshold"):
        make_rule("loss", None, -0.5)


def test_package_reexports():
    for name in ("NodeState", "PeerSnapshot", "MixOutcome", "Rule", "RULES", "make_rule"):
        assert name in rules.__all__ and hasattr(rules, name)


@pytest.mark.parametrize("make", [ConstantRule, ClockRule, LossRule], ids=lambda c: c.name)
def test_a_repeated_snapshot_is_skipped_unless_repeats_mix(make):
    """``PeerSnapshot.repeat`` (the node saw this peer's snapshot generation last time): ``skip`` (default) leaves
    x, the clock and the factor alone and counts it; ``mix`` mixes it like any reply."""
    own = NodeState("a", clock=1.0, loss=1.0)
    x = [np.array([0.0, 2.0])]
    peer = PeerSnapshot(NodeState("b", clock=1.0, loss=1.0), [np.array([2.0, 2.0])], repeat=True)
    skip = make()
    assert skip.mix(own, x, [peer]) == MixOutcome(0.0, (), {"repeats_skipped": 1.0})
    np.testing.assert_array_equal(x[0], [0.0, 2.0])
    assert own.clock == 1.0
    mixing = make(repeats="mix")
    out = mixing.mix(own, x, [peer])
    assert out.factor == 0.5 and out.peers == ("b",) and out.metrics["repeats_skipped"] == 0.0
    np.testing.assert_array_equal(x[0], [1.0, 2.0])
    with pytest.raises(ValueError, match="repeats"):
        make(repeats="sometimes")


@pytest.mark.parametrize("outer", [False, True])
def test_a_restored_group_rule_counts_its_sync_steps_from_the_step_restored(outer: bool) -> None:
    """The groups schedule reads the node's step for its sync steps; the rule counts its own publishes. A
    checkpoint restored at step 7 (under an outer optimizer too) puts both at 7: the rule used to count from 0, and
    mixed sync steps with a group step's weights (and the reverse) for the rest of the run."""
    from dpwa.checkpoint import DpwaState
    from dpwa.node.recovery import restore_state
    from dpwa.rules.group import GroupRule
    from dpwa.rules.outer import OuterRule

    rule: rules.Rule = rules.make_rule("group", None, 0.0)
    if outer:
        rule = OuterRule(rule, every=2)
    own = NodeState("w1", extras=rule.initial_extras("w1", ["w1", "w2"]))
    restore_state(own, rule, DpwaState(clock=7.0, step=7, loss=1.0, rule=rule.name), None)
    rule.on_publish(own, [])
    group = rule.base if isinstance(rule, OuterRule) else rule
    assert isinstance(group, GroupRule) and group.step == 7
    with pytest.raises(ValueError):
        group.follow(-1)
