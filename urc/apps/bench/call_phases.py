"""The reference workload's phases timed call by call, as a caller sees them, through the
package's top-level API only (so that one copy of this code can drive any checkout's ``urc``).

What :func:`run_call_phases` measures, on a fresh cache: insert every sequence, match every
sequence, lock every matched node, unlock every one, evict ``chunk_len`` tokens per call
(SWA also ``chunk_len`` window tokens, Mamba also one state) until nothing is freed.  The
cyclic GC is off for all phases, keys and params are built outside the timed call, and each
call is timed on its own (``perf_counter_ns``), lock and unlock included, right after the
match phase: the shape of SGLang's own tree benchmark, where a lock runs on the caches a
match pass left.  :mod:`urc.apps.bench.core` times lock and unlock back to back on a frozen
heap instead (its throughput figure), which is why it reads lock differently.

Every phase gets two figures from the same calls: ``sum`` (calls / their summed time, as
SGLang's benchmark reports) and ``robust`` (the same, with each call above 20x the phase's
median counted as the median).  A lock phase lasts 1-3 ms in all, so one descheduling of a
few milliseconds on a shared machine moves ``sum`` by 2-4x; ``robust`` leaves such calls out
and is the figure to compare two checkouts by.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["CALL_PHASES", "run_call_phases", "robust_ops", "sum_ops"]

CALL_PHASES = ("insert", "match", "lock", "unlock", "evict")
_OUTLIER = 20  # a call above this many medians was descheduled, not slow


def sum_ops(lat_ns: list[int]) -> float:
    """Calls per second over the summed latencies (0.0 for no calls)."""
    total = sum(lat_ns)
    return len(lat_ns) / (total / 1e9) if total else 0.0


def robust_ops(lat_ns: list[int]) -> float:
    """:func:`sum_ops` with each call above 20x the median counted as the median."""
    if not lat_ns:
        return 0.0
    med = sorted(lat_ns)[len(lat_ns) // 2]
    cap = _OUTLIER * med
    total = sum(x if x <= cap else med for x in lat_ns)
    return len(lat_ns) / (total / 1e9) if total else 0.0


def _config(urc: ModuleType, components: str, page_size: int, kv: int, states: int) -> Any:
    """The phases' config in ``urc``'s own spelling: specs in ``components`` (the flat fields
    are deprecated), or the flat fields where they are still the config's own fields (a
    checkout from before specs, which sorts its components as types)."""
    ct = urc.ComponentType
    if "sliding_window_size" in {f.name for f in dataclasses.fields(urc.CacheConfig)}:
        flat = {
            "full": (ct.FULL,),
            "full+swa": (ct.FULL, ct.SWA),
            "full+mamba": (ct.FULL, ct.MAMBA),
        }
        return urc.CacheConfig(
            components=flat[components],
            page_size=page_size,
            kv_size=kv,
            swa_kv_size=kv,
            sliding_window_size=128,
            mamba_size=states,
        )
    specs = {
        "full": (ct.FULL,),
        "full+swa": (ct.FULL, urc.SlidingWindowSpec(window=128, kv_size=kv)),
        "full+mamba": (ct.FULL, urc.MambaSpec(size=states)),
    }
    return urc.CacheConfig(components=specs[components], page_size=page_size, kv_size=kv)


def run_call_phases(
    urc: ModuleType,
    components: str,
    page_size: int,
    seqs: list[list[int]],
    chunk_len: int,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> dict[str, list[int]]:
    """Run the phases (see the module docstring) on a fresh cache of ``urc`` (a checkout's
    top-level package); ``components``: ``full``, ``full+swa`` or ``full+mamba``.  Returns
    each phase's per-call latencies in ``clock`` units (nanoseconds) and, under
    ``"checksum"``, the matched and evicted token counts (equal for equal trees).  Leaves the
    GC as it found it."""
    seqs = [s[: len(s) // page_size * page_size] for s in seqs]
    longest = max(len(s) for s in seqs)
    kv = (sum(len(s) for s in seqs) + chunk_len + 4 * longest) // page_size * page_size
    kv += page_size
    cache = urc.build_cache(_config(urc, components, page_size, kv, len(seqs) + 64))
    alloc = cache.token_to_kv_pool_allocator
    mamba = cache.pools.mamba if components == "full+mamba" else None
    radix_key, insert_params = urc.RadixKey, urc.InsertParams
    lat: dict[str, list[int]] = {p: [] for p in CALL_PHASES}
    matched = 0
    evicted = [0, 0, 0]
    enabled = gc.isenabled()
    gc.disable()
    try:
        for s in seqs:
            kw: dict[str, Any] = {}
            if mamba is not None:
                kw["mamba_value"] = mamba.alloc(1)
            params = insert_params(key=radix_key(list(s)), value=alloc.alloc(len(s)), **kw)
            t0 = clock()
            r = cache.insert(params)
            lat["insert"].append(clock() - t0)
            if mamba is not None and r.mamba_exist:
                mamba.free(kw["mamba_value"])
        nodes = []
        for s in seqs:
            mp = urc.MatchPrefixParams(key=radix_key(list(s)))
            t0 = clock()
            m = cache.match_prefix(mp)
            lat["match"].append(clock() - t0)
            matched += m.device_prefix_len
            nodes.append(m.last_device_node)
        inc, dec = cache.inc_lock_ref, cache.dec_lock_ref
        receipts = []
        for node in nodes:
            t0 = clock()
            receipt = inc(node)
            lat["lock"].append(clock() - t0)
            receipts.append(receipt)
        for node, receipt in zip(nodes, receipts, strict=True):
            dp = receipt.to_dec_params()
            t0 = clock()
            dec(node, dp)
            lat["unlock"].append(clock() - t0)
        ep = urc.EvictParams(
            num_tokens=chunk_len,
            swa_num_tokens=chunk_len if components == "full+swa" else 0,
            mamba_num=1 if mamba is not None else 0,
        )
        while True:
            t0 = clock()
            er = cache.evict(ep)
            lat["evict"].append(clock() - t0)
            freed = (er.num_tokens_evicted, er.swa_num_tokens_evicted, er.mamba_num_evicted)
            evicted = [a + b for a, b in zip(evicted, freed, strict=True)]
            if not any(freed):
                break
    finally:
        if enabled:
            gc.enable()
    lat["checksum"] = [matched, *evicted]
    return lat
