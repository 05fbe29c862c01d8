"""The command-line pieces ``urc replay`` and ``urc fleet`` share: the parser with one-line
usage errors, the help formatter, the value types, the path checks and the usage-error line.

Standard library only, so ``--help`` and every usage error answer before torch, asyncio, the
cache or the service are imported.  A usage error is one line on stderr that names the flag
as the command line spells it, and exit status 2::

    urc fleet: error: argument --replicas: must be an integer >= 1, got '0' (see 'urc fleet --help')

The value types raise ``argparse.ArgumentTypeError`` (argparse adds ``argument --flag:``);
the checks made after parsing return the problem as text (``None``: none), and the caller
prints it with :func:`usage_error`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

__all__ = [
    "USAGE_ERROR",
    "HelpFormatter",
    "Parser",
    "directory_problem",
    "non_negative_float",
    "number",
    "output_path_problem",
    "positive_float",
    "positive_int",
    "probe_write",
    "trace_problem",
    "usage_error",
]

USAGE_ERROR = 2
"""The exit status of a usage error (argparse's)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``<prog>: error: argument --flag: problem``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where the help text does not already say the default and
    there is one to show (not ``None`` or a switch's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def usage_error(prog: str, flag: str, problem: str) -> int:
    """Print the usage-error line for ``flag`` (as the command line spells it) to stderr;
    returns :data:`USAGE_ERROR`."""
    print(f"{prog}: error: argument {flag}: {problem} (see '{prog} --help')", file=sys.stderr)
    return USAGE_ERROR


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def number(text: str) -> float:
    """Any number (``float``)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probe_write(directory: Path) -> str | None:
    """Create and remove a file in ``directory``: the only test that holds for root (whom
    ``os.access`` always allows) and for ``/proc`` or ``/sys``, which refuse new files."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".urc-write-probe-")
    except OSError as exc:
        return f"cannot create files in directory {directory}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None


def output_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot receive an output file, or ``None`` when it can (``-``: stdout).

    Checked before a run starts, so a finished run is never lost to a bad path: an existing
    file is opened for appending (nothing is written), a new one is probed by creating and
    removing a file beside it."""
    if str(path) == "-":
        return None
    if path.is_dir():
        return f"{path} is a directory (give a file name)"
    parent = path.parent
    for above in (parent, *parent.parents):
        if above.exists():
            if not above.is_dir():
                return f"{above} is not a directory"
            break
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
        return None
    return probe_write(parent)


def trace_problem(path: Path) -> str | None:
    """Why ``path`` is not a trace that can be read (a file, or a directory of agentic
    session files), or ``None``."""
    if not path.exists():
        return f"{path}: no such file or directory"
    if path.is_dir():
        if not any(path.glob("*.json")):
            return f"{path} is a directory without session files (*.json)"
        return None
    if not os.access(path, os.R_OK):
        return f"{path} is not readable"
    return None


def directory_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a directory the run writes in, or ``None``.  Creates it when
    missing (the run would), so a path that cannot be one fails now."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{path} exists and is not a directory"
    except OSError as exc:
        return f"cannot create directory {path}: {exc.strerror or exc}"
    return probe_write(path)
