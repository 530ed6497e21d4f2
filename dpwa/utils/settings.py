"""Checked settings dataclasses: each field says what it allows, and the object checks itself when built.

A field is declared with :func:`setting` (a number in a range, or any :class:`Spec` given as
``spec=``) or :func:`choice` (one of a set of words, shorthand for ``setting(default, spec=Choice(...))``)::

    @dataclasses.dataclass(frozen=True)
    class ConstantSettings(Settings):
        value: float = setting(0.5, lo=0, hi=1)
        repeats: str = choice("skip", ("skip", "mix"))

``ConstantSettings(value=2)`` then raises :class:`SettingError` (``key="value"``,
``reason="must be a number in [0, 1], got 2"``); valid values are normalized (a number becomes a float
unless the field is an integer). The rules declare their settings this way (``dpwa.rules``), and so does
``dpwa.config`` for the cluster file's keys: it passes :func:`validate` a callback that turns a problem
into its own ``ConfigError`` with the file and line, and reads a field's YAML through :meth:`Spec.read`.

This module imports nothing but the standard library, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

__all__ = [
    "CLIP_CHARS",
    "AutoOrCount",
    "Choice",
    "Flag",
    "HostName",
    "NAME_PATTERN",
    "NodeName",
    "Number",
    "RESERVED_NAMES",
    "Reader",
    "SettingError",
    "Settings",
    "Spec",
    "choice",
    "clipped",
    "omits_default",
    "setting",
    "show_value",
    "spec_of",
    "suggest",
    "validate",
]

_SPEC = "dpwa.settings.spec"  # dataclasses.field metadata key: the field's Spec
_OMIT_DEFAULT = "dpwa.settings.omit_default"  # field metadata key: leave the key out of a dump while at its default


class SettingError(ValueError):
    """A field's value is not allowed: ``key`` names the field (``"value"``, ``"nodes[1].port"``), ``reason``
    says what is allowed and what was given. ``str(err)`` is ``"<key>: <reason>"``."""

    def __init__(self, reason: str, key: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.key = key or None

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}" if self.key else self.reason

    def __reduce__(self) -> tuple[type[SettingError], tuple[str, str | None]]:
        return type(self), (self.reason, self.key)


class Reader(Protocol):
    """What :meth:`Spec.read` needs of a file reader: the plain Python value of one parsed node."""

    def value(self, node: Any, key: str) -> object: ...


class Spec:
    """How one field is read from a file, what it allows and how it is written back.

    ``check`` yields (sub-key, reason) per problem (the sub-key is appended to the field's name:
    ``"[1].port"``); ``coerce`` normalizes a valid value; ``dump`` gives plain data to write.
    """

    def read(self, reader: Reader, node: Any, key: str) -> object:
        """The Python value of ``key``'s parsed ``node`` (checked later by :meth:`check`)."""
        return reader.value(node, key)

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        return iter(())

    def coerce(self, value: object) -> object:
        return value

    def dump(self, value: object) -> object:
        """The value as plain data (what YAML or JSON can hold)."""
        return value


@dataclasses.dataclass(frozen=True)
class Number(Spec):
    """A finite real number (never a bool) in an optionally open/closed range; optionally an integer."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def allowed(self) -> str:
        """E.g. ``"a number in [0, 1]"``, ``"a number > 0"``, ``"an integer in [1, 65535]"``."""
        noun = "an integer" if self.integer else "a number"
        lo, hi = (None if b is None else _bound(b) for b in (self.lo, self.hi))
        if lo is not None and hi is not None:
            return f"{noun} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if lo is not None:
            return f"{noun} {'>' if self.lo_open else '>='} {lo}"
        if hi is not None:
            return f"{noun} {'<' if self.hi_open else '<='} {hi}"
        return noun

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not self._ok(value):
            yield "", f"must be {self.allowed()}, got {show_value(value)}"

    def _ok(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        try:
            if not math.isfinite(value):  # also rules out ints too large for a float
                return False
        except OverflowError:
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def coerce(self, value: object) -> object:
        return value if self.integer else float(value)  # type: ignore[arg-type]


def _bound(b: float) -> str:
    """A range's bound as written: ``86400000`` (not ``8.64e+07``), ``0.5``, ``1e-12``."""
    return str(int(b)) if float(b).is_integer() and abs(b) < 1e16 else f"{b:g}"


