"""The outer optimizer (dpwa/rules/outer.py): SlowMo / DiLoCo's step on the mixed model's motion every ``every`` steps,
nothing exchanged in between; with ``every: 1, lr: 1, momentum: 0`` exactly the base rule."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import free_ports, traced, write_cluster
from test_consensus import BIAS_TOL, ROUNDS, SEED_PARAMS, SPREAD_TOL, consensus_error

from dpwa.config import ClusterConfig, ConfigError, load_config, parse_config
from dpwa.node.connection import DpwaConnection
from dpwa.node.recovery import Recovery
from dpwa.rules import RULES, MixOutcome, NodeState, PeerSnapshot, Rule, make_rule
from dpwa.rules.gem import GemRule
from dpwa.rules.mixing import BLOCK
from dpwa.rules.outer import (
    OuterRule,
    OuterSchedule,
    OuterSettings,
    is_outer_step,
    momentum_hazard,
    outer_step_,
    with_outer,
)
from dpwa.rules.pairwise import ConstantRule
from dpwa.rules.schedules import SCHEDULES, ExponentialSchedule, GroupsSchedule, Round, make_schedule
from dpwa.tools.simtrain import simulate_training
from dpwa.tools.simulation import SimNode, Simulation
from dpwa.utils.bfloat16 import BFLOAT16, from_float32, to_float32

IDENTITY = {"every": 1, "lr": 1.0, "momentum": 0.0}
NODES = 4


def make(values: Any, dtype: str) -> np.ndarray:
    """An array of ``dtype`` (bfloat16: dpwa's BFLOAT16) holding ``values`` rounded once."""
    v = np.asarray(values, dtype=np.float64)
    if dtype == "bfloat16":
        return from_float32(v.astype(np.float32), np.empty(v.shape, BFLOAT16))
    return v.astype(dtype)


def wide(a: np.ndarray) -> np.ndarray:
    """A float64 copy of any float array (bfloat16 widened exactly)."""
    if a.dtype == np.uint16:
        return to_float32(a, np.empty(a.shape, np.float32)).astype(np.float64)
    return a.astype(np.float64)


# --------------------------------------------------------------------------- (1) bit for bit the base rule


def _cluster(
    name: str, dtype: type, outer: dict[str, Any] | None, bases: list[Rule] | None = None, rounds: int = 24
) -> tuple[list[bytes], bool]:
    """``NODES`` simulated nodes of rule ``name`` on its default schedule (under ``outer`` if given), each
    training toward its own centre between send and wait, a few replies lost: every node's arrays as bytes after
    ``rounds`` rounds, and whether the rule changed any arrays (the control: the comparison is not vacuous).
    ``bases``: the nodes' rules, built beforehand (a rule may draw a random number when it is built)."""
    rng = np.random.default_rng(5)
    settings = RULES[name].settings_class()
    made = iter(bases if bases is not None else [make_rule(name, settings, 0.0) for _ in range(NODES)])
    shapes = [(5, 3), (7,)]
    start = [[rng.normal(size=s).astype(dtype) for s in shapes] for _ in range(NODES)]
    centres = [[rng.normal(scale=2.0, size=s).astype(dtype) for s in shapes] for _ in range(NODES)]
    start[0][1][:3] = [0.0, -0.0, 1e-30]  # signed zeros and tiny values travel too

    def rule() -> Rule:
        base = next(made)
        return base if outer is None else OuterRule(base, **outer)

    def schedule() -> Any:
        base = make_schedule(RULES[name].default_schedule, settings)
        return base if outer is None else OuterSchedule(base, outer["every"])

    sim = Simulation(start, rule, schedule, seed=3)
    index = {n: i for i, n in enumerate(sim.names)}

    def train(node: SimNode) -> float:
        for x, c in zip(node.arrays, centres[index[node.name]]):
            x -= (x - c) * dtype(0.125)
        return float(sum(np.sum((wide(x) - wide(c)) ** 2) for x, c in zip(node.arrays, centres[index[node.name]])))

    dropped = np.random.default_rng(11)
    moved = False
    for _ in range(rounds):
        losses = {n: sim[n].state.loss or 1.0 for n in sim.names}
        outcomes = sim.run_round(losses, train=train, lose=lambda a, b: "timeout" if dropped.random() < 0.1 else None)
        moved = moved or any(o.changed for o in outcomes.values())
    return [b"".join(x.tobytes() for x in sim[n].arrays) for n in sim.names], moved


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("name", list(RULES))
def test_the_identity_outer_step_leaves_every_rule_bit_for_bit(name: str, dtype: type) -> None:
    """``every: 1, lr: 1, momentum: 0``: ``x_mixed - (1*delta - delta)`` is ``x_mixed - 0.0``, every bit kept. Both
    runs start from copies of the same rules (CHOCO and gradient tracking draw their epochs when built)."""
    bases = [make_rule(name, RULES[name].settings_class(), 0.0) for _ in range(NODES)]
    plain, moved = _cluster(name, dtype, None, copy.deepcopy(bases))
    wrapped, _ = _cluster(name, dtype, IDENTITY, copy.deepcopy(bases))
    assert moved, f"{name} never mixed: the comparison would say nothing"
    assert wrapped == plain


def test_a_real_outer_step_is_not_the_identity() -> None:
    """Control for the test above: the same cluster under DiLoCo's defaults (every step) ends elsewhere."""
    plain, _ = _cluster("dpsgd", np.float32, None)
    again, _ = _cluster("dpsgd", np.float32, None)
    wrapped, _ = _cluster("dpsgd", np.float32, {"every": 1, "lr": 0.7, "momentum": 0.9})
    assert again == plain  # the simulator is deterministic
    assert wrapped != plain


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_the_identity_keeps_every_bit_of_any_dtype(dtype: str) -> None:
    """Signed zeros, subnormals, the largest finite values and several blocks: ``x - 0.0`` changes nothing, and
    the anchor becomes ``x`` (widened)."""
    rng = np.random.default_rng(1)
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}[dtype]
    values = np.concatenate([rng.normal(size=BLOCK + 37), [0.0, -0.0, 1e-45, -1e-40, big, -big]])
    x = make(values, dtype)
    anchor = wide(make(rng.normal(size=x.size), dtype)).astype(np.float64 if dtype == "float64" else np.float32)
    before = x.tobytes()
    outer_step_(x, anchor, None, 1.0, 0.0, True)
    assert x.tobytes() == before
    assert np.array_equal(anchor, wide(x)) and np.array_equal(np.signbit(anchor), np.signbit(wide(x)))


