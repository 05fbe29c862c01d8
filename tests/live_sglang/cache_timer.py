"""A SGLang plug-in that times the tree cache inside a live server's scheduler (benchmark only).

``bench_tree_cache_time.py`` starts servers with this module's ``install`` registered in
SGLang's ``sglang.srt.plugins`` group and ``URC_CACHE_TIMER_OUT`` naming a JSON file.  In the
scheduler process ``install`` makes ``Scheduler.tree_cache`` a property whose setter wraps
every public method of the cache SGLang built (default or urc, the same way) with a
``perf_counter_ns`` timer -- the outermost call only, so a method calling another is counted
once -- and wraps ``Scheduler.run_batch`` to count scheduler steps and their time.  A thread
writes the running totals to the file twice a second: ``steps``, ``step_ns``, ``cache_ns``,
``cache_calls`` and ``per_method`` (ns per method name).
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["install"]

_STATS: dict[str, Any] = {"steps": 0, "step_ns": 0, "cache_ns": 0, "cache_calls": 0}
_PER_METHOD: Counter[str] = Counter()
_LOCAL = threading.local()
_WRITER: list[threading.Thread] = []


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "inside", False):
            return fn(*args, **kwargs)
        _LOCAL.inside = True
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter_ns() - t0
            _LOCAL.inside = False
            _STATS["cache_ns"] += dt
            _STATS["cache_calls"] += 1
            _PER_METHOD[name] += dt

    return timed


def _wrap(cache: Any) -> None:
    for name in dir(type(cache)):
        if name.startswith("_") or not inspect.isfunction(getattr(type(cache), name, None)):
            continue  # methods only: properties and attributes stay as they are
        setattr(cache, name, _timed(name, getattr(cache, name)))


def _write_forever(out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    while True:
        tmp.write_text(json.dumps({**_STATS, "per_method": dict(_PER_METHOD)}))
        tmp.replace(out)
        time.sleep(0.5)


def install() -> None:
    """Patch the scheduler class (in each process SGLang loads plug-ins in; only a scheduler
    that builds a tree cache starts the writer)."""
    out = os.environ.get("URC_CACHE_TIMER_OUT")
    if not out:
        return
    from sglang.srt.managers.scheduler import Scheduler

    if getattr(Scheduler, "_urc_cache_timer", False):
        return

    def get(self: Any) -> Any:
        try:
            return self.__dict__["_timed_tree_cache"]
        except KeyError:
            raise AttributeError("tree_cache") from None

    def set_(self: Any, cache: Any) -> None:
        if cache is not None:
            _wrap(cache)
            if not _WRITER:
                _WRITER.append(
                    threading.Thread(target=_write_forever, args=(Path(out),), daemon=True)
                )
                _WRITER[0].start()
        self.__dict__["_timed_tree_cache"] = cache

    run_batch = Scheduler.run_batch

    def timed_run_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return run_batch(self, *args, **kwargs)
        finally:
            _STATS["step_ns"] += time.perf_counter_ns() - t0
            _STATS["steps"] += 1

    Scheduler.tree_cache = property(get, set_)  # type: ignore[attr-defined]
    Scheduler.run_batch = timed_run_batch  # type: ignore[method-assign]
    Scheduler._urc_cache_timer = True  # type: ignore[attr-defined]
