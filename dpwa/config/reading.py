"""Reading a cluster file: YAML text -> a validated :class:`~dpwa.config.cluster.ClusterConfig`.

The reader keeps the line of every key path it reads, so each problem becomes a
:class:`~dpwa.config.cluster.ConfigError` naming the file, the line, the key and what is allowed. Both shapes of a
cluster file read the same way: a mapping (``nodes: [...]``, ``fetch_probability: 1.0``) or a list of one-key maps
(``- nodes: [...]``). YAML is read with the safe constructor only: no tag builds a Python object.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import yaml

from dpwa.config import yaml12
from dpwa.config.cluster import MEMORY, ClusterConfig, ConfigError, NodeSpec, field_spec, line_of, top_level_fields
from dpwa.rules import RULES
from dpwa.utils.settings import SettingError, show_value, suggest

__all__ = ["ClusterFileReader", "load_config", "parse_config", "resolve_config"]

log = logging.getLogger(__name__)


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate the cluster file at ``path``; an unreadable file is a ConfigError too."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8-sig") as handle:
            text = handle.read()
    except OSError as err:
        raise ConfigError(f"cannot read cluster file: {err.strerror or err}", source) from err
    except UnicodeDecodeError as err:
        line = err.object[: err.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: {err.reason} (byte {err.start})", source, line) from err
    return parse_config(text, source)


def resolve_config(config: ClusterConfig | str | os.PathLike[str]) -> ClusterConfig:
    """``config`` itself if it is a ClusterConfig, else the cluster file it names, loaded."""
    if isinstance(config, ClusterConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    raise TypeError(f"expected a ClusterConfig or a path, got {type(config).__name__}")


def parse_config(text: str, source: str = MEMORY) -> ClusterConfig:
    """Validate cluster-file ``text`` (either format); ``source`` names it in errors."""
    try:
        return _parse(text, source)
    except RecursionError:  # PyYAML composes (and we read) nested collections recursively
        raise ConfigError("collections nested too deep (a cluster file needs three levels)", source, 1) from None


def _parse(text: str, source: str) -> ClusterConfig:
    doc = ClusterFileReader(source)
    values: dict[str, Any] = {}
    rules: dict[str, object] = {}
    fields = {f.name: f for f in top_level_fields()}
    allowed = [*fields, *RULES]
    for key, node in doc.top_level(doc.compose(text)):
        if key in RULES:
            rules[key] = doc.settings(key, node)
        elif key in fields:
            values[key] = field_spec(fields[key]).read(doc, node, key)
        else:
            raise doc.error(key, f"unknown key{suggest(key, allowed)}")
    if "nodes" in values and not values["nodes"]:
        raise doc.error(
            "nodes",
            "must list at least one node ({name, host, port} maps), got an empty list; leave `nodes` out to take "
            "them from the engine (dpwa run -n N, srun, torchrun)",
        )
    config = ClusterConfig(**values, rule_settings=rules, source=source, marks=doc.marks)
    log.debug("%s: %d nodes, interpolation %s", source, len(config.nodes), config.interpolation)
    return config


class ClusterFileReader:
    """One cluster file being read: YAML nodes -> Python values, remembering the line of every key path."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.marks: dict[str, int] = {}
        self._constructor = yaml12.Constructor()

    def error(self, key: str | None, reason: str, node: yaml.Node | None = None) -> ConfigError:
        line = node.start_mark.line + 1 if node is not None else line_of(self.marks, key or "")
        return ConfigError(reason, self.source, line, key)

    def compose(self, text: str) -> yaml.Node:
        """The document's root node; YAML syntax errors, empty files and scalars are ConfigErrors."""
        try:
            root = yaml.compose(text, Loader=yaml12.Loader)
        except yaml.MarkedYAMLError as err:
            raise self._yaml_error(err) from err
        except yaml.YAMLError as err:  # ReaderError: a character YAML does not allow
            position = getattr(err, "position", None)
            line = None if position is None else text.count("\n", 0, position) + 1
            raise ConfigError(f"invalid YAML: {' '.join(str(err).split())}", self.source, line) from err
        if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == "tag:yaml.org,2002:null"):
            raise ConfigError(f"file is empty; expected {_SHAPES}", self.source, 1)
        self.marks[""] = root.start_mark.line + 1
        return root

    def _yaml_error(self, err: yaml.MarkedYAMLError) -> ConfigError:
        """E.g. ``invalid YAML: while parsing a flow mapping on line 5, expected ',' or '}', but got ':'``."""
        mark = err.problem_mark or err.context_mark
        context = err.context or ""
        if context and err.context_mark is not None:
            context += f" on line {err.context_mark.line + 1}"
        reason = "invalid YAML: " + ", ".join(part for part in (context, err.problem or "") if part)
        return ConfigError(" ".join(reason.split()), self.source, mark.line + 1 if mark else None)

    def value(self, node: yaml.Node, key: str) -> object:
        """The plain Python value of ``node`` (SafeLoader types only)."""
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as err:
            raise self.error(key, f"cannot read value: {err.problem or err}", node) from err
        except (ValueError, TypeError, OverflowError) as err:  # e.g. `2001-13-45`, `!!float abc`
            raise self.error(key, f"cannot read value: {err}", node) from err

    def entries(self, node: yaml.MappingNode, prefix: str) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """(key, key node, value node) of a mapping, in order; keys must be strings. Records key lines."""
        out = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                reason = "merge keys (<<) are not supported; write the keys out"
                raise self.error(prefix or None, reason, key_node)
            key = self.value(key_node, prefix)
            if not isinstance(key, str) or not key:
                raise self.error(prefix or None, f"keys must be non-empty strings, got {show_value(key)}", key_node)
            self.marks.setdefault(f"{prefix}.{key}" if prefix else key, key_node.start_mark.line + 1)
            out.append((key, key_node, value_node))
        return out

    def unique(self, entries: list[tuple[str, yaml.Node, yaml.Node]], prefix: str) -> list[tuple[str, yaml.Node]]:
        """``entries`` as (key, value node), ConfigError at the second occurrence of a repeated key."""
        first: dict[str, int] = {}
        for key, key_node, _ in entries:
            if key in first:
                reason = f"duplicate key (first set on line {first[key]}); each key may appear once"
                raise self.error(f"{prefix}.{key}" if prefix else key, reason, key_node)
            first[key] = key_node.start_mark.line + 1
        return [(key, value_node) for key, _, value_node in entries]

    def mapping(self, node: yaml.MappingNode, prefix: str) -> list[tuple[str, yaml.Node]]:
        """(key, value node) of a mapping with string keys, each at most once."""
        return self.unique(self.entries(node, prefix), prefix)

    def top_level(self, root: yaml.Node) -> list[tuple[str, yaml.Node]]:
        """Top-level (key, value node) pairs of either format, each key at most once."""
        if isinstance(root, yaml.MappingNode):
            return self.mapping(root, "")
        if not isinstance(root, yaml.SequenceNode):
            raise self.error(None, f"expected {_SHAPES}, got {show_value(self.value(root, ''))}", root)
        entries = []
        for item in root.value:
            pairs = self.entries(item, "") if isinstance(item, yaml.MappingNode) else []
            if len(pairs) != 1:
                keys = ", ".join(k for k, _, _ in pairs)
                got = f"a map with keys {keys}" if pairs else show_value(self.value(item, ""))
                reason = f"each list item must be a one-key map like `- timeout_ms: 2500`, got {got}"
                raise self.error(None, reason, item)
            entries.extend(pairs)
        return self.unique(entries, "")

    def nodes(self, node: yaml.Node, key: str) -> tuple[NodeSpec, ...]:
        """The node list as NodeSpecs; checks shape and per-node keys (cross-node checks: ClusterConfig)."""
        if not isinstance(node, yaml.SequenceNode):
            got = show_value(self.value(node, key))
            raise self.error(key, f"must be a list of {{name, host, port}} maps, got {got}", node)
        allowed = [f.name for f in dataclasses.fields(NodeSpec)]
        required = _required(NodeSpec)
        specs = []
        for i, item in enumerate(node.value):
            path = f"{key}[{i}]"
            self.marks[path] = item.start_mark.line + 1
            if not isinstance(item, yaml.MappingNode):
                got = show_value(self.value(item, path))
                raise self.error(path, f"must be a {{name, host, port}} map, got {got}", item)
            given = {}
            for field, value_node in self.mapping(item, path):
                if field not in allowed:
                    raise self.error(f"{path}.{field}", f"unknown node key{suggest(field, allowed)}")
                given[field] = self.value(value_node, f"{path}.{field}")
            for field in required:
                if field not in given:
                    raise self.error(f"{path}.{field}", f"missing; every node needs {', '.join(required)}")
            specs.append(self.build(NodeSpec, given, path))
        return tuple(specs)

    def settings(self, rule: str, node: yaml.Node) -> object:
        """The settings object of ``rule``: a map of its fields, or 0/null/{} for the defaults."""
        cls = RULES[rule].settings_class
        allowed = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(node, yaml.MappingNode):
            value = self.value(node, rule)
            if value is None or (type(value) in (int, float) and value == 0):  # not False
                return cls()
            raise self.error(rule, f"must be a map of settings ({', '.join(allowed)}), got {show_value(value)}", node)
        given = {}
        for key, value_node in self.mapping(node, rule):
            if key not in allowed:
                raise self.error(f"{rule}.{key}", f"unknown setting{suggest(key, allowed)}")
            given[key] = self.value(value_node, f"{rule}.{key}")
        return self.build(cls, given, rule)

    def build(self, cls: type, given: dict[str, object], path: str) -> object:
        """``cls(**given)``, its validation error re-pointed at ``path.<field>`` and its line."""
        try:
            return cls(**given)
        except (ConfigError, SettingError) as err:
            raise self.error(f"{path}.{err.key}" if err.key else path, err.reason) from None


# --------------------------------------------------------------------------- helpers

_SHAPES = "a mapping (nodes: ..., fetch_probability: ...) or a list of one-key maps (- nodes: ...)"


def _required(cls: type) -> list[str]:
    """Names of the dataclass fields of ``cls`` that have no default."""
    no_default = dataclasses.MISSING
    return [f.name for f in dataclasses.fields(cls) if f.default is no_default and f.default_factory is no_default]
