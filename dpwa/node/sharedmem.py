"""Shared memory between co-located nodes: the segments a node publishes its snapshots in, and a reader's map of
its peers' segments.

A segment is an anonymous memory file (``memfd_create``): no name in ``/dev/shm``, so nothing is left behind
by any exit, a SIGKILL included -- the kernel frees it once the last descriptor and mapping are gone. Only
processes of the same user (and root) can open it, through ``/proc/<pid>/fd/<fd>``: owner-only by
construction. Once sized it is sealed (:data:`SEALS`): its size never changes again, so a map of it can never be
cut short under a reader (a reader refuses an unsealed file, ``shm-seals``). Its first :data:`HEADER_BYTES` bytes::

    b"DPWASHM1" | token: 16 random bytes | gen: u64 | payload bytes: u64 | checked: u64 | (padding to 64)

then the payload (one snapshot's wire buffer, 64-byte aligned). ``gen`` is 0 while the pool writes the
buffer and the snapshot's generation once it is published; a reader checks it before and after use.
``checked`` is the generation whose every value the writer's checker thread found finite after it published
them (0: not checked yet, or not all finite): a reader that mixes straight from the segment takes that check
instead of reading the whole model once more.

Two nodes are *co-located* when :func:`host_identity` is equal: the same kernel boot and the same network,
IPC, PID, mount and time namespaces, the same user. A node in another network namespace (or container, or machine)
has another identity and is never offered a segment; a reader that still cannot open one falls back to TCP.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import hashlib
import logging
import mmap
import os
import secrets
import stat
import struct
from dataclasses import dataclass

import numpy as np

from dpwa.node.wire import SharedRef, WireError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_MAPPED",
    "SEALS",
    "Mapped",
    "Segment",
    "SegmentReader",
    "host_identity",
    "supported",
]

log = logging.getLogger(__name__)

MAGIC = b"DPWASHM1"
MEMFD_PREFIX = "dpwa-"
"""A segment's memfd name starts so; ``/proc/<pid>/fd/<fd>`` of one links to ``/memfd:dpwa-...``."""
MEMFD_LINK = f"/memfd:{MEMFD_PREFIX}"
HEADER_BYTES = 64
"""The segment's header; the payload starts here (a multiple of 64: the wire's buffer alignment)."""
_HEADER = struct.Struct("<8s16sQQQ")
_GEN_OFFSET = 24
_CHECKED_OFFSET = 40
SEALS = sum(getattr(fcntl, seal, 0) for seal in ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL"))
"""The seals a segment gets once sized, and a reader requires: no process (another of the same user writing
through ``/proc/<pid>/fd``) can shrink it under a reader's map, which would end the reader with SIGBUS, nor
grow it or seal it further."""
MAX_MAPPED = 64
"""The most peer segments a reader keeps mapped (least recently used first out)."""


def supported() -> bool:
    """True where segments work: Linux with ``memfd_create``, file seals and ``/proc``."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


@functools.cache
def host_identity() -> str:
    """This process's co-location identity (32 hex digits): a digest of the boot id, the network, IPC, PID, mount
    and time namespaces (a loan's deadline is a ``CLOCK_MONOTONIC`` reading, which time namespaces offset) and the
    user id; "" where shared memory is not supported (then nobody is co-located)."""
    if not supported():
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts = [f.read().strip()]
        parts += [str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("net", "ipc", "pid", "mnt")]
    except OSError:
        return ""
    if os.path.exists("/proc/self/ns/time"):  # Linux >= 5.6: loans end at a CLOCK_MONOTONIC deadline
        parts.append(str(os.stat("/proc/self/ns/time").st_ino))
    parts.append(str(os.getuid()))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


class Segment:
    """One memory file holding a header and ``payload_bytes`` of payload (:attr:`payload`, uint8, writable)."""

    def __init__(self, tag: str, payload_bytes: int) -> None:
        self.fd = os.memfd_create(f"{MEMFD_PREFIX}{tag}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + payload_bytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)  # its size is final: no reader can be cut short
            self._map: mmap.mmap | None = mmap.mmap(self.fd, HEADER_BYTES + payload_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = secrets.token_bytes(16)
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, self.token, 0, payload_bytes, 0)
        whole = np.frombuffer(self._map, np.uint8)
        self.payload = whole[HEADER_BYTES:]
        self._gen = whole[_GEN_OFFSET : _GEN_OFFSET + 8].view("<u8")
        self._checked = whole[_CHECKED_OFFSET : _CHECKED_OFFSET + 8].view("<u8")
        self.closed = False

    def set_gen(self, gen: int) -> None:
        """Say which generation the payload holds (0: being written); nothing checked yet."""
        self._checked[0] = 0
        self._gen[0] = gen

    def set_checked(self, gen: int) -> None:
        """Say that every value of generation ``gen`` (the one held) was found finite."""
        self._checked[0] = gen

    def ref(self, gen: int, until: float) -> SharedRef:
        """How a co-located reader finds this segment, holding ``gen``, lent until ``until`` (monotonic s)."""
        return SharedRef(pid=os.getpid(), fd=self.fd, token=self.token.hex(), until=until)

    def close(self) -> None:
        """Close the descriptor (no reader can open the segment any more); the map stays. Idempotent."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)

    def unmap(self) -> None:
        """Close the descriptor and drop this segment's own views and map (no thread writes it any more): the
        kernel frees it at once unless an array held elsewhere still views it, then with that array. The payload is
        empty after. Idempotent."""
        self.close()
        self.payload = self._gen = self._checked = np.empty(0, np.uint8)
        mapped, self._map = self._map, None
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # an array still views it (and holds the map): unmapped when that array goes
                log.debug("a segment of %d bytes stays mapped until its last view goes", len(mapped))


@dataclass
class _Mapped:
    map: mmap.mmap
    payload: np.ndarray
    gen: np.ndarray
    checked: np.ndarray


@dataclass(frozen=True)
class Mapped:
    """A peer's segment as a reader sees it: the payload (read-only uint8) and the header's words ``gen`` and
    ``checked`` (live: the writer may change them)."""

    payload: np.ndarray
    gen: np.ndarray
    checked: np.ndarray

    def confirm(self, gen: int) -> None:
        """After a copy out of the payload: raise WireError ``shm-torn`` unless the segment still holds ``gen``."""
        if int(self.gen[0]) != gen:
            raise WireError("shm-torn", "the segment was rewritten while it was read")


class SegmentReader:
    """A node's read-only maps of its peers' segments (one thread's), at most :data:`MAX_MAPPED` at a time; a peer
    that answers from another process (it restarted) has the maps of its former process dropped at once, and one
    that is no member any more (:meth:`forget`) has its maps dropped then, so its memory goes with its process."""

    def __init__(self) -> None:
        self._maps: collections.OrderedDict[tuple[int, int, str], _Mapped] = collections.OrderedDict()
        self._pids: dict[str, int] = {}

    def open(self, peer: str, ref: SharedRef, payload_bytes: int, gen: int) -> Mapped:
        """The segment ``ref`` names, after checking it is that segment (token), of ``payload_bytes`` (size) and
        holds ``gen``. Raises WireError ``shm-open``, ``shm-size``, ``shm-token`` or ``shm-gen``."""
        former = self._pids.get(peer)
        if former is not None and former != ref.pid:
            self._drop(former)
        self._pids[peer] = ref.pid
        key = (ref.pid, ref.fd, ref.token)
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._map(ref, payload_bytes)
            self._maps[key] = mapped
            while len(self._maps) > MAX_MAPPED:
                self._maps.popitem(last=False)  # its mapping goes with the last view of it
        else:
            self._maps.move_to_end(key)
        if mapped.payload.nbytes != payload_bytes:
            raise WireError("shm-size", f"segment of {mapped.payload.nbytes} payload bytes, expected {payload_bytes}")
        if int(mapped.gen[0]) != gen:
            raise WireError("shm-gen", f"segment holds generation {int(mapped.gen[0])}, the reply names {gen}")
        return Mapped(mapped.payload, mapped.gen, mapped.checked)

    def _map(self, ref: SharedRef, payload_bytes: int) -> _Mapped:
        path = f"/proc/{ref.pid}/fd/{ref.fd}"
        try:  # what the descriptor is, read without opening it: a forged reply may name a FIFO, a device, a file
            target = os.readlink(path)  # on a hung mount (opening one can block, O_NONBLOCK or not)
        except OSError as exc:
            raise WireError("shm-open", f"cannot open {path}: {exc.strerror}") from None
        if not target.startswith(MEMFD_LINK):
            raise WireError("shm-token", f"{path} is not a dpwa memory file")
        try:  # never blocks (a FIFO swapped in meanwhile), never becomes a controlling terminal
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            raise WireError("shm-open", f"cannot open {path}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WireError("shm-token", f"{path} is not a memory file")
            size = info.st_size
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:  # EINVAL: a file on a disk, not a memory file (it has no seals)
                raise WireError("shm-seals", f"{path} has no seals ({exc.strerror})") from None
            if seals & SEALS != SEALS:
                raise WireError("shm-seals", f"{path} may still change size (not sealed)")
            if size != HEADER_BYTES + payload_bytes:
                raise WireError("shm-size", f"segment of {size} bytes, expected {HEADER_BYTES + payload_bytes}")
            try:
                segment = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                raise WireError("shm-open", f"cannot map {path}: {exc}") from None
        finally:
            os.close(fd)
        magic, token, _, announced, _ = _HEADER.unpack_from(segment)
        if magic != MAGIC or token.hex() != ref.token:
            raise WireError("shm-token", f"{path} is not the segment the reply names")
        if announced != payload_bytes:
            raise WireError("shm-size", f"segment announces {announced} payload bytes, expected {payload_bytes}")
        whole = np.frombuffer(segment, np.uint8)
        words = [whole[at : at + 8].view("<u8") for at in (_GEN_OFFSET, _CHECKED_OFFSET)]
        return _Mapped(segment, whole[HEADER_BYTES:], *words)

    def forget(self, peer: str) -> int:
        """``peer`` is no member any more: drop the maps of its process (each unmapped once no array views it, so a
        loan still being mixed stays readable); how many were dropped."""
        pid = self._pids.pop(peer, None)
        if pid is None or pid in self._pids.values():
            return 0
        return self._drop(pid)

    def _drop(self, pid: int) -> int:
        keys = [key for key in self._maps if key[0] == pid]
        for key in keys:
            del self._maps[key]
        return len(keys)

    def mapped(self) -> int:
        """Segments mapped now."""
        return len(self._maps)

    def close(self) -> None:
        """Forget every map (each unmapped once no array views it)."""
        self._maps.clear()
        self._pids.clear()
