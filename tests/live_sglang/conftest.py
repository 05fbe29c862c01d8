"""Live SGLang servers for the ``live_sglang`` tests: the side environment, server pairs, the
per-case report.

The suite runs only when selected (``python -m pytest -m live_sglang tests/live_sglang``):
each server start imports all of SGLang (about a minute on two cores), so a plain
``python -m pytest`` skips it with one line.  It skips with one line, too, where the side
environment cannot be built (no PyPI); ``URC_LIVE_SGLANG_REQUIRED=1`` (``.ci/run``) turns that
skip into a failure.

``server_pool`` (session) holds the one running pair of servers (:mod:`pairs`);
``report(line)`` adds a line to the "live SGLang: default vs urc" section printed at the end
of the run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from pairs import ServerPool  # noqa: E402
from side_env import SideEnv, SideEnvUnavailable, ensure  # noqa: E402

_REPORT: list[str] = []
_POOL_CPU = [0.0, 0]  # CPU seconds of the servers, how many


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "live_sglang" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(
        reason="live SGLang servers: run `python -m pytest -m live_sglang tests/live_sglang`"
    )
    for item in items:
        if item.get_closest_marker("live_sglang"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORT:
        terminalreporter.section("live SGLang: default vs urc")
        for line in _REPORT:
            terminalreporter.write_line(line)
        # CPU time says what the stage costs on an idle machine better than the wall time
        # on a shared one does.
        terminalreporter.write_line(
            f"{_POOL_CPU[0]:.0f} s of CPU in {_POOL_CPU[1]} servers (their processes, at stop)"
        )


@pytest.fixture(scope="session")
def report() -> Callable[[str], None]:
    """Add a line to the end-of-run section (and print it, for ``-s``)."""

    def add(line: str) -> None:
        _REPORT.append(line)
        print(line)

    return add


@pytest.fixture(scope="session")
def side_env() -> SideEnv:
    """The built side environment, or a one-line skip (a failure in CI) when it cannot be."""
    try:
        return ensure()
    except SideEnvUnavailable as e:
        if os.environ.get("URC_LIVE_SGLANG_REQUIRED") == "1":
            pytest.fail(f"live SGLang side environment required but unavailable: {e}")
        pytest.skip(f"live SGLang side environment unavailable: {e}")


@pytest.fixture(scope="session")
def server_pool(side_env: SideEnv) -> Iterator[ServerPool]:
    with tempfile.TemporaryDirectory(prefix="urc-live-") as scratch:
        pool = ServerPool(side_env, Path(scratch))
        try:
            yield pool
        finally:
            pool.close()
            _POOL_CPU[:] = [pool.cpu_used, pool.started]
