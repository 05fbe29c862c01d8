"""The sliding window's lock walks (``urc.components.swa_window``): the compiled walks and
their Python twins agree on every receipt, valid or not."""

from __future__ import annotations

import random

import pytest

from urc import (
    CacheConfig,
    ComponentType,
    DecLockRefParams,
    EvictParams,
    IncLockRefResult,
    InsertParams,
    InvalidLockError,
    MatchPrefixParams,
    RadixKey,
    TreeNode,
    UnifiedRadixCache,
    build_cache,
)
from urc.components.swa_window import select_window_walks
from urc.fastpath import WalkImpl, native_available
from urc.specs import SlidingWindowSpec

SWA = ComponentType.SWA


def _swa_locks(cache: UnifiedRadixCache) -> list[tuple[int, int]]:
    """Every node's SWA lock count, by node id."""
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        cd = node.data[SWA]
        assert cd is not None
        out.append((node.id, cd.lock_ref))
        stack.extend(node.children.values())
    return sorted(out)


@pytest.mark.skipif(not native_available(), reason="urc._native._walk not built")
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(("ps", "window"), [(1, 4), (4, 8), (2, 3)])
def test_compiled_window_release_is_the_python_twin(seed: int, ps: int, window: int) -> None:
    """Both implementations of the window walks return, raise and change the same on random
    locked trees with SWA tombstones, for real receipts, none, and broken ones (wrong or
    missing uuid, skip sets, epochs), dry and applied; a release that raises leaves every
    count as it was."""
    rng = random.Random(seed)
    cache = build_cache(
        CacheConfig(
            components=(ComponentType.FULL, SlidingWindowSpec(window)),
            page_size=ps,
            kv_size=400 * ps,
        )
    )
    alloc = cache.token_to_kv_pool_allocator

    def pages(start: int, n: int) -> list[int]:
        return list(range(start, start + n * ps))

    receipts: list[tuple[TreeNode, IncLockRefResult]] = []
    for _ in range(8):
        tokens = pages(rng.choice([0, 1000, 2000]), rng.randint(1, 6))[:ps]
        tokens += pages(3000 + rng.randrange(4) * 100, rng.randint(0, 4))
        value = alloc.alloc(len(tokens))
        assert value is not None
        cache.insert(InsertParams(key=RadixKey(tokens), value=value))
        if rng.random() < 0.7:
            key = RadixKey(tokens[: rng.randint(1, len(tokens) // ps) * ps])
            node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
            if node.parent is not None:
                receipts.append((node, cache.inc_lock_ref(node)))
        if rng.random() < 0.4:
            cache.evict(EvictParams(swa_num_tokens=ps * rng.randint(1, 3)))
        cache.sanity_check()
    walks = (select_window_walks(WalkImpl.PYTHON), select_window_walks(WalkImpl.NATIVE))
    for node, receipt in receipts:
        p = receipt.to_dec_params()
        uuid, skip, epoch = p.swa_uuid_for_lock, p.skip_lock_node_ids, p.swa_lock_epoch
        path_ids = {n.id for n in cache.tree.path_to(node)}
        for params in [
            p,
            None,
            DecLockRefParams(None, skip_lock_node_ids=skip, swa_lock_epoch=epoch),
            DecLockRefParams(10**6, skip_lock_node_ids=skip, swa_lock_epoch=epoch),
            DecLockRefParams(uuid, skip_lock_node_ids={SWA: path_ids}, swa_lock_epoch=epoch),
            DecLockRefParams(uuid),
            DecLockRefParams(uuid, skip_lock_node_ids=skip, swa_lock_epoch=-1),
        ]:
            before = _swa_locks(cache)
            outs: list[object] = []
            for w in walks:
                try:
                    locked = w.locked(node, SWA, params, window)
                    res: object = [n.id for n in locked]
                except InvalidLockError as e:
                    locked, res = [], str(e)
                assert _swa_locks(cache) == before  # a dry walk
                try:
                    delta: object = w.release(node, SWA, params, window)
                except InvalidLockError as e:
                    delta = str(e)
                outs.append((res, delta, _swa_locks(cache)))
                for n in locked:  # undo the release, for the other twin
                    cd = n.data[SWA]
                    assert cd is not None
                    cd.lock_ref += isinstance(delta, int)
                assert _swa_locks(cache) == before  # (a release that raised restored itself)
            assert outs[0] == outs[1], params
    for node, receipt in receipts:
        cache.dec_lock_ref(node, receipt.to_dec_params())
    cache.sanity_check()
