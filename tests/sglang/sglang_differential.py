"""urc against SGLang 0.5.23's own cache on random operation scripts, through SGLang's own
param objects.

Three caches run every script side by side, each on its own pools:

- ``sglang``: SGLang 0.5.23's ``UnifiedRadixCache`` (the reference; its tree core as SGLang
  resolves it here), driven with SGLang's ``InsertParams`` / ``MatchPrefixParams`` /
  ``EvictParams``;
- ``plugin``: urc's SGLang plug-in (``urc.apps.sglang.create_cache``) on SGLang's pools,
  driven with the same SGLang param objects;
- ``core``: urc's own ``UnifiedRadixCache`` on urc's pools, driven through urc's API.

After every operation the three must agree on its result (insert: prefix length and
whether the node had a Mamba state; match: device hit; copy-on-write: hit and whether the
request got a state; evict: tokens / SWA tokens / states freed), on the cache's sizes and
on the KV events it recorded (SGLang's event objects; urc's core events in SGLang's form).
Operations: inserts (SWA: the request's out-of-window SWA slots freed first and named in
``component_evicted_seqlens``; Mamba: with a state slot), matches, Mamba copy-on-write
matches, lock / unlock, evictions of every kind, resets.  A Mamba tree at pages above 1 is
SGLang's extra-buffer mode on SGLang's side (its no_buffer mode needs page 1); the
operations here do not reach what the two modes do differently.

One command, from the repository root (prints one line per kind and page, then a total)::

    python tests/sglang/sglang_differential.py --kinds full,swa,mamba --pages 1,4,16 --scripts 20

The test suite runs it too (``tests/sglang/test_sglang_param_differential.py``).  Needs the
SGLang wheel (``sglang_wheel.load()``: fetched once, then cached).
"""

from __future__ import annotations

import argparse
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sglang_wheel  # noqa: E402

__all__ = ["Mismatch", "make_script", "run_kind"]

MAMBA_SLOTS = 64  # no Mamba allocation runs out: state eviction is what EvictOp asks for


# ============================================================================ operations
@dataclass(frozen=True)
class InsertOp:
    tokens: tuple[int, ...]
    swa_evicted: int = 0  # SWA: positions whose SWA slots the request freed already
    mamba: bool = False  # with a state slot


@dataclass(frozen=True)
class MatchOp:
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class CowOp:
    """A Mamba copy-on-write match for a fresh request (which then gives its slot back)."""

    tokens: tuple[int, ...]


@dataclass(frozen=True)
class LockOp:
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class UnlockOp:
    pass


@dataclass(frozen=True)
class EvictOp:
    num_tokens: int
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclass(frozen=True)
class ResetOp:
    pass


Op = InsertOp | MatchOp | CowOp | LockOp | UnlockOp | EvictOp | ResetOp


