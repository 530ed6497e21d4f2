"""dpwa.config: both file formats, defaults, round-trips, and one bad file per error case."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dpwa.config import ClusterConfig, ConfigError, NodeSpec, load_config, parse_config, resolve_config, yaml12
from dpwa.launcher.rundir import RunDir
from dpwa.rules import RULES
from dpwa.rules.base import REPEATS
from dpwa.rules.pairwise import ClockRule, ClockSettings, ConstantSettings, LossSettings
from dpwa.utils.settings import SettingError, Settings, setting, spec_of

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
BAD = Path(__file__).resolve().parent / "data" / "configs" / "bad"
GOOD = Path(__file__).resolve().parent / "data" / "configs" / "good"

# The sample of dpwa's 2017 README (a list of one-key maps), which must keep loading unchanged.
ORIGINAL_SAMPLE = """\
# Sample configuration file for a multi-core machine
# Each worker is running on a seperate core
---
- nodes:
  - {name: w1, host: localhost, port: 45000}
  - {name: w2, host: localhost, port: 45001}
  - {name: w3, host: localhost, port: 45002}
  - {name: w4, host: localhost, port: 45003}
# The probability of initiating a fetch parameter request
- fetch_probability: 1
# The timeout value is used for flow-control
- timeout_ms: 2500
# Choose interpolation method: clock, loss or constant
- interpolation: constant
# Diverge models when loss is reaching the value specified here (use 0 to disable)
- divergence_threshold: 0.2
# Individual interpolation methods configuration:
- constant: { value: 0.5 }
- clock: 0
- loss: 0
"""

MAPPING_SAMPLE = """\
nodes:
  - {name: w1, host: localhost, port: 45000}
  - {name: w2, host: localhost, port: 45001}
