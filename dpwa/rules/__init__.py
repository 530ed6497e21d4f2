"""Interpolation rules: the registry and the factory the connection uses.

Each rule module declares, beside its rule class, the rule's settings dataclass
(``ConstantSettings`` beside ``ConstantRule``, fields declared with
:func:`dpwa.utils.settings.setting`); the rule class names it in
:attr:`Rule.settings_class` and names the peer schedules it works with in
:attr:`Rule.allowed_schedules` and :attr:`Rule.default_schedule`.
:data:`RULES` maps each rule's name to its class, and is all that ``dpwa.config``
reads to know the rules: their names (the ``interpolation`` key), their settings
keys and their schedules (the ``peers`` key). Adding a rule is one module with
its settings and rule class, and one entry in :data:`RULES`.

Any rule can run under the outer optimizer of :mod:`dpwa.rules.outer` (SlowMo, DiLoCo), which wraps the rule
and its schedule: it is not a rule of :data:`RULES` but the cluster file's ``outer`` key.

Rules never import ``dpwa.config``: :func:`make_rule` takes the rule's settings
as any dataclass instance (or a mapping, or None) and passes its fields as
constructor keyword arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from dpwa.rules.adpsgd import AdpsgdRule, AdpsgdSettings
from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, Transfer
from dpwa.rules.choco import ChocoRule, ChocoSettings
from dpwa.rules.dpsgd import DpsgdRule, DpsgdSettings
from dpwa.rules.gem import GemRule, GemSettings
from dpwa.rules.group import GroupRule, GroupSettings
from dpwa.rules.gt import GtRule, GtSettings
from dpwa.rules.leader import LeaderRule, LeaderSettings
from dpwa.rules.outer import OuterRule, OuterSchedule, OuterSettings, momentum_hazard
from dpwa.rules.pairwise import (
    ClockRule,
    ClockSettings,
    ConstantRule,
    ConstantSettings,
    LossRule,
    LossSettings,
    PairwiseRule,
)
from dpwa.rules.pushsum import PushSumRule, PushSumSettings

__all__ = [
    "RULES",
    "AdpsgdRule",
    "AdpsgdSettings",
    "ChocoRule",
    "ChocoSettings",
    "ClockRule",
    "ClockSettings",
    "ConstantRule",
    "ConstantSettings",
    "DpsgdRule",
    "DpsgdSettings",
    "GemRule",
    "GemSettings",
    "GroupRule",
    "GroupSettings",
    "GtRule",
    "GtSettings",
    "LeaderRule",
    "LeaderSettings",
    "LossRule",
    "LossSettings",
    "MixOutcome",
    "NodeState",
    "OuterRule",
    "OuterSchedule",
    "OuterSettings",
    "PairwiseRule",
    "PeerSnapshot",
    "PushSumRule",
    "PushSumSettings",
    "Rule",
    "Transfer",
    "make_rule",
    "momentum_hazard",
]

RULES: dict[str, type[Rule]] = {
    cls.name: cls
    for cls in (
        ConstantRule,
        ClockRule,
        LossRule,
        GemRule,
        PushSumRule,
        LeaderRule,
        GroupRule,
        AdpsgdRule,
        DpsgdRule,
        GtRule,
        ChocoRule,
    )
}
"""Rule name -> rule class, in the order the cluster file's error messages list the rules; each class
carries its settings dataclass and its schedules (:class:`Rule`)."""


def _settings_kwargs(settings: object) -> dict[str, Any]:
    if settings is None:
        return {}
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return dataclasses.asdict(settings)
    if isinstance(settings, Mapping):
        return dict(settings)
    raise TypeError(f"rule settings must be a dataclass instance, a mapping or None, got {type(settings).__name__}")


def make_rule(name: str, settings: object, divergence_threshold: float) -> Rule:
    """Build ``RULES[name](**fields(settings), divergence_threshold=divergence_threshold)``.

    ``settings`` is a dataclass instance (fields via ``dataclasses.asdict``), a
    mapping, or None (defaults).  Raises ValueError for an unknown rule name
    (listing the allowed ones), for a settings field the rule does not accept
    (listing the accepted ones), for ``divergence_threshold`` inside
    ``settings`` (it is a separate argument), and for out-of-range values.
    """
    try:
        cls = RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown interpolation rule {name!r}; allowed: {', '.join(sorted(RULES))}") from None
    kwargs = _settings_kwargs(settings)
    if "divergence_threshold" in kwargs:
        raise ValueError(f"rule {name!r}: divergence_threshold is a global setting, not a rule setting")
    accepted = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "divergence_threshold"
    ]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"rule {name!r} does not accept {', '.join(unknown)}; accepted: {', '.join(accepted) or '(none)'}"
        )
    return cls(**kwargs, divergence_threshold=divergence_threshold)
