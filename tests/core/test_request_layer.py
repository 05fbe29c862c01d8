"""The request layer in SGLang 0.5.23's terms (:mod:`urc.request_caching`): ``checkpoint``,
``release``, ``lock`` / ``unlock`` / ``move_lock`` / ``release_swa`` over a request, for
every component set and page size, with ``sanity_check()`` and pool conservation after
every step."""

from __future__ import annotations

import pytest
import torch
from cache_harness import components_of

from urc import CacheConfig, ComponentType, Req, UnifiedRadixCache, build_cache
from urc.errors import InvalidInputError
from urc.key import RadixKey
from urc.lock_receipts import TreeLock
from urc.params import MatchPrefixParams
from urc.specs import MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
KINDS = {"full": (FULL,), "swa": (FULL, SWA), "mamba": (FULL, MAMBA)}
PAGE_SIZES = [1, 4, 16]


def _cache(kind: str, ps: int) -> UnifiedRadixCache:
    return build_cache(
        CacheConfig(
            components=components_of(
                KINDS[kind], SlidingWindowSpec(2 * ps), MambaSpec(size=8, chunk_size=ps)
            ),
            page_size=ps,
            kv_size=64 * ps,
            max_num_reqs=4,
            max_context_len=32 * ps,
        )
    )


class _Run:
    """One request on ``cache`` and what it holds outside the tree (Full slots in its row
    past the protected prefix; its Mamba slot)."""

    def __init__(self, cache: UnifiedRadixCache, prompt: list[int], output: list[int]) -> None:
        self.cache = cache
        self.req = Req(rid="r", origin_input_ids=prompt, output_ids=output)
        req = self.req
        row = cache.req_to_token_pool.alloc()
        assert row is not None
        req.req_pool_idx = row
        cow = cache.has_component(MAMBA)
        hit = cache.match_prefix(
            MatchPrefixParams(RadixKey(list(prompt)), cow, req if cow else None)
        )
        cache.move_lock(req, hit.last_device_node)
        req.cache_protected_len = hit.device_prefix_len
        if cow:
            cache.component(MAMBA).alloc_req_slot(req)  # type: ignore[attr-defined]
        total = len(prompt) + len(output)
        own = cache.token_to_kv_pool_allocator.alloc(total - req.cache_protected_len)
        assert own is not None
        cache.req_to_token_pool.write(row, 0, torch.cat([hit.indices, own]))
        self.total = total
        self.check()

    def held(self) -> dict[ComponentType, int]:
        own = self.total - self.req.cache_protected_len if self.req.req_pool_idx is not None else 0
        mamba = 0 if self.req.mamba_pool_idx is None else 1
        return {FULL: own, SWA: own, MAMBA: mamba}

    def check(self) -> None:
        self.cache.sanity_check()
        self.cache.check_pools(self.held())

    def finish(self) -> None:
        """SGLang's ``release_kv_cache``: a finished checkpoint, the row's own slots freed,
        the lock released, then :func:`release`."""
        cache, req = self.cache, self.req
        cache.checkpoint(req, self.total, finished=True)
        row = req.req_pool_idx
        assert row is not None
        cache.token_to_kv_pool_allocator.free(
            cache.req_to_token_pool.read(row, req.cache_protected_len, self.total)
        )
        cache.unlock(req.lock)
        req.lock = None
        cache.release(req, checkpointed=True)
        cache.req_to_token_pool.free(row)
        req.req_pool_idx = None
        self.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_checkpoint_moves_the_lock_and_points_the_row_at_the_trees_copy(kind: str, ps: int) -> None:
    cache = _cache(kind, ps)
    prompt, output = list(range(1, 6 * ps + 1)), list(range(1000, 1000 + 2 * ps))
    run = _Run(cache, prompt, output)
    req = run.req
    for up_to in (2 * ps + 1, 5 * ps, len(prompt) + 1):
        cache.checkpoint(req, up_to)
        aligned = up_to - up_to % ps
        assert req.cache_protected_len == aligned
        assert req.lock is not None and req.lock.node is req.last_node
        assert req.last_node is not None
        path = cache.path_device_indices(req.last_node)
        assert path.shape[0] == aligned
        assert torch.equal(cache.req_to_token_pool.read(req.req_pool_idx or 0, 0, aligned), path)
        assert cache.full_protected_size() == aligned
        run.check()
    run.finish()
    assert cache.protected_size() == 0
    # The owner released the lock itself (SGLang's order): release leaves last_node.
    assert (req.lock, req.mamba_pool_idx) == (None, None)
    # The whole request is cached (Mamba: its donated state ends the path).
    if kind != "swa":
        hit = cache.match_prefix(MatchPrefixParams(RadixKey(prompt + output)))
        assert hit.device_prefix_len == run.total


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_full_only_checkpoint_splits_the_path_at_the_prompts_end(ps: int) -> None:
    cache = _cache("full", ps)
    prompt, output = list(range(1, 3 * ps + 1)), list(range(1000, 1000 + 2 * ps))
    run = _Run(cache, prompt, output)
    run.finish()
    ends = sorted(n.key_len for n in cache.iter_nodes())
    assert ends == [2 * ps, 3 * ps]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_release_without_a_checkpoint_gives_the_requests_state_back(kind: str) -> None:
    cache = _cache(kind, 4)
    run = _Run(cache, list(range(1, 9)), [])
    req = run.req
    row = req.req_pool_idx
    assert row is not None
    cache.token_to_kv_pool_allocator.free(cache.req_to_token_pool.read(row, 0, run.total))
    run.total = req.cache_protected_len  # the row's own slots are gone
    cache.release(req, checkpointed=False)
    assert (req.lock, req.last_node, req.mamba_pool_idx) == (None, None, None)
    cache.req_to_token_pool.free(row)
    req.req_pool_idx = None
    run.check()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_checkpoint_below_the_protected_prefix_is_refused_and_changes_nothing(kind: str) -> None:
    cache = _cache(kind, 4)
    run = _Run(cache, list(range(1, 17)), [])
    req = run.req
    cache.checkpoint(req, 12)
    before = (req.lock, req.last_node, req.cache_protected_len, cache.full_protected_size())
    with pytest.raises(InvalidInputError):
        cache.checkpoint(req, 8)
    assert (req.lock, req.last_node, req.cache_protected_len, cache.full_protected_size()) == before
    run.check()
    run.finish()


def test_a_released_swa_part_is_not_released_again_by_unlock() -> None:
    cache = _cache("swa", 1)
    run = _Run(cache, list(range(1, 9)), [])
    req = run.req
    cache.checkpoint(req, 8)
    tree_lock = req.lock
    assert isinstance(tree_lock, TreeLock) and cache.swa_protected_size() > 0
    cache.release_swa(tree_lock)
    cache.release_swa(tree_lock)  # once only
    assert tree_lock.swa_released and cache.swa_protected_size() == 0
    assert cache.full_protected_size() == 8
    run.check()
    run.finish()
    assert cache.protected_size() == cache.swa_protected_size() == 0
