"""Network namespaces for the multi-host tests: build, cut, heal and clean up only what this process made.

Every namespace is named ``dpwa-t-<pid>-<short>`` and every link is a veth pair
created directly between two of these namespaces, with addresses in
``10.222.<pid % 250>.0/24`` that exist only inside them: nothing is added to the
host's namespace, so only loopback and these namespaces ever see traffic.

    with Lab() as lab:
        a, b = lab.namespace("a"), lab.namespace("b")
        lab.veth(a, "ab", "10.222.7.1/30", b, "ba", "10.222.7.2/30")
        subprocess.Popen([*lab.exec_prefix(a), "python", ...])

``Lab.close`` (also run on an exception, KeyboardInterrupt included, and at
interpreter exit) deletes every namespace it made -- which deletes their veths and
qdiscs with them -- and namespaces left behind by earlier runs whose process is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

PREFIX = "dpwa-t-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-\w+$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Names of every network namespace that ``ip netns`` knows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Delete dpwa-t-<pid>-* namespaces whose creating process no longer exists (a run that was SIGKILLed)."""
    removed = []
    for name in namespaces():
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Lab:
    """The namespaces and links of one test; ``close`` removes all of them."""

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.subnet = f"10.222.{os.getpid() % 250}"
        self.made: list[str] = []
        self._closed = False
        atexit.register(self.close)

    def namespace(self, short: str) -> str:
        name = self.prefix + short
        _ip("netns", "add", name)
        self.made.append(name)
        self.ip(name, "link", "set", "lo", "up")
        return name

    def ip(self, ns: str, *args: str) -> str:
        """``ip -n NS ARGS...``; raises with ip's message on failure."""
        done = _ip("-n", ns, *args, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ip -n {ns} {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def run(self, ns: str, *argv: str) -> str:
        """A command inside ``ns``; raises with its message on failure."""
        done = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {ns}: {done.stderr.strip()}")
        return done.stdout

    def veth(self, a: str, a_dev: str, a_addr: str, b: str, b_dev: str, b_addr: str) -> None:
        """A veth pair from ``a`` to ``b``, created in them (never in the host's namespace), addressed and up."""
        _ip("link", "add", a_dev, "netns", a, "type", "veth", "peer", "name", b_dev, "netns", b)
        for ns, dev, addr in ((a, a_dev, a_addr), (b, b_dev, b_addr)):
            self.ip(ns, "addr", "add", addr, "dev", dev)
            self.ip(ns, "link", "set", dev, "up")

    def route(self, ns: str, prefix: str, via: str) -> None:
        self.ip(ns, "route", "replace", prefix, "via", via)

    def forwarding(self, ns: str) -> None:
        """Let ``ns`` route between its links (a per-namespace sysctl)."""
        self.run(ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")

    def rate_limit(self, ns: str, dev: str, rate: str = "5mbit") -> None:
        """A token-bucket bandwidth cap on ``dev``'s egress."""
        self.run(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "50ms")

    def link(self, ns: str, dev: str, up: bool) -> None:
        self.ip(ns, "link", "set", dev, "up" if up else "down")

    @staticmethod
    def exec_prefix(ns: str) -> Sequence[str]:
        return ("ip", "netns", "exec", ns)

    def close(self) -> None:
        """Delete every namespace made here (their links go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        return [n for n in namespaces() if n.startswith(self.prefix)]

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
