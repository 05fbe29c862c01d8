"""Stall a server the tests started (a child process) and let it answer again."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

__all__ = ["resume", "stop"]


def stop(process: subprocess.Popen[Any]) -> None:
    """``SIGSTOP`` ``process`` and return once every thread of it has stopped.

    ``kill`` only queues the stop: each thread stops as it next leaves the kernel, so a
    request sent right after it could still be answered (Mooncake's master, 21 threads, on a
    loaded machine: 2 test runs in 7).  ``waitpid(WUNTRACED)`` returns when the group stop is
    complete; a child's stop is reported to its parent only.
    """
    os.kill(process.pid, signal.SIGSTOP)
    _, status = os.waitpid(process.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"process {process.pid} did not stop (wait status {status})"


def resume(process: subprocess.Popen[Any]) -> None:
    """Let a stopped ``process`` run again (``SIGCONT``)."""
    os.kill(process.pid, signal.SIGCONT)