fetch_probability: 1.0
timeout_ms: 2500
interpolation: constant
divergence_threshold: 0.0
constant: {value: 0.5}
"""

FOUR_NODES = tuple(NodeSpec(f"w{i + 1}", "localhost", 45000 + i) for i in range(4))


def two_nodes(extra: str = "") -> str:
    return "nodes:\n  - {name: a, host: localhost, port: 45000}\n  - {name: b, host: localhost, port: 45001}\n" + extra


# --------------------------------------------------------------------------- good files


def test_original_sample_is_saved_unchanged() -> None:
    assert (SAMPLES / "original-dpwa.yaml").read_text(encoding="utf-8") == ORIGINAL_SAMPLE


def test_original_sample_loads_with_its_values() -> None:
    config = load_config(SAMPLES / "original-dpwa.yaml")
    assert config.nodes == FOUR_NODES
    assert config.fetch_probability == 1.0
    assert config.timeout_ms == 2500.0
    assert config.interpolation == "constant"
    assert config.divergence_threshold == 0.2
    assert config.settings == ConstantSettings(0.5)
    assert config.peers == "auto" and config.schedule == "random"
    assert dict(config.rule_settings) == {
        "constant": ConstantSettings(0.5),
        "clock": ClockSettings(),
        "loss": LossSettings(),
        **{name: rule.settings_class() for name, rule in RULES.items() if name not in ("constant", "clock", "loss")},
    }
    assert config.source == str(SAMPLES / "original-dpwa.yaml")


def test_localhost_sample_is_a_mapping_that_writes_out_every_key() -> None:
    config = load_config(SAMPLES / "localhost.yaml")
    assert config.nodes == FOUR_NODES
    raw = yaml.safe_load((SAMPLES / "localhost.yaml").read_text(encoding="utf-8"))
    assert isinstance(raw, dict)
    assert list(raw) == list(config.to_dict())
    assert parse_config(yaml.safe_dump(raw)) == config


def test_mapping_and_list_formats_give_the_same_config() -> None:
    as_list = "\n".join("- " + line if not line.startswith(" ") else line for line in MAPPING_SAMPLE.splitlines())
    assert yaml.safe_load(as_list)[0] == {"nodes": yaml.safe_load(MAPPING_SAMPLE)["nodes"]}
    assert parse_config(as_list) == parse_config(MAPPING_SAMPLE)


def test_every_key_but_nodes_has_a_default() -> None:
    config = parse_config("nodes:\n  - {name: solo, host: 10.0.0.7, port: 1}\n")
    assert config == ClusterConfig(nodes=(NodeSpec("solo", "10.0.0.7", 1),))
    assert (config.fetch_probability, config.timeout_ms) == (1.0, 2500.0)
    assert (config.interpolation, config.divergence_threshold) == ("constant", 0.0)
    assert config.settings == ConstantSettings(0.5)
    assert set(config.rule_settings) == set(RULES)
    assert config.peers_of("solo") == ()


@pytest.mark.parametrize("value", ["0", "null", "", "{}"])
@pytest.mark.parametrize("rule", ["clock", "loss", "constant"])
def test_zero_null_or_empty_map_mean_default_settings(rule: str, value: str) -> None:
    config = parse_config(two_nodes(f"interpolation: {rule}\n{rule}: {value}\n"))
    assert config.settings == RULES[rule].settings_class()


@pytest.mark.parametrize("sample", ["original-dpwa.yaml", "localhost.yaml"])
def test_to_dict_round_trips_through_yaml(sample: str) -> None:
    config = load_config(SAMPLES / sample)
    plain = config.to_dict()
    again = parse_config(yaml.safe_dump(plain, sort_keys=False))
    assert again == config
    assert again.to_dict() == plain
    assert plain["nodes"][0] == {"name": "w1", "host": "localhost", "port": 45000}
    assert plain["constant"] == {"value": 0.5, "repeats": "skip"} and plain["clock"] == {"repeats": "skip"}


def test_numbers_are_normalized_int_to_float_but_ports_stay_int() -> None:
    config = parse_config(two_nodes("timeout_ms: 100\nfetch_probability: 0\n"))
    assert type(config.timeout_ms) is float and type(config.fetch_probability) is float
    assert type(config.nodes[0].port) is int


@pytest.mark.parametrize(
    ("written", "read"),
    [("04500", 4500), ("+4500", 4500), ("0x1194", 4500), ("0o10624", 4500), ("4500", 4500)],
)
def test_integers_are_read_as_yaml_1_2_reads_them(written: str, read: int) -> None:
    """YAML 1.1 (PyYAML's resolver) reads ``04500`` as the octal 2368 and ``0o10624`` as a string."""
    config = parse_config(f"nodes: [{{name: w1, host: localhost, port: {written}}}]\ncheckpoint_every: {written}\n")
    assert config.nodes[0].port == read and config.checkpoint_every == read


@pytest.mark.parametrize(("written", "read"), [("1e3", 1000.0), ("1.5E+3", 1500.0), (".5", 0.5), ("2.", 2.0)])
def test_floats_are_read_as_yaml_1_2_reads_them(written: str, read: float) -> None:
    """YAML 1.1 reads ``1e3`` (an exponent without a dot) as a string."""
    assert parse_config(two_nodes(f"timeout_ms: {written}\n")).timeout_ms == read


def test_a_written_config_reads_back_equal_whatever_its_names_look_like(tmp_path: Path) -> None:
    """Every cluster file dpwa writes (a run's resolved cluster.yaml, which its nodes load) goes through
    ``yaml12.dump``: names YAML 1.2 would read as numbers are quoted. ``yaml.safe_dump`` quotes by YAML 1.1 and
    wrote ``08`` and ``1e5`` bare, which read back as the numbers 8 and 100000.0."""
    names = ["08", "1e5", "0o17", "1.0e5", "123e4", "0x1F"]
    nodes = tuple(NodeSpec(name, host, 45000 + i) for i, (name, host) in enumerate(zip(names, ["1e5", "0x10"] * 3)))
    config = ClusterConfig(nodes=nodes, timeout_ms=1e-3, divergence_threshold=1e16)
    written = RunDir(tmp_path / "run")
    written.path.mkdir(parents=True)
    assert load_config(written.write_config(config)) == config  # what a run's nodes load
    text = yaml12.dump(config.to_dict(), sort_keys=False)
    assert parse_config(yaml12.dump(yaml12.load(text), sort_keys=False)) == config


def test_booleans_keep_yaml_1_1_spellings_and_strings_stay_strings() -> None:
    config = parse_config(two_nodes("transport: {shared_memory: off}\nsecurity: {curve: no}\n"))
    assert config.transport.shared_memory == "off" and config.security.curve is False
    named = parse_config("nodes: [{name: 1e3x, host: 0x.example, port: 45000}]\n").nodes[0]
    assert (named.name, named.host) == ("1e3x", "0x.example")


def test_one_inbox_slot_takes_one_push_per_sender_unless_told_otherwise() -> None:
    """``inbox_per_sender`` left out is 2, or ``inbox_slots`` when that is smaller; given, it is checked."""
    assert parse_config(two_nodes("inbox_slots: 1\n")).per_sender_limit == 1
    assert parse_config(two_nodes("")).per_sender_limit == 2
    assert parse_config(two_nodes("inbox_slots: 8\ninbox_per_sender: 5\n")).per_sender_limit == 5
    with pytest.raises(ConfigError, match=r"inbox_per_sender: must be at most inbox_slots \(1\), got 2"):
        parse_config(two_nodes("inbox_slots: 1\ninbox_per_sender: 2\n"))


def test_an_error_repeats_at_most_a_clipped_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(two_nodes(f"interpolation: {'x' * 2_000_000}\n"))
    assert len(str(info.value)) < 1000 and "(2000000 characters)" in str(info.value)


def test_a_file_without_nodes_holds_the_settings_and_takes_its_nodes_later() -> None:
    path = GOOD / "no_nodes_from_the_engine.yaml"
    config = load_config(path)
    assert config.nodes == () and config.interpolation == "pushsum" and "nodes" not in config.to_dict()
    with pytest.raises(ConfigError) as info:
        config.node("w1")
    assert info.value.key == "nodes" and "no nodes yet" in info.value.reason and "dpwa run -n N" in info.value.reason
    nodes = (NodeSpec("a", "127.0.0.1", 5000), NodeSpec("b", "127.0.0.1", 5001))
    resolved = config.with_nodes(nodes)
    assert resolved.nodes == nodes and resolved.interpolation == "pushsum" and resolved.source == str(path)
    assert [p.name for p in resolved.peers_of("a")] == ["b"]
    with pytest.raises(ConfigError, match="duplicate node name"):  # engine nodes are checked like a file's
        config.with_nodes((nodes[0], NodeSpec("a", "127.0.0.1", 5002)))


def test_node_lookup_peers_and_endpoint() -> None:
    config = load_config(SAMPLES / "localhost.yaml")
    assert config.node("w3") == NodeSpec("w3", "localhost", 45002)
    assert config.node("w3").endpoint == "tcp://localhost:45002"
    assert [p.name for p in config.peers_of("w2")] == ["w1", "w3", "w4"]


def test_unknown_node_name_points_at_the_nodes_line() -> None:
    path = SAMPLES / "localhost.yaml"
    config = load_config(path)
    nodes_line = 1 + path.read_text(encoding="utf-8").splitlines().index("nodes:")
    for lookup in (config.node, config.peers_of):
        with pytest.raises(ConfigError) as info:
            lookup("w5")
        err = info.value
        assert (err.file, err.line, err.key) == (str(path), nodes_line, "nodes")
        assert "no node named 'w5'; allowed: w1, w2, w3, w4" in err.reason
        assert str(err).startswith(f"{path}:{nodes_line}: nodes: ")


def test_config_is_frozen_and_rule_settings_read_only() -> None:
    config = parse_config(MAPPING_SAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout_ms = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.rule_settings["constant"] = ConstantSettings(0.1)  # type: ignore[index]
    assert hash(config) == hash(parse_config(MAPPING_SAMPLE, source="elsewhere.yaml"))


def test_config_pickles_copies_and_replaces() -> None:
    config = load_config(SAMPLES / "original-dpwa.yaml")
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert clone == config and clone.source == config.source
        assert dict(clone.marks) == dict(config.marks) and clone.marks["nodes"] == 4
        with pytest.raises(TypeError):
            clone.rule_settings["clock"] = ClockSettings()  # type: ignore[index]
    faster = dataclasses.replace(config, timeout_ms=100)
    assert faster.timeout_ms == 100.0 and faster.nodes == config.nodes
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(config, timeout_ms=-1)
    assert (info.value.line, info.value.key) == (12, "timeout_ms")


def test_resolve_config_passes_configs_through_and_loads_paths() -> None:
    config = parse_config(MAPPING_SAMPLE)
    assert resolve_config(config) is config
    path = SAMPLES / "localhost.yaml"
    assert resolve_config(path) == resolve_config(str(path)) == load_config(path)
    with pytest.raises(TypeError):
        resolve_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", sorted(GOOD.glob("*.yaml")), ids=lambda p: p.name)
def test_good_files_load(path: Path) -> None:
    config = load_config(path)
    assert parse_config(yaml.safe_dump(config.to_dict())) == config


# --------------------------------------------------------------------------- bad files


def expectations(path: Path) -> tuple[int | None, str | None, list[str]]:
    """(line, key, phrases) from the file's ``# error-line:``, ``# error-key:``, ``# error-says:`` lines."""
    text = path.read_text(encoding="utf-8")
    fields = re.findall(r"^# error-(line|key|says): (.*)$", text, flags=re.MULTILINE)
    line = [v for k, v in fields if k == "line"]
    key = [v for k, v in fields if k == "key"]
    says = [v for k, v in fields if k == "says"]
    assert len(line) == 1 and len(key) == 1 and says, f"{path.name} must state its expected error"
    return int(line[0]), None if key[0] == "-" else key[0], says


@pytest.mark.parametrize("path", sorted(BAD.glob("*.yaml")), ids=lambda p: p.name)
def test_bad_file_names_file_line_key_and_what_is_allowed(path: Path) -> None:
    line, key, says = expectations(path)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.file, err.line, err.key) == (str(path), line, key), str(err)
    for phrase in says:
        assert phrase in err.reason, str(err)
    prefix = f"{path}:{line}: " + (f"{key}: " if key else "")
    assert str(err) == prefix + err.reason
    assert "\n" not in str(err)


REQUIRED_CASES = {
    "unknown_top_level_key", "unknown_node_key", "unknown_settings_key", "bool_as_number",
    "string_as_number", "nodes_not_list", "node_not_mapping", "fetch_probability_out_of_range",
    "constant_value_out_of_range", "timeout_not_positive", "divergence_negative", "port_out_of_range",
    "port_not_integer", "missing_node_field", "empty_node_name", "duplicate_node_name", "duplicate_address",
    "no_nodes", "unknown_interpolation", "yaml_syntax_error", "duplicate_key_mapping", "node_name_a_path",
    "node_name_absolute", "node_name_nul", "node_name_reserved", "nested_too_deep", "join_host_nul",
    "join_port_not_ascii",
    "duplicate_key_list_format", "list_item_two_keys", "empty", "top_level_scalar",
}  # fmt: skip


def test_there_is_a_bad_file_for_every_error_case() -> None:
    assert REQUIRED_CASES <= {p.stem for p in BAD.glob("*.yaml")}


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.file, err.line, err.key) == (str(path), None, None)
    assert str(err) == f"{path}: cannot read cluster file: No such file or directory"


