"""The cluster configuration as dataclasses: what each key means, its limits, and the checks across keys.

A cluster file is YAML in one of two shapes, read the same way:

* a mapping (``nodes: [...]``, ``fetch_probability: 1.0``, ...), or
* the 2017 dpwa shape, a list of one-key maps (``- nodes: [...]``, ``- fetch_probability: 1``).

Every problem is a :class:`ConfigError` naming file, line, key and what is allowed.
The value objects check themselves on construction (so a config built in Python is
checked the same way) and the YAML reader adds file and line.

One field style: every cluster-file key is a dataclass field declared with
:func:`~dpwa.utils.settings.setting` (a number in a range, or any other
:class:`~dpwa.utils.settings.Spec` passed as ``spec=``) or its shorthand
:func:`~dpwa.utils.settings.choice`; the spec says how the key is read, checked and
written back, and ``omit_default=True`` keeps a key added after files were written
out of :meth:`ClusterConfig.to_dict` while it holds its default. Adding a top-level
key is one such field on :class:`ClusterConfig`.

The rules are not listed here: each rule module declares its settings dataclass
beside its rule class, and :data:`dpwa.rules.RULES` names them all. Each rule name
is an ``interpolation`` value and a top-level key holding that rule's settings;
its class says which ``peers`` schedules fit it and which one ``auto`` stands for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import yaml

from dpwa.config.addresses import address_clashes
from dpwa.config.errors import MEMORY, ConfigError, error_in_memory
from dpwa.config.join import MAX_JOINED, JoinAddress, JoinSpec, parse_join
from dpwa.config.tablesize import TABLE_BUDGET_BYTES, table_bytes
from dpwa.rules import RULES, OuterSettings, momentum_hazard
from dpwa.rules.schedules import SCHEDULES
from dpwa.security.keyfiles import KeyFileError, public_path, read_key_file, secret_path
from dpwa.utils.dtypes import WIRE_DTYPES
from dpwa.utils.settings import (
    AutoOrCount,
    Flag,
    HostName,
    NodeName,
    Number,
    Reader,
    Spec,
    choice,
    omits_default,
    setting,
    show_value,
    spec_of,
    suggest,
    validate,
)

__all__ = [
    "MEMORY",
    "BOOTSTRAP_MODES",
    "PEER_SCHEDULES",
    "ClusterConfig",
    "ConfigError",
    "NodeSpec",
    "SHARED_MEMORY_MODES",
    "MEMORY_MODES",
    "SecurityConfig",
    "TransportConfig",
]

log = logging.getLogger(__name__)


class FileReader(Reader, Protocol):
    """What the cluster-level specs (``security``, ``nodes``) need of the file reader
    (:class:`dpwa.config.reading.ClusterFileReader`)."""

    source: str

    def error(self, key: str | None, reason: str, node: yaml.Node | None = None) -> ConfigError: ...

    def mapping(self, node: yaml.MappingNode, prefix: str) -> list[tuple[str, yaml.Node]]: ...

    def nodes(self, node: yaml.Node, key: str) -> tuple[NodeSpec, ...]: ...

    def build(self, cls: type, given: dict[str, object], path: str) -> object: ...


MAX_WAIT_S = 86400.0
"""The longest a setting may make a node wait (a day): a timeout beyond it is a typo, and one beyond what
``threading`` can wait would fail only at the wait."""
_NOT_UNDER_OUTER = {
    "choco": "CHOCO's messages are increments that every neighbour must receive",
    "gt": "the tracker is mixed by offers made at every publish, and offers nobody collects drain it between the "
    "exchanges: the local steps would be lost",
}
"""The rules the outer optimizer cannot wrap, and why."""
DEFAULT_PER_SENDER = 2
"""How many unmixed pushes one sender may hold in a receiver's inbox unless ``inbox_per_sender`` says."""


