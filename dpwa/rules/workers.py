"""Mix workers: the blocks of a large mix split over threads, so that the mix reads memory with more than one core.

The mix kernels (:mod:`dpwa.rules.mixing`) run an array's blocks through :func:`run_ranges`: on the calling
thread alone, unless that thread holds a :class:`MixWorkers` (``with workers.active(): rule.mix(...)``) and the
array has at least :data:`PARALLEL_MIN` elements. Then ``[0, n)`` splits into ``threads`` contiguous ranges on
block boundaries (:func:`split_ranges`); the caller takes the first, the workers the others, and the call returns
once every range is done. The blocks are independent and computed the same whoever computes them, so the result
is bit-for-bit the serial one. numpy releases the GIL inside its loops; each range gets its own scratch.

The node owns one :class:`MixWorkers` (``transport: {mix_threads: auto|N}``) and closes it when it closes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PARALLEL_MIN", "MixWorkers", "current_workers", "run_ranges", "split_ranges", "splitting"]

PARALLEL_MIN = 1 << 20
"""Elements an array needs before its mix is split (1M: a few ms of work against ~50 us to hand a range over)."""

_local = threading.local()


def split_ranges(n: int, parts: int, block: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` contiguous, non-empty ranges of whole blocks (the last block may be
    short), as even as the blocks allow; ``[]`` for ``n == 0``."""
    if n <= 0:
        return []
    blocks = -(-n // block)
    parts = max(1, min(parts, blocks))
    edges = [min(n, (blocks * i // parts) * block) for i in range(parts + 1)]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


class MixWorkers:
    """``threads - 1`` worker threads (the caller is the last), started at the first split mix, stopped by
    :meth:`close`. ``threads == 1``: every mix runs on the caller."""

    def __init__(self, threads: int, name: str = "dpwa-mix") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def active(self) -> Iterator[MixWorkers]:
        """Within the block, the mix kernels this thread calls split large arrays over these workers."""
        previous = getattr(_local, "workers", None)
        _local.workers = self
        try:
            yield self
        finally:
            _local.workers = previous

    def submit(self, fn: Callable[[], None]) -> Future[None] | None:
        """Run ``fn`` on a worker; None when there is none -- one thread, closed, or the interpreter shutting down
        (a node closed at exit still mixes): the caller runs it itself."""
        with self._lock:
            if self._closed or self.threads == 1:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
            try:
                return self._pool.submit(fn)
            except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown": nothing was queued
                return None

    def close(self) -> None:
        """Stop the worker threads, after the ranges they were given (mixes after this run on the caller)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def current_workers() -> MixWorkers | None:
    """The workers the calling thread made active (:meth:`MixWorkers.active`), if any."""
    return getattr(_local, "workers", None)


def splitting(n: int) -> MixWorkers | None:
    """The workers a mix of ``n`` elements on this thread splits over: the active ones, when they have more than one
    thread and ``n >= PARALLEL_MIN``; else None (the mix runs whole on this thread)."""
    workers = current_workers()
    return workers if workers is not None and workers.threads > 1 and n >= PARALLEL_MIN else None


def run_ranges(n: int, block: int, body: Callable[[int, int], None]) -> None:
    """``body(start, stop)`` over ``[0, n)``: in one call on this thread, or -- when it is :func:`splitting` --
    one call per range of :func:`split_ranges`, the first on this thread. Returns once every range is done; the
    first exception of a range is raised after all have ended (none is left writing)."""
    workers = splitting(n)
    if workers is None:
        if n > 0:
            body(0, n)
        return
    ranges = split_ranges(n, workers.threads, block)
    futures: list[Future[None]] = []
    error: BaseException | None = None
    try:
        local: list[tuple[int, int]] = [ranges[0]]
        for start, stop in ranges[1:]:
            future = workers.submit(lambda a=start, b=stop: body(a, b))
            if future is None:
                local.append((start, stop))
            else:
                futures.append(future)
        for start, stop in local:
            body(start, stop)
    except BaseException as exc:  # noqa: BLE001 - re-raised once the workers' ranges have ended
        error = exc
    for future in futures:
        error = _wait_for(future, error)
    if error is not None:
        raise error


def _wait_for(future: Future[None], error: BaseException | None) -> BaseException | None:
    """Wait until ``future`` is done, even through an interrupt (a Ctrl-C while waiting is kept, not let out
    while the range still writes); the first error seen so far, or the range's own."""
    while True:
        try:
            future.result()
            return error
        except BaseException as exc:  # noqa: BLE001 - the range's error, or an interrupt of the wait
            error = error or exc
            if future.done():
                return error