def make_script(rng: random.Random, kind: str, ps: int, n_ops: int) -> list[Op]:
    """``n_ops`` operations on a few families of prompts that share prefixes (whole pages
    for inserts: a Mamba state sits only where a key ends on a page boundary)."""
    roots = [[rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 4) * ps)] for _ in range(3)]
    prompts: list[list[int]] = []
    for _ in range(10):
        p = list(rng.choice(roots))
        for _ in range(rng.randrange(1, 4)):
            p += [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 4) * ps)]
        prompts.append(p)
    script: list[Op] = []
    for _ in range(n_ops):
        p = rng.choice(prompts)
        x = rng.random()
        if x < 0.36:
            cut = rng.randrange(1, len(p) // ps + 1) * ps
            sev = 0
            if kind == "swa" and rng.random() < 0.3:
                sev = rng.randrange(0, cut // ps + 1) * ps
            script.append(InsertOp(tuple(p[:cut]), sev, kind == "mamba"))
        elif x < 0.58:
            q = p[: rng.randrange(1, len(p) + 1)]
            if rng.random() < 0.3:
                q = q + [rng.randrange(30_000, 40_000) for _ in range(rng.randrange(1, 2 * ps + 1))]
            script.append(MatchOp(tuple(q)))
        elif x < 0.64 and kind == "mamba":
            script.append(CowOp(tuple(p[: rng.randrange(1, len(p) + 1)])))
        elif x < 0.74:
            script.append(LockOp(tuple(p)))
        elif x < 0.83:
            script.append(UnlockOp())
        elif x < 0.985:
            script.append(
                EvictOp(
                    rng.randrange(0, 6) * ps,
                    rng.randrange(0, 4) * ps if kind == "swa" else 0,
                    rng.randrange(0, 3) if kind == "mamba" else 0,
                )
            )
        else:
            script.append(ResetOp())
    return script


# ============================================================================ drivers
def _event_rows(events: Sequence[Any]) -> list[tuple[Any, ...]]:
    """SGLang's KV event objects as comparable rows (every field a router reads)."""
    rows: list[tuple[Any, ...]] = []
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            rows.append(
                (name, tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids),
                 e.block_size, e.medium)
            )  # fmt: skip
        elif name == "BlockRemoved":
            rows.append((name, tuple(e.block_hashes), e.medium))
        else:
            rows.append((name,))
    return rows


class _Driver:
    """One cache under test: the operations a script names, in its API's terms."""

    kind: str
    ps: int

    def alloc(self, n: int) -> Any: ...
    def free_kv(self, value: Any) -> None: ...
    def insert(self, op: InsertOp, value: Any) -> tuple[int, bool]: ...
    def match(self, tokens: Sequence[int]) -> tuple[int, Any]: ...
    def cow(self, tokens: Sequence[int]) -> tuple[int, bool]: ...
    def lock(self, node: Any) -> Any: ...
    def unlock(self, held: Any) -> None: ...
    def evict(self, op: EvictOp) -> tuple[int, int, int]: ...
    def reset(self) -> None: ...
    def sizes(self) -> tuple[int, ...]: ...
    def events(self) -> list[tuple[Any, ...]]: ...
    def sanity(self) -> None: ...


class SGLangParamsDriver(_Driver):
    """A cache with SGLang 0.5.23's surface (SGLang's own, or urc's plug-in), driven with
    SGLang's param objects on SGLang's pools."""

    def __init__(self, cache: Any, pools: Any, kind: str) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self.cache, self.pools, self.kind, self.ps = cache, pools, kind, pools.page_size
        self._insert, self._match, self._evict = InsertParams, MatchPrefixParams, EvictParams
        self._key = lambda tokens: RadixKey(array("q", tokens))
        self._swa = ComponentType.SWA
        self._rid = 0

    def alloc(self, n: int) -> Any:
        a = self.pools.allocator
        if self.kind != "swa" or self.ps == 1:
            return a.alloc(n)
        # SGLang's paired allocator serves page 1 only: pair whole pages by hand.
        if n > a.full_available_size() or n > a.swa_available_size():
            return None
        full = a.full_attn_allocator.alloc(n)
        a.set_full_to_swa_mapping(full, a.swa_attn_allocator.alloc(n))
        return full

    def free_kv(self, value: Any) -> None:
        self.pools.allocator.free(value)

    def insert(self, op: InsertOp, value: Any) -> tuple[int, bool]:
        params = self._insert(key=self._key(op.tokens), value=value)
        slot = None
        if op.mamba:
            slot = self.pools.req_to_token_pool.mamba_allocator.alloc(1)
            assert slot is not None, "Mamba slots ran out"
            params.mamba_value = slot
        if op.swa_evicted:
            self.pools.allocator.free_swa(value[: op.swa_evicted])
            params.component_evicted_seqlens[self._swa] = op.swa_evicted
        r = self.cache.insert(params)
        if slot is not None and r.mamba_exist:
            self.pools.req_to_token_pool.mamba_allocator.free(slot)
        return int(r.prefix_len), bool(r.mamba_exist)

    def match(self, tokens: Sequence[int]) -> tuple[int, Any]:
        r = self.cache.match_prefix(self._match(key=self._key(tokens)))
        return int(r.device_prefix_len), r.last_device_node

    def cow(self, tokens: Sequence[int]) -> tuple[int, bool]:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        req = Req(f"cow{self._rid}", "", array("q", tokens), SamplingParams(max_new_tokens=1))
        r = self.cache.match_prefix(self._match(key=self._key(tokens), cow_mamba=True, req=req))
        got = req.kv.mamba_pool_idx is not None
        if got:
            assert req.kv.mamba_cow_src_index is not None, "a state slot without its source"
            self.pools.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
        return int(r.device_prefix_len), got

    def lock(self, node: Any) -> Any:
        return self.cache.lock(node)

    def unlock(self, held: Any) -> None:
        self.cache.unlock(held)

    def evict(self, op: EvictOp) -> tuple[int, int, int]:
        r = self.cache.evict(self._evict(op.num_tokens, op.swa_num_tokens, op.mamba_num))
        return int(r.num_tokens_evicted), int(r.swa_num_tokens_evicted), int(r.mamba_num_evicted)

    def reset(self) -> None:
        """SGLang's ``Scheduler.flush_cache``: the tree resets, then the pools are cleared
        (SGLang's tree leaves its slots to that clear)."""
        self.cache.reset()
        self.pools.req_to_token_pool.clear()
        self.pools.allocator.clear()

    def sizes(self) -> tuple[int, ...]:
        c = self.cache
        out = [c.full_evictable_size(), c.full_protected_size()]
        if self.kind == "swa":
            out += [c.swa_evictable_size(), c.swa_protected_size()]
        if self.kind == "mamba":
            out += [c.mamba_evictable_size(), c.mamba_protected_size()]
        return tuple(int(x) for x in out)

    def events(self) -> list[tuple[Any, ...]]:
        return _event_rows(self.cache.take_events())

    def sanity(self) -> None:
        self.cache.sanity_check()


class URCCoreDriver(_Driver):
    """urc's own cache and pools, through urc's API."""

    def __init__(self, kind: str, ps: int, kv_size: int, window: int) -> None:
        from urc import CacheConfig, ComponentType, MambaSpec, SlidingWindowSpec, build_cache

        specs = {
            "full": (),
            "swa": (SlidingWindowSpec(window=window, kv_size=kv_size),),
            "mamba": (MambaSpec(size=MAMBA_SLOTS, chunk_size=ps),),
        }[kind]
        self.cache = build_cache(
            CacheConfig(
                components=(ComponentType.FULL, *specs),
                page_size=ps, kv_size=kv_size, max_num_reqs=8, max_context_len=4096,
            )
        )  # fmt: skip
        self.cache.enable_kv_events()
        self.cache.reset()  # as SGLang's cache does at construction: AllBlocksCleared
        self.kind, self.ps = kind, ps
        self._rid = 0

    def alloc(self, n: int) -> Any:
        return self.cache.token_to_kv_pool_allocator.alloc(n)

    def free_kv(self, value: Any) -> None:
        self.cache.token_to_kv_pool_allocator.free(value)

    def _mamba_pool(self) -> Any:
        return self.cache.pools.mamba

    def insert(self, op: InsertOp, value: Any) -> tuple[int, bool]:
        import torch

        from urc import ComponentType, InsertParams, RadixKey

        params = InsertParams(key=RadixKey(list(op.tokens)), value=value)
        slot = None
        if op.mamba:
            slot = self._mamba_pool().alloc_slot()
            assert slot is not None, "Mamba slots ran out"
            params.mamba_value = torch.tensor([slot], dtype=torch.int64)
        if op.swa_evicted:
            self.cache.token_to_kv_pool_allocator.free_swa(value[: op.swa_evicted])
            params.set_evicted_seqlen(ComponentType.SWA, op.swa_evicted)
        r = self.cache.insert(params)
        if slot is not None and r.mamba_exist:
            self._mamba_pool().free_slots([slot])
        return int(r.prefix_len), bool(r.mamba_exist)

    def match(self, tokens: Sequence[int]) -> tuple[int, Any]:
        from urc import MatchPrefixParams, RadixKey

        r = self.cache.match_prefix(MatchPrefixParams(RadixKey(list(tokens)), with_indices=False))
        return int(r.device_prefix_len), r.last_device_node

    def cow(self, tokens: Sequence[int]) -> tuple[int, bool]:
        from urc import MatchPrefixParams, RadixKey, Req

        self._rid += 1
        req = Req(f"cow{self._rid}", list(tokens))
        r = self.cache.match_prefix(
            MatchPrefixParams(RadixKey(list(tokens)), cow_mamba=True, req=req, with_indices=False)
        )
        got = req.mamba_pool_idx is not None
        if got:
            self._mamba_pool().free_slots([int(req.mamba_pool_idx)])
        return int(r.device_prefix_len), got

    def lock(self, node: Any) -> Any:
        return self.cache.lock(node)

    def unlock(self, held: Any) -> None:
        self.cache.unlock(held)

    def evict(self, op: EvictOp) -> tuple[int, int, int]:
        from urc import EvictParams

        r = self.cache.evict(EvictParams(op.num_tokens, op.swa_num_tokens, op.mamba_num))
        return int(r.num_tokens_evicted), int(r.swa_num_tokens_evicted), int(r.mamba_num_evicted)

    def reset(self) -> None:
        self.cache.reset()

    def sizes(self) -> tuple[int, ...]:
        c = self.cache
        out = [c.full_evictable_size(), c.full_protected_size()]
        if self.kind == "swa":
            out += [c.swa_evictable_size(), c.swa_protected_size()]
        if self.kind == "mamba":
            out += [c.mamba_evictable_size(), c.mamba_protected_size()]
        return tuple(int(x) for x in out)

    def events(self) -> list[tuple[Any, ...]]:
        from urc.apps.sglang._events import to_sglang_events

        return _event_rows(to_sglang_events(self.cache.take_events()))

    def sanity(self) -> None:
        self.cache.sanity_check()


def _sglang_caches(kind: str, ps: int, kv_size: int, window: int) -> tuple[Any, Any]:
    """SGLang's own cache and urc's plug-in, each on its own SGLang pools, KV events on."""
    from scheduler_steps import Pools, _mamba_cache_params, make_context
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.registry import create_tree_cache

    from urc.apps.sglang import create_cache

    def pools(extra_buffer: bool) -> Any:
        p = Pools(ps, kv_size, 8, 4096, kind=kind, window=window, mamba_size=MAMBA_SLOTS)
        if extra_buffer:  # SGLang's no_buffer Mamba needs page 1
            p.req_to_token_pool = HybridReqToTokenPool(
                size=8, mamba_size=MAMBA_SLOTS, mamba_spec_state_size=8, max_context_len=4096,
                device="cpu", enable_memory_saver=False, cache_params=_mamba_cache_params(),
                mamba_layer_ids=[0], enable_mamba_extra_buffer=True,
                speculative_num_draft_tokens=None,
            )  # fmt: skip
        return p

    extra = kind == "mamba" and ps > 1
    sglang_wheel.publish_server_args(
        page_size=ps, attention_backend="torch_native",
        mamba_radix_cache_strategy="extra_buffer" if extra else "no_buffer",
    )  # fmt: skip
    own_pools = pools(extra)
    own = create_tree_cache(
        make_context(own_pools, enable_kv_cache_events=True, enable_mamba_extra_buffer=extra)
    )
    sglang_wheel.publish_server_args(page_size=ps, attention_backend="torch_native")
    urc_pools = pools(False)
    plugin = create_cache(make_context(urc_pools, enable_kv_cache_events=True))
    return SGLangParamsDriver(own, own_pools, kind), SGLangParamsDriver(plugin, urc_pools, kind)


# ============================================================================ the runner
@dataclass(frozen=True)
class Mismatch:
    """Where a script's caches first disagreed: the step, the operation, each one's view."""

    step: int
    op: Op
    views: dict[str, Any]


def _step(d: _Driver, op: Op, held: list[Any]) -> tuple[Any, ...]:
    if isinstance(op, InsertOp):
        value = d.alloc(len(op.tokens))
        if value is None:  # the pool is full: make room, as a scheduler would
            d.evict(EvictOp(len(op.tokens), len(op.tokens) if d.kind == "swa" else 0))
            value = d.alloc(len(op.tokens))
        if value is None:
            return ("insert", None)
        return ("insert", *d.insert(op, value))
    if isinstance(op, MatchOp):
        return ("match", d.match(op.tokens)[0])
    if isinstance(op, CowOp):
        return ("cow", *d.cow(op.tokens))
    if isinstance(op, LockOp):
        n, node = d.match(op.tokens)
        held.append(d.lock(node))
        return ("lock", n)
    if isinstance(op, UnlockOp):
        if held:
            d.unlock(held.pop())
        return ("unlock",)
    if isinstance(op, EvictOp):
        return ("evict", *d.evict(op))
    while held:
        d.unlock(held.pop())
    d.reset()
    return ("reset",)


def run_script(drivers: dict[str, _Driver], script: Sequence[Op]) -> Mismatch | None:
    """Apply ``script`` to every driver; the first disagreement, or ``None``."""
    held: dict[str, list[Any]] = {name: [] for name in drivers}
    first = {name: d.events() for name, d in drivers.items()}
    if len(set(map(repr, first.values()))) > 1:
        return Mismatch(-1, ResetOp(), first)  # construction (SGLang: AllBlocksCleared)
    for i, op in enumerate(script):
        views = {}
        for name, d in drivers.items():
            views[name] = (_step(d, op, held[name]), d.sizes(), d.events())
            d.sanity()
        if len({repr(v) for v in views.values()}) > 1:
            return Mismatch(i, op, views)
    for name, d in drivers.items():
        while held[name]:
            d.unlock(held[name].pop())
        d.sanity()
    return None


def run_kind(
    kind: str, ps: int, seed: int, scripts: int, n_ops: int = 120,
    on_mismatch: Callable[[int, Mismatch], None] | None = None,
) -> tuple[int, int]:  # fmt: skip
    """Run ``scripts`` random scripts for ``kind`` at page ``ps``; returns (agreeing, run)."""
    sglang_wheel.load()
    kv_size = 48 * ps
    window = max(16, 2 * ps)
    agree = 0
    for s in range(scripts):
        rng = random.Random(f"{seed}/{kind}/{ps}/{s}")
        own, plugin = _sglang_caches(kind, ps, kv_size, window)
        drivers = {
            "sglang": own,
            "plugin": plugin,
            "core": URCCoreDriver(kind, ps, kv_size, window),
        }
        miss = run_script(drivers, make_script(rng, kind, ps, n_ops))
        if miss is None:
            agree += 1
        elif on_mismatch is not None:
            on_mismatch(s, miss)
    return agree, scripts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="full,swa,mamba")
    ap.add_argument("--pages", default="1,4,16")
    ap.add_argument("--scripts", type=int, default=20, help="scripts per kind and page")
    ap.add_argument("--ops", type=int, default=120, help="operations per script")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    total = run = 0

    def show(s: int, m: Mismatch) -> None:
        print(f"  script {s}: step {m.step} {m.op}")
        for name, v in m.views.items():
            print(f"    {name:7s} {v}")

    for kind in args.kinds.split(","):
        for ps in map(int, args.pages.split(",")):
            a, n = run_kind(kind, ps, args.seed, args.scripts, args.ops, show)
            print(f"{kind} page {ps}: agree {a}/{n}")
            total, run = total + a, run + n
    print(f"agree {total}/{run} scripts ({100.0 * total / max(run, 1):.1f}%)")
    return 0 if total == run else 1


if __name__ == "__main__":
    sys.exit(main())
