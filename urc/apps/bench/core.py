"""Benchmark of the synchronous core on the reference workload; prints JSON.

Usage::

    python -m urc.apps.bench.core                       # every component set, page sizes 1 and 16
    python -m urc.apps.bench.core --components full --page-sizes 1 --num-seqs 2000 --scaling

Reference workload (seeded): a root of ``chunk_len // 4`` random tokens; the first sequence is
root + ``chunk_len`` fresh tokens; then repeatedly, with probability 1/2, a random earlier
sequence + ``chunk_len`` fresh tokens, otherwise 2-10 children of a random earlier sequence,
each + ``chunk_len`` fresh tokens.  Phases: insert every sequence (freshly allocated values),
match every sequence (``match_prefix``; then again without building the indices,
``match_prefix_without_indices``), lock and unlock every matched node, evict until empty (one
call per sequence's worth of tokens).  Lock and unlock throughput comes from back-to-back
passes, their percentiles from a per-call timed one (see ``_lock_phases``); the other phases
time each call (their calls cost tens of microseconds, the clock reads well under one).
``--scaling`` also reports per-op cost at 10^4, 10^5 and 10^6 cached tokens, per-token
cost of match and insert at 1k- and 128k-token keys (``run_key_scaling``), and the memory a
10^6-token tree holds (``urc.apps.bench.tree_memory``).
``--workload long-context`` runs the phases on :func:`generate_long_context` instead.
``--hints`` gives every insert a :class:`~urc.reuse_hint.ReuseHint` (see :func:`bench_hint`),
as a server caching finished requests does: the cost of a policy that uses them.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from urc.apps.bench.tree_memory import tree_memory
from urc.cache import UnifiedRadixCache, build_cache
from urc.config import CacheConfig
from urc.eviction_policy import EvictionPolicy
from urc.fastpath import common_len
from urc.key import RadixKey
from urc.node import ComponentType
from urc.params import EvictParams, InsertParams, MatchPrefixParams
from urc.reuse_hint import ReuseHint, StopReason
from urc.specs import ComponentSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "COMPONENT_SETS",
    "PhaseStats",
    "bench_hint",
    "generate_long_context",
    "generate_sequences",
    "main",
    "make_config",
    "run_phases",
    "run_key_scaling",
    "run_scaling",
    "unique_tokens",
]

COMPONENT_SETS: dict[str, tuple[ComponentType, ...]] = {
    "full": (ComponentType.FULL,),
    "full+swa": (ComponentType.FULL, ComponentType.SWA),
    "full+mamba": (ComponentType.FULL, ComponentType.MAMBA),
}
_VOCAB = 1 << 30
_BATCH_PASSES = 5


def generate_sequences(num_seqs: int, chunk_len: int, seed: int = 42) -> list[list[int]]:
    """The reference workload's token sequences (see the module docstring)."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(_VOCAB) for _ in range(n)]

    root = fresh(chunk_len // 4)
    seqs = [root + fresh(chunk_len)]
    while len(seqs) < num_seqs:
        if rng.random() < 0.5:
            seqs.append(rng.choice(seqs) + fresh(chunk_len))
        else:
            parent = rng.choice(seqs)
            for _ in range(min(rng.randint(2, 10), num_seqs - len(seqs))):
                seqs.append(parent + fresh(chunk_len))
    return seqs


def generate_long_context(
    num_seqs: int = 200,
    min_len: int = 32 * 1024,
    max_len: int = 128 * 1024,
    turn_len: int = 4096,
    num_system: int = 4,
    system_len: int = 8192,
    seed: int = 42,
) -> list[list[int]]:
    """The long-context (agent) workload: ``num_seqs`` prompts of ``min_len`` to ``max_len``
    tokens, seeded.

    ``num_system`` system prompts of ``system_len`` tokens; a conversation starts with one
    of them plus a fresh document up to ``min_len`` tokens, and each later turn is an
    earlier turn of the same conversation (the latest one, or with probability 1/4 a random
    earlier one: a regenerated answer) plus ``turn_len`` fresh tokens.  A conversation that
    would pass ``max_len`` ends and the next one starts.  Every prompt is emitted in order,
    so most of each one is a cached prefix (its system prompt and earlier turns)."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(_VOCAB) for _ in range(n)]

    systems = [fresh(system_len) for _ in range(num_system)]
    seqs: list[list[int]] = []
    turns: list[list[int]] = []
    while len(seqs) < num_seqs:
        if not turns:
            system = rng.choice(systems)
            seq = system + fresh(max(min_len - system_len, turn_len))
        else:
            base = turns[-1] if rng.random() < 0.75 else rng.choice(turns)
            seq = base + fresh(turn_len)
        if len(seq) > max_len:
            turns = []
            continue
        turns.append(seq)
        seqs.append(seq)
    return seqs


def unique_tokens(seqs: list[list[int]]) -> int:
    """Tokens a radix tree of page 1 holds once every sequence of ``seqs`` is inserted (the
    number of nodes of their token trie), for sizing pools: in lexicographic order, each
    sequence adds what lies beyond its common prefix with the one before it."""
    total = 0
    prev: list[int] = []
    for seq in sorted(seqs):
        total += len(seq) - common_len(prev, seq, 0)
        prev = seq
    return total


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """Timing of one phase: ``ops`` calls, ``tokens`` tokens, per-call latencies."""

    ops: int
    tokens: int
    seconds: float
    p50_us: float
    p99_us: float

    def as_dict(self) -> dict[str, float]:
        return {
            "ops": self.ops,
            "ops_per_s": round(self.ops / self.seconds, 1) if self.seconds else 0.0,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
            "p50_us": round(self.p50_us, 2),
            "p99_us": round(self.p99_us, 2),
        }


def _phase(lat: list[float], tokens: int, seconds: float | None = None) -> PhaseStats:
    """Figures of one phase from its per-call latencies; ``seconds`` (when the calls were
    also timed back to back) replaces their sum for the throughput."""
    lat_sorted = sorted(lat)
    n = len(lat_sorted)
    return PhaseStats(
        ops=n,
        tokens=tokens,
        seconds=sum(lat_sorted) if seconds is None else seconds,
        p50_us=statistics.median(lat_sorted) * 1e6 if n else 0.0,
        p99_us=lat_sorted[min(n - 1, int(n * 0.99))] * 1e6 if n else 0.0,
    )


def bench_hint(i: int) -> ReuseHint:
    """The hint of the bench's ``i``-th insert: one of 64 sessions in turn, three tool calls
    in four (the rest answers), finished half a second after the previous one."""
    stop = StopReason.END_TURN if i % 4 == 3 else StopReason.TOOL_USE
    return ReuseHint(f"s{i % 64}", stop, None, 0.5 * i)


class _Driver:
    """Supplies the per-component parts of an insert (Mamba state slots; with ``hints``,
    each insert's :func:`bench_hint`)."""

    def __init__(self, cache: UnifiedRadixCache, hints: bool = False) -> None:
        self.cache = cache
        self.mamba = cache.pools.mamba if cache.has_component(ComponentType.MAMBA) else None
        self.hints = hints
        self.inserts = 0

    def insert(self, seq: list[int]) -> tuple[InsertParams, Callable[[Any], None]]:
        value = self.cache.token_to_kv_pool_allocator.alloc(len(seq))
        assert value is not None, "bench pool too small"
        params = InsertParams(key=RadixKey(seq), value=value)
        if self.hints:
            params.reuse_hint = bench_hint(self.inserts)
        self.inserts += 1
        if self.mamba is None:
            return params, _noop
        slot = self.mamba.alloc(1)
        assert slot is not None, "bench Mamba pool too small"
        params.mamba_value = slot
        mamba = self.mamba

        def after(result: Any) -> None:
            if result.mamba_exist:
                mamba.free(slot)

        return params, after


def _noop(_: Any) -> None:
    return None


def make_config(
    components: tuple[ComponentType, ...], page_size: int, kv_size: int, **config: Any
) -> CacheConfig:
    """The bench's cache config (``config``: more ``CacheConfig`` fields, e.g. the eviction
    policy)."""
    kv_size = -(-kv_size // page_size) * page_size
    specs: list[ComponentSpec] = []
    if ComponentType.SWA in components:
        specs.append(SlidingWindowSpec(window=128))
    if ComponentType.MAMBA in components:
        specs.append(MambaSpec(size=kv_size // 64 + 16))
    return CacheConfig(
        **config,
        components=(ComponentType.FULL, *specs),
        page_size=page_size,
        kv_size=kv_size,
        max_num_reqs=4,
        max_context_len=8,
    )


def run_phases(
    components: tuple[ComponentType, ...],
    page_size: int,
    seqs: list[list[int]],
    kv_events: bool = False,
    hints: bool = False,
    **config: Any,
) -> dict[str, Any]:
    """Run the phases on a fresh cache (``config``: more ``CacheConfig`` fields);
    returns per-phase figures.  ``hints``: every insert carries a :func:`bench_hint`.
    ``kv_events``: with the cache's KV events on, taken after the insert and the evict
    phase (outside the phases' timings: the drain, where the page hashes are computed, is
    reported on its own)."""
    total = sum(len(s) for s in seqs)
    cache = build_cache(make_config(components, page_size, total + 1024, **config))
    if kv_events:
        cache.enable_kv_events()
    driver = _Driver(cache, hints)
    _settle()  # the workload itself (lists of millions of ints) is not the cache's
    clock = time.perf_counter
    lat: list[float] = []
    for seq in seqs:
        params, after = driver.insert(seq)
        t0 = clock()
        result = cache.insert(params)
        lat.append(clock() - t0)
        after(result)
    insert = _phase(lat, total)
    cached = cache.total_size()
    t0 = clock()
    events = len(cache.take_events())
    drain = clock() - t0

    _settle()
    lat = []
    nodes = []
    hit = 0
    for seq in seqs:
        mp = MatchPrefixParams(key=RadixKey(seq))
        t0 = clock()
        m = cache.match_prefix(mp)
        lat.append(clock() - t0)
        nodes.append(m.last_device_node)
        hit += m.device_prefix_len
    match = _phase(lat, total)

    # The same matches without building the indices (SGLang 0.5.23's match_prefix).
    _settle()
    lat = []
    for seq in seqs:
        mp = MatchPrefixParams(key=RadixKey(seq), with_indices=False)
        t0 = clock()
        cache.match_prefix(mp)
        lat.append(clock() - t0)
    match_len = _phase(lat, total)

    _settle()
    lock, unlock = _lock_phases(cache, nodes)

    per_call = -(-cached // len(seqs))
    _settle()
    lat = []
    freed = 0
    ep = EvictParams(num_tokens=per_call)
    while cache.total_size() > 0:
        t0 = clock()
        er = cache.evict(ep)
        lat.append(clock() - t0)
        freed += er.num_tokens_evicted
        if er.num_tokens_evicted == 0:
            break
    evict = _phase(lat, freed)
    t0 = clock()
    events += len(cache.take_events())
    drain += clock() - t0
    gc.unfreeze()
    cache.sanity_check()
    cache.check_pools()
    return {
        # KV events: how many were taken, and the time taking them cost (the page hashes)
        "kv_events": {"events": events, "drain_s": drain},
        "cached_tokens": cached,
        "match_hit_tokens": hit,
        "insert": insert.as_dict(),
        "match_prefix": match.as_dict(),
        "match_prefix_without_indices": match_len.as_dict(),
        "lock": lock.as_dict(),
        "unlock": unlock.as_dict(),
        "evict": evict.as_dict(),
    }


def _lock_phases(cache: UnifiedRadixCache, nodes: list[Any]) -> tuple[PhaseStats, PhaseStats]:
    """Lock every matched node, then unlock every one: once timed per call, then
    ``_BATCH_PASSES`` times back to back.

    A lock costs well under a microsecond, so the two clock reads around each call would be
    a third of what a per-call timing measures.  The first pass times each call (the
    p50/p99); the back-to-back passes time the whole loop (the throughput, ``ops_per_s``),
    and the fastest counts, as ``timeit`` does: one pass lasts about a millisecond, so a
    single one mostly measures the machine's noise.  Every pass does the same work: each
    lock is released before the next pass."""
    clock = time.perf_counter
    inc, dec = cache.inc_lock_ref, cache.dec_lock_ref
    lat_lock: list[float] = []
    receipts = []
    for node in nodes:
        t0 = clock()
        r = inc(node)
        lat_lock.append(clock() - t0)
        receipts.append(r)
    lat_unlock: list[float] = []
    for node, dp in zip(nodes, [r.to_dec_params() for r in receipts], strict=True):
        t0 = clock()
        dec(node, dp)
        lat_unlock.append(clock() - t0)
    lock_s = unlock_s = float("inf")
    for _ in range(_BATCH_PASSES):
        t0 = clock()
        receipts = [inc(node) for node in nodes]
        lock_s = min(lock_s, clock() - t0)
        params = [r.to_dec_params() for r in receipts]
        t0 = clock()
        for node, dp in zip(nodes, params, strict=True):
            dec(node, dp)
        unlock_s = min(unlock_s, clock() - t0)
    return _phase(lat_lock, 0, lock_s), _phase(lat_unlock, 0, unlock_s)


def _settle() -> None:
    """Collect, then move everything alive out of the cyclic GC's generations.

    Between phases only: long-lived objects (the workload, the tree built so far) are not
    rescanned by collections that the next phase's allocations trigger, as a server that
    calls ``gc.freeze()`` after warm-up would see.  The phases still pay for collecting
    their own garbage."""
    gc.collect()
    gc.freeze()


def _grow(seed: int, chunk_len: int) -> Generator[list[int], None, None]:
    """An endless stream of reference-workload sequences (for the scaling runs)."""
    rng = random.Random(seed)
    root = [rng.randrange(_VOCAB) for _ in range(chunk_len // 4)]
    seqs = [root]
    while True:
        parent = rng.choice(seqs[-4096:]) if rng.random() < 0.5 else rng.choice(seqs)
        seq = parent + [rng.randrange(_VOCAB) for _ in range(chunk_len)]
        if len(seq) > 16 * chunk_len:
            seq = root + [rng.randrange(_VOCAB) for _ in range(chunk_len)]
        seqs.append(seq)
        yield seq


def run_scaling(
    components: tuple[ComponentType, ...], page_size: int, chunk_len: int, sizes: list[int]
) -> dict[str, Any]:
    """Per-op cost of insert, match and evict (per freed token) at each tree size."""
    out: dict[str, Any] = {}
    clock = time.perf_counter
    samples = 400
    for size in sizes:
        pool = size + (samples + 64) * chunk_len + 4096
        cache = build_cache(make_config(components, page_size, pool))
        driver = _Driver(cache)
        stream = _grow(7, chunk_len)
        inserted: list[list[int]] = []
        while cache.total_size() < size:
            seq = next(stream)
            params, after = driver.insert(seq)
            after(cache.insert(params))
            inserted.append(seq)
        # Probes of one fixed length (root + 4 chunks), so that only the tree size varies:
        # insert extends a cached 3-chunk sequence by a fresh chunk; match a cached 4-chunk one.
        rng = random.Random(3)
        n4 = chunk_len // 4 + 4 * chunk_len
        three = [s for s in inserted if len(s) == n4 - chunk_len] or inserted
        probe = [
            rng.choice(three) + [rng.randrange(_VOCAB) for _ in range(chunk_len)]
            for _ in range(samples)
        ]
        ins: list[float] = []
        for seq in probe:
            params, after = driver.insert(seq)
            t0 = clock()
            r = cache.insert(params)
            ins.append(clock() - t0)
            after(r)
        mat: list[float] = []
        for seq in rng.sample(probe, min(samples, len(probe))):
            mp = MatchPrefixParams(key=RadixKey(seq))
            t0 = clock()
            cache.match_prefix(mp)
            mat.append(clock() - t0)
        ev_time = 0.0
        ev_tokens = 0
        ep = EvictParams(num_tokens=chunk_len)
        for _ in range(samples):
            t0 = clock()
            er = cache.evict(ep)
            ev_time += clock() - t0
            ev_tokens += er.num_tokens_evicted
        out[str(size)] = {
            "insert_us": round(statistics.median(ins) * 1e6, 2),
            "match_us": round(statistics.median(mat) * 1e6, 2),
            "evict_us_per_token": round(ev_time / max(ev_tokens, 1) * 1e6, 4),
        }
    lo, hi = out[str(sizes[0])], out[str(sizes[-1])]
    out["ratio_largest_to_smallest"] = {
        k: round(hi[k] / lo[k], 2) for k in ("insert_us", "match_us", "evict_us_per_token")
    }
    return out


def _fresh_copy(tokens: list[int]) -> list[int]:
    """The same token ids as new int objects, as a server's next request holds them (so no
    comparison can take the identity shortcut)."""
    return [t ^ 0 if t > 256 else t for t in tokens]


def run_key_scaling(
    components: tuple[ComponentType, ...], page_size: int, lengths: list[int]
) -> dict[str, Any]:
    """Per-token cost of match and insert at each key length.

    For a length ``L``: a cached conversation of ``L`` tokens in 8 turns; match probes are
    fresh copies of it (a full hit), insert probes its first 7 turns plus a fresh one (each
    a new leaf).  Figures are medians over the probes, in ns per key token."""
    out: dict[str, Any] = {}
    clock = time.perf_counter
    rng = random.Random(11)
    for n in lengths:
        turn = n // 8
        samples = max(8, min(64, (1 << 20) // n))
        cache = build_cache(make_config(components, page_size, n * (3 + samples // 8) + 4096))
        driver = _Driver(cache)
        base = [rng.randrange(_VOCAB) for _ in range(n)]
        for k in range(1, 9):
            params, after = driver.insert(base[: k * turn])
            after(cache.insert(params))
        mat: list[float] = []
        for _ in range(samples):
            mp = MatchPrefixParams(key=RadixKey(_fresh_copy(base)))
            t0 = clock()
            cache.match_prefix(mp)
            mat.append(clock() - t0)
        ins: list[float] = []
        for _ in range(samples):
            seq = _fresh_copy(base[: n - turn]) + [rng.randrange(_VOCAB) for _ in range(turn)]
            params, after = driver.insert(seq)
            t0 = clock()
            r = cache.insert(params)
            ins.append(clock() - t0)
            after(r)
        out[str(n)] = {
            "match_ns_per_token": round(statistics.median(mat) / n * 1e9, 2),
            "insert_ns_per_token": round(statistics.median(ins) / n * 1e9, 2),
        }
    lo, hi = out[str(lengths[0])], out[str(lengths[-1])]
    out["ratio_longest_to_shortest"] = {k: round(hi[k] / lo[k], 2) for k in lo}
    return out


def _tree_memory(
    components: tuple[ComponentType, ...], page_size: int, chunk_len: int
) -> dict[str, Any]:
    """:func:`~urc.apps.bench.tree_memory.tree_memory` of a 10^6-token tree."""
    cache = build_cache(make_config(components, page_size, 10**6 + 64 * chunk_len + 4096))
    driver = _Driver(cache)

    def insert(seq: list[int]) -> None:
        params, after = driver.insert(seq)
        after(cache.insert(params))

    return tree_memory(cache, insert, _grow(7, chunk_len))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m urc.apps.bench.core", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--components", nargs="+", choices=sorted(COMPONENT_SETS), default=None)
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--num-seqs", type=int, default=2000)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--workload",
        choices=["reference", "long-context"],
        default="reference",
        help="long-context: generate_long_context (--num-seqs prompts of 32k-128k tokens)",
    )
    ap.add_argument(
        "--eviction-policy",
        choices=[p.value for p in EvictionPolicy if p is not EvictionPolicy.BELADY],
        default=EvictionPolicy.LRU.value,
        help="the strategy the Full heaps order by (belady needs a workload's future)",
    )
    ap.add_argument(
        "--partial-leaf-eviction",
        action="store_true",
        help="evict only the tail pages an eviction needs (the evict phase then splits leaves)",
    )
    ap.add_argument(
        "--kv-events",
        action="store_true",
        help="record KV events (urc.kv_events) during the phases",
    )
    ap.add_argument(
        "--hints",
        action="store_true",
        help="give every insert a reuse hint (session, stop reason, finish), as a server does",
    )
    ap.add_argument(
        "--scaling",
        action="store_true",
        help="also measure 1e4/1e5/1e6 trees, per-token cost at 1k vs 128k-token keys, and "
        "the memory of a 1e6-token tree",
    )
    args = ap.parse_args(argv)
    eviction = {
        "eviction_policy": EvictionPolicy(args.eviction_policy),
        "partial_leaf_eviction": args.partial_leaf_eviction,
    }
    names = args.components or [n for n in COMPONENT_SETS if _available(COMPONENT_SETS[n])]
    torch.set_num_threads(1)
    if args.workload == "reference":
        seqs = generate_sequences(args.num_seqs, args.chunk_len, args.seed)
    else:
        seqs = generate_long_context(args.num_seqs, seed=args.seed)
    report: dict[str, Any] = {
        "workload": {
            "name": args.workload,
            "num_seqs": args.num_seqs,
            "chunk_len": args.chunk_len,
            "seed": args.seed,
            "total_tokens": sum(len(s) for s in seqs),
            "eviction_policy": args.eviction_policy,
            "partial_leaf_eviction": args.partial_leaf_eviction,
            "kv_events": args.kv_events,
            "hints": args.hints,
        },
        "results": {},
    }
    for name in names:
        for ps in args.page_sizes:
            entry = run_phases(
                COMPONENT_SETS[name], ps, seqs, args.kv_events, args.hints, **eviction
            )
            if args.scaling:
                entry["scaling"] = run_scaling(
                    COMPONENT_SETS[name], ps, args.chunk_len, [10**4, 10**5, 10**6]
                )
                entry["key_scaling"] = run_key_scaling(COMPONENT_SETS[name], ps, [1024, 131072])
                entry["tree_memory"] = _tree_memory(COMPONENT_SETS[name], ps, args.chunk_len)
            report["results"][f"{name}/page{ps}"] = entry
            print(json.dumps({f"{name}/page{ps}": entry}), flush=True)
    print(json.dumps(report, indent=2))


def _available(components: tuple[ComponentType, ...]) -> bool:
    """Whether the component modules of this set exist in this installation."""
    from urc.components import component_class

    try:
        for ct in components:
            component_class(ct)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
