"""The real ``sglang==0.5.23`` wheel for the plug-in tests (``sglang_wheel``), or a clean
skip of this folder where it cannot be fetched (no network, no pip)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import sglang_wheel  # noqa: E402


@pytest.fixture(scope="session")
def sglang() -> None:
    """Import SGLang 0.5.23 (fetched once, then cached); skip when it cannot be had."""
    try:
        sglang_wheel.load()
    except sglang_wheel.WheelUnavailable as e:
        pytest.skip(f"sglang=={sglang_wheel.VERSION} unavailable: {e}")
