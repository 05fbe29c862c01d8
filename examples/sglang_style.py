"""The synchronous, SGLang-style API of the cache, step by step (run it: it prints each step).

This is the surface a scheduler such as SGLang's calls from its own (single) thread:
``match_prefix``, ``insert``, ``inc_lock_ref`` / ``dec_lock_ref``, ``cache_unfinished_req`` /
``cache_finished_req`` and ``evict``, with the parameter types of :mod:`urc.params`.  The cache
holds slot indices only; the KV bytes live in the pools the config builds.
"""

from __future__ import annotations

import torch

from urc import (
    CacheConfig,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    build_cache,
)


def main() -> None:
    cache = build_cache(CacheConfig(kv_size=64, page_size=1, max_num_reqs=4, max_context_len=64))
    allocator = cache.token_to_kv_pool_allocator

    # 1. A prompt was prefilled into fresh KV slots: hand them to the tree.
    system = [101, 102, 103, 104, 105, 106, 107, 108]
    slots = allocator.alloc(len(system))
    assert slots is not None
    res = cache.insert(InsertParams(key=RadixKey(system), value=slots))
    print(f"insert: {res.total_len} tokens, {res.prefix_len} were cached already")

    # 2. A new request shares that prefix: match it, and lock the hit while it runs.
    prompt = [*system, 1, 2, 3]
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    hit = m.device_indices.shape[0]
    tree_lock = cache.lock(m.last_device_node)
    print(
        f"match_prefix: {hit} of {len(prompt)} tokens hit; locked {cache.protected_size()} tokens"
    )
    print(f"  evictable {cache.evictable_size()}, protected {cache.protected_size()}")

    # 3. The request runs: its row in req_to_token holds the hit, then its own new slots.
    req = Req("req-1", prompt, output_ids=[7, 8])
    row = cache.req_to_token_pool.alloc()
    assert row is not None
    req.req_pool_idx = row
    req.prefix_indices = m.device_indices
    req.last_node = m.last_device_node
    req.lock = tree_lock
    req.cache_protected_len = hit
    total = len(req.fill_ids)
    own = allocator.alloc(total - hit)
    assert own is not None
    cache.req_to_token_pool.write(row, 0, torch.cat([m.device_indices, own]))

    # Chunked prefill: the prompt so far becomes matchable while the request decodes.
    req.kv_committed_len = len(prompt)  # computed so far
    req.kv_allocated_len = total  # slots for the output too
    cache.cache_unfinished_req(req)
    print(f"cache_unfinished_req: {req.cache_protected_len} tokens now tree-owned")

    # 4. It finished decoding: the tree takes its KV and the lock is released.
    req.kv_committed_len = total
    cache.cache_finished_req(req)
    print(f"cache_finished_req: the tree holds {cache.total_size()} tokens")

    # 5. A plain lock/unlock pair (what a server does around a batch that reads the prefix).
    m2 = cache.match_prefix(MatchPrefixParams(key=RadixKey([*prompt, 7, 8, 9])))
    r2 = cache.inc_lock_ref(m2.last_device_node)
    cache.dec_lock_ref(m2.last_device_node, r2.to_dec_params())
    print(f"match after finish: {m2.device_indices.shape[0]} tokens hit")

    # 6. Memory pressure: evict least recently used, unlocked leaves.
    ev = cache.evict(EvictParams(num_tokens=4))
    print(f"evict: freed {ev.num_tokens_evicted} tokens; {allocator.available_size()} free")

    cache.sanity_check()
    cache.check_pools()
    print("sanity_check and pool conservation: ok")
    cache.pretty_print()  # prints the tree


if __name__ == "__main__":
    main()