# --------------------------------------------------------------------------- (2) the math


def reference(anchor: np.ndarray, x_mixed: np.ndarray, m: np.ndarray, lr: float, mu: float, nesterov: bool) -> tuple:
    """The outer step in float64, as the papers write it: (new x, new m)."""
    delta = anchor - x_mixed
    m = mu * m + delta
    step = delta + mu * m if nesterov else m
    return anchor - lr * step, m


@pytest.mark.parametrize(("lr", "mu", "nesterov"), [(0.7, 0.9, True), (1.0, 0.5, False), (0.5, 0.0, True)])
def test_the_outer_step_is_slowmo_diloco_over_several_steps(lr: float, mu: float, nesterov: bool) -> None:
    """DiLoCo (Nesterov), SlowMo (heavy ball) and no momentum, against the float64 formula, across blocks."""
    rng = np.random.default_rng(2)
    n = BLOCK + 123
    x = rng.normal(size=n)
    anchor = x.copy()
    m = np.zeros(n) if mu else None
    ref_anchor, ref_m = x.copy(), np.zeros(n)
    for _ in range(4):
        x += rng.normal(scale=0.1, size=n)  # local steps and a mix: anything
        x_mixed = x.copy()
        norm2 = outer_step_(x, anchor, m, lr, mu, nesterov)
        expected, ref_m = reference(ref_anchor, x_mixed, ref_m, lr, mu, nesterov)
        np.testing.assert_allclose(x, expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(anchor, x)  # the parameters are the new anchor
        if m is not None:
            np.testing.assert_allclose(m, ref_m, rtol=1e-12, atol=1e-14)
        assert norm2 == pytest.approx(float(np.sum((ref_anchor - x_mixed) ** 2)), rel=1e-12)
        ref_anchor = expected


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32_and_rounded_once(dtype: str) -> None:
    rng = np.random.default_rng(4)
    n = BLOCK + 9
    x = make(rng.normal(size=n), dtype)
    anchor, m = wide(x).astype(np.float32), np.zeros(n, np.float32)
    ref_anchor, ref_m = wide(x), np.zeros(n)
    for _ in range(3):
        x[...] = make(wide(x) + rng.normal(scale=0.05, size=n), dtype)
        x_mixed = wide(x)
        outer_step_(x, anchor, m, 0.7, 0.9, True)
        expected, ref_m = reference(ref_anchor, x_mixed, ref_m, 0.7, 0.9, True)
        ulp = {"float16": 2**-10, "bfloat16": 2**-7}[dtype]
        np.testing.assert_array_less(np.abs(wide(x) - expected), ulp * np.abs(expected) + 1e-4)
        assert anchor.dtype == np.float32 and np.array_equal(anchor, wide(x))  # the rounded parameters
        ref_anchor = wide(x)
        np.testing.assert_allclose(m, ref_m, rtol=1e-5, atol=1e-5)


class Still(Rule):
    """A base rule that mixes nothing and allocates nothing: what the outer step alone costs."""

    name = "still"

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        return MixOutcome(0.0, ())


def test_the_rule_steps_on_boundaries_only_and_allocates_nothing_model_sized_after_the_first_mix() -> None:
    rule, own = OuterRule(Still(), every=3, lr=0.7, momentum=0.9), NodeState("a")
    x = [np.zeros(3 * BLOCK, np.float32)]
    first, peak = traced(lambda: rule.mix(own, x, []))  # takes the anchor (step 0): no outer step
    assert first.metrics["outer_step"] == 0.0 and rule.anchor is not None and rule.momentum_buffer is not None
    assert peak >= 2 * x[0].nbytes  # control: the probe sees the anchor and m allocated at the first mix
    steps = []
    for k in range(1, 9):
        x[0] -= 1.0  # one local step
        outcome, peak = traced(lambda: rule.mix(own, x, []))
        steps.append(outcome.metrics["outer_step"])
        if k > 2:  # after the first outer step, which allocates the block-sized scratch
            assert peak < 128 * 1024, peak
        assert outcome.changed == bool(outcome.metrics["outer_step"])
    assert steps == [float(is_outer_step(k, 3)) for k in range(1, 9)] == [0, 1, 0, 0, 1, 0, 0, 1]
    assert rule.round == 9


def test_settings_and_nesting_are_checked() -> None:
    for bad in ({"every": 0}, {"every": 2.0}, {"lr": 0.0}, {"momentum": 1.0}, {"momentum": -0.1}, {"nesterov": 1}):
        with pytest.raises(ValueError):
            OuterRule(ConstantRule(), **bad)
    with pytest.raises(ValueError, match="already"):
        OuterRule(OuterRule(ConstantRule()))
    with pytest.raises(ValueError):
        OuterSchedule(ExponentialSchedule(), 0)
    assert OuterSettings() == OuterSettings(every=8, lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer step


def test_every_hook_is_the_base_rules() -> None:
    """Each method of the Rule contract is the base rule's (a hook added to Rule must be delegated too), and so are
    the class-level facts the node reads."""
    hooks = {n for n, f in inspect.getmembers(Rule, inspect.isfunction) if not n.startswith("_") and n != "diverge"}
    assert hooks - set(vars(OuterRule)) == set()
    base = make_rule("pushsum", {"overlap": 1}, 0.0)
    rule = OuterRule(base)
    for attr in ("name", "transfer", "mass_key", "wire_exact", "allowed_schedules", "default_schedule", "overlap"):
        assert getattr(rule, attr) == getattr(base, attr), attr
    own = NodeState("w1", extras=rule.initial_extras("w1", ["w1", "w2"]))
    assert own.extras == {"weight": 1.0}
    assert rule.push_shares(own, 1) and own.extras["weight"] == 0.5  # push-sum's own share-out


@pytest.mark.parametrize(("name", "reads"), [("constant", False), ("dpsgd", True), ("gem", True), ("pushsum", True)])
def test_the_outer_rule_reads_what_it_published_as_its_base_does(name: str, reads: bool) -> None:
    """What decides whether a ``memory: low`` node keeps its snapshot in a narrower wire dtype alone: the outer
    step keeps its own anchor, so only the base rule's reading counts."""
    base = make_rule(name, {}, 0.0)
    assert base.reads_published() is reads and OuterRule(base).reads_published() is reads


# --------------------------------------------------------------------------- (3) nothing exchanged in between


@pytest.mark.parametrize("name", ["exponential", "ring", "neighbours", "groups", "random"])
def test_the_schedule_names_peers_on_boundaries_only_and_the_outer_round_to_the_base(name: str) -> None:
    base = GroupsSchedule(2, 3) if name == "groups" else make_schedule(name)
    schedule = OuterSchedule(base, 4)
    names = tuple(f"w{i}" for i in range(6))
    assert (schedule.name, schedule.fanout, schedule.period) == (base.name, base.fanout, 4)
    assert schedule.max_fanout(6) == base.max_fanout(6)
    for k in range(24):
        rnd = Round("w1", names, k, NodeState("w1"))
        outer = dataclasses.replace(rnd, index=k // 4)
        if is_outer_step(k, 4):
            assert schedule.targets(rnd) == base.targets(outer)
            assert schedule.sources(rnd) == base.sources(outer)
        else:
            assert schedule.targets(rnd) == [] and schedule.sources(rnd) == []


@pytest.mark.parametrize(("name", "every"), [("dpsgd", 4), ("pushsum", 4), ("adpsgd", 3), ("constant", 5)])
def test_in_the_simulator_peers_arrive_on_boundaries_only(name: str, every: int) -> None:
    settings = RULES[name].settings_class()
    rng = np.random.default_rng(0)
    sim = Simulation(
        [[rng.normal(size=6)] for _ in range(NODES)],
        lambda: OuterRule(make_rule(name, settings, 0.0), every=every),
        lambda: OuterSchedule(make_schedule(RULES[name].default_schedule, settings), every),
    )
    for k in range(4 * every):
        outcomes = sim.run_round(1.0, train=nudge)
        mixed = [o.peers for o in outcomes.values()]
        outer = [o.metrics["outer_step"] for o in outcomes.values()]
        if is_outer_step(k, every):  # an exchange refused (its peer's snapshot paired already) mixes nothing
            assert (any if name == "adpsgd" else all)(mixed) and all(s == 1.0 for s in outer), (k, mixed)
        else:
            assert not any(mixed) and not any(outer), (k, mixed)


def nudge(node: SimNode) -> None:
    """A local step: every parameter down by 0.01."""
    for x in node.arrays:
        x -= 0.01


def _lockstep(conns: list[DpwaConnection], params: list[list[np.ndarray]], steps: int) -> None:
    for _ in range(steps):
        for c, p in zip(conns, params):
            c.update_send(p, 1.0)
        for p in params:
            p[0] -= 0.01  # a local step
        for c in conns:
            c.update_wait(1.0)


@pytest.mark.integration
@pytest.mark.parametrize("rule", ["constant", "pushsum"])
def test_two_nodes_exchange_every_fourth_step_only(rule: str, tmp_path: Path) -> None:
    """Over the network: 12 steps with ``every: 4`` fetch (or push) 3 times, and no step counts as skipped."""
    outer = {"every": 4, "lr": 0.7, "momentum": 0.9}
    config = write_cluster(tmp_path / "c.yaml", free_ports(2), interpolation=rule, timeout_ms=2000, outer=outer)
    conns = [DpwaConnection(f"w{i + 1}", config, seed=i) for i in range(2)]
    try:
        assert all(isinstance(c._node.rule, OuterRule) and isinstance(c._node.schedule, OuterSchedule) for c in conns)
        params = [[np.full(16, float(i), np.float32)] for i in range(2)]
        _lockstep(conns, params, 12)
        assert all(c.last_exchange is not None and c.last_exchange["outer_step"] == 1.0 for c in conns)  # step 11
        _lockstep(conns, params, 1)  # step 12 folds a push that came after its receiver's update_wait
        for c in conns:
            s = c.stats()
            if rule == "pushsum":
                assert s["pushes_sent"] == 3 and s["pushes_skipped"] == 0 and s["fetches_started"] == 0, s
            else:
                assert s["fetches_started"] == 3 and s["fetches_ok"] == 3 and s["fetches_skipped"] == 0, s
        if rule == "pushsum":
            assert sum(c.dpwa_state().extras["weight"] for c in conns) == pytest.approx(2.0)  # no mass lost
        gap = abs(float(params[0][0][0] - params[1][0][0]))
        assert gap < 0.5, gap  # they mixed (1.0 apart at the start)
    finally:
        for c in conns:
            c.close()


# --------------------------------------------------------------------------- (4) checkpoints


def _gem_cluster(rounds: int) -> Simulation:
    rng = np.random.default_rng(9)
    sim = Simulation(
        [[rng.normal(size=(4, 5)).astype(np.float16), rng.normal(size=3)] for _ in range(3)],
        lambda: OuterRule(GemRule(), every=2, lr=0.7, momentum=0.9),
        lambda: OuterSchedule(make_schedule("random"), 2),
        seed=1,
    )
    for _ in range(rounds):
        sim.run_round(1.0, train=nudge)
    return sim


def test_state_arrays_round_trip_the_anchor_the_momentum_and_the_step_count() -> None:
    sim = _gem_cluster(7)
    rule = sim["w1"].rule
    assert isinstance(rule, OuterRule)
    saved = rule.state_arrays()
    assert {"outer_anchor/0", "outer_anchor/1", "outer_m/0", "outer_m/1", "outer_round", "gem_m/0"} <= set(saved)
    assert saved["outer_anchor/0"].dtype == np.float32 and saved["outer_anchor/1"].dtype == np.float64
    fresh = OuterRule(GemRule(), every=2, lr=0.7, momentum=0.9)
    assert fresh.load_state_arrays(saved, sim["w1"].arrays)
    assert fresh.round == rule.round == 7
    again = fresh.state_arrays()
    assert saved.keys() == again.keys() and all(np.array_equal(saved[k], again[k]) for k in saved)
    # What does not fit changes nothing.
    for broken in (
        {**saved, "outer_anchor/0": saved["outer_anchor/0"].astype(np.float16)},
        {**saved, "outer_m/1": saved["outer_m/1"][:2]},
        {**saved, "outer_round": np.array([-1])},
        {**saved, "outer_round": np.array([1.5])},
    ):
        other = OuterRule(GemRule(), every=2)
        assert not other.load_state_arrays(broken, sim["w1"].arrays)
        assert other.anchor is None and other.round == 0


def test_a_restored_rule_goes_on_exactly_as_the_one_it_was_saved_from() -> None:
    """Save every node's rule after 5 rounds, put fresh rules in their place, load: 6 more rounds end bit for bit
    where the uninterrupted cluster does."""
    sim, other = _gem_cluster(5), _gem_cluster(5)
    for name in other.names:
        node = other[name]
        saved = node.rule.state_arrays()
        node.rule = OuterRule(GemRule(), every=2, lr=0.7, momentum=0.9)
        assert node.rule.load_state_arrays(saved, node.arrays)
        node.rule.on_publish(node.state, node.published)  # GEM's x_sent is not checkpoint state: republish
    for _ in range(6):
        for s in (sim, other):
            s.run_round(1.0, train=nudge)
    for name in sim.names:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(sim[name].arrays, other[name].arrays))


def test_a_catch_up_copy_counts_its_step_and_re_anchors() -> None:
    rule = OuterRule(ConstantRule(), every=4)
    recovery = Recovery("w1", rule, 10.0, lambda event: None)
    own, x = NodeState("w1", clock=3.0), [np.zeros(4)]
    rule.mix(own, x, [])  # step 0: the anchor
    far = PeerSnapshot(NodeState("w2", clock=50.0), [np.ones(4)])
    assert recovery.catch_up(own, x, [far]) is not None  # step 1: copied, not mixed
    assert rule.round == 2 and rule.anchor is None and np.array_equal(x[0], np.ones(4))
    rule.mix(own, x, [])  # step 2 re-anchors on the copy
    assert rule.anchor is not None and np.array_equal(rule.anchor[0], np.ones(4))


@pytest.mark.integration
def test_a_restored_node_counts_from_the_step_restored(tmp_path: Path) -> None:
    """The rule's count follows the node's step at a restore: one taken mid-step (after update_send, as the node's
    own export is), and one from a run without ``outer`` (no outer arrays at all)."""
    plain = write_cluster(tmp_path / "plain.yaml", free_ports(1), interpolation="dpsgd")
    outer = write_cluster(tmp_path / "outer.yaml", free_ports(1), interpolation="dpsgd", outer={"every": 4})
    params = [np.ones(8, np.float32)]
    with DpwaConnection("w1", outer) as a:
        _lockstep([a], [params], 5)
        a.update_send(params, 1.0)  # step 5 started, not ended
        mid = a.dpwa_state()
    with DpwaConnection("w1", plain) as b:
        _lockstep([b], [params], 7)
        other = b.dpwa_state()
    for state, step in ((mid, 6), (other, 7)):
        with DpwaConnection("w1", outer) as c:
            c.restore_state(state, params)
            node = c._node
            assert isinstance(node.rule, OuterRule) and node.step == node.rule.round == step


@pytest.mark.integration
def test_the_optimizer_state_dict_holds_the_outer_state_and_restores_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from dpwa.adapters.optimizer import DpwaOptimizer

    config = write_cluster(
        tmp_path / "c.yaml", free_ports(2), timeout_ms=2000, interpolation="dpsgd", outer={"every": 2}
    )
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    opts = [
        DpwaOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, f"w{i + 1}", config) for i, m in enumerate(models)
    ]
    data = torch.randn(8, 4)
    try:
        for _ in range(5):  # one thread, the two nodes in turn: each step's exchange overlaps the other's
            for m, opt in zip(models, opts):
                loss = m(data).pow(2).mean()
                loss.backward()
                opt.step(loss=loss)
                opt.zero_grad()
        saved = opts[0].state_dict()
        arrays = saved["dpwa"]["arrays"]
        assert {"outer_anchor/0", "outer_anchor/1", "outer_m/0", "outer_m/1", "outer_round"} <= set(arrays)
        rule = opts[0].adapter.connection._node.rule
        assert int(arrays["outer_round"][0]) == rule.round == opts[0].adapter.step == 4  # the step counts agree
        opts[0].close()
        again = DpwaOptimizer(torch.optim.SGD(models[0].parameters(), lr=0.1), models[0], "w1", config)
        opts[0] = again
        again.load_state_dict(saved)
        restored = again.adapter.connection._node
        assert restored.rule.round == restored.step == 4
        anchor = restored.rule.anchor
        assert anchor is not None and len(anchor) == 2
        assert all(np.array_equal(a, arrays[f"outer_anchor/{i}"].numpy()) for i, a in enumerate(anchor))
    finally:
        for opt in opts:
            opt.close()


# --------------------------------------------------------------------------- (5) the cluster file


def two_nodes(extra: str) -> str:
    return "nodes:\n  - {name: a, host: localhost, port: 45000}\n  - {name: b, host: localhost, port: 45001}\n" + extra


def test_the_outer_key_reads_writes_and_is_left_out_when_off() -> None:
    assert parse_config(two_nodes("")).outer is None and "outer" not in parse_config(two_nodes("")).to_dict()
    assert parse_config(two_nodes("outer: null\n")).outer is None
    assert parse_config(two_nodes("outer: {}\n")).outer == OuterSettings()
    config = parse_config(two_nodes("interpolation: dpsgd\nouter: {every: 4, lr: 1, momentum: 0.5, nesterov: false}\n"))
    assert config.outer == OuterSettings(every=4, lr=1.0, momentum=0.5, nesterov=False)
    assert config.to_dict()["outer"] == {"every": 4, "lr": 1.0, "momentum": 0.5, "nesterov": False}
    assert parse_config(yaml.safe_dump(config.to_dict())) == config
    assert ClusterConfig(outer=OuterSettings(every=2)).outer == OuterSettings(every=2)


@pytest.mark.parametrize(
    ("extra", "line", "key", "says"),
    [
        ("outer: {evry: 4}\n", 4, "outer.evry", "unknown outer setting (did you mean 'every'?)"),
        ("outer:\n  every: 0\n", 5, "outer.every", "must be an integer >= 1, got 0"),
        ("outer:\n  every: 2.5\n", 5, "outer.every", "must be an integer >= 1"),
        ("outer:\n  lr: 0\n", 5, "outer.lr", "must be a number > 0, got 0"),
        ("outer:\n  every: 4\n  momentum: 1.0\n", 6, "outer.momentum", "must be a number in [0, 1), got 1.0"),
        ("outer: {nesterov: 'yes'}\n", 4, "outer.nesterov", "must be true or false"),
        ("outer: 8\n", 4, "outer", "must be a map like {every: 8"),
        ("interpolation: pushsum\npeers: ring\nouter: {every: 4}\n", 6, "outer.momentum", "use momentum: 0 or"),
        ("interpolation: adpsgd\nouter:\n  momentum: 0.5\n", 6, "outer.momentum", "adpsgd nodes in two exchanges"),
        (
            "interpolation: dpsgd\ndpsgd: {graph: directed-ring}\nouter: {every: 4}\n",
            6,
            "outer.momentum",
            "on the directed ring the differences between nodes rotate",
        ),
    ],
)
def test_a_bad_outer_key_names_file_line_and_key(extra: str, line: int, key: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(two_nodes(extra), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.file, err.line, err.key) == (str(path), line, key), str(err)
    assert says in err.reason and str(err).startswith(f"{path}:{line}: {key}: ")


def _consensus_alone(name: str, schedule: str, graph: str | None = None, rounds: int = 800) -> tuple[float, float]:
    """6 nodes of ``name`` on ``schedule`` (its ``graph``, where the rule has one) under DiLoCo's defaults every 4th
    step, from random starts, without training: their spread at the start and after ``rounds`` steps."""
    settings = RULES[name].settings_class(**({"graph": graph} if graph else {}))
    rng = np.random.default_rng(0)
    sim = Simulation(
        [[rng.normal(size=8)] for _ in range(6)],
        lambda: OuterRule(make_rule(name, settings, 0.0), every=4),
        lambda: OuterSchedule(make_schedule(schedule, settings), 4),
    )
    start = sim.spread()
    for _ in range(rounds):
        sim.run_round(1.0)
    return start, sim.spread()


MIXING_PAIRS = [(n, s, None) for n, cls in RULES.items() if n not in ("gem", "leader") for s in cls.allowed_schedules]
MIXING_PAIRS += [("dpsgd", "neighbours", "exponential"), ("dpsgd", "neighbours", "directed-ring")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "schedule", "graph"), MIXING_PAIRS, ids=[f"{n}-{s}" + (f"-{g}" if g else "") for n, s, g in MIXING_PAIRS]
)
def test_momentum_hazard_names_exactly_the_pairs_that_diverge(name: str, schedule: str, graph: str | None) -> None:
    """Consensus alone (no training, 800 steps): the rule and schedule pairs the cluster file refuses with
    momentum grow apart, every other pair comes together. Measured (spread 3.07 at the start): the refused pairs
    end 3e7-3e33 apart (ring 9e18-1e19, D-PSGD's directed ring 1e19, adpsgd on ring 3e7 and exponential 3e33); the
    others at 1e-16-8e-9, CHOCO
    (top-1 % of 8 values: one a step) at 0.043. One refused pair comes together in lock-step: adpsgd on random
    peers (0.089), refused for what lock-step cannot show (a node mixing its own exchange and two it served in one
    asynchronous step). Not here: ``gem`` and ``leader``, which do not mix models that neither move nor differ in
    loss."""
    start, end = _consensus_alone(name, schedule, graph)
    if (name, schedule) == ("adpsgd", "random"):
        assert momentum_hazard(name, schedule) and end < start, (start, end)
        return
    assert (end > start) == bool(momentum_hazard(name, schedule, graph)), (start, end)


# --------------------------------------------------------------------------- wiring: node, simulator, sample


def test_with_outer_wraps_both_or_follows_a_wrapped_rule() -> None:
    rule, schedule = with_outer(ConstantRule(), make_schedule("ring"), None)
    assert type(rule) is ConstantRule and type(schedule) is SCHEDULES["ring"]
    rule, schedule = with_outer(ConstantRule(), make_schedule("ring"), {"every": 3, "momentum": 0.0})
    assert isinstance(rule, OuterRule) and rule.every == 3 and isinstance(schedule, OuterSchedule)
    mine = OuterRule(ConstantRule(), every=5)
    rule, schedule = with_outer(mine, make_schedule("ring"), {"every": 3})
    assert rule is mine and isinstance(schedule, OuterSchedule) and schedule.every == 5


def test_dpwa_validate_summarizes_the_outer_optimizer() -> None:
    from dpwa.cli.app import summary

    sample = Path(__file__).resolve().parents[1] / "samples" / "outer.yaml"
    assert (
        "interpolation dpsgd (graph=ring, max_staleness=10), outer (every=8, lr=1, momentum=0.5, nesterov=False)"
        in (summary(load_config(sample)))
    )


def test_simtrain_runs_a_rule_under_outer() -> None:
    plain = simulate_training("dpsgd", rounds=40, nodes=3)
    same = simulate_training("dpsgd", rounds=40, nodes=3, outer=IDENTITY)
    assert same.node_accuracy == plain.node_accuracy
    diloco = simulate_training("dpsgd", rounds=40, nodes=3, outer={"every": 4})
    assert diloco.averaged_accuracy > 0.5


# --------------------------------------------------------------------------- (6) the consensus point


@pytest.mark.outcome
@pytest.mark.parametrize(("rule", "schedule"), [("dpsgd", "neighbours"), ("pushsum", "exponential")])
@pytest.mark.parametrize("seed", SEED_PARAMS)
def test_exchanging_every_fourth_step_keeps_the_consensus_point(
    rule: str, schedule: str, seed: int, record_property: Callable[[str, object], None]
) -> None:
    """tests/test_consensus.py's heterogeneous quadratics (6 nodes, decaying local steps) under DiLoCo's outer step
    every 4th step: the nodes' mean still reaches the minimizer of the average objective, within the same
    tolerances. Measured, seeds 0-2: the bias is 7e-16-1e-14 for both rules at ROUNDS and 2e-16-7e-16 at 2*ROUNDS
    (both rules keep the nodes' sum and the outer step is linear: the nodes' mean takes DiLoCo's step on their
    mean pseudo-gradient). The spread, which the three local steps between exchanges widen, is
    0.049-0.070 (dpsgd) and 0.040-0.076 (pushsum) at ROUNDS, against 0.021-0.026 and 0.016-0.029 without outer;
    after 2*ROUNDS (as many exchanges as half the plain run's) 0.026-0.036 and 0.020-0.039, within SPREAD_TOL (dpsgd
    taking its whole local step since 2026-11-28; before: 0.040-0.054, 0.007-0.009 and 0.021-0.028)."""
    _, spread, bias = consensus_error(rule, schedule, None, seed, rounds=2 * ROUNDS, outer=OuterSettings(every=4))
    record_property("bias", bias)
    record_property("spread", spread)
    assert bias < BIAS_TOL and spread < SPREAD_TOL, (bias, spread)
