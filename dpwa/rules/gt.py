"""Gradient tracking -- DIGing (Nedic, Olshevsky & Shi 2017), GT-DSGD (Pu & Nedic 2020); docs/rules.md.

Each node keeps a tracker ``y`` of the network's average gradient and moves along it, not along its own
gradient. With a doubly-stochastic mixing matrix ``W`` (the uniform weights ``1/(d+1)`` of a regular graph,
as D-PSGD) and a constant step ``alpha``, DIGing's recursion is

    x_{k+1} = sum_j W_ij x_j,k - alpha * y_k,      y_{k+1} = sum_j W_ij y_j,k + g_i(x_{k+1}) - g_i(x_k)

with ``y_0 = g(x_0)``. Since ``sum_i y_i = sum_i g_i`` at every step, the nodes' common fixed point has
``sum_i g_i(x*) = 0``: the minimizer of the AVERAGE objective, with no bias from data that differ between
nodes (D-PSGD's fixed point is off by ``O(alpha * heterogeneity)``).

In dpwa the trainer's optimizer makes the local step between ``update_send`` and ``update_wait``; the rule
works in step units, ``u_k = x_now - x_sent = -alpha * g_i(x_k)`` for plain SGD, and keeps ``z = -alpha * y``.
The tracker's sum must be kept exactly, and a pull network loses and delays messages; so ``z`` is mixed by
running sums (the robust form of push-sum, Bof, Carli & Schenato 2017; R-FAST, Zhu et al. 2023): at each
publish a node offers ``w z_i`` to each of its ``d`` neighbours, takes ``d w z_i`` out of its own tracker and
adds ``w z_i`` to ``rho_i``, the running sum of its offers, which the snapshot carries; a receiver adds what
the sum grew by since the last ``rho_j`` it received. At update_wait:

    z_k     = z + sum_{j received} (rho_j - rho_j_last) + u_k - u_{k-1}
    x_{k+1} = x_sent + sum_{j fresh} w (x_j - x_sent) + z_k                    w = 1/(d+1)

Without losses in lock-step this is DIGing exactly (``z - d w z + sum_j w z_j = W z``); a lost or late
message is collected by the next one, so ``sum_i z_i`` plus what is still in flight is always ``sum_i u_i``.
The parameters move along the tracker (``x <- W x + z``; the optimizer's step is taken back out of ``x`` and
fed into the tracker): which variable the local step updates in the papers. With momentum or Adam the
tracker tracks the optimizer's update rather than the gradient; a fixed point then has ``sum_i u_i = 0``: the
minimizer of the average for SGD and heavy-ball momentum (one scalar preconditioner on every node), not for Adam
(``sum_i P_i g_i = 0``, each node's own preconditioner ``P_i``). A neighbour that did not answer, or lags by
more than ``max_staleness``, is left out of the ``x`` average and its weight stays with this node.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.dpsgd import UNDIRECTED_GRAPHS, checked_graph, neighbours
from dpwa.rules.mixing import compute_dtype
from dpwa.rules.state import load_model_arrays, save_model_arrays, store_, whole_number, widened
from dpwa.utils.settings import Settings, choice, setting

__all__ = ["TRACKER_KEY", "GtRule", "GtSettings"]

TRACKER_KEY = "gt_z"
"""Checkpoint arrays of the tracker are named ``gt_z/<i>``; the previous local step ``gt_u/<i>``; the running
sum of the offers ``gt_rho/<i>``, and a neighbour's last one ``gt_rho:<name>/<i>``."""
STEP_KEY = "gt_u"
SUM_KEY = "gt_rho"
EPOCH_KEY = "gt_epoch"
"""The extras key of the number a node draws when its rule starts (its running sums count from then)."""
RECEIVERS_KEY = "gt_to"
"""The extras key of the neighbours an epoch's offers are for: a node that is not among them takes none."""