def test_directory_and_non_utf8_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_config(tmp_path)
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes(b"# a comment\n\nnodes: \xff\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text: invalid start byte \(byte 20\)") as info:
        load_config(binary)
    assert info.value.line == 3


def test_config_error_format_and_pickling() -> None:
    assert str(ConfigError("bad", "f.yaml", 7, "k")) == "f.yaml:7: k: bad"
    assert str(ConfigError("bad", "f.yaml", None, "k")) == "f.yaml: k: bad"
    assert str(ConfigError("bad", "f.yaml", 3)) == "f.yaml:3: bad"
    err = pickle.loads(pickle.dumps(ConfigError("bad", "f.yaml", 7, "k")))
    assert (err.reason, err.file, err.line, err.key) == ("bad", "f.yaml", 7, "k")
    assert isinstance(err, ValueError)


# --------------------------------------------------------------------------- in-memory configs and new rules


def test_configs_built_in_python_are_validated_the_same_way() -> None:
    with pytest.raises(ConfigError) as info:
        ClusterConfig(nodes=FOUR_NODES, fetch_probability=2)
    assert (info.value.file, info.value.line, info.value.key) == ("<memory>", None, "fetch_probability")
    assert ClusterConfig(nodes=()).nodes == ()  # no nodes yet: an engine gives them (with_nodes)
    with pytest.raises(ConfigError, match="at least one node"):
        ClusterConfig(nodes=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="duplicate node name 'w1'"):
        ClusterConfig(nodes=(FOUR_NODES[0], NodeSpec("w1", "h2", 1)))
    with pytest.raises(ConfigError, match="port: must be an integer in"):
        NodeSpec("w1", "localhost", 0)
    with pytest.raises(SettingError, match="value: must be a number in"):
        ConstantSettings(value=1.01)  # a rule's settings live beside the rule, which knows no cluster file
    with pytest.raises(ConfigError, match="unknown rule"):
        ClusterConfig(nodes=FOUR_NODES, rule_settings={"constnat": ConstantSettings()})
    with pytest.raises(ConfigError, match="must be a ConstantSettings"):
        ClusterConfig(nodes=FOUR_NODES, rule_settings={"constant": ClockSettings()})
    config = ClusterConfig(nodes=list(FOUR_NODES), rule_settings={"constant": ConstantSettings(0.25)})
    assert config.nodes == FOUR_NODES and config.settings == ConstantSettings(0.25)


