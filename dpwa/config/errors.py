"""The error of a bad cluster file: file, line and key, and the reason (dpwa/config/cluster.py raises it)."""

from __future__ import annotations

__all__ = ["MEMORY", "ConfigError", "error_in_memory"]

MEMORY = "<memory>"
"""The ``file`` of a config built in memory (no file, no lines)."""


class ConfigError(ValueError):
    """Invalid cluster file: ``str(err)`` is ``"<file>:<line>: <key>: <reason>"``.

    ``line`` is 1-based (``None`` when unknown, then ``":<line>"`` is left out);
    ``key`` is a path such as ``"nodes[1].port"`` (``None`` when no key applies).
    """

    def __init__(self, reason: str, file: str = MEMORY, line: int | None = None, key: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.file = file
        self.line = line
        self.key = key or None

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.reason}" if self.key else f"{where}: {self.reason}"

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, int | None, str | None]]:
        return type(self), (self.reason, self.file, self.line, self.key)


def error_in_memory(key: str, reason: str) -> ConfigError:
    """The error of ``key`` in a config built in memory: no file, no line."""
    return ConfigError(reason, MEMORY, None, key)
