"""A SGLang plug-in that times the tree cache inside a live server's scheduler (benchmark only).

``bench_tree_cache_time.py`` starts servers with this module's ``install`` registered in
SGLang's ``sglang.srt.plugins`` group and ``URC_CACHE_TIMER_OUT`` naming a JSON file.  In the
scheduler process ``install`` makes ``Scheduler.tree_cache`` a property whose setter wraps
every public method of the cache SGLang built (default or urc, the same way) with a timer of
the scheduler thread's CPU time (``thread_time_ns``: a call the OS preempts on a busy host
is not charged the wait) -- the outermost call only, so a method calling another counts
once.  Only a step's calls count: those of ``get_next_batch_to_run`` on a turn that runs a
batch, of ``run_batch`` (which also counts the steps and their wall time) and of
``process_batch_result``; an idle turn's polling (size queries, leak checks) does not.  A
thread writes the running totals to the file twice a second: ``steps``, ``step_ns``,
``cache_ns``, ``cache_calls`` and ``per_method`` (ns per method name).
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
# Where the scheduler is: outside a step (idle turns, request intake: not counted), in
# ``get_next_batch_to_run`` (held until it says whether a batch runs), or in a step.
_OUT_OF_STEP, _PLANNING, _IN_STEP = 0, 1, 2
_WHERE = [_OUT_OF_STEP]
_HELD: list[tuple[str, int]] = []


def _count(name: str, ns: int) -> None:
    _STATS["cache_ns"] += ns
    _STATS["cache_calls"] += 1
    _PER_METHOD[name] += ns


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "inside", False) or _WHERE[0] == _OUT_OF_STEP:
            return fn(*args, **kwargs)
        _LOCAL.inside = True
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.thread_time_ns() - t0
            _LOCAL.inside = False
            if _WHERE[0] == _PLANNING:
                _HELD.append((name, dt))
            else:
                _count(name, dt)

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


def _in_step(fn: Callable[..., Any], *, is_model_step: bool = False) -> Callable[..., Any]:
    def step_part(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = _WHERE[0]
        _WHERE[0] = _IN_STEP
        t0 = time.perf_counter_ns()
        try:
            return fn(self, *args, **kwargs)
        finally:
            if is_model_step:
                _STATS["step_ns"] += time.perf_counter_ns() - t0
                _STATS["steps"] += 1
            _WHERE[0] = outer

    return step_part


def _planning(fn: Callable[..., Any]) -> Callable[..., Any]:
    def plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        _WHERE[0] = _PLANNING
        _HELD.clear()
        try:
            result = fn(self, *args, **kwargs)
        finally:
            _WHERE[0] = _OUT_OF_STEP
        if getattr(result, "batch_to_run", None) is not None:
            for name, ns in _HELD:  # this turn runs a batch: its planning is step time
                _count(name, ns)
        _HELD.clear()
        return result

    return plan


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

    Scheduler.tree_cache = property(get, set_)  # type: ignore[attr-defined]
    Scheduler.get_next_batch_to_run = _planning(Scheduler.get_next_batch_to_run)  # type: ignore[method-assign]
    Scheduler.run_batch = _in_step(Scheduler.run_batch, is_model_step=True)  # type: ignore[method-assign]
    Scheduler.process_batch_result = _in_step(Scheduler.process_batch_result)  # type: ignore[method-assign]
    Scheduler._urc_cache_timer = True  # type: ignore[attr-defined]
