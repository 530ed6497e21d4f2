"""The outer optimizer -- SlowMo (Wang et al. 2020) and DiLoCo (Douillard et al. 2023) in gossip form; docs/rules.md.

Any rule runs under it. A node trains locally and exchanges nothing for ``every - 1`` steps; at every
``every``-th step (a *boundary*: 0-based step ``k`` with ``(k + 1) % every == 0``) its rule mixes as usual and
the outer step follows, on the *pseudo-gradient* ``delta``, how far the mixed model moved from the *anchor* (the
parameters right after the previous outer step):

    delta    = x_anchor - x_mixed
    m        <- momentum*m + delta
    step     = delta + momentum*m          (nesterov)   or   m   (heavy ball)
    x        <- x_mixed - (lr*step - delta)                     (= x_anchor - lr*step)
    x_anchor <- x

DiLoCo's all-reduce of the pseudo-gradients is the base rule's mix here (NoLoCo, Kolehmainen et al. 2025,
averages with peers in the same way). The new parameters are computed as ``x_mixed - (lr*step - delta)``: with
``lr = 1`` and ``momentum = 0`` the bracket is exactly 0 (``1*delta - delta``) and ``x - 0.0`` keeps every bit of
``x`` (-0.0 included), so the node computes exactly what the base rule alone does. Everything runs in blocks of
:data:`~dpwa.rules.mixing.BLOCK` elements with block-sized scratch; float16/bfloat16 parameters are computed in
float32 and rounded once, and the anchor is then the rounded parameters (widened).

Model-sized state: the anchor and ``m`` (float32 for float16/bfloat16/float32 parameters, float64 for float64;
no ``m`` with ``momentum: 0``), allocated at the first :meth:`OuterRule.mix`, which takes the parameters after
its mix as the first anchor (that mix makes no outer step). A copy of a peer (bootstrap, catch-up) re-anchors at
the next mix and starts ``m`` afresh.

Two wrappers make it: :class:`OuterRule` around the rule (every hook goes to the base rule; :meth:`OuterRule.mix`
counts the steps and adds the outer step on boundaries) and :class:`OuterSchedule` around the schedule (no peers
off the boundaries, so nothing is fetched or pushed there; on a boundary the base schedule's peers for the outer
round ``k // every``, so the exponential graph's hops and the groups' rotation advance once per exchange). Both
count the same steps: the schedule reads the node's step (``Round.index``, ``update_send`` calls before this
one), the rule counts its :meth:`~OuterRule.mix` calls (one per ``update_wait``) and keeps the count in its
checkpoint arrays (``outer_round``), beside ``outer_anchor/<i>`` and ``outer_m/<i>``. Where the node's step
does not come with a mix, the node tells the rule (:mod:`dpwa.node.recovery`): a restored checkpoint sets the
count to the step restored (:meth:`OuterRule.follow`), a catch-up copy in place of a mix counts its step
(:meth:`OuterRule.step_without_mix`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule, Transfer, checked_step
from dpwa.rules.mixing import BLOCK, Scratch, compute_dtype, is_half, narrow, widen
from dpwa.rules.schedules import Round, Schedule
from dpwa.rules.state import load_model_arrays, save_model_arrays
from dpwa.utils.settings import Flag, Settings, setting

__all__ = [
    "ANCHOR_KEY",
    "MOMENTUM_KEY",
    "ROUND_KEY",
    "OuterRule",
    "OuterSchedule",
    "OuterSettings",
    "is_outer_step",
    "momentum_hazard",
    "outer_rule",
    "outer_schedule",
    "outer_settings",
    "outer_step_",
    "with_outer",
]

ANCHOR_KEY = "outer_anchor"
"""Checkpoint arrays of the anchor are named ``outer_anchor/<i>``, of the momentum ``outer_m/<i>``; the steps
counted, one int64, ``outer_round``."""
MOMENTUM_KEY = "outer_m"
ROUND_KEY = "outer_round"


@dataclasses.dataclass(frozen=True)
class OuterSettings(Settings):
    """The cluster file's ``outer`` map: every ``every`` steps, ``m <- momentum*m + delta`` and
    ``x <- x_anchor - lr*step`` with ``step = delta + momentum*m`` (``nesterov``) or ``m``. Defaults: DiLoCo's
    outer optimizer (lr 0.7, Nesterov momentum 0.9), exchanging every 8th step."""

    every: int = setting(8, lo=1, integer=True)
    lr: float = setting(0.7, lo=0, lo_open=True)
    momentum: float = setting(0.9, lo=0, hi=1, hi_open=True)
    nesterov: bool = setting(True, spec=Flag())


def is_outer_step(index: int, every: int) -> bool:
    """True on the steps that exchange and make the outer step: 0-based ``index`` ``every - 1``, ``2*every - 1``..."""
    return (index + 1) % every == 0


def momentum_hazard(rule: str, schedule: str, graph: str | None = None) -> str:
    """Why outer momentum is known to make ``rule`` on ``schedule`` (and its ``graph``, for the ``neighbours``
    schedule) diverge ("" when it is not known to).

    The pseudo-gradient holds the mix's own motion, so the momentum acts on the differences between nodes too; it
    makes them grow where the mix turns them around instead of shrinking them. Measured in the simulator (6 nodes
    from random starts, no training; docs/rules.md): on the directed ``ring`` schedule and D-PSGD's
    ``directed-ring`` graph (both ``W = (I + P)/2``: a rotation of the differences; spread 3.07 -> 1e19 with
    DiLoCo's settings, 8e11 with SlowMo's) and
    with ``adpsgd`` (a node in two exchanges at once keeps no weight of its own: the differences flip sign). In
    lock-step ``adpsgd`` on random peers converges all the same, but asynchronously a node can mix its own exchange
    and two it served in one step (its own weight then -0.5), which lock-step never does: refused on every graph."""
    if rule == "adpsgd":
        return "adpsgd nodes in two exchanges at once flip their differences, and outer momentum makes them grow"
    if schedule == "ring":
        return "on the ring schedule the differences between nodes rotate, and outer momentum makes them grow"
    if graph == "directed-ring":
        return "on the directed ring the differences between nodes rotate, and outer momentum makes them grow"
    return ""


def outer_step_(
    x: np.ndarray,
    anchor: np.ndarray,
    m: np.ndarray | None,
    lr: float,
    momentum: float,
    nesterov: bool,
    scratch: Scratch | None = None,
) -> float:
    """One array, in place: ``delta = anchor - x``, ``m <- momentum*m + delta`` (``m`` None: ``momentum`` is 0 and
    ``step = delta``), ``step = delta + momentum*m`` (``nesterov``) or ``m``, ``x <- x - (lr*step - delta)``,
    ``anchor <- x``. ``anchor`` and ``m`` are in ``x``'s compute dtype (float32 for float16/bfloat16), ``x`` is
    rounded once. Returns ``sum(delta**2)`` (the pseudo-gradient's squared norm)."""
    scratch = scratch if scratch is not None else Scratch()
    c = compute_dtype(x.dtype)
    lr_c, mu_c = c.type(lr), c.type(momentum)
    xv, av = x.reshape(-1), anchor.reshape(-1)
    mv = m.reshape(-1) if m is not None else None
    squares = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite element stays non-finite: no warning
        for start in range(0, xv.size, BLOCK):
            stop = min(start + BLOCK, xv.size)
            mb = mv[start:stop] if mv is not None else None
            squares += _step_block(xv[start:stop], av[start:stop], mb, lr_c, mu_c, nesterov, scratch)
    return squares


def _step_block(
    xb: np.ndarray,
    ab: np.ndarray,
    mb: np.ndarray | None,
    lr: np.generic,
    mu: np.generic,
    nesterov: bool,
    scratch: Scratch,
) -> float:
    """:func:`outer_step_` on one block (``lr`` and ``mu`` in the compute dtype); ``sum(delta**2)``."""
    c, n = ab.dtype, xb.size
    half = is_half(xb.dtype)
    xc = widen(xb, scratch.get(c, n, 0)) if half else xb  # x_mixed in compute precision
    d = np.subtract(ab, xc, out=scratch.get(c, n, 1))  # delta
    squares = float(np.dot(d, d))
    if not math.isfinite(squares):  # float32 overflows first: again in float64 (a rare, large delta)
        squares = float(np.einsum("i,i->", d, d, dtype=np.float64))
    u = scratch.get(c, n, 2)
    step = d
    if mb is not None:
        np.multiply(mb, mu, out=mb)
        np.add(mb, d, out=mb)  # m <- momentum*m + delta
        step = np.add(np.multiply(mb, mu, out=u), d, out=u) if nesterov else mb
    np.multiply(step, lr, out=u)
    np.subtract(u, d, out=u)  # lr*step - delta: exactly 0 with lr = 1 and no momentum
    np.subtract(xc, u, out=xc)
    if half:
        narrow(xc, xb, d)
        widen(xb, ab)  # the anchor is the parameters as rounded
    else:
        np.copyto(ab, xb)
    return squares


class OuterRule(Rule):
    """``base`` under the outer optimizer (module doc-string): every hook is ``base``'s, and so are its name,
    transfer, schedules, mass key and overlap; :meth:`mix` runs ``base``'s mix at every step and, on the
    boundaries, the outer step. Metrics: ``outer_step`` (1 on a boundary, else 0) and, on a boundary,
    ``outer_delta_norm`` (``||x_anchor - x_mixed||``)."""

    settings_class = OuterSettings

    def __init__(
        self, base: Rule, every: int = 8, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True
    ) -> None:
        if isinstance(base, OuterRule):
            raise ValueError("the rule already runs under an outer optimizer")
        super().__init__(base.divergence_threshold)
        checked = OuterSettings(every=every, lr=lr, momentum=momentum, nesterov=nesterov)  # SettingError
        self.base = base
        self.every, self.lr, self.momentum, self.nesterov = (
            checked.every,
            checked.lr,
            checked.momentum,
            checked.nesterov,
        )
        self.round = 0
        """Steps mixed (:meth:`mix` calls): the 0-based index of the step the next :meth:`mix` ends."""
        self._anchor: list[np.ndarray] | None = None
        self._m: list[np.ndarray] | None = None
        self._scratch = Scratch()

    def _params(self) -> dict[str, Any]:
        keys = ("base", "every", "lr", "momentum", "nesterov")
        return {k: getattr(self, k) for k in keys}

    # ------------------------------------------------------------ what the base rule is

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.name

    @property
    def transfer(self) -> Transfer:  # type: ignore[override]
        return self.base.transfer

    @property
    def mass_key(self) -> str | None:  # type: ignore[override]
        return self.base.mass_key

    @property
    def wire_exact(self) -> str:  # type: ignore[override]
        return self.base.wire_exact

    @property
    def allowed_schedules(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.base.allowed_schedules

    @property
    def default_schedule(self) -> str:  # type: ignore[override]
        return self.base.default_schedule

    @property
    def overlap(self) -> int:  # type: ignore[override]
        return self.base.overlap

    @property
    def anchor(self) -> list[np.ndarray] | None:
        """The anchor (one array per parameter array), None before the first mix and after a copy."""
        return self._anchor

    @property
    def momentum_buffer(self) -> list[np.ndarray] | None:
        """``m`` (one array per parameter array), None before the first mix and with ``momentum: 0``."""
        return self._m

    @property
    def exact(self) -> bool:
        """``lr = 1`` and ``momentum = 0``: the outer step leaves the parameters as the base rule mixed them."""
        return self.lr == 1.0 and self.momentum == 0.0

    # ------------------------------------------------------------ every hook: the base rule's

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        return self.base.initial_extras(me, names)

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        self.base.on_members(me, names, mass)

    def hand_off(self, own: NodeState) -> dict[str, Any] | None:
        return self.base.hand_off(own)

    def reads_published(self) -> bool:
        return self.base.reads_published()

    def mixes_narrower_peers(self) -> bool:
        return self.base.mixes_narrower_peers()

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        self.base.on_publish(own, published)

    def request_extras(self, own: NodeState) -> dict[str, Any]:
        return self.base.request_extras(own)

    def push_shares(self, own: NodeState, targets: int) -> list[dict[str, Any]]:
        return self.base.push_shares(own, targets)

    def on_request(self, own: NodeState, extras: dict[str, Any]) -> None:
        self.base.on_request(own, extras)

    def on_serve(self, own: NodeState) -> dict[str, Any]:
        return self.base.on_serve(own)

    def on_serve_failed(self, own: NodeState, given: dict[str, Any]) -> None:
        self.base.on_serve_failed(own, given)

    def on_reply_lost(self, own: NodeState, peer_extras: dict[str, Any] | None) -> None:
        self.base.on_reply_lost(own, peer_extras)

    def on_params_replaced(self, own: NodeState) -> None:
        """The base rule's hook; the parameters are a peer's now: the next mix re-anchors, ``m`` starts afresh."""
        self.base.on_params_replaced(own)
        self._anchor, self._m = None, None

    def on_reply_not_mixed(self, own: NodeState, peer_extras: Mapping[str, Any]) -> None:
        self.base.on_reply_not_mixed(own, peer_extras)

    def public_arrays(self, params: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        return self.base.public_arrays(params)

    def public_bounds(self) -> tuple[int, ...] | None:
        return self.base.public_bounds()

    def params_of(self, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray] | None:
        return self.base.params_of(arrays)

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        return self.base.state_metrics(own)

    # ------------------------------------------------------------ the outer optimizer's own state

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The base rule's arrays, and copies of ``outer_anchor/<i>``, ``outer_m/<i>`` (once allocated) and
        ``outer_round`` (one int64)."""
        return {
            **self.base.state_arrays(),
            **save_model_arrays(ANCHOR_KEY, self._anchor),
            **save_model_arrays(MOMENTUM_KEY, self._m),
            ROUND_KEY: np.array([self.round], dtype=np.int64),
        }

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], params: Sequence[np.ndarray]) -> bool:
        """Take back :meth:`state_arrays`: the base rule's, then the anchor, ``m`` and the steps counted, when they
        fit ``params`` (one per parameter array, its shape, its compute dtype) and the count is one int64 >= 0;
        False, and nothing changed, when something does not fit. Arrays not there start afresh (the anchor at the
        next mix, ``m`` at 0); a missing ``outer_round`` leaves the count as it is."""
        anchor = load_model_arrays(ANCHOR_KEY, arrays, params, compute_dtype)
        m = load_model_arrays(MOMENTUM_KEY, arrays, params, compute_dtype)
        count = arrays.get(ROUND_KEY)
        if anchor is False or m is False or (count is not None and not _is_count(count)):
            return False
        if not self.base.load_state_arrays(arrays, params):
            return False
        if count is not None:
            self.round = int(count.reshape(-1)[0])
        self._anchor = anchor if isinstance(anchor, list) else None
        if self._anchor is None or self.momentum == 0.0:
            self._m = None
        else:
            self._m = m if isinstance(m, list) else [np.zeros_like(a) for a in self._anchor]
        return True

    # ------------------------------------------------------------ the step count (the node's, see the module)

    def follow(self, step: int) -> None:
        """The node's step is ``step`` now (a checkpoint restored it): the next :meth:`mix` ends step ``step``."""
        self.round = checked_step(step)
        self.base.follow(step)

    def step_without_mix(self) -> None:
        """A step ended without :meth:`mix` (a catch-up copy of a peer took its place): count it."""
        self.round += 1

    # ------------------------------------------------------------ the step

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """The base rule's mix, then, on a boundary, the outer step; the first mix (and the first after a copy of
        a peer) takes the parameters as the anchor instead. ValueError when the parameters changed layout since
        the anchor was taken (the base rule has mixed then)."""
        outcome = self.base.mix(own, arrays, peers)
        index, self.round = self.round, self.round + 1
        metrics: dict[str, float] = {**outcome.metrics, "outer_step": 0.0}
        if self._anchor is None:
            self._take_anchor(arrays)
        elif is_outer_step(index, self.every):
            self._check_layout(arrays)
            assert self._anchor is not None
            squares = 0.0
            for i, x in enumerate(arrays):
                m = self._m[i] if self._m is not None else None
                squares += outer_step_(x, self._anchor[i], m, self.lr, self.momentum, self.nesterov, self._scratch)
            metrics.update(outer_step=1.0, outer_delta_norm=float(np.sqrt(squares)))
            moved = outcome.changed or not self.exact
            return MixOutcome(outcome.factor, outcome.peers, metrics, moved=moved)
        return MixOutcome(outcome.factor, outcome.peers, metrics, moved=outcome.moved)

    def _take_anchor(self, arrays: Sequence[np.ndarray]) -> None:
        """The anchor is ``arrays`` now (in compute dtype), ``m`` zeros (none with ``momentum: 0``)."""
        anchor = []
        for x in arrays:
            a = np.empty(x.shape, compute_dtype(x.dtype))
            if is_half(x.dtype):
                widen(x.reshape(-1), a.reshape(-1))
            else:
                np.copyto(a, x)
            anchor.append(a)
        self._anchor = anchor
        self._m = [np.zeros_like(a) for a in anchor] if self.momentum != 0.0 else None

    def _check_layout(self, arrays: Sequence[np.ndarray]) -> None:
        anchor = self._anchor
        assert anchor is not None
        if len(anchor) != len(arrays) or any(
            a.shape != x.shape or a.dtype != compute_dtype(x.dtype) for a, x in zip(anchor, arrays)
        ):
            raise ValueError("outer optimizer: the parameter layout changed since the anchor was taken")


def _is_count(a: np.ndarray) -> bool:
    """One integer >= 0 (the ``outer_round`` of a checkpoint)."""
    return a.size == 1 and np.issubdtype(a.dtype, np.integer) and int(a.reshape(-1)[0]) >= 0


class OuterSchedule(Schedule):
    """``base`` on the boundaries only: no peers on the other steps; on step ``k`` with ``(k + 1) % every == 0``,
    ``base``'s peers for the outer round ``k // every`` (its name, fan-out and sizes are ``base``'s)."""

    def __init__(self, base: Schedule, every: int) -> None:
        if isinstance(base, OuterSchedule):
            raise ValueError("the schedule already runs under an outer optimizer")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.base = base
        self.every = every

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.name

    @property
    def fanout(self) -> int:  # type: ignore[override]
        return self.base.fanout

    @property
    def period(self) -> int:  # type: ignore[override]
        return self.every * self.base.period

    def max_fanout(self, n_nodes: int) -> int:
        return self.base.max_fanout(n_nodes)

    def outer_round(self, rnd: Round) -> Round | None:
        """``rnd`` as the base schedule sees it (index ``k // every``), or None off the boundaries."""
        if not is_outer_step(rnd.index, self.every):
            return None
        return dataclasses.replace(rnd, index=rnd.index // self.every)

    def targets(self, rnd: Round) -> Sequence[str] | None:
        outer = self.outer_round(rnd)
        return [] if outer is None else self.base.targets(outer)

    def sources(self, rnd: Round) -> Sequence[str] | None:
        outer = self.outer_round(rnd)
        return [] if outer is None else self.base.sources(outer)

    def candidates(self, rnd: Round) -> frozenset[str] | None:
        outer = self.outer_round(rnd)
        return None if outer is None else self.base.candidates(outer)

    def fetches(self, me: str, names: Sequence[str]) -> bool:
        return self.base.fetches(me, names)

    def fetched(self, me: str, names: Sequence[str]) -> bool:
        return self.base.fetched(me, names)

    def splits_roles(self) -> bool:
        return self.base.splits_roles()

    def adopt_roster(self, roster: Sequence[str]) -> None:
        self.base.adopt_roster(roster)

    def __repr__(self) -> str:
        return f"OuterSchedule({self.base!r}, every={self.every})"


def outer_settings(settings: object) -> OuterSettings | None:
    """``settings`` as :class:`OuterSettings`: an instance itself, a mapping of its fields (checked:
    SettingError), or None (no outer optimizer)."""
    if settings is None or isinstance(settings, OuterSettings):
        return settings
    if isinstance(settings, Mapping):
        return OuterSettings(**settings)
    raise TypeError(f"outer settings must be OuterSettings, a mapping or None, got {type(settings).__name__}")


def outer_rule(rule: Rule, settings: object) -> Rule:
    """``rule`` under the outer optimizer of ``settings`` (:func:`outer_settings`); ``rule`` itself for None."""
    checked = outer_settings(settings)
    return rule if checked is None else OuterRule(rule, **dataclasses.asdict(checked))


def outer_schedule(schedule: Schedule, settings: object) -> Schedule:
    """``schedule`` on the boundaries of ``settings`` (:func:`outer_settings`); ``schedule`` itself for None."""
    checked = outer_settings(settings)
    return schedule if checked is None else OuterSchedule(schedule, checked.every)


def with_outer(rule: Rule, schedule: Schedule, settings: object) -> tuple[Rule, Schedule]:
    """The rule and schedule a node runs: both under the outer optimizer of ``settings`` (None: as they are). A rule
    that is an :class:`OuterRule` already keeps its own settings, and the schedule follows its ``every``."""
    if isinstance(rule, OuterRule):
        return rule, schedule if isinstance(schedule, OuterSchedule) else OuterSchedule(schedule, rule.every)
    return outer_rule(rule, settings), outer_schedule(schedule, settings)
