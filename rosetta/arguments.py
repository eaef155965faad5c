"""What the subcommands share: the usage error (exit code 2), comma-separated lists, and the
checks of an argument made before any work starts."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

CommandLine = Callable[[list[str]], int]  # the `rosetta` entry point (rosetta.main.main): argv -> exit code


class UsageError(Exception):
    """Bad command-line usage: exit code 2."""


def comma_list(value: str | None) -> list[str] | None:
    """'a, b' -> ['a', 'b']; None, '', 'all' and 'auto' -> None (the command's default)."""
    if value is None or value in ("", "all", "auto"):
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def writable_folder(path: Path, option: str) -> Path:
    """Make sure a folder can be written before a long run, not after it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot write there ({error.strerror or error})") from None
    return path


def positive_integer(value: str, option: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(f"{option} takes a positive integer or auto, got {value!r}")
    return number