@dataclasses.dataclass(frozen=True)
class Choice(Spec):
    """One of a set of strings. ``options`` is read at every check, so it may be a live mapping (a registry
    whose keys are the names) that grows after the field was declared."""

    options: Iterable[str]

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        names = list(self.options)
        if not isinstance(value, str):
            yield "", f"must be one of: {', '.join(names)}, got {show_value(value)}"
        elif value not in names:
            yield "", f"unknown value {clipped(value)}{suggest(value, names)}"


@dataclasses.dataclass(frozen=True)
class AutoOrCount(Spec):
    """``auto`` (the program decides) or a whole number in ``[lo, hi]`` (never a bool)."""

    lo: int = 1
    hi: int = 64

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if value == "auto":
            return
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            yield "", f"must be auto or an integer in [{self.lo}, {self.hi}], got {show_value(value)}"


@dataclasses.dataclass(frozen=True)
class HostName(Spec):
    """A node's host: an IPv4 address (four decimal octets) or a host name: dot-separated labels of letters, digits,
    ``-`` and ``_`` (1-63 characters, no ``-`` at either end), at most 253 characters, a final dot allowed. Nodes
    bind and connect over IPv4 (the host is resolved as IPv4), and ``host:port`` is how addresses are written, so an
    IPv6 literal is refused here."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, str) or not value or not value.isascii() or not value.isprintable() or " " in value:
            yield "", f"must be an IPv4 address or a host name (ASCII, no spaces), got {show_value(value)}"
        elif "://" in value:
            yield "", f"must be a host name or an IPv4 address, not a URL, got {clipped(value)}"
        elif ":" in value:
            yield (
                "",
                (
                    "a host only (the port is the node's `port`), and IPv6 is not supported: give an IPv4 "
                    f"address or a host name, got {clipped(value)}"
                ),
            )
        elif _IPV4_LIKE.fullmatch(value):
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                yield "", f"not an IPv4 address (four numbers 0-255, no leading zeros), got {clipped(value)}"
        elif len(value.removesuffix(".")) > 253 or not all(
            _HOST_LABEL.fullmatch(label) for label in value.removesuffix(".").split(".")
        ):
            yield (
                "",
                (
                    "must be an IPv4 address or a host name (labels of letters, digits, '-' and '_' joined by dots, "
                    f"1-63 characters each, no '-' at either end, at most 253 in all), got {clipped(value)}"
                ),
            )


_IPV4_LIKE = re.compile(r"[0-9.]+")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
"""A node's name: letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit, at most 128 characters. It
names files (its log, metrics, model and key files), so it never names a path outside their directory."""
RESERVED_NAMES = {
    "evaluate": "dpwa run's evaluation step writes evaluate.log",
    "averaged": "dpwa average writes averaged.model.npz",
}
"""Names a node cannot take, and why: files the launcher and ``dpwa average`` write beside the nodes' own."""