@dataclasses.dataclass(frozen=True)
class GtSettings(Settings):
    """Gradient tracking: ``z <- W z + u - u_prev``, ``x <- W x_sent + z`` on a ``ring`` or ``exponential``
    graph (every neighbour, every step); a neighbour more than ``max_staleness`` steps behind is left out."""

    graph: str = choice("ring", UNDIRECTED_GRAPHS)  # every neighbour must also read this node's offers
    max_staleness: float = setting(10.0, lo=0)


class GtRule(Rule):
    """``z <- z + sum_j (rho_j - rho_j_last) + u - u_prev``, ``x <- x_sent + sum_j w (x_j - x_sent) + z``.

    ``u = x - x_sent`` is the local step of this round, ``w = 1/(d+1)``, ``d`` the node's degree on the graph;
    each publish offers ``w z`` to every neighbour (``z <- z - d w z``, ``rho <- rho + w z``). The snapshot
    publishes ``x`` followed by ``rho`` (float64: running sums must not lose what they add). Divergence damping
    scales every neighbour's weight in the ``x`` average by ``loss/t``. Metrics ``left_out``,
    ``neighbours_mixed``, ``tracker_norm`` (``||z||``).
    """

    name = "gt"
    settings_class = GtSettings
    allowed_schedules = ("neighbours",)
    default_schedule = "neighbours"
    wire_exact = "receivers difference its running sums"

    def __init__(self, graph: str = "ring", max_staleness: float = 10.0, divergence_threshold: float = 0.0) -> None:
        super().__init__(divergence_threshold)
        self.graph, self.max_staleness = graph, checked_graph(graph, max_staleness, UNDIRECTED_GRAPHS, "gt")
        self.left_out = 0
        self._degree = 0
        self._neighbours: tuple[str, ...] = ()
        self._epoch = secrets.randbits(31)
        self._receivers: tuple[str, ...] = ()  # whom this epoch's offers are for (its degree is theirs)
        self._restart = False  # the neighbours changed: a new epoch starts at the next publish
        self._z: list[np.ndarray] | None = None
        self._u: list[np.ndarray] | None = None
        self._rho: list[np.ndarray] = []
        self._offer: list[np.ndarray] = []  # rho + w z, computed for the snapshot being published
        self._last: dict[str, tuple[int, list[np.ndarray]]] = {}  # neighbour -> (its epoch, its last rho)
        self._sent: Sequence[np.ndarray] | None = None

    def _params(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "max_staleness": self.max_staleness,
            "divergence_threshold": self.divergence_threshold,
        }

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        """``gt_epoch``: the number that names this node's running sums since they last started from zero;
        ``gt_to``: the neighbours they are offered to."""
        self.on_members(me, names, float(len(names)))
        self._receivers, self._restart = self._neighbours, False
        return self._extras()

    def _extras(self) -> dict[str, Any]:
        return {EPOCH_KEY: self._epoch, RECEIVERS_KEY: list(self._receivers)}

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """My neighbours on the graph of the current members (the ``x`` average's, from now), and the sums of
        nodes no longer neighbours forgotten. When they change, the running sums start over from zero under a
        new epoch for the new neighbours -- at the next publish (:meth:`on_publish`), so that a snapshot's epoch,
        sums and receivers always belong together, whichever thread calls this and when. Until then the offers
        go to the old neighbours: what a neighbour that left does not collect is lost for good (so is a leaver's
        ``z``: the fixed point moves, docs/rules.md); a new neighbour takes nothing of an epoch not offered to it."""
        members = list(names)
        mine = (
            tuple(members[j] for j in neighbours(members.index(me), len(members), self.graph)) if me in members else ()
        )
        if mine != self._neighbours:
            self._restart = True
        self._neighbours, self._degree = mine, len(mine)
        for gone in set(self._last) - set(mine):
            del self._last[gone]

    def _allocate(self, params: Sequence[np.ndarray]) -> None:
        if self._z is None or len(self._z) != len(params):
            self._z = [np.zeros(p.shape, compute_dtype(p.dtype)) for p in params]
            self._u = [np.zeros(p.shape, compute_dtype(p.dtype)) for p in params]
            self._rho = [np.zeros(p.shape, np.float64) for p in params]
            self._offer = [np.zeros(p.shape, np.float64) for p in params]

    def _w(self) -> float:
        return 1.0 / float(self._degree + 1)

    def _offer_weight(self) -> float:
        """``w`` of the offers: ``1/(d+1)`` with ``d`` the epoch's receivers (0.0: none)."""
        return 1.0 / float(len(self._receivers) + 1) if self._receivers else 0.0

    def public_arrays(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``x`` then ``rho + w z`` (float64), the running sum with this publish's offer; ``rho`` and ``z`` change
        only when the snapshot is published (:meth:`on_publish`)."""
        self._allocate(params)
        assert self._z is not None
        w = self._offer_weight()
        for offer, rho, z in zip(self._offer, self._rho, self._z):
            np.multiply(z, w, out=offer, dtype=np.float64)
            offer += rho
        return [*params, *self._offer]

    def params_of(self, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """The first half of a snapshot: ``x``."""
        return arrays[: len(arrays) // 2]

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """The offer went out: ``z <- z - d (rho_new - rho)`` and ``rho <- rho_new`` (taking out exactly what the
        sum grew by, ``d`` the epoch's receivers); then, if the neighbours changed, a new epoch for them, its sums
        at zero; the next snapshot's epoch and receivers into ``own.extras``. Remember ``x_sent`` (read-only
        views, valid until the next ``update_send``)."""
        assert self._z is not None
        n = len(published) // 2
        for z, rho, new in zip(self._z, self._rho, published[n:]):
            given = np.subtract(new, rho)
            given *= len(self._receivers)
            z -= given.astype(z.dtype, copy=False)
            rho[...] = new
        if self._restart:
            self._epoch, self._receivers, self._restart = secrets.randbits(31), self._neighbours, False
            for rho in self._rho:
                rho[...] = 0.0
        own.extras.update(self._extras())  # the next snapshot's (a checkpoint restore may have set a float)
        self._sent = published[:n]

    def on_params_replaced(self, own: NodeState) -> None:
        """A catch-up copied a peer's ``x``: no local step to take out this round (the tracker stays)."""
        self._sent = None

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``gt_z/<i>``, ``gt_u/<i>``, ``gt_rho/<i>`` and ``gt_epoch`` (``{}`` before the first publish), and each
        neighbour's last running sum ``gt_rho:<name>/<i>`` with its epoch ``gt_epoch:<name>``."""
        if self._z is None:
            return {}
        out = {**save_model_arrays(TRACKER_KEY, self._z), **save_model_arrays(STEP_KEY, self._u)}
        out.update(save_model_arrays(SUM_KEY, self._rho))
        out[EPOCH_KEY] = np.array(self._epoch, np.int64)
        for name, (epoch, last) in self._last.items():
            out.update(save_model_arrays(f"{SUM_KEY}:{name}", last))
            out[f"{EPOCH_KEY}:{name}"] = np.array(epoch, np.int64)
        return out

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], params: Sequence[np.ndarray]) -> bool:
        """Take back the tracker, the step, the running sums and their epochs when they fit ``params`` (True), so
        that a cluster resumed from its checkpoints goes on collecting where it stopped; False, nothing changed,
        when they do not fit."""
        z = load_model_arrays(TRACKER_KEY, arrays, params, compute_dtype)
        u = load_model_arrays(STEP_KEY, arrays, params, compute_dtype)
        rho = load_model_arrays(SUM_KEY, arrays, params, lambda _: np.dtype(np.float64))
        if z is None and u is None and rho is None:
            return True
        epoch = whole_number(arrays.get(EPOCH_KEY))
        if not (isinstance(z, list) and isinstance(u, list) and isinstance(rho, list)) or epoch is None:
            return False
        last: dict[str, tuple[int, list[np.ndarray]]] = {}
        for key in arrays:
            if key.startswith(EPOCH_KEY + ":"):
                name = key[len(EPOCH_KEY) + 1 :]
                sums = load_model_arrays(f"{SUM_KEY}:{name}", arrays, params, lambda _: np.dtype(np.float64))
                their = whole_number(arrays[key])
                if not isinstance(sums, list) or their is None:
                    return False
                last[name] = (their, sums)
        self._allocate(params)
        self._z, self._u, self._rho, self._epoch = z, u, rho, epoch
        self._receivers, self._restart = self._neighbours, False
        self._last = {name: entry for name, entry in last.items() if name in self._neighbours or not self._neighbours}
        return True

    def _collect(self, peer: PeerSnapshot, n: int, me: str) -> list[np.ndarray] | None:
        """What neighbour ``peer``'s running sums grew by since the last message of it this node took (from zero
        for an epoch not seen before: every epoch's sums start at zero); remembers the sums. None: not a
        neighbour, no epoch, or an epoch whose offers are not for ``me`` (the sender's neighbours changed and its
        new epoch starts at its next publish)."""
        extras = peer.state.extras
        epoch = whole_number(extras.get(EPOCH_KEY))
        receivers = extras.get(RECEIVERS_KEY)
        if epoch is None or peer.state.name not in self._neighbours:
            return None
        if isinstance(receivers, list) and me not in receivers:
            return None
        sums = [np.array(a, dtype=np.float64) for a in peer.arrays[n:]]
        known = self._last.get(peer.state.name)
        self._last[peer.state.name] = (epoch, sums)
        if known is None or known[0] != epoch:
            return sums
        return [new - old for new, old in zip(sums, known[1])]

    def _fresh(self, own: NodeState, peers: Sequence[PeerSnapshot]) -> list[PeerSnapshot]:
        return [p for p in peers if math.isfinite(p.state.clock) and own.clock - p.state.clock <= self.max_staleness]

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Collect the neighbours' offers into ``z``, add this round's step, average ``x`` with the fresh
        neighbours (none: ``W = I`` this round, the tracker still steps)."""
        self._allocate(arrays)
        assert self._z is not None and self._u is not None
        n = len(arrays)
        others = [p for p in peers if p.state.name in self._neighbours]  # the graph's: d of them at most
        for peer in others:
            grown = self._collect(peer, n, own.name)
            for z, inc in zip(self._z, grown or ()):
                z += inc.astype(z.dtype, copy=False)
        fresh = self._fresh(own, others)
        self.left_out += max(0, self._degree - len(fresh))
        g = self.diverge(1.0, own.loss)
        if self._degree == 0 or g == 0.0:
            fresh = []
        w = g * self._w() if fresh else 0.0
        sent = self._sent
        metrics = {"left_out": float(self.left_out), "neighbours_mixed": float(len(fresh))}
        if sent is None:  # no update_send since the last mix, or a catch-up copy: no step to track
            return MixOutcome(0.0, (), metrics)
        for i, x in enumerate(arrays):
            z, u_prev = self._z[i], self._u[i]
            own_x = widened(sent[i])
            u = np.subtract(widened(x), own_x, dtype=z.dtype)  # this round's local step
            z += u
            z -= u_prev
            u_prev[...] = u
            mixed = np.zeros_like(z)
            for p in fresh:  # the neighbours' differences to x_sent, summed, then x_sent and z
                mixed += w * (widened(p.arrays[i]) - own_x)
            mixed += own_x
            mixed += z
            store_(mixed, x)
        self._sent = None
        if fresh:
            k = len(fresh)
            own.clock = math.fsum([w * p.state.clock for p in fresh] + [(1.0 - w * k) * own.clock])
        metrics["tracker_norm"] = math.sqrt(math.fsum(float(np.vdot(z, z)) for z in self._z))
        return MixOutcome(w * len(fresh), tuple(p.state.name for p in fresh), metrics, moved=True)
