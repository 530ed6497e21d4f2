"""Fetching: jobs the TX thread runs into this node's preallocated receive buffers, and their verdicts.

Every transfer pattern fetches: a pull rule every round, an exchange rule one peer a round (its job carries the
exchange's push), a push rule only to bootstrap. :class:`Fetcher` owns what that takes:

* the receive buffers (one per peer a round can fetch), allocated at the first publish;
* the job ``update_send`` started (:attr:`Fetcher.pending`), waited for by ``update_wait`` at most until its
  deadline plus the verdict slack, a target still without a verdict then timed out here (``late``);
* the generation of the snapshot last fetched from each peer, so that a reply holding the very snapshot fetched
  last time is marked a ``repeat`` (the peer published nothing since);
* each verdict's counting, logging and flow-control effect (:meth:`Fetcher.fetch_done`, on the TX thread);
* whether the node trains alone (no peer up), said once when it starts and once when a peer answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from dpwa.metrics import DECLINED_CODES, fetch_reason
from dpwa.node.states import FetchStatus, fetch_effect
from dpwa.node.transfers.host import Host
from dpwa.node.transport import FetchJob, FetchTarget
from dpwa.node.wire import Layout, State
from dpwa.rules import NodeState, PeerSnapshot
from dpwa.rules.schedules import Round

__all__ = ["FIRST_MIX_BYTES_PER_S", "LEND_MARGIN_S", "Fetcher", "loan_holds_until", "round_peers"]

log = logging.getLogger(__name__)

LEND_MARGIN_S = 1.0
"""A lent reply is mixed only if its loan has this many seconds left, plus twice the longest this node has held a
loan from collecting it to giving it back (:func:`loan_holds_until`): the mix ends well before the server may
reuse the buffer, however large the model (a mix of a few GB takes seconds)."""


FIRST_MIX_BYTES_PER_S = 1e9
"""What a mix is assumed to read per second until this node has held a loan (a pessimistic figure: measured mixes
run at 1.25x a memcpy, several GB/s): the hold a loan must outlast, ``longest_hold_s``, starts at the model's bytes
over it."""


def loan_holds_until(until: float, now: float, longest_hold_s: float) -> bool:
    """Whether a loan ending at ``until`` (monotonic s) may still be mixed at ``now``: more than
    ``LEND_MARGIN_S + 2 * longest_hold_s`` left, ``longest_hold_s`` the longest this node has held one."""
    return now < until - (LEND_MARGIN_S + 2.0 * longest_hold_s)


def round_peers(host: Host) -> tuple[list[str], bool]:
    """This round's peers, to fetch from or push to: the schedule's (down peers left out unless a probe is due),
    else flow control's choice (among the schedule's candidates); and whether any peer was wanted at all."""
    with host.state_lock:
        rnd = Round(host.name, host.names, host.step, host.state)
        wanted = host.schedule.targets(rnd)
        among = host.schedule.candidates(rnd) if wanted is None else None
    with host.flow_lock:
        if wanted is None:
            chosen = host.flow.choose(host.schedule.fanout, among)
        else:
            chosen = host.flow.admit([p for p in wanted if p != host.name])
    return chosen, wanted is None or bool(wanted)


class Fetcher:
    """One node's fetch jobs (see the module doc-string). The trainer's thread starts and waits for jobs; the TX
    thread reports verdicts through :meth:`fetch_done`; :meth:`forget` may come from any thread."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.slots: list[tuple[np.ndarray, list[np.ndarray]]] = []
        """The receive buffers: (flat buffer, its views in the node's receive layout: ``receive_layout``)."""
        self.pending: FetchJob | None = None
        """The job ``update_send`` started and ``update_wait`` has not waited for yet."""
        self._waited: FetchJob | None = None
        self.alone = False
        """No peer was up at the latest fetch: the node trains alone until one answers."""
        self._gens: dict[str, int] = {}
        self._gens_lock = threading.Lock()
        self._layout: Layout | None = None
        """The receive layout :meth:`allocate` was given."""
        self._lent: list[tuple[FetchTarget, int]] = []
        """The targets of the collected job whose views lie in a peer's segment, with the job's request id."""
        self._collected = 0.0
        """When the collected job's loans were checked (monotonic s)."""
        self.longest_hold_s = 0.0
        """The longest this node held loans from :meth:`collect` to :meth:`give_back` (the mix reading them); before
        the first, from :meth:`allocate` on, the model's bytes over FIRST_MIX_BYTES_PER_S."""
        self._held = False
        """A hold was measured: ``longest_hold_s`` is measured, no more the first estimate."""
        self._measure = False
        """The collected job had a lent reply (mixed in place or copied out): :meth:`give_back` measures the mix."""

    def allocate(self, layout: Layout, count: int) -> None:
        """Allocate ``count`` receive buffers in ``layout`` (once, at the first publish; 0: a node that never
        fetches, which still gets one if it bootstraps: :meth:`fetch_one`)."""
        self._layout = layout
        # before any loan was held, a mix is assumed to read FIRST_MIX_BYTES_PER_S: a model of a few GB is not
        # mixed straight from a segment whose loan ends within the second of LEND_MARGIN_S (it is copied out)
        if not self._held:
            self.longest_hold_s = layout.total_bytes / FIRST_MIX_BYTES_PER_S
        for _ in range(count):
            self._add_slot(layout)

    def _add_slot(self, layout: Layout) -> None:
        buffer = layout.allocate()
        self.slots.append((buffer, layout.views(buffer)))

    def in_flight(self) -> bool:
        """True while the pending job has a target without a verdict (any thread)."""
        job = self.pending
        return job is not None and not job.done.is_set()

    # ------------------------------------------------------------ trainer thread: the step

    def plan(self) -> tuple[list[FetchTarget], dict[str, Any]] | None:
        """``update_send``: this round's targets (one receive buffer each) and the rule's request extras, or None
        when no fetch starts: the previous one is still in flight, ``fetch_probability`` said no, the schedule
        wants no peer this round, or no peer is up (counted in ``fetches_skipped``; the node then trains alone,
        said once)."""
        host = self.host
        if self.in_flight():
            host.stats.add("fetches_skipped")  # update_wait was not called for the previous fetch
            return None
        if self.pending is not None:  # done, never waited for (update_send twice): give back what it was lent
            for target in self.pending.targets:
                if target.loan is not None:
                    target.loan, target.views = None, []
                    host.transport.submit_release(target.peer, self.pending.req)
        self.pending = None
        if host.rng.random() >= host.config.fetch_probability:
            return None
        with host.state_lock:
            extras = host.rule.request_extras(host.state)
        chosen, wanted = round_peers(host)
        if not wanted:  # the schedule wants nobody this round (an outer optimizer's local steps): nothing skipped
            return None
        chosen = chosen[: len(self.slots)]
        if not chosen:
            host.stats.add("fetches_skipped")
            if not self.alone and len(host.names) > 1 and wanted:
                log.warning("node %s: no peer to fetch is up; training alone (factor 0) until one answers", host.name)
            self.alone = True
            return None
        return [FetchTarget(peer, buf, views) for peer, (buf, views) in zip(chosen, self.slots)], extras

    def job(self, targets: list[FetchTarget], extras: dict[str, Any], *, lend: bool = False) -> FetchJob:
        """A job for ``targets`` with the next request id, due one exchange timeout from now; ``lend``: a
        shared-memory reply stays in the peer's segment until :meth:`give_back` (after the mix)."""
        deadline = time.monotonic() + self.host.timeouts.exchange_s
        return FetchJob(next(self.host.requests), targets, deadline, extras, lend=lend)

    def submit(self, job: FetchJob) -> None:
        """Hand ``job`` to the TX thread; it is the pending job until ``update_wait``."""
        self.pending = job
        self.host.transport.submit(job)

    def wait(self) -> None:
        """``update_wait``: wait for the pending job's verdicts (bounded); a target without one is timed out."""
        job, self.pending = self.pending, None
        for target in job.wait() if job is not None else ():  # a busy or stalled TX thread: timed out here
            self.fetch_done(job, target)
        self._waited = job

    def collect(self) -> tuple[list[FetchTarget], list[PeerSnapshot]]:
        """After :meth:`wait`: the job's targets, and its replies that came whole as peers for the rule. A reply
        lent in shared memory whose loan ends too soon for the mix (:func:`loan_holds_until`: a local step longer
        than the loan) is copied into its receive buffer and given back at once (``shm_loans_copied``), or left out
        (``shm_loans_lapsed``) when its peer's segment no longer holds it; :meth:`give_back` ends the other loans
        once the rule is done."""
        job, self._waited = self._waited, None
        targets, req = (job.targets, job.req) if job is not None else ([], 0)
        self._collected = time.monotonic()
        # a mix of a lent reply, in place or copied out, measures how long a hold lasts
        self._measure = any(t.status == FetchStatus.OK and t.loan is not None for t in targets)
        peers = []
        for t in targets:
            if t.status != FetchStatus.OK or t.header is None:
                continue
            if t.loan is not None and not self._loan_holds(t) and not self._copy_out(t, req):
                continue
            peers.append(self.fetched(t))
        # only an ok target keeps its loan for the rule (the TX thread gives back any other one itself)
        self._lent = [(t, req) for t in targets if t.status == FetchStatus.OK and t.loan is not None]
        return targets, peers

    def _loan_holds(self, target: FetchTarget) -> bool:
        """The lent segment still holds the generation fetched, with its loan not ending within the margin."""
        assert target.loan is not None and isinstance(target.header, State) and target.header.shm is not None
        word, gen = target.loan
        return int(word[0]) == gen and loan_holds_until(target.header.shm.until, time.monotonic(), self.longest_hold_s)

    def _copy_out(self, target: FetchTarget, req: int) -> bool:
        """A lent reply whose loan ends too soon: copy it into its receive buffer, confirming the segment held the
        generation fetched before and after (a rewrite begins by changing it), and give the loan back now. False
        (counted ``shm_loans_lapsed``, nothing to mix) when the segment holds another generation."""
        assert target.loan is not None
        word, gen = target.loan
        views = next(v for b, v in self.slots if b is target.buffer)
        copied = int(word[0]) == gen
        if copied:
            for mine, lent in zip(views, target.views):
                np.copyto(mine, lent)
            copied = int(word[0]) == gen
        target.loan, target.views = None, views
        self.host.transport.submit_release(target.peer, req)
        self.host.stats.add("shm_loans_copied" if copied else "shm_loans_lapsed")
        return copied

    def give_back(self) -> None:
        """The rule is done with the collected job's lent replies: check each segment still held what was mixed
        (else counted ``shm_torn`` and logged: a loan outlived), then RELEASE each (TX thread)."""
        lent, self._lent = self._lent, []
        if self._measure:
            self._measure = False
            held = time.monotonic() - self._collected
            self.longest_hold_s = max(self.longest_hold_s, held) if self._held else held
            self._held = True
        for target, req in lent:
            loan, target.loan, target.views = target.loan, None, []
            if loan is None:  # pragma: no cover - given back already
                continue
            word, gen = loan
            if int(word[0]) != gen:
                self.host.stats.add("shm_torn")
                log.error("node %s: %s rewrote a lent snapshot while it was mixed", self.host.name, target.peer)
            self.host.transport.submit_release(target.peer, req)

    def closed(self) -> None:
        """The node's threads stopped: drop what a job not given back still views of its peers' segments (a close
        between update_send and update_wait; the loans end at their deadlines, no RELEASE goes out any more)."""
        jobs = [job for job in (self.pending, self._waited) if job is not None]
        for target in [t for job in jobs for t in job.targets] + [t for t, _ in self._lent]:
            if target.loan is not None:
                target.loan, target.views = None, []
        self._lent = []

    def fetched(self, target: FetchTarget) -> PeerSnapshot:
        """A fetched reply as a peer for the rule, marked ``repeat`` when it holds the very snapshot (same
        generation) this node fetched from that peer last time: the peer has published nothing since."""
        header = target.header
        assert header is not None
        with self._gens_lock:
            repeat = header.gen >= 1 and self._gens.get(target.peer) == header.gen
            self._gens[target.peer] = header.gen
        self.host.note_front(header.front)
        return PeerSnapshot(
            NodeState(target.peer, header.clock, header.loss, dict(header.extras)), target.views, repeat=repeat
        )

    def fetch_one(self, peer: str, deadline: float) -> PeerSnapshot | None:
        """Fetch ``peer``'s snapshot into the first receive buffer, waiting at most until one exchange timeout from
        now (or ``deadline``, if sooner) plus the verdict slack; the snapshot, or None when it did not come. A node
        that allocated no receive buffer (it never fetches: AD-PSGD's passive nodes) allocates one now."""
        if not self.slots:
            assert self._layout is not None, "fetch_one before the first publish"
            self._add_slot(self._layout)
        buffer, views = self.slots[0]
        target = FetchTarget(peer, buffer, views)
        due = min(deadline, time.monotonic() + self.host.timeouts.exchange_s)
        job = FetchJob(next(self.host.requests), [target], due)
        self.host.transport.submit(job)
        for late in job.wait():  # the TX thread is late: time the fetch out here, as update_wait does
            self.fetch_done(job, late)
        if target.status != FetchStatus.OK or target.header is None:
            return None
        return self.fetched(target)  # its generation is recorded: a copied snapshot is not mixed again

    def forget(self, peer: str) -> None:
        """``peer`` was forgotten: drop the generation last fetched from it."""
        with self._gens_lock:
            self._gens.pop(peer, None)

    # ------------------------------------------------------------ TX thread

    def fetch_done(self, job: FetchJob, target: FetchTarget) -> None:
        """Count a finished fetch, take the member news of its answer, feed flow control, say what went wrong."""
        host, peer = self.host, target.peer
        host.stats.peer_outcome(peer, target.status)
        if target.header is not None and target.status in (FetchStatus.OK, FetchStatus.REFUSED):
            # an answer from the peer's own address (with CURVE, its key) is its word: its "left" is taken
            host.membership.observe(target.header, authenticated=target.header.node == peer)
        if target.status == FetchStatus.OK:
            host.stats.fetch_done(target.ms, target.nbytes)
        else:
            host.stats.outcome(fetch_reason(target.status, target.code, target.late) or target.status)
        host.flow_outcome(peer, fetch_effect(target.status, target.code))
        if target.status != FetchStatus.OK:
            self._failed(target)
        elif self.alone:
            log.info("node %s: peer %s answers; mixing again", host.name, peer)
            self.alone = False

    def _failed(self, target: FetchTarget) -> None:
        """Count a fetch that did not end ok by its kind, and say so once per peer and reason."""
        host, peer, once = self.host, target.peer, self.host.once
        if target.status == FetchStatus.TIMEOUT and target.late:
            host.stats.add("fetches_timed_out")
            host.stats.add("fetches_late")
            once.warning(
                (peer, "late"), "node %s: no verdict on %s by the deadline: the TX thread is late", host.name, peer
            )
        elif target.status == FetchStatus.TIMEOUT:
            host.stats.add("fetches_timed_out")
            once.warning((peer, "timeout"), "node %s: peer %s did not answer in time", host.name, peer)
        elif target.status == FetchStatus.REFUSED:
            host.stats.refuse(target.code)
            once.warning(
                (peer, target.code),
                "node %s: peer %s refused: %s (%s)",
                host.name,
                peer,
                target.code,
                target.detail,
                # a peer starting up, busy, or gone has declined, not failed: routine
                level=logging.INFO if target.code in DECLINED_CODES else logging.WARNING,
            )
        else:
            host.stats.reject(target.code, target.nbytes)
            once.warning(
                (peer, target.code),
                "node %s: dropped a reply from %s (%s%s)",
                host.name,
                peer,
                target.code,
                f": {target.detail}" if target.detail else "",
            )
