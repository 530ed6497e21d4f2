"""GEM -- Gradient Energy Matching in gossip form (Hermans & Louppe 2018; docs/rules.md).

Per batch a node moves by its local step ``delta = x_now - x_at_update_send``
and by the mixing step ``d = f0*(x_peer - x_at_update_send)`` (``f0 = base``; the
default ``reference="sent"``, below).  A momentum
proxy ``m <- mu*m + delta`` (updated at EVERY ``update_wait``, peer or not)
bounds the motion element-wise:

    pi = clamp((kappa*|m| - |delta|) / (|d| + eps), 0, 1/f0),    x <- x_now + pi*d

so the effective factor ``g = f0*pi`` lies in [0, 1] and, wherever ``pi > 0``,
``|delta + pi*d| <= |delta| + pi*|d| <= kappa*|m|``: the node never moves more
than momentum SGD would.  Disagreeing peers are damped, agreeing ones amplified
up to a full copy.

Numerics: ``g`` is computed as ``(kappa*|m| - |delta|) / (|x_peer - x| + eps/f0)``
(the same quantity, ``f0`` folded in, two operations fewer) and clamped to
[0, 1]; a NaN ``g`` (from non-finite ``m`` or ``delta``) counts as 0.  ``x`` is
then updated as ``x - g*x + g*x_peer`` like
:func:`~dpwa.rules.mixing.interpolate_elementwise_`, so ``g = 0`` keeps an
element bit-exact and ``g = 1`` copies the peer's.  Everything runs in blocks
of :data:`~dpwa.rules.mixing.BLOCK` elements with block-sized scratch owned by
the rule; float16/bfloat16 are computed in float32 and rounded once.  The only
model-sized state is ``m``: float32 for float16/bfloat16/float32 arrays,
float64 for float64, allocated at the first :meth:`GemRule.mix`.

Divergence damping (``divergence_threshold = t``): every ``g`` is multiplied by
``s = diverge(f0, loss) / f0`` (``s = loss/t`` when ``loss < t``, else 1), the
same damping the pairwise rules apply to their single factor.

The default, ``reference="sent"``, measures the mixing step from the model this node
published at ``update_send``: ``d = f0*(x_peer - x_at_update_send)`` and ``x <- x_now + pi*d``
with the same ``pi`` formula. The node's own local step ``delta`` is kept whole and only the
pull toward the peer is energy-matched (``g = 1`` gives ``x_peer + delta``): this is the
reading of the paper's worker step in which the committed update is rescaled and the
worker's own progress is not.

``reference="now"`` takes ``d = f0*(x_peer - x_now)``, the literal transcription of the
mixing step against the current model. Kept for one documented reason: to reproduce runs
made with dpwa before it was the default and to show why it is not. A peer's snapshot
predates this node's local step, so once the nodes agree ``x_peer ~ x_at_update_send`` and
``d ~ -f0*delta``; the proxy then allows ``pi = 1/f0`` and the mix undoes the local step
(``delta + pi*d ~ 0``): nothing trains (the demo stays at its initial loss). The energy
bound holds in both forms -- it limits motion, not progress.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import REPEATS, MixOutcome, NodeState, PeerSnapshot, Rule, check_repeats, fresh_peers
from dpwa.rules.mixing import BLOCK, Scratch, check_pairs, compute_dtype, is_half, mix_clock, narrow, widen
from dpwa.rules.state import load_model_arrays
from dpwa.utils.settings import Settings, choice, setting

__all__ = ["PROXY_KEY", "GemRule", "GemSettings"]

PROXY_KEY = "gem_m"
"""Checkpoint arrays of the proxy are named ``gem_m/<i>``, one per parameter array."""


@dataclasses.dataclass(frozen=True)
class GemSettings(Settings):
    """GEM in gossip form: ``d = base*(x_peer - x_sent)``, ``m = momentum*m + delta``,
    ``pi = clamp((kappa*|m| - |delta|) / (|d| + eps), 0, 1/base)``, ``x <- x + pi*d`` (element-wise)."""

    base: float = setting(0.5, lo=0, hi=1, lo_open=True)
    momentum: float = setting(0.9, lo=0, hi=1, hi_open=True)
    kappa: float = setting(1.0, lo=0, lo_open=True)
    eps: float = setting(1e-12, lo=0, lo_open=True)
    #: ``sent`` (default): ``d = base*(x_peer - x_at_update_send)``, which keeps the node's own local step;
    #: ``now``: ``d = base*(x_peer - x)``, the literal form, kept to reproduce older runs: it undoes the
    #: local step once the nodes agree, so nothing trains.
    reference: str = choice("sent", ("sent", "now"))
    repeats: str = choice("skip", REPEATS)


class GemRule(Rule):
    """``pi = clamp((kappa*|m| - |delta|)/(|d| + eps), 0, 1/base)``, ``x <- x + pi*d``, ``d = base*(x_peer - x_sent)``.

    ``m = momentum*m + delta`` with ``delta = x - x_at_update_send``, every step. ``repeats`` as for the
    pairwise rules: a reply repeating the peer's last snapshot is not mixed (``skip``, default) or is (``mix``).
    The outcome's factor is the mean effective factor ``base*pi`` (after
    divergence damping) over all elements; metrics: ``gem_pi_mean`` (mean
    undamped ``pi``), ``gem_clip_low`` / ``gem_clip_high`` (fraction of
    elements with ``pi`` at 0 / at ``1/base``) and ``gem_damping`` (``s``).
    """

    name = "gem"
    settings_class = GemSettings

    def __init__(
        self,
        base: float = 0.5,
        momentum: float = 0.9,
        kappa: float = 1.0,
        eps: float = 1e-12,
        reference: str = "sent",
        divergence_threshold: float = 0.0,
        *,
        repeats: str = "skip",
    ) -> None:
        super().__init__(divergence_threshold)
        self.repeats = check_repeats(repeats)
        self.repeats_skipped = 0
        base, momentum, kappa, eps = float(base), float(momentum), float(kappa), float(eps)
        if not 0.0 < base <= 1.0:
            raise ValueError(f"gem base must lie in (0, 1], got {base!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"gem momentum must lie in [0, 1), got {momentum!r}")
        if not 0.0 < kappa < float("inf"):
            raise ValueError(f"gem kappa must be a finite number > 0, got {kappa!r}")
        if not 0.0 < eps < float("inf"):
            raise ValueError(f"gem eps must be a finite number > 0, got {eps!r}")
        if reference not in ("now", "sent"):
            raise ValueError(f"gem reference must be 'now' or 'sent', got {reference!r}")
        self.base, self.momentum, self.kappa, self.eps = base, momentum, kappa, eps
        self.reference = reference
        self._published: Sequence[np.ndarray] | None = None
        self._m: list[np.ndarray] | None = None
        self._scratch = Scratch()

    def _params(self) -> dict[str, Any]:
        keys = ("base", "momentum", "kappa", "eps", "reference", "repeats", "divergence_threshold")
        return {k: getattr(self, k) for k in keys}

    @property
    def proxy(self) -> list[np.ndarray] | None:
        """The momentum proxy ``m`` (one array per parameter array), None before the first mix."""
        return self._m

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"gem_m/<i>": m_i}``: copies of the proxy for a checkpoint (``{}`` before the first mix)."""
        if self._m is None:
            return {}
        return {f"{PROXY_KEY}/{i}": np.array(m, copy=True) for i, m in enumerate(self._m)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], params: Sequence[np.ndarray]) -> bool:
        """Set ``m`` from a checkpoint's ``gem_m/<i>`` when there is one per parameter array, of its shape
        and compute dtype (True); False (``m`` unchanged) when they do not fit; True when there are none."""
        proxy = load_model_arrays(PROXY_KEY, arrays, params, compute_dtype)
        if isinstance(proxy, list):
            self._m = proxy
        return proxy is not False

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """Remember ``x_at_update_send`` (read-only views, valid until the next ``update_send``)."""
        self._published = published

    def _proxy_for(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._m is None:
            self._m = [np.zeros(a.shape, compute_dtype(a.dtype)) for a in arrays]
        if len(self._m) != len(arrays) or any(
            m.shape != a.shape or m.dtype != compute_dtype(a.dtype) for m, a in zip(self._m, arrays)
        ):
            raise ValueError("GEM: the parameter layout changed since the first mix")
        return self._m

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Update ``m`` (always), then mix at most one peer element-wise; the clock mixes with the mean factor.

        Raises RuntimeError before any :meth:`on_publish`, ValueError for more
        than one peer or mismatched layouts (nothing changed then).
        """
        if self._published is None:
            raise RuntimeError("GEM: mix() before on_publish(): x_at_update_send is unknown")
        if len(peers) > 1:
            raise ValueError(f"GemRule mixes one peer at a time, got {len(peers)}")
        check_pairs(arrays, self._published, "published")
        peers, skipped = fresh_peers(peers, self.repeats)  # a repeat is not mixed: m still tracks the step
        self.repeats_skipped += skipped
        peer = peers[0] if peers else None
        if peer is not None:
            check_pairs(arrays, peer.arrays)
        proxy = self._proxy_for(arrays)
        damping = self.diverge(self.base, own.loss) / self.base if peer is not None else 0.0
        total = low = high = 0.0
        count = 0
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            for i, (x, m) in enumerate(zip(arrays, proxy)):
                p = peer.arrays[i] if peer is not None else None
                t, lo, hi = self._mix_array(x, self._published[i], m, p, damping)
                total, low, high, count = total + t, low + lo, high + hi, count + x.size
        if peer is None:
            return MixOutcome(0.0, (), self.state_metrics(own))
        n = max(count, 1)
        factor = min(1.0, total * damping / n)  # mean of the damped g (damping is a common factor)
        own.clock = mix_clock(own.clock, peer.state.clock, factor)
        metrics = {
            "gem_pi_mean": total / n / self.base,
            "gem_clip_low": low / n,
            "gem_clip_high": high / n,
            "gem_damping": damping,
            **self.state_metrics(own),
        }
        return MixOutcome(factor, (peer.state.name,), metrics)

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """``repeats_skipped``: replies not mixed because they repeated the peer's last snapshot."""
        return {"repeats_skipped": float(self.repeats_skipped)}

    def _mix_array(
        self, x: np.ndarray, sent: np.ndarray, m: np.ndarray, peer: np.ndarray | None, damping: float
    ) -> tuple[float, int, int]:
        """One array, block by block: ``m``; then (with a peer) ``g`` and ``x``. Returns (sum g, #g==0, #g==1)."""
        if x.size == 0:
            return 0.0, 0, 0
        c = compute_dtype(x.dtype)
        half = is_half(x.dtype)
        mu, kappa, eps = c.type(self.momentum), c.type(self.kappa), c.type(self.eps / self.base)
        s = c.type(damping)
        xv, bv, mv = x.reshape(-1), sent.reshape(-1), m.reshape(-1)
        pv = peer.reshape(-1) if peer is not None else None
        scratch = self._scratch
        total, low, high = 0.0, 0, 0
        for start in range(0, xv.size, BLOCK):
            stop = min(start + BLOCK, xv.size)
            n = stop - start
            xb, bb, mb = xv[start:stop], bv[start:stop], mv[start:stop]
            xc = widen(xb, scratch.get(c, n, 0)) if half else xb  # x_now in compute precision
            dl = _advance_proxy(xc, bb, mb, scratch.get(c, n, 1), mu, half)
            if pv is None:
                continue
            pc = widen(pv[start:stop], scratch.get(c, n, 2)) if half else pv[start:stop]
            if self.reference == "now":
                ref = xc
            else:  # "sent": the mixing step is measured from the published model
                ref = widen(bb, scratch.get(c, n, 4)) if half else bb
            g = _factor(scratch.get(c, n, 3), mb, dl, pc, ref, kappa, eps)
            flags = scratch.get(np.bool_, n, 0)
            low += int(np.count_nonzero(np.equal(g, 0, out=flags)))
            high += int(np.count_nonzero(np.equal(g, 1, out=flags)))
            total += float(np.add.reduce(g, dtype=np.float64))
            if s == 0:
                continue
            if s != 1:
                np.multiply(g, s, out=g)
            _step(xc, g, pc, ref, dl, self.reference == "now")
            if half:
                narrow(xc, xb, dl)
        return total, low, high


def _advance_proxy(
    xc: np.ndarray, sent: np.ndarray, m: np.ndarray, dl: np.ndarray, mu: np.generic, half: bool
) -> np.ndarray:
    """One block: ``dl <- delta = x_now - x_sent`` (``xc``: x_now in compute precision; ``sent`` widened into
    ``dl`` first when ``half``) and ``m <- mu*m + delta`` in place; returns ``dl``."""
    if half:
        widen(sent, dl)
        np.subtract(xc, dl, out=dl)
    else:
        np.subtract(xc, sent, out=dl)
    np.multiply(m, mu, out=m)
    np.add(m, dl, out=m)  # m <- mu*m + delta
    return dl


def _factor(
    g: np.ndarray, m: np.ndarray, dl: np.ndarray, pc: np.ndarray, ref: np.ndarray, kappa: np.generic, eps: np.generic
) -> np.ndarray:
    """One block: ``g <- clamp((kappa*|m| - |delta|) / (|x_peer - ref| + eps/f0), 0, 1)`` (= ``f0*pi``, NaN -> 0),
    with ``dl`` holding delta on entry and used as scratch (undefined after); returns ``g``."""
    np.abs(m, out=g)
    if kappa != 1:
        np.multiply(g, kappa, out=g)
    np.abs(dl, out=dl)
    np.subtract(g, dl, out=g)  # kappa*|m| - |delta|
    np.subtract(pc, ref, out=dl)
    np.abs(dl, out=dl)
    np.add(dl, eps, out=dl)  # |x_peer - x| + eps/f0  (= (|d| + eps)/f0)
    np.divide(g, dl, out=g)  # f0*pi
    np.fmax(g, 0, out=g)  # NaN -> 0
    np.fmin(g, 1, out=g)
    return g


def _step(xc: np.ndarray, g: np.ndarray, pc: np.ndarray, ref: np.ndarray, dl: np.ndarray, now: bool) -> None:
    """One block, in place: ``xc <- xc - g*xc + g*x_peer`` (``now``), else ``xc <- xc + g*(x_peer - ref)``
    (``ref``: x_sent); ``dl`` is scratch."""
    if now:
        np.multiply(g, xc, out=dl)
        np.subtract(xc, dl, out=xc)
        np.multiply(g, pc, out=dl)
        np.add(xc, dl, out=xc)  # x - g*x + g*x_peer
    else:
        np.subtract(pc, ref, out=dl)
        np.multiply(dl, g, out=dl)
        np.add(xc, dl, out=xc)  # x_now + g*(x_peer - x_sent)
