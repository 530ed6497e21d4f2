"""Every cluster file in samples/ loads, and its rule and peer schedule can be built from it.

The per-rule samples (samples/<rule>.yaml) are the examples of docs/rules.md: they must select their rule,
use the same four localhost nodes as samples/localhost.yaml (so `dpwa run` works on any of them the
same way), be in the mapping format, and their settings must make the rule mix in the in-process
simulator (a sample whose settings never move the models would still load).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from dpwa.config import ClusterConfig, load_config
from dpwa.rules import RULES, make_rule
from dpwa.rules.outer import OuterRule, OuterSchedule, outer_rule, outer_schedule
from dpwa.rules.schedules import SCHEDULES, GroupsSchedule, make_schedule
from dpwa.security.keys import generate_keys
from dpwa.tools.simulation import SimNode, Simulation

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
ALL_SAMPLES = sorted(SAMPLES.glob("*.yaml"))
RULE_SAMPLES = ("gem", "pushsum", "leader", "group", "adpsgd", "dpsgd")  # one samples/<rule>.yaml each


def test_the_samples_directory_holds_a_sample_per_new_rule() -> None:
    names = {p.stem for p in ALL_SAMPLES}
    assert {"localhost", *RULE_SAMPLES} <= names, sorted(names)


def load_sample(path: Path, tmp_path: Path) -> ClusterConfig:
    """``load_config(path)``; a sample with ``security.curve`` is loaded from a copy in ``tmp_path`` next to
    freshly generated keys (the repository holds no keys: such a sample's header says how to generate them)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    security = raw.get("security") if isinstance(raw, dict) else None
    if not (isinstance(security, dict) and security.get("curve")):
        return load_config(path)
    copy = tmp_path / path.name
    copy.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    generate_keys([node["name"] for node in raw["nodes"]], tmp_path / security["keys"])
    return load_config(copy)


@pytest.mark.parametrize("path", ALL_SAMPLES, ids=lambda p: p.name)
def test_every_sample_loads_and_builds_its_rule_and_schedule(path: Path, tmp_path: Path) -> None:
    config = load_sample(path, tmp_path)
    rule = make_rule(config.interpolation, config.settings, config.divergence_threshold)
    assert isinstance(rule, RULES[config.interpolation])
    rule_class = RULES[config.interpolation]
    assert config.schedule == rule_class.default_schedule or config.schedule in rule_class.allowed_schedules
    schedule = make_schedule(config.schedule, config.settings)
    assert isinstance(schedule, SCHEDULES[config.schedule])
    # The rule starts on every node of the file (the leader rule checks the node is one of them).
    names = [node.name for node in config.nodes]
    for name in names:
        make_rule(config.interpolation, config.settings, config.divergence_threshold).initial_extras(name, names)


@pytest.mark.parametrize("rule", RULE_SAMPLES)
def test_a_rule_sample_selects_its_rule_on_the_localhost_nodes(rule: str) -> None:
    path = SAMPLES / f"{rule}.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(raw, dict), "mapping format"
    assert rule in raw, f"{path.name} spells out the {rule} settings"
    config = load_config(path)
    assert config.interpolation == rule
    assert config.schedule == RULES[rule].default_schedule, "the sample runs the rule's default schedule"
    localhost = load_config(SAMPLES / "localhost.yaml")
    assert config.nodes == localhost.nodes, "the same 4 nodes and ports 45000-45003 as samples/localhost.yaml"
    assert [node.port for node in config.nodes] == [45000, 45001, 45002, 45003]
    # Every setting the file gives is one of the rule's settings, with the value the rule ends up with.
    fields = {f.name for f in dataclasses.fields(RULES[rule].settings_class)}
    assert set(raw[rule] or {}) <= fields
    for key, value in (raw[rule] or {}).items():
        assert getattr(config.settings, key) == value


def test_the_group_sample_rotates_pairs_and_syncs() -> None:
    config = load_config(SAMPLES / "group.yaml")
    schedule = make_schedule(config.schedule, config.settings)
    assert isinstance(schedule, GroupsSchedule)
    s = config.settings
    assert s.group_size == 2 and s.sync_every > 1, "pairs that rotate, with a full average now and then"
    n = len(config.nodes)
    assert schedule.group(0, n, 0) == [0, 1] and schedule.group(0, n, 1) == [0, 2]
    assert schedule.group(0, n, s.sync_every - 1) == list(range(n))


def _simulate(rule: str, rounds: int, mix: bool) -> float:
    """Spread of 4 simulated nodes after ``rounds`` rounds of the sample's rule and schedule (under its outer
    optimizer, if it has one).

    Every node takes a gradient step on its own quadratic ``|x - c_i|^2 / 2`` (different centres, so
    without mixing the nodes drift apart); ``mix=False`` serves nobody (fetches fail as timeouts).
    """
    config = load_config(SAMPLES / f"{rule}.yaml")
    rng = np.random.default_rng(0)
    start = rng.normal(size=64).astype(np.float32)
    centres = {f"w{i + 1}": rng.normal(size=64).astype(np.float32) for i in range(4)}
    sim = Simulation(
        [[start] for _ in range(4)],
        lambda: outer_rule(make_rule(config.interpolation, config.settings, config.divergence_threshold), config.outer),
        lambda: outer_schedule(make_schedule(config.schedule, config.settings), config.outer),
        names=[node.name for node in config.nodes],
    )

    def train(node: SimNode) -> float:
        x = node.arrays[0]
        x -= np.float32(0.05) * (x - centres[node.name])
        return float(0.5 * np.sum((x - centres[node.name]) ** 2))

    losses = {name: 1.0 for name in sim.names}
    for _ in range(rounds):
        outcomes = sim.run_round(losses, train=train, lose=None if mix else (lambda a, b: "timeout"))
        losses = {name: sim[name].state.loss for name in sim.names}
        if not mix:
            assert all(o.factor == 0.0 for o in outcomes.values())
    return sim.spread()


@pytest.mark.parametrize("rule", RULE_SAMPLES)
def test_a_rule_sample_mixes_in_the_simulator(rule: str) -> None:
    alone, gossip = _simulate(rule, 60, mix=False), _simulate(rule, 60, mix=True)
    assert gossip < 0.5 * alone, (rule, gossip, alone)


def test_the_outer_sample_runs_its_rule_under_the_outer_optimizer() -> None:
    """samples/outer.yaml: a rule sample's shape (the localhost nodes, the rule's default schedule) with ``outer``;
    the node wraps rule and schedule, and the simulated nodes come together though they exchange every 8th step."""
    config = load_config(SAMPLES / "outer.yaml")
    localhost = load_config(SAMPLES / "localhost.yaml")
    assert config.nodes == localhost.nodes and config.schedule == RULES[config.interpolation].default_schedule
    assert config.outer is not None and config.outer.every > 1
    raw = yaml.safe_load((SAMPLES / "outer.yaml").read_text(encoding="utf-8"))
    assert raw["outer"] == dataclasses.asdict(config.outer), "the sample spells out every outer setting"
    rule = outer_rule(make_rule(config.interpolation, config.settings, 0.0), config.outer)
    assert isinstance(rule, OuterRule) and rule.every == config.outer.every
    assert isinstance(outer_schedule(make_schedule(config.schedule, config.settings), config.outer), OuterSchedule)
    alone, gossip = _simulate("outer", 64, mix=False), _simulate("outer", 64, mix=True)
    assert gossip < 0.5 * alone, (gossip, alone)