@dataclasses.dataclass(frozen=True)
class NodeName(Spec):
    """A node's name (:data:`NAME_PATTERN`, not one of :data:`RESERVED_NAMES`)."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, str) or not NAME_PATTERN.match(value):
            yield (
                "",
                (
                    "must be letters, digits, '.', '_' or '-', starting with a letter or digit, at most 128 characters "
                    f"(it names the node's files), got {show_value(value)}"
                ),
            )
        elif value in RESERVED_NAMES:
            yield "", f"{value!r} is reserved ({RESERVED_NAMES[value]}); choose another name"


@dataclasses.dataclass(frozen=True)
class Flag(Spec):
    """``true`` or ``false`` (a bool; 0 and 1 are not flags)."""

    def check(self, value: object) -> Iterator[tuple[str, str]]:
        if not isinstance(value, bool):
            yield "", f"must be true or false, got {show_value(value)}"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
    spec: Spec | None = None,
    omit_default: bool = False,
) -> Any:
    """A dataclass field whose :class:`Spec` travels in its metadata (checked by :func:`validate`).

    Without ``spec`` the field is a :class:`Number` bounded by ``lo``/``hi`` (``*_open``: the bound itself is
    not allowed) and, with ``integer``, whole. ``omit_default``: a dump leaves the key out while it holds its
    default (for keys added after files were written, so those files round-trip unchanged).
    """
    if spec is None:
        spec = Number(lo, hi, lo_open, hi_open, integer)
    elif (lo, hi, lo_open, hi_open, integer) != (None, None, False, False, False):
        raise TypeError("setting(): give either a spec or numeric bounds, not both")
    return dataclasses.field(default=default, metadata={_SPEC: spec, _OMIT_DEFAULT: omit_default})


def choice(default: Any, options: Iterable[str], *, omit_default: bool = False) -> Any:
    """A string field that must be one of ``options``: ``setting(default, spec=Choice(options))``."""
    return setting(default, spec=Choice(options), omit_default=omit_default)


def _setting_error(key: str, reason: str) -> SettingError:
    return SettingError(reason, key)


def spec_of(field: dataclasses.Field[Any]) -> Spec | None:
    """The :class:`Spec` of a field made by :func:`setting` or :func:`choice`; None for any other field."""
    return field.metadata.get(_SPEC)


def omits_default(field: dataclasses.Field[Any], value: object) -> bool:
    """True when a dump should leave ``field`` out: it was declared with ``omit_default`` and holds its default."""
    return bool(field.metadata.get(_OMIT_DEFAULT)) and value == field.default


def validate(obj: Any, on_error: Callable[[str, str], Exception] | None = None) -> None:
    """Check, then normalize, every field of dataclass ``obj`` that has a :class:`Spec`, in field order.

    The first problem raises ``on_error(key, reason)`` (default: :class:`SettingError`); ``key`` is the field's
    name plus the spec's sub-key. ``obj`` may be frozen: normalized values are set with ``object.__setattr__``.
    """
    on_error = on_error or _setting_error
    for f in dataclasses.fields(obj):
        spec = spec_of(f)
        if spec is None:
            continue
        value = getattr(obj, f.name)
        for sub, reason in spec.check(value):
            raise on_error(f.name + sub, reason)
        object.__setattr__(obj, f.name, spec.coerce(value))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of a rule's settings: the fields made by :func:`setting` or :func:`choice` are checked when the
    object is built (:class:`SettingError` naming the field)."""

    def __post_init__(self) -> None:
        validate(self)


# --------------------------------------------------------------------------- error-message helpers


def suggest(word: object, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?); allowed: a, b, c`` -- the tail of every "unknown ..." message."""
    options = list(options)
    close = difflib.get_close_matches(word, options, n=1) if isinstance(word, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; allowed: {', '.join(options)}"


def show_value(value: object) -> str:
    """A short description of a value for error messages, e.g. ``true (a boolean)``, ``'0.5' (a string; ...)``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"{clipped(value)} (a string{_NUMBER_HINT if _looks_numeric(value) else ''})"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return f"a {type(value).__name__} value"


_NUMBER_HINT = "; write numbers unquoted"
CLIP_CHARS = 80
"""The most characters of a value an error message repeats."""


def clipped(text: str) -> str:
    """``repr(text)``, its middle left out beyond :data:`CLIP_CHARS` characters (a 2 MB value makes no message)."""
    if len(text) <= CLIP_CHARS:
        return repr(text)
    half = CLIP_CHARS // 2
    return f"{text[:half]!r}...{text[-half:]!r} ({len(text)} characters)"


def _looks_numeric(text: str) -> bool:
    """True for text such as ``"0.5"`` that is a number unquoted (not ``1_000``, which YAML 1.2 reads as text)."""
    if "_" in text:
        return False
    try:
        float(text)
    except ValueError:
        return False
    return any(c.isdigit() for c in text)
