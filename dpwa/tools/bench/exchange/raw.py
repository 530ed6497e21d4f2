"""(a) ``raw`` and (a2) ``raw chunked``: the model's float32 bytes over loopback pyzmq, no dpwa framing at all.

The peer runs a :class:`RawServer`, a ROUTER that answers ``get`` with its whole buffer as one zero-copy frame
and ``chunks`` with one zero-copy message per :data:`~dpwa.node.wire.CHUNK_BYTES` chunk (dpwa's framing,
without validation). The trainer's :class:`RawClient`, a DEALER, asks and receives into a preallocated
buffer: (a) the one frame -- the transport's limit, what moving the bytes costs; (a2) each chunk into its
place as it lands -- a stricter limit, since libzmq receives one 100 MB frame into a freshly mapped buffer
(page faults on every byte) but 4 MiB ones into reused heap memory.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq

from dpwa.node.wire import CHUNK_BYTES

__all__ = ["RawClient", "RawServer"]


class RawServer(threading.Thread):
    """(a)'s server: a ROUTER answering every request with ``buffer`` as one zero-copy frame."""

    def __init__(self, ctx: zmq.Context, port: int, buffer: np.ndarray) -> None:
        super().__init__(name="bench-raw", daemon=True)
        from dpwa.node.transport import tune_data_socket

        raw = buffer.reshape(-1).view(np.uint8)
        self._buffer = raw
        self._chunks = [memoryview(raw[s : s + CHUNK_BYTES]) for s in range(0, raw.size, CHUNK_BYTES)]
        self._stop_flag = threading.Event()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        tune_data_socket(self._sock)
        self._sock.bind(f"tcp://127.0.0.1:{port}")

    def run(self) -> None:
        try:
            while not self._stop_flag.is_set():
                if self._sock.poll(100):
                    identity, what = self._sock.recv_multipart()
                    if what == b"chunks":  # (a2): one message per chunk
                        for chunk in self._chunks:
                            self._sock.send(identity, zmq.SNDMORE)
                            self._sock.send(zmq.Frame(chunk, copy=False), copy=False)
                        continue
                    self._sock.send(identity, zmq.SNDMORE)
                    self._sock.send(zmq.Frame(memoryview(self._buffer), copy=False), copy=False)
        finally:
            self._sock.close(linger=0)

    def stop(self) -> None:
        """Stop serving and wait (up to 2 s) for the thread to close its socket."""
        self._stop_flag.set()
        self.join(2.0)


class RawClient:
    """(a) and (a2)'s client: a DEALER connected to the peer's :class:`RawServer` on ``port``."""

    def __init__(self, ctx: zmq.Context, port: int, nbytes: int, timeout_s: float) -> None:
        from dpwa.node.transport import tune_data_socket

        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.buffer = np.zeros(nbytes, np.uint8)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        tune_data_socket(self._sock)
        self._sock.connect(f"tcp://127.0.0.1:{port}")

    def fetch(self) -> float:
        """(a): one frame of the whole model; its milliseconds."""
        t0 = time.perf_counter()
        self._sock.send(b"get")
        if not self._sock.poll(int(self.timeout_s * 1000)):
            raise TimeoutError("raw fetch: no reply")
        got = self._sock.recv_into(self.buffer)
        ms = (time.perf_counter() - t0) * 1000.0
        if got != self.nbytes:
            raise RuntimeError(f"raw fetch: {got} bytes, expected {self.nbytes}")
        return ms

    def fetch_chunked(self) -> float:
        """(a2): one message per chunk, each received into its place as it lands; its milliseconds."""
        t0 = time.perf_counter()
        self._sock.send(b"chunks")
        for start in range(0, self.nbytes, CHUNK_BYTES):
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError("raw chunked fetch: no reply")
            end = min(start + CHUNK_BYTES, self.nbytes)
            if self._sock.recv_into(self.buffer[start:end]) != end - start:
                raise RuntimeError("raw chunked fetch: a chunk of the wrong size")
        return (time.perf_counter() - t0) * 1000.0

    def close(self) -> None:
        """Close the socket at once (no linger)."""
        self._sock.close(linger=0)