# --------------------------------------------------------------------------- value objects


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One cluster member: a unique name and the host:port its server binds/peers connect to."""

    name: str = setting(spec=NodeName())
    host: str = setting(spec=HostName())
    port: int = setting(lo=1, hi=65535, integer=True)

    def __post_init__(self) -> None:
        validate(self, error_in_memory)

    @property
    def endpoint(self) -> str:
        """ZeroMQ address ``"tcp://host:port"``."""
        return f"tcp://{self.host}:{self.port}"


#: Values of the ``peers`` key: ``auto`` (the rule's :attr:`~dpwa.rules.base.Rule.default_schedule`) or a
#: schedule of ``dpwa.rules.schedules``; the rule's ``allowed_schedules`` say which ones fit it.
PEER_SCHEDULES = ("auto", *SCHEDULES)
#: Values of the ``bootstrap`` key: ``none`` or ``peer`` (copy a peer's model before the first step).
BOOTSTRAP_MODES = ("none", "peer")


@dataclasses.dataclass(frozen=True)
class _OptionalPort(Spec):
    """None (not given: the engine derives it) or a port, an integer in [1, 65535]."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if value is not None:
            yield from Number(1, 65535, integer=True).check(value)


@dataclasses.dataclass(frozen=True)
class _Directory(Spec):
    """None (not given) or a directory path, made absolute (``~`` expanded) against the working directory."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
            yield "", f"must be a directory path, got {show_value(value)}"

    def coerce(self, value: object) -> object:
        return None if value is None else os.path.abspath(os.path.expanduser(os.fspath(value)))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    """The ``security`` key: ``curve: true`` encrypts and authenticates all traffic with CurveZMQ.

    ``keys`` is the directory of the key files (``NAME.key``, ``NAME.key_secret``; see
    ``dpwa keys generate``), made absolute on construction: a cluster file's relative ``keys`` is
    relative to the file, one given in Python relative to the working directory. Required when
    ``curve`` is true; ignored otherwise. With ``curve`` on, :class:`ClusterConfig` checks that every
    node's public key is there; a node's own secret key is checked when it starts
    (:meth:`ClusterConfig.check_secret_key`), so a machine needs only the secret keys of its nodes.
    """

    curve: bool = setting(False, spec=Flag())
    keys: str | None = setting(None, spec=_Directory())

    def __post_init__(self) -> None:
        validate(self, error_in_memory)
        if self.curve and self.keys is None:
            raise error_in_memory("keys", "missing; `curve: true` needs `keys: DIR`, the directory of the key files")


@dataclasses.dataclass(frozen=True)
class _Security(Spec):
    """The ``security`` map (``{curve: true, keys: DIR}``; null or {} for no security)."""

    def read(self, doc: FileReader, node: yaml.Node, key: str) -> object:
        allowed = [f.name for f in dataclasses.fields(SecurityConfig)]
        if not isinstance(node, yaml.MappingNode):
            value = doc.value(node, key)
            if value is None:
                return SecurityConfig()
            raise doc.error(key, f"must be a map like {{curve: true, keys: DIR}}, got {show_value(value)}", node)
        given: dict[str, object] = {}
        for field, value_node in doc.mapping(node, key):
            if field not in allowed:
                raise doc.error(f"{key}.{field}", f"unknown security key{suggest(field, allowed)}")
            given[field] = doc.value(value_node, f"{key}.{field}")
        keys = given.get("keys")
        if isinstance(keys, str) and keys and doc.source != MEMORY:  # relative to the cluster file
            base = os.path.dirname(os.path.abspath(doc.source))
            given["keys"] = os.path.join(base, os.path.expanduser(keys))
        return doc.build(SecurityConfig, given, key)

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, SecurityConfig):
            yield "", f"must be a SecurityConfig, got {show_value(value)}"

    def dump(self, value: object) -> object:
        return dataclasses.asdict(value)  # type: ignore[call-overload]


SHARED_MEMORY_MODES = ("auto", "off")  # transport.shared_memory
MEMORY_MODES = ("normal", "low")  # transport.memory
MAX_MIX_THREADS = 64  # transport.mix_threads


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """The ``transport`` key. ``shared_memory: auto`` (the default): a node answers a co-located peer's fetch with
    its snapshot's shared-memory segment instead of sending it (dpwa/node/sharedmem.py); with ``security.curve``
    on, only a peer that authenticated as the node it names. ``off``: sockets only.

    ``mix_threads: auto`` (the default): a large mix (an array of 1M elements or more) splits over the node's share
    of the cores (:func:`dpwa.utils.cores.mix_thread_count`; the same bits as one thread: dpwa/rules/workers.py);
    ``N``: N threads.

    ``memory: normal`` (the default): a pool of snapshot buffers (3, more while all are busy), so publishing never
    waits for a peer. ``low``: one snapshot buffer, rewritten in place once the sends of the last one ended (the
    trainer waits for them at most ``timeout_ms``, else peers keep the last snapshot); a co-located reader copies
    the snapshot out of the segment and gives it back at once instead of mixing from it."""

    shared_memory: str = choice("auto", SHARED_MEMORY_MODES)
    memory: str = choice("normal", MEMORY_MODES, omit_default=True)
    mix_threads: str | int = setting("auto", spec=AutoOrCount(1, MAX_MIX_THREADS), omit_default=True)

    def __post_init__(self) -> None:
        validate(self, error_in_memory)


_OUTER_SHAPE = "a map like {every: 8, lr: 0.7, momentum: 0.9, nesterov: true} ({} for the defaults), or null"


@dataclasses.dataclass(frozen=True)
class _SettingsMap(Spec):
    """A map of one settings dataclass's fields (``{}``: its defaults); null gives ``empty`` (None: the feature is
    off, e.g. no outer optimizer). ``shape``: an example map for the error message."""

    cls: type
    what: str
    shape: str
    empty: object = None

    def read(self, doc: FileReader, node: yaml.Node, key: str) -> object:
        allowed = [f.name for f in dataclasses.fields(self.cls)]
        if not isinstance(node, yaml.MappingNode):
            value = doc.value(node, key)
            if value is None:
                return self.empty
            raise doc.error(key, f"must be {self.shape}, got {show_value(value)}", node)
        given: dict[str, object] = {}
        for field, value_node in doc.mapping(node, key):
            if field not in allowed:
                raise doc.error(f"{key}.{field}", f"unknown {self.what}{suggest(field, allowed)}")
            value = doc.value(value_node, f"{key}.{field}")
            given[field] = "off" if value is False and self.cls is TransportConfig else value  # YAML 1.1: off = false
        return doc.build(self.cls, given, key)

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, self.cls) and not (value is None and self.empty is None):
            yield (
                "",
                f"must be a {self.cls.__name__}{' or None' if self.empty is None else ''}, got {show_value(value)}",
            )

    def dump(self, value: object) -> object:
        """The map's fields, less those declared ``omit_default`` that hold their default (keys added after files
        were written: a file dumped here stays readable by the dpwa that wrote the older ones)."""
        if value is None:
            return None
        fields = dataclasses.fields(value)  # type: ignore[arg-type]
        return {f.name: getattr(value, f.name) for f in fields if not omits_default(f, getattr(value, f.name))}


@dataclasses.dataclass(frozen=True)
class _Nodes(Spec):
    """A sequence of NodeSpec with unique names and unique host:port pairs; empty: the nodes come from an
    engine (``dpwa run -n N``, SLURM, torchrun), see :meth:`ClusterConfig.with_nodes`."""

    def read(self, doc: FileReader, node: yaml.Node, key: str) -> object:
        return doc.nodes(node, key)

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, (list, tuple)):
            yield "", f"must list at least one node ({{name, host, port}} maps), got {show_value(value)}"
            return
        names: dict[str, int] = {}
        for i, node in enumerate(value):
            if not isinstance(node, NodeSpec):
                yield f"[{i}]", f"must be a NodeSpec, got {show_value(node)}"
                return
            if node.name in names:
                first = names[node.name]
                yield (
                    f"[{i}].name",
                    f"duplicate node name {node.name!r} (also nodes[{first}]); names must be unique",
                )
            names.setdefault(node.name, i)
        for i, reason in address_clashes(value):
            yield f"[{i}]", reason
        size = table_bytes(value)
        if size > TABLE_BUDGET_BYTES:
            yield (
                "",
                f"{len(value)} nodes take {size} bytes in the member table every node sends, over the "
                f"{TABLE_BUDGET_BYTES} a message carries: list fewer nodes, or give them shorter names and hosts",
            )

    def coerce(self, value: object) -> object:
        return tuple(value)  # type: ignore[arg-type]

    def dump(self, value: object) -> object:
        return [dataclasses.asdict(node) for node in value]  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster: its nodes, exchange settings and one settings object per rule.

    Each field declared with ``setting`` or ``choice`` is a top-level key of the cluster file, in this order;
    ``rule_settings`` is spread over one top-level key per rule name (:data:`dpwa.rules.RULES`), and
    ``source`` and ``marks`` say where the file came from.
    """

    # The top-level keys, in file order, one line each: the field's spec says how it is read and checked.
    #: Empty (the key left out): the nodes come from an engine (dpwa.engines) and :meth:`with_nodes`.
    nodes: tuple[NodeSpec, ...] = setting((), spec=_Nodes(), omit_default=True)
    fetch_probability: float = setting(1.0, lo=0, hi=1)
    timeout_ms: float = setting(2500.0, lo=0, lo_open=True, hi=1000 * MAX_WAIT_S)
    interpolation: str = choice("constant", RULES)
    divergence_threshold: float = setting(0.0, lo=0)
    peers: str = choice("auto", PEER_SCHEDULES)
    #: ``auto``: every array travels in its own dtype; else the dtype that arrays wider than it travel in
    #: (rounded to nearest even when published, widened exactly when received); ``int8``: every float array
    #: travels as blockwise int8 with float32 scales (dpwa/utils/int8.py).
    wire_dtype: str = choice("auto", ("auto", *WIRE_DTYPES), omit_default=True)
    #: The outer optimizer (SlowMo, DiLoCo; dpwa/rules/outer.py): exchange every ``every``-th step only, and there
    #: step the mixed model's motion since the last such step with Nesterov momentum; None: every step mixes.
    outer: OuterSettings | None = setting(
        None, spec=_SettingsMap(OuterSettings, "outer setting", _OUTER_SHAPE), omit_default=True
    )
    security: SecurityConfig = setting(SecurityConfig(), spec=_Security(), omit_default=True)
    #: How snapshots travel: ``{shared_memory: auto|off}`` (co-located peers read them in shared memory).
    transport: TransportConfig = setting(
        TransportConfig(),
        spec=_SettingsMap(TransportConfig, "transport key", "a map like {shared_memory: off}", TransportConfig()),
        omit_default=True,
    )
    #: Checkpoint every this many steps into <run_dir>/checkpoints/ (0 = never); dpwa/checkpoint.py.
    checkpoint_every: int = setting(0, lo=0, integer=True, omit_default=True)
    #: ``peer``: before its first step a node copies a peer's model (dpwa/node/recovery.py); ``none``: it does not.
    bootstrap: str = choice("none", BOOTSTRAP_MODES, omit_default=True)
    #: How long a bootstrapping node looks for a peer before it trains from its own state.
    bootstrap_timeout_s: float = setting(10.0, lo=0, lo_open=True, hi=MAX_WAIT_S, omit_default=True)
    #: "Far behind": a first reply whose clock is more than this ahead is copied outright (0 = never).
    bootstrap_gap: float = setting(100.0, lo=0, omit_default=True)
    #: Push rules (pushsum, adpsgd): how many pushes a node's inbox holds unmixed (one model-sized buffer each).
    inbox_slots: int = setting(4, lo=1, hi=64, integer=True, omit_default=True)
    #: Push rules: how many of those one sender may fill; update_wait mixes one per sender, its oldest. 0: the
    #: default, 2 or ``inbox_slots`` if that is smaller (:attr:`per_sender_limit`).
    inbox_per_sender: int = setting(0, lo=0, hi=64, integer=True, omit_default=True)
    #: Engines that choose the ports (SLURM): a node listens on base_port + its index among its host's tasks;
    #: None: derived from the job and step (:func:`dpwa.engines.slurm.derived_base_port`).
    base_port: int | None = setting(None, spec=_OptionalPort(), omit_default=True)
    #: ``[NAME@]HOST:PORT`` of any member of a running cluster: this file's nodes join it (docs/membership.md);
    #: ``nodes`` then lists only the joining nodes' own addresses (or is left out: the engine gives them).
    join: str = setting("", spec=JoinSpec(), omit_default=True)
    #: How long a joining node keeps asking the member at ``join`` before it gives up (an error).
    join_timeout_s: float = setting(30.0, lo=0, lo_open=True, hi=MAX_WAIT_S, omit_default=True)
    #: A joined member down (suspected or left) this long is forgotten; the file's nodes never are.
    forget_after_s: float = setting(60.0, lo=0, lo_open=True, hi=MAX_WAIT_S, omit_default=True)
    #: At most this many joined members in a node's table (a flood of forged entries costs no more).
    max_members: int = setting(256, lo=0, hi=MAX_JOINED, integer=True, omit_default=True)
    rule_settings: Mapping[str, object] = dataclasses.field(default_factory=dict, hash=False)
    source: str = dataclasses.field(default=MEMORY, compare=False)
    #: 1-based line of each key path in ``source`` ("nodes", "nodes[1].port", ...); empty if built in memory.
    marks: Mapping[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "marks", MappingProxyType(dict(self.marks)))
        validate(self, self.error)
        if self.join and self.security.curve and not parse_join(self.join).name:
            raise self.error("join", "with security.curve on, name the member to join: NAME@HOST:PORT (its key)")
        if self.inbox_per_sender > self.inbox_slots:
            raise self.error(
                "inbox_per_sender", f"must be at most inbox_slots ({self.inbox_slots}), got {self.inbox_per_sender}"
            )
        object.__setattr__(self, "rule_settings", MappingProxyType(self._every_rules_settings()))
        rule = RULES[self.interpolation]
        if self.peers != "auto" and self.peers not in rule.allowed_schedules:
            raise self.error(
                "peers",
                f"schedule {self.peers!r} does not fit interpolation {self.interpolation!r}; "
                f"allowed with {self.interpolation}: auto (= {rule.default_schedule}), "
                f"{', '.join(rule.allowed_schedules)}",
            )
        if rule.wire_exact and self.wire_dtype != "auto":
            raise self.error(
                "wire_dtype",
                f"interpolation {self.interpolation!r} needs its snapshots bit for bit ({rule.wire_exact}); "
                "leave wire_dtype at auto",
            )
        if getattr(self.settings, "bipartite", False):
            self._check_bipartite()
        if self.outer and self.interpolation in _NOT_UNDER_OUTER:
            raise self.error(
                "outer",
                f"does not fit interpolation {self.interpolation!r} (docs/rules.md): "
                f"{_NOT_UNDER_OUTER[self.interpolation]}; under the outer optimizer a node publishes at every step "
                "while its neighbours fetch only every `every`-th; leave outer out",
            )
        graph = getattr(self.settings, "graph", None)
        hazard = momentum_hazard(self.interpolation, self.schedule, graph) if self.outer and self.outer.momentum else ""
        if hazard:
            ways = {"adpsgd": "", "dpsgd": " or graph: ring"}
            way_out = ways.get(self.interpolation, " or another schedule than ring")
            raise self.error("outer.momentum", f"{hazard} (docs/rules.md); use momentum: 0{way_out}")
        self._check_public_keys()

    def _check_bipartite(self) -> None:
        """``bipartite``: an active node picks its passive peer at random (a joining file may say it too: its nodes
        learn the cluster file's order from their JOIN's answer and take the role their names give them)."""
        key = f"{self.interpolation}.bipartite"
        if self.schedule != "random":
            raise self.error(
                key, f"an active node picks a passive peer at random: it takes peers random, not {self.peers}"
            )

    def _every_rules_settings(self) -> dict[str, object]:
        """``rule_settings`` checked (each an instance of its rule's ``settings_class``), with the defaults of
        every rule not given, in :data:`dpwa.rules.RULES` order."""
        given = dict(self.rule_settings)
        for name, obj in given.items():
            if name not in RULES:
                raise self.error(name, f"unknown rule{suggest(name, RULES)}")
            cls = RULES[name].settings_class
            if not isinstance(obj, cls):
                raise self.error(name, f"must be a {cls.__name__}, got {show_value(obj)}")
        return {name: given[name] if name in given else rule.settings_class() for name, rule in RULES.items()}

    def _check_public_keys(self) -> None:
        """With ``security.curve``: every node's public key is readable (node names can name key files: every name
        can, :class:`~dpwa.utils.settings.NodeName`)."""
        keys = self.security.keys
        if not self.security.curve or keys is None:
            return
        names = [node.name for node in self.nodes]
        hint = f"; generate with `dpwa keys generate {{}} --dir {keys}` and copy every NAME.key to every machine"
        if not os.path.isdir(keys):
            raise self.error("security.keys", f"key directory {keys} does not exist" + hint.format(" ".join(names)))
        missing = [name for name in names if not os.path.lexists(public_path(keys, name))]
        if missing:
            files = ", ".join(public_path(keys, name).name for name in missing)
            raise self.error("security.keys", f"no public key {files} in {keys}" + hint.format(" ".join(missing)))
        owners: dict[bytes, str] = {}
        for name in names:
            try:
                public, _ = read_key_file(public_path(keys, name))
            except KeyFileError as err:
                raise self.error("security.keys", str(err)) from None
            if public in owners:
                reason = f"nodes {owners[public]!r} and {name!r} have the same public key; every node needs its own"
                raise self.error("security.keys", reason)
            owners[public] = name

    def public_key_files(self) -> dict[str, str]:
        """Node name -> the path of its public key file ``NAME.key`` in ``security.keys`` (checked at load)."""
        keys = self.security.keys
        if not self.security.curve or keys is None:
            raise self.error("security", "security.curve is off: no keys are used")
        return {node.name: str(public_path(keys, node.name)) for node in self.nodes}

    def check_secret_key(self, name: str) -> str:
        """The path of node ``name``'s secret key file, checked: it exists, holds a key pair, and that
        pair's public key is ``name``'s public key file. ConfigError at ``security.keys`` otherwise.

        Only meaningful with ``security.curve`` on; a node calls it when it starts (a machine needs
        only the secret keys of the nodes it runs).
        """
        self.node(name)
        keys = self.security.keys
        if not self.security.curve or keys is None:
            raise self.error("security", "security.curve is off: no keys are used")
        path = secret_path(keys, name)
        try:
            public, _ = read_key_file(path, secret=True)
            listed, _ = read_key_file(public_path(keys, name))
        except KeyFileError as err:
            hint = (
                f"; the machine that runs {name!r} needs it: copy it there, or make a new pair with "
                f"`dpwa keys generate {name} --dir {keys} --force` and give every machine the new {name}.key"
            )
            raise self.error("security.keys", str(err) + hint) from None
        if public != listed:
            reason = f"{path} does not belong to {public_path(keys, name)}: its public key differs"
            raise self.error("security.keys", reason + "; regenerate the pair or copy the matching files")
        return str(path)

    @property
    def schedule(self) -> str:
        """The peer schedule in force: ``peers``, or the rule's default when ``peers`` is ``auto``."""
        return RULES[self.interpolation].default_schedule if self.peers == "auto" else self.peers

    def __reduce__(self) -> tuple[Callable[[], ClusterConfig], tuple[()]]:
        """Pickle (e.g. for spawned workers) as a constructor call: read-only mappings cannot be pickled."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(rule_settings=dict(self.rule_settings), marks=dict(self.marks))
        return functools.partial(ClusterConfig, **fields), ()

    def error(self, key: str, reason: str) -> ConfigError:
        """A ConfigError for ``key`` at its line in ``source`` (else at its closest enclosing key's)."""
        return ConfigError(reason, self.source, line_of(self.marks, key), key)

    @property
    def per_sender_limit(self) -> int:
        """How many of the inbox's slots one sender may fill: ``inbox_per_sender``, or 2 (at most ``inbox_slots``)."""
        return self.inbox_per_sender or min(DEFAULT_PER_SENDER, self.inbox_slots)

    @property
    def join_address(self) -> JoinAddress | None:
        """The member to join (the ``join`` setting), or None: this file's nodes are the cluster."""
        return parse_join(self.join) if self.join else None

    def with_join(self, join: str) -> ClusterConfig:
        """This config joining the cluster at ``join`` (``[NAME@]HOST:PORT``; ConfigError when malformed)."""
        return dataclasses.replace(self, join=join)

    def with_nodes(self, nodes: Sequence[NodeSpec]) -> ClusterConfig:
        """This config with ``nodes`` (from an engine), validated like a file's (ConfigError)."""
        return dataclasses.replace(self, nodes=tuple(nodes))

    def node(self, name: str) -> NodeSpec:
        """The node called ``name``; if none, a ConfigError at the ``nodes`` line listing the names."""
        for node in self.nodes:
            if node.name == name:
                return node
        if not self.nodes:
            raise self.error(
                "nodes",
                f"no nodes yet (node {name!r} asked for): the cluster file has no `nodes` and none came from an "
                "engine (dpwa run -n N, srun, torchrun)",
            )
        names = [node.name for node in self.nodes]
        raise self.error("nodes", f"no node named {name!r}{suggest(name, names)}")

    def peers_of(self, name: str) -> tuple[NodeSpec, ...]:
        """Every node but ``name``, in file order (ConfigError if ``name`` is not a node)."""
        self.node(name)
        return tuple(node for node in self.nodes if node.name != name)

    @property
    def settings(self) -> object:
        """The settings object of the selected ``interpolation`` rule."""
        return self.rule_settings[self.interpolation]

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data in the mapping format; its YAML parses back to ``self``.

        Keys added after the sample files were written (``wire_dtype``) appear only when not at their default.
        """
        out = {
            f.name: field_spec(f).dump(getattr(self, f.name))
            for f in top_level_fields()
            if not omits_default(f, getattr(self, f.name))
        }
        rules: Mapping[str, Any] = self.rule_settings
        return out | {name: dataclasses.asdict(obj) for name, obj in rules.items()}


def top_level_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`ClusterConfig` that are cluster-file keys (those with a spec), in file order."""
    return tuple(f for f in dataclasses.fields(ClusterConfig) if spec_of(f) is not None)


def field_spec(field: dataclasses.Field[Any]) -> Spec:
    """The spec of a top-level field (every one has one)."""
    spec = spec_of(field)
    assert spec is not None, field.name
    return spec


def line_of(marks: Mapping[str, int], key: str) -> int | None:
    """Line of ``key``, else of its closest enclosing key ("nodes[1].port" -> "nodes[1]" -> "nodes" -> "")."""
    while True:
        if key in marks:
            return marks[key]
        if not key:
            return None
        key = key[: max(key.rfind("."), key.rfind("["), 0)]
