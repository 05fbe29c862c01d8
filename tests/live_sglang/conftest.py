"""Live SGLang servers for the ``live_sglang`` tests: the side environment, server pairs, the
per-case report.

The suite runs only when selected (``python -m pytest -m live_sglang tests/live_sglang``):
each server start imports all of SGLang (about a minute on two cores), so a plain
``python -m pytest`` skips it with one line.  It skips with one line, too, where the side
environment cannot be built (no PyPI); ``URC_LIVE_SGLANG_REQUIRED=1`` (``.ci/run``) turns that
skip into a failure.

``server_pair(config)`` returns a default-cache and a urc server of one configuration, started
side by side and kept for every case that asks for the same configuration; a pair of another
configuration replaces it (at most two servers run at once).  ``report(line)`` adds a line
to the "live SGLang: default vs urc" section printed at the end of the run.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from live_server import LiveServer, ServerConfig  # noqa: E402
from side_env import SideEnv, SideEnvUnavailable, ensure  # noqa: E402

CHECKOUT = HERE.parent.parent
_REPORT: list[str] = []


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


@dataclass
class ServerPair:
    """A default-cache and a urc server of one configuration, started side by side."""

    config: ServerConfig
    default: LiveServer
    urc: LiveServer
    # KV events each published before the first case (its start-up and warm-up request)
    startup_events: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def stop(self) -> None:
        self.default.stop()
        self.urc.stop()


class ServerPool:
    """Keeps the one pair of the configuration the cases ask for now."""

    def __init__(self, side: SideEnv, scratch: Path) -> None:
        self.side = side
        self.scratch = scratch
        self.current: ServerPair | None = None

    def pair(self, config: ServerConfig) -> ServerPair:
        if self.current is not None and self.current.config == config:
            return self.current
        self.close()
        configs = (config.with_backend("default"), config.with_backend("urc"))
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(LiveServer, self.side, c, CHECKOUT, self.scratch) for c in configs
            ]
            started = [f.exception() or f.result() for f in futures]
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if isinstance(s, LiveServer):
                    s.stop()
            raise failed[0]
        default, urc = started
        assert isinstance(default, LiveServer) and isinstance(urc, LiveServer)
        pair = ServerPair(config, default, urc)
        if config.kv_events:
            pair.startup_events = {"default": default.take_events(), "urc": urc.take_events()}
        self.current = pair
        return pair

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def server_pool(side_env: SideEnv) -> Iterator[ServerPool]:
    with tempfile.TemporaryDirectory(prefix="urc-live-") as scratch:
        pool = ServerPool(side_env, Path(scratch))
        try:
            yield pool
        finally:
            pool.close()
