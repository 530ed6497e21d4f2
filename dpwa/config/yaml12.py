"""PyYAML's safe loader with YAML 1.2's numbers: what a cluster file's numbers mean does not depend on YAML 1.1.

PyYAML resolves plain scalars by YAML 1.1, whose numbers surprise: ``04500`` is the octal 2368, ``46_101`` is 46101,
``12:30`` the base-60 750, ``0b101`` binary, while ``1e3`` is the *string* ``"1e3"``. YAML 1.2's core schema, which
this module's :class:`Loader` and :class:`Constructor` apply, reads:

* integers ``[-+]?[0-9]+`` in decimal (``04500`` is 4500), ``0o[0-7]+`` in octal, ``0x[0-9a-fA-F]+`` in hex;
* floats ``[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?`` (``1e3`` is 1000.0), ``.inf``, ``-.inf``, ``.nan``;
* everything else (``46_101``, ``12:30``, ``0b101``) as a string, which a number's check then refuses.

Booleans keep YAML 1.1's spellings (``yes``/``no``/``on``/``off`` besides ``true``/``false``): a file may say
``shared_memory: off``. An integer of more than :data:`MAX_DIGITS` digits is refused as such. :func:`dump` writes
with the same resolvers, so a string that YAML 1.2 would read as a number (a node named ``08`` or ``1e5``) is
quoted, and every file dpwa writes reads back as it was (:func:`load`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

__all__ = ["MAX_DIGITS", "Constructor", "Dumper", "Loader", "dump", "load"]

MAX_DIGITS = 100
"""The most digits an integer in a cluster file may have (no setting needs more than 20)."""

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_INT_PATTERN = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_PATTERN = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class Loader(yaml.SafeLoader):
    """The safe loader resolving plain scalars as numbers by YAML 1.2's core schema (module doc)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(_INT, _INT_PATTERN, list("-+0123456789"))  # an int matches before a float
Loader.add_implicit_resolver(_FLOAT, _FLOAT_PATTERN, list("-+0123456789."))


def _construct_int(constructor: SafeConstructor, node: yaml.ScalarNode) -> int:
    """``node``'s integer, read by YAML 1.2: decimal whatever its leading zeros, ``0o``/``0x``; a ConstructorError
    for more than :data:`MAX_DIGITS` digits, or for an explicit ``!!int`` on text 1.2 reads otherwise."""
    text = str(constructor.construct_scalar(node))
    if not _INT_PATTERN.match(text):  # an explicit ``!!int`` on text YAML 1.2 would not read as one (``46_101``)
        raise ConstructorError(None, None, f"not an integer as YAML 1.2 writes one: {text[:40]!r}", node.start_mark)
    digits = text.lstrip("+-")
    if len(digits) > MAX_DIGITS:
        raise ConstructorError(None, None, f"an integer of {len(digits)} digits is too long", node.start_mark)
    if digits.startswith(("0o", "0x")):
        return int(text, 0)  # only 1.2's explicit prefixes reach here unsigned (the resolver's pattern)
    return int(text, 10)  # Python's int() reads leading zeros as decimal, as YAML 1.2 does


class Constructor(SafeConstructor):
    """The safe constructor reading integers by YAML 1.2 (:func:`_construct_int`)."""


Constructor.add_constructor(_INT, _construct_int)
Loader.add_constructor(_INT, _construct_int)


class Dumper(yaml.SafeDumper):
    """The safe dumper quoting every string that :class:`Loader` would read as something else."""


Dumper.yaml_implicit_resolvers = {first: list(resolvers) for first, resolvers in Loader.yaml_implicit_resolvers.items()}


def dump(data: Any, **options: Any) -> str:
    """``data`` as YAML that :func:`load` reads back equal (``options``: :func:`yaml.dump`'s, e.g. ``sort_keys``)."""
    return yaml.dump(data, Dumper=Dumper, **options)


def load(text: str) -> Any:
    """The plain Python data of YAML ``text``, numbers by YAML 1.2 (safe: no tag builds a Python object)."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader
