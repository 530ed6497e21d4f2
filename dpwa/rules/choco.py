"""CHOCO-SGD -- compressed gossip with error feedback (Koloskova, Stich & Jaggi 2019; Koloskova et al. 2020).

Every node ``i`` keeps a public copy ``x_hat_i`` of its parameters that all its neighbours know exactly, and
a copy ``x_hat_j`` of each neighbour's. Per step it sends only the compressed difference ``q_i =
Q(x_i - x_hat_i)`` (:mod:`dpwa.rules.compress`: top-k, random-k or int8), everybody who receives it applies
``x_hat_i += q_i``, and the node moves toward its neighbours' public copies:

    q_i     = Q(x_i - x_hat_i)                                   at update_send (published)
    x_hat_j = x_hat_j + q_j        for j = i and every neighbour whose q_j arrived
    x_i     = x_i + gamma * sum_{j in N(i)} w (x_hat_j - x_hat_i),   w = 1/(d+1)   at update_wait

``x_i`` is the trainer's parameters, so the local optimizer step updates ``x`` and the compressed
difference picks it up at the next ``update_send``: the order of the reference code's ``ParallelCHOCO``, in
which the next gradient is computed while the compressed message travels. Whatever ``Q`` drops stays in
``x_i - x_hat_i`` and is sent later (error feedback), so CHOCO converges with arbitrarily strong compression.

On the wire. A sparse message carries the indices (ascending; uint16 for arrays of up to 2^16 elements, else
uint32; each checked below its array's size by the wire) and the NEW public values there,
``x_hat_i[idx] + q_i[idx]``, which every receiver assigns:
the same copy as adding ``q``, and idempotent, so a message fetched twice changes nothing. An int8 message
carries ``q`` itself (one float32 scale per block, then the int8 values), which receivers add; a reply that
repeats the previous one is skipped. Asynchrony loses messages (a neighbour published twice between two
fetches), and a lost one would leave the copy wrong for good; so every message also carries one of
``resync`` windows of ``x_hat_i`` after the update (window ``w`` of each array: elements ``[w*m, (w+1)*m)``,
``m = ceil(n / resync)``), which the receiver writes over its copy, counting the elements that differed
(``choco_drift``, 0 when no message was lost). The windows go round in cycles, each in its own order, so a
spoiled copy is exact again after at most ``2 * resync - 1`` messages received in a row. Every message names
its sender's epoch (its public copy's start from zero) and its number there: a message fetched twice is
skipped, a new epoch restarts the copy at zero.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpwa.rules.base import MixOutcome, NodeState, PeerSnapshot, Rule
from dpwa.rules.compress import Compressor, CompressorSpec, index_dtype, parse_compressor, random_k, top_k
from dpwa.rules.dpsgd import GRAPHS, neighbours
from dpwa.rules.mixing import compute_dtype
from dpwa.rules.state import load_model_arrays, save_model_arrays, store_, whole_number, widened
from dpwa.utils.int8 import dequantize_int8_, int8_scales, quantize_int8_
from dpwa.utils.settings import Settings, choice, setting

__all__ = ["HAT_KEY", "WINDOW_KEY", "ChocoRule", "ChocoSettings", "auto_gamma"]

HAT_KEY = "choco_hat"
"""Checkpoint arrays: the node's own public copy ``choco_hat/<i>``; a neighbour's ``choco_hat:<name>/<i>``."""
WINDOW_KEY = "choco_window"
"""The extras key of the resync window a snapshot carries."""
EPOCH_KEY = "choco_epoch"
"""The extras key of the number that names the sender's public copy since it last started from zero."""
COUNT_KEY = "choco_n"
"""The extras key of the number of messages the sender published before this one, in its epoch."""


def auto_gamma(compressor: Compressor) -> float:
    """The consensus step ``gamma: 0`` stands for: ``int8`` 0.5, ``topk:F`` ``min(0.5, 2F)``, ``randk:F``
    ``min(0.5, F/2)``. Measured in the simulator (6 nodes on a ring and on the exponential graph, consensus from
    random starts): top-1 % converges at 0.02 and diverges at 0.05; random-1 % needs 0.005; int8 converges
    at every value up to 1. CHOCO's theory (Koloskova et al. 2019, Theorem 2) gives a ``gamma`` linear in
    ``delta`` (the compression quality; top-k and random-k: the share kept), as these are."""
    if compressor.kind == "topk":
        return min(0.5, 2.0 * compressor.fraction)
    if compressor.kind == "randk":
        return min(0.5, compressor.fraction / 2.0)
    return 0.5


@dataclasses.dataclass(frozen=True)
class ChocoSettings(Settings):
    """CHOCO-SGD: publish ``Q(x - x_hat)``, ``x_hat_j += q_j``, ``x <- x + gamma * sum_j w (x_hat_j - x_hat)``
    on the ``ring``, ``exponential`` or ``directed-ring`` graph; ``resync`` windows of ``x_hat`` ride along."""

    compressor: str = setting("topk:0.01", spec=CompressorSpec())
    gamma: float = setting(0.0, lo=0, hi=1)
    graph: str = choice("ring", GRAPHS)
    resync: int = setting(100, lo=0, integer=True)
    max_staleness: float = setting(10.0, lo=0)


@dataclasses.dataclass
class _Copy:
    """A neighbour's public copy as this node knows it: the epoch and number of the last message applied, its
    clock, and the windows still to receive before it may be mixed (empty: usable)."""

    hat: list[np.ndarray]
    clock: float
    epoch: int
    last: int = -1
    missing: set[int] = dataclasses.field(default_factory=set)


class ChocoRule(Rule):
    """``x <- x + gamma * sum_{j in N(i)} w (x_hat_j - x_hat_i)``, ``w = 1/(d+1)``, the copies kept by compressed
    messages (module doc-string). The clock is averaged with the neighbours heard from, with the same weights (as
    D-PSGD's); a neighbour whose last message is more than ``max_staleness`` steps older than this node is left
    out. Divergence damping scales ``gamma`` by ``loss/t``. Metrics: ``neighbours_mixed``,
    ``choco_drift`` (copy elements a resync window corrected, in all), ``choco_dropped`` (messages with indices
    not ascending, or int8 ones that would overflow a copy), ``choco_gaps`` (neighbours' messages never received).
    """

    name = "choco"
    settings_class = ChocoSettings
    allowed_schedules = ("neighbours",)
    default_schedule = "neighbours"
    wire_exact = "receivers keep exact copies of its public copy"
    array_extras = frozenset({EPOCH_KEY, COUNT_KEY, WINDOW_KEY})

    def __init__(
        self,
        compressor: str = "topk:0.01",
        gamma: float = 0.0,
        graph: str = "ring",
        resync: int = 100,
        max_staleness: float = 10.0,
        divergence_threshold: float = 0.0,
    ) -> None:
        super().__init__(divergence_threshold)
        try:
            self.compressor: Compressor = parse_compressor(compressor)
        except ValueError as err:
            raise ValueError(f"choco compressor {err}") from None
        if not 0.0 <= float(gamma) <= 1.0:
            raise ValueError(f"choco gamma must lie in [0, 1] (0: automatic), got {gamma!r}")
        self.gamma = float(gamma) or auto_gamma(self.compressor)
        neighbours(0, 2, graph)  # validates the name
        if int(resync) != resync or resync < 0:
            raise ValueError(f"choco resync must be an integer >= 0, got {resync!r}")
        self.graph, self.resync, self.max_staleness = graph, int(resync), float(max_staleness)
        self.drift = 0
        self.dropped = 0
        self._rng = np.random.default_rng(0)  # random-k's draws; seeded from the node's name when it starts
        self._neighbours: tuple[str, ...] = ()
        self._degree = 0
        self._epoch = secrets.randbits(31)
        self._order_seed = 0
        """Seeds the order of the resync windows (the node's name: reproducible, unlike the epoch)."""
        self._count = 0
        self._cycle: tuple[int, np.ndarray] | None = None
        self.gaps = 0
        self._hat: list[np.ndarray] | None = None
        self._scratch: list[np.ndarray] = []
        self._message: list[np.ndarray] = []
        self._copies: dict[str, _Copy] = {}

    def _params(self) -> dict[str, Any]:
        return {
            "compressor": str(self.compressor),
            "gamma": self.gamma,
            "graph": self.graph,
            "resync": self.resync,
            "max_staleness": self.max_staleness,
            "divergence_threshold": self.divergence_threshold,
        }

    # ------------------------------------------------------------ membership

    def initial_extras(self, me: str, names: Sequence[str]) -> dict[str, Any]:
        """Random-k draws, and the resync windows' order, from the node's name (reproducible, different per
        node)."""
        self._order_seed = zlib.crc32(me.encode())
        self._rng = np.random.default_rng(self._order_seed)
        self._cycle = None
        self.on_members(me, names, float(len(names)))
        return self._extras()

    def _extras(self) -> dict[str, Any]:
        return {EPOCH_KEY: self._epoch, COUNT_KEY: self._count, WINDOW_KEY: self._window_at(self._count)}

    def _window_at(self, count: int) -> int:
        """The window message ``count`` carries: windows go round in cycles of ``resync`` messages, each cycle
        in its own order (a permutation drawn from the node's name and the cycle), so that no regular pattern of
        lost messages keeps missing the same windows; every window comes once a cycle. Not from the epoch: that
        one is random, and a seeded simulation must give the same figures in every run."""
        if not self.resync:
            return 0
        cycle = count // self.resync
        if self._cycle is None or self._cycle[0] != cycle:
            self._cycle = (cycle, np.random.default_rng([self._order_seed, cycle]).permutation(self.resync))
        return int(self._cycle[1][count % self.resync])

    def on_members(self, me: str, names: Sequence[str], mass: float) -> None:
        """My neighbours on the graph of the current members; copies of nodes no longer my neighbours are dropped:
        one kept while its owner was not (a node joined between us) would take its messages on top of a stale copy
        once it is again, and be mixed at once (the cluster's mean moved by about 23 steps in the simulator); a
        copy made afresh waits for every window."""
        members = list(names)
        self._neighbours = (
            tuple(members[j] for j in neighbours(members.index(me), len(members), self.graph)) if me in members else ()
        )
        self._degree = len(self._neighbours)
        for gone in set(self._copies) - set(self._neighbours):
            del self._copies[gone]

    # ------------------------------------------------------------ the message

    def _allocate(self, params: Sequence[np.ndarray]) -> None:
        """Own public copy (zeros, as in the paper), one scratch per array, the message buffers."""
        if self._hat is not None and len(self._hat) == len(params):
            return
        self._hat = [np.zeros(p.shape, compute_dtype(p.dtype)) for p in params]
        self._scratch = [np.zeros(p.size, compute_dtype(p.dtype)) for p in params]
        message: list[np.ndarray] = []
        for p in params:
            dtype = compute_dtype(p.dtype)
            if self.compressor.sparse:
                k = self.compressor.kept(p.size)
                message += [np.zeros(k, index_dtype(p.size)), np.zeros(k, dtype)]
            else:
                message += [np.zeros(int8_scales(p.size), np.float32), np.zeros(p.size, np.int8)]
        if self.resync:
            message += [np.zeros(self._window_size(p.size), compute_dtype(p.dtype)) for p in params]
        self._message = message

    def _window_size(self, n: int) -> int:
        return math.ceil(n / self.resync) if self.resync else 0

    def _window_slice(self, n: int, window: int) -> slice:
        m = self._window_size(n)
        return slice(min(n, window * m), min(n, (window + 1) * m))

    def public_arrays(self, params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``Q(x - x_hat)`` per array (indices + new values, or scales + int8), then this publish's window of
        ``x_hat`` after the update: computed into the rule's buffers, ``x_hat`` itself unchanged until
        :meth:`on_publish`."""
        self._allocate(params)
        assert self._hat is not None
        count = len(params)
        window_index = self._window_at(self._count)
        for i, (param, hat, new) in enumerate(zip(params, self._hat, self._scratch)):
            flat_hat = hat.reshape(-1)
            x = widened(param)
            np.subtract(x.reshape(-1), flat_hat, out=new, dtype=new.dtype)  # d = x - x_hat
            first, second = self._message[2 * i], self._message[2 * i + 1]
            if self.compressor.sparse:
                if self.compressor.kind == "topk":
                    top_k(new, first.size, first)
                else:
                    random_k(self._rng, new.size, first.size, first)
                np.copyto(second, x.reshape(-1)[first], casting="unsafe")  # x_hat_new[idx] = x[idx]
                new[...] = flat_hat
                new[first] = second
            else:
                quantize_int8_(new, second, first)
                dequantize_int8_(second, first, new)
                new += flat_hat
            if self.resync:
                window = self._message[2 * count + i]
                part = new[self._window_slice(new.size, window_index)]
                window[: part.size] = part
                window[part.size :] = 0
        return self._message

    def public_bounds(self) -> tuple[int, ...] | None:
        """Each index array is bounded by its parameter array's size."""
        if not self.compressor.sparse or self._hat is None:
            return None
        bounds = [b for h in self._hat for b in (h.size, 0)]
        return tuple(bounds + [0] * (len(self._message) - len(bounds)))

    def params_of(self, arrays: Sequence[np.ndarray]) -> None:
        """A CHOCO snapshot holds differences, not parameters: nothing to copy or measure."""
        return None

    def _apply(self, hat: Sequence[np.ndarray], message: Sequence[np.ndarray], scratch: Sequence[np.ndarray]) -> None:
        """``x_hat += q`` from a message (assign the new values at the indices, or add the dequantized int8)."""
        for i, h in enumerate(hat):
            first, second = message[2 * i], message[2 * i + 1]
            flat = h.reshape(-1)
            if self.compressor.sparse:
                flat[np.asarray(first, dtype=np.intp)] = second
            else:
                dequantize_int8_(second, first, scratch[i])
                flat += scratch[i]

    def on_publish(self, own: NodeState, published: Sequence[np.ndarray]) -> None:
        """The message went out: ``x_hat_i += q_i`` from the published values; the next one's number and window."""
        assert self._hat is not None
        self._apply(self._hat, published, self._scratch)
        self._count += 1
        own.extras.update(self._extras())

    # ------------------------------------------------------------ receiving and mixing

    def _valid(self, message: Sequence[np.ndarray]) -> bool:
        """A sparse message's indices ascend strictly (the sender sorts them; repeats would make the copies
        depend on the order of assignment). The wire already checked sizes, index range and finiteness."""
        if not self.compressor.sparse:
            return True
        return all(bool(np.all(message[2 * i][1:] > message[2 * i][:-1])) for i in range(len(message) // 2))

    def _copy_for(self, name: str, epoch: int, count: int, clock: float) -> _Copy:
        """My copy of ``name``'s public copy for its message ``count`` of ``epoch``: a new epoch (a first message,
        a restart) starts a copy at zero, as the sender's did; one whose first message is not the epoch's first
        (this node missed it, joined or restarted late) is not mixed until every window has arrived: the copy
        lacks the messages before, and message 0 is Q(x), all of the model under int8, so mixing it would move the
        cluster's mean for good. So is an epoch that starts after this node's first cycle of windows (a node that
        joined or restarted late): its public copy is near zero for long under top-k and random-k (message 0 is
        1 % of the model at ``topk:0.01``), while ours is not, and it waits for our windows before it mixes us."""
        copy = self._copies.get(name)
        if copy is None or copy.epoch != epoch:
            assert self._hat is not None
            copy = _Copy([np.zeros_like(h) for h in self._hat], clock, epoch)
            if count > 0 or (self.resync and self._count > self.resync):
                copy.missing = set(range(self.resync)) if self.resync else {-1}
            self._copies[name] = copy
        return copy

    def _receive(self, peer: PeerSnapshot, scratch: Sequence[np.ndarray]) -> None:
        """Apply one neighbour's message to my copy of its public copy, then its resync window. A message that
        is malformed, or would make the copy non-finite (a hostile int8 scale), is dropped whole."""
        assert self._hat is not None
        count = len(self._hat)
        message, extras = peer.arrays, peer.state.extras
        epoch, number = whole_number(extras.get(EPOCH_KEY)), whole_number(extras.get(COUNT_KEY))
        if len(message) != len(self._message) or not self._valid(message[: 2 * count]) or None in (epoch, number):
            self.dropped += 1
            return
        assert epoch is not None and number is not None
        copy = self._copy_for(peer.state.name, epoch, number, peer.state.clock)
        if number <= copy.last:  # a message already applied (fetched twice)
            return
        if not self._apply_checked(copy.hat, message[: 2 * count], scratch):
            self.dropped += 1
            return
        self.gaps += number - copy.last - 1  # a new copy's last is -1: the messages before its first are gaps
        copy.last, copy.clock = number, peer.state.clock
        window = whole_number(extras.get(WINDOW_KEY))
        if not self.resync or window is None or not 0 <= window < self.resync:
            return
        for i, h in enumerate(copy.hat):
            flat = h.reshape(-1)
            part = self._window_slice(flat.size, window)
            sent = message[2 * count + i][: part.stop - part.start]
            if not copy.missing:
                self.drift += int(np.count_nonzero(flat[part] != sent))
            flat[part] = sent
        copy.missing.discard(window)

    def _apply_checked(
        self, hat: Sequence[np.ndarray], message: Sequence[np.ndarray], scratch: Sequence[np.ndarray]
    ) -> bool:
        """:meth:`_apply` to a received message; False, ``hat`` untouched, when it would leave a non-finite
        value (sparse values are finite already: the wire checked them)."""
        if self.compressor.sparse:
            self._apply(hat, message, scratch)
            return True
        for i, h in enumerate(hat):
            with np.errstate(over="ignore", invalid="ignore"):
                dequantize_int8_(message[2 * i + 1], message[2 * i], scratch[i])
                scratch[i] += h.reshape(-1)
            if not np.isfinite(scratch[i]).all():
                return False
        for i, h in enumerate(hat):
            h.reshape(-1)[...] = scratch[i]
        return True

    def mix(self, own: NodeState, arrays: list[np.ndarray], peers: Sequence[PeerSnapshot]) -> MixOutcome:
        """Apply what arrived to the copies, then ``x += gamma * w * sum_j (x_hat_j - x_hat_i)`` over the
        neighbours whose copies are fresh (``max_staleness``)."""
        self._allocate(arrays)
        assert self._hat is not None
        heard = [p for p in peers if p.state.name != own.name and p.state.name in self._neighbours]
        for peer in heard:
            if not peer.repeat:
                self._receive(peer, self._scratch)
        clocks = [p.state.clock for p in heard if math.isfinite(p.state.clock)]
        if clocks:  # the clock is averaged as D-PSGD's, so that staleness compares nodes' progress fairly
            w = 1.0 / float(self._degree + 1)
            own.clock = math.fsum([w * c for c in clocks] + [(1.0 - w * len(clocks)) * own.clock])
        fresh = [
            name
            for name in self._neighbours
            if name in self._copies
            and not self._copies[name].missing
            and own.clock - self._copies[name].clock <= self.max_staleness
        ]
        step = self.diverge(self.gamma, own.loss) / float(self._degree + 1) if fresh else 0.0
        if step > 0.0:
            for i, (x, hat) in enumerate(zip(arrays, self._hat)):
                pull = self._scratch[i].reshape(hat.shape)  # free again: the messages were applied above
                pull[...] = 0.0
                for name in fresh:
                    pull += self._copies[name].hat[i] - hat
                pull *= step
                pull += widened(x)
                store_(pull, x)
        metrics = {**self.state_metrics(own), "neighbours_mixed": float(len(fresh))}
        return MixOutcome(step * len(fresh), tuple(fresh), metrics)

    def state_metrics(self, own: NodeState) -> dict[str, float]:
        """``choco_drift``, ``choco_dropped`` and ``choco_gaps`` (messages of neighbours never received), counts
        since the start."""
        return {"choco_drift": float(self.drift), "choco_dropped": float(self.dropped), "choco_gaps": float(self.gaps)}

    # ------------------------------------------------------------ checkpoints

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The own public copy ``choco_hat/<i>`` with its epoch and message count, and every neighbour's copy
        ``choco_hat:<name>/<i>`` with the epoch and number of the last message applied to it."""
        if self._hat is None:
            return {}
        out = save_model_arrays(HAT_KEY, self._hat)
        out[EPOCH_KEY] = np.array([self._epoch, self._count], np.int64)
        for name, copy in self._copies.items():
            out.update(save_model_arrays(f"{HAT_KEY}:{name}", copy.hat))
            out[f"{EPOCH_KEY}:{name}"] = np.array([copy.epoch, copy.last], np.int64)
        return out

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], params: Sequence[np.ndarray]) -> bool:
        """Take back the public copies when they fit ``params`` (True): a cluster resumed from its checkpoints
        taken at the same message goes on with the same copies on both ends (one node restored alone from an older
        one does not: docs/rules.md's known limit); False, nothing changed, when they do not fit."""
        own = load_model_arrays(HAT_KEY, arrays, params, compute_dtype)
        if own is None:
            return True
        marks = arrays.get(EPOCH_KEY)
        if own is False or marks is None or np.shape(marks) != (2,):
            return False
        copies: dict[str, _Copy] = {}
        for key in arrays:
            if key.startswith(EPOCH_KEY + ":"):
                name = key[len(EPOCH_KEY) + 1 :]
                hat = load_model_arrays(f"{HAT_KEY}:{name}", arrays, params, compute_dtype)
                if not isinstance(hat, list) or np.shape(arrays[key]) != (2,):
                    return False
                epoch, last = (int(v) for v in arrays[key])
                copies[name] = _Copy(hat, -math.inf, epoch, last)
        self._allocate(params)
        self._hat, self._copies = own, copies
        self._epoch, self._count = (int(v) for v in marks)
        self._cycle = None
        return True
