"""(a) ``raw`` and (a2) ``raw chunked``: the model's float32 bytes over loopback pyzmq, no dpwa framing at all;
(a3) ``tcp``: the same bytes over a plain TCP socket, no ZeroMQ.

The peer runs a :class:`RawServer`, a ROUTER that answers ``get`` with its whole buffer as one zero-copy frame
and ``chunks`` with one zero-copy message per :data:`~dpwa.node.wire.CHUNK_BYTES` chunk (dpwa's framing,
without validation). The trainer's :class:`RawClient`, a DEALER, asks and receives into a preallocated
buffer: (a) the one frame -- the transport's limit, what moving the bytes costs; (a2) each chunk into its
place as it lands -- a stricter limit, since libzmq receives one 100 MB frame into a freshly mapped buffer
(page faults on every byte) but 4 MiB ones into reused heap memory. (a3) is the floor of any fetch over a
kernel socket: the peer's ``sendall`` of the buffer, received with ``recv_into`` straight into place (the kernel's
two copies, and none of libzmq's: libzmq receives into a message of its own, then copies it out).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import zmq

from dpwa.node.wire import CHUNK_BYTES

__all__ = ["RawClient", "RawServer", "TcpClient", "TcpServer"]


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


class TcpServer(threading.Thread):
    """(a3)'s server: a plain TCP listener on 127.0.0.1:``port`` answering every request byte with ``buffer``."""

    def __init__(self, port: int, buffer: np.ndarray, send_timeout_s: float = 60.0) -> None:
        super().__init__(name="bench-tcp", daemon=True)
        self._view = memoryview(buffer.reshape(-1).view(np.uint8))
        self._send_timeout_s = send_timeout_s
        self._stop_flag = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(0.1)  # seconds: how often the accept loop looks at the stop flag

    def run(self) -> None:
        try:
            while not self._stop_flag.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with conn, contextlib.suppress(OSError):  # a client gone mid-send, or one that stopped reading
                    self._serve(conn)
        finally:
            self._listener.close()

    def _serve(self, conn: socket.socket) -> None:
        """Answer ``conn``'s requests until it closes or the server stops."""
        conn.settimeout(0.1)
        while not self._stop_flag.is_set():
            try:
                request = conn.recv(1)
            except TimeoutError:
                continue
            if not request:
                return
            conn.settimeout(self._send_timeout_s)
            conn.sendall(self._view)
            conn.settimeout(0.1)

    def stop(self) -> None:
        """Stop serving and wait (up to 2 s) for the thread to close its sockets."""
        self._stop_flag.set()
        self.join(2.0)


class TcpClient:
    """(a3)'s client: one TCP connection to the peer's :class:`TcpServer` on ``port``."""

    def __init__(self, port: int, nbytes: int, timeout_s: float) -> None:
        self.nbytes = nbytes
        self.buffer = np.zeros(nbytes, np.uint8)
        self._view = memoryview(self.buffer)
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fetch(self) -> float:
        """(a3): ask, then receive the whole buffer into place; its milliseconds (TimeoutError past the timeout)."""
        t0 = time.perf_counter()
        self._sock.sendall(b"g")
        got = 0
        while got < self.nbytes:
            n = self._sock.recv_into(self._view[got:])
            if n == 0:
                raise RuntimeError(f"tcp fetch: the peer closed after {got} of {self.nbytes} bytes")
            got += n
        return (time.perf_counter() - t0) * 1000.0

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()