def test_duplicate_addresses_treat_localhost_and_127_0_0_1_as_one_host() -> None:
    ClusterConfig(nodes=(NodeSpec("a", "localhost", 1), NodeSpec("b", "127.0.0.2", 1)))
    with pytest.raises(ConfigError, match="duplicate address"):
        ClusterConfig(nodes=(NodeSpec("a", "127.0.0.1", 1), NodeSpec("b", "LOCALHOST", 1)))
    with pytest.raises(ConfigError, match="duplicate address"):
        ClusterConfig(nodes=(NodeSpec("a", "example.com", 1), NodeSpec("b", "Example.COM.", 1)))


@pytest.mark.parametrize("host", ["*", "a/b", "...", "-x", "x-", "a..b", "x" * 64, ".".join(["x" * 60] * 5), "1.2.3"])
def test_a_host_that_is_no_host_name_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="host: (must be an IPv4 address or a host name|not an IPv4 address)"):
        NodeSpec("w1", host, 1)


@pytest.mark.parametrize("host", ["localhost", "node-7.cluster.local", "my_host", "example.com.", "10.0.0.1", "x" * 63])
def test_host_names_and_addresses_are_taken(host: str) -> None:
    assert NodeSpec("w1", host, 1).host == host


def test_every_rule_default_is_within_its_own_range() -> None:
    for name, rule in RULES.items():
        assert isinstance(rule.settings_class(), Settings), name


