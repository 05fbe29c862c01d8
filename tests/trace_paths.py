"""Where the trace-driven tests find Mooncake traces.

``URC_TRACE_DIR`` names the directory holding ``conversation_trace.jsonl`` (and any other
published trace); without it the tests look in ``../shared/traces`` next to the repository.
Tests that need a trace skip cleanly when the file is absent.  The traces are never copied
into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["TRACE_DIR_ENV", "conversation_trace", "requires_conversation_trace", "trace_dir"]

TRACE_DIR_ENV = "URC_TRACE_DIR"
_DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"


def trace_dir() -> Path:
    """``$URC_TRACE_DIR`` when set (and not empty), else ``../shared/traces``."""
    env = os.environ.get(TRACE_DIR_ENV, "").strip()
    return Path(env).expanduser() if env else _DEFAULT_DIR


def conversation_trace() -> Path:
    """Mooncake's conversation trace (it may not exist)."""
    return trace_dir() / "conversation_trace.jsonl"


requires_conversation_trace = pytest.mark.skipif(
    not conversation_trace().is_file(),
    reason=f"conversation_trace.jsonl not found in {trace_dir()} (set {TRACE_DIR_ENV})",
)