@dataclasses.dataclass(frozen=True)
class ToySettings(Settings):
    rate: float = setting(0.1, lo=0, hi=1, lo_open=True)
    steps: int = setting(4, lo=1, integer=True)
    slack: float = setting(0.0, hi=1, hi_open=True)


class ToyRule(ClockRule):
    name = "toy"
    settings_class = ToySettings
    allowed_schedules = ("random",)
    default_schedule = "random"


def test_a_new_rule_needs_only_a_rule_class_naming_its_settings_and_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(RULES, "toy", ToyRule)
    config = parse_config(two_nodes("interpolation: toy\ntoy: {rate: 1, steps: 9}\n"))
    assert config.settings == ToySettings(rate=1.0, steps=9)
    assert config.to_dict()["toy"] == {"rate": 1.0, "steps": 9, "slack": 0.0}
    assert parse_config(two_nodes()).rule_settings["toy"] == ToySettings()
    cases = [
        ("toy: {rate: 0}", "toy.rate", "must be a number in (0, 1], got 0"),
        ("toy: {steps: 2.0}", "toy.steps", "must be an integer >= 1, got 2.0"),
        ("toy: {slack: 1}", "toy.slack", "must be a number < 1, got 1"),
        ("toy: {stpes: 3}", "toy.stpes", "(did you mean 'steps'?); allowed: rate, steps, slack"),
    ]
    for text, key, reason in cases:
        with pytest.raises(ConfigError) as info:
            parse_config(two_nodes(text + "\n"), source="toy.yaml")
        assert (info.value.line, info.value.key) == (4, key)
        assert reason in info.value.reason


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_fetch_probability_accepts_exactly_the_unit_interval(value: float) -> None:
    text = two_nodes(f"fetch_probability: {yaml.safe_dump(value).splitlines()[0]}\n")
    if 0.0 <= value <= 1.0:
        assert parse_config(text).fetch_probability == value
    else:
        with pytest.raises(ConfigError) as info:
            parse_config(text)
        assert (info.value.line, info.value.key) == (4, "fetch_probability")


def test_the_repeats_choices_are_the_rules_own() -> None:
    """A rule's ``repeats`` setting offers exactly what its constructor accepts (dpwa.rules.base.REPEATS)."""
    fields = [(name, f) for name, rule in RULES.items() for f in dataclasses.fields(rule.settings_class)]
    repeats = [(name, spec_of(f)) for name, f in fields if f.name == "repeats"]
    assert {name for name, _ in repeats} == {"constant", "clock", "loss", "gem"}
    for name, spec in repeats:
        assert tuple(spec.options) == REPEATS, name  # type: ignore[union-attr]


def test_a_file_whose_nodes_outgrow_the_member_table_a_message_carries_is_refused() -> None:
    """Every node sends the member table (the file's nodes, then the joined ones) in its messages' headers: a file
    whose nodes take more than TABLE_BUDGET_BYTES there is refused when read, naming `nodes`. Before, a node of
    such a cluster could not encode its table: its leave announcement and JOIN answers were silently lost."""
    from dpwa.config.tablesize import TABLE_BUDGET_BYTES, table_bytes

    def listing(count: int, name: str) -> str:
        return "nodes:\n" + "".join(f"  - {{name: {name}{i}, host: node{i}.cluster.example, port: 4000}}\n"
                                    for i in range(count))  # fmt: skip

    fits = parse_config(listing(200, "w"))
    assert table_bytes(fits.nodes) <= TABLE_BUDGET_BYTES
    with pytest.raises(ConfigError, match=r"nodes: 600 nodes take \d+ bytes in the member table") as err:
        parse_config(listing(600, "worker-with-a-long-name-"))
    assert err.value.key == "nodes"
