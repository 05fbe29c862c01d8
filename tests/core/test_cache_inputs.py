"""Bad input to the synchronous core: typed errors that change nothing (insert values, devices,
configs, evict amounts), and EAGLE bigram keys."""

from __future__ import annotations

import pytest
import torch
from cache_harness import Harness

from urc import (
    CacheConfig,
    ComponentType,
    ConfigError,
    EvictParams,
    InsertParams,
    InvalidIndicesError,
    InvalidInputError,
    KeyValueMismatchError,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.eviction_policy import EvictionPolicy
from urc.specs import MambaSpec, SlidingWindowSpec

FULL = ComponentType.FULL

PAGE_SIZES = [1, 4, 16, 64]


@pytest.fixture(params=PAGE_SIZES, ids=lambda p: f"page{p}")
def h(request: pytest.FixtureRequest) -> Harness:
    return Harness(page_size=request.param, kv_size=64 * 64)


def test_eagle_bigram_keys() -> None:
    cache = build_cache(CacheConfig(kv_size=256, is_eagle=True))
    alloc = cache.token_to_kv_pool_allocator

    def insert(ids: list[int]) -> int:
        v = alloc.alloc(len(ids) - 1)
        assert v is not None
        r = cache.insert(InsertParams(key=RadixKey(ids), value=v))
        cache.sanity_check()
        return r.prefix_len

    assert [insert(s) for s in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12])] == [0, 2, 0]
    assert insert([1, 2, 3, 4, 5, 60, 70]) == 4
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 60, 70])))
    assert m.device_indices.shape[0] == 6
    assert m.last_device_node.key == [(5, 60), (60, 70)]
    cache.check_pools()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (torch.arange(3, dtype=torch.int64), KeyValueMismatchError),
        (torch.arange(4, dtype=torch.int32), InvalidIndicesError),
        (torch.arange(4, dtype=torch.float32), InvalidIndicesError),
        (torch.tensor([0, 1, 2, 1 << 20]), InvalidIndicesError),
        (torch.tensor([-1, 1, 2, 3]), InvalidIndicesError),
        (torch.tensor([40, 41, 42, 43]), InvalidIndicesError),  # in range, never allocated
        (torch.arange(8).view(2, 4), InvalidIndicesError),
        (None, InvalidInputError),
    ],
)
def test_bad_insert_values_are_typed_errors_and_change_nothing(
    value: torch.Tensor | None, error: type[Exception]
) -> None:
    h = Harness(page_size=1, kv_size=64)
    h.insert([1, 2])
    before = (h.cache.num_nodes, h.cache.evictable_size(), h.alloc.available_size())
    with pytest.raises(error):
        h.cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=value))
    assert (h.cache.num_nodes, h.cache.evictable_size(), h.alloc.available_size()) == before
    h.check()


def test_value_on_another_device_is_rejected() -> None:
    h = Harness(page_size=1, kv_size=64)
    v = torch.arange(2, dtype=torch.int64, device="meta")
    with pytest.raises(InvalidIndicesError):
        h.cache.insert(InsertParams(key=RadixKey([1, 2]), value=v))
    h.check()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"page_size": 3},
        {"page_size": 0},
        {"kv_size": -4},
        {"kv_size": 10, "page_size": 4},
        {"max_num_reqs": 0},
        {"components": (ComponentType.SWA,)},
        {"components": (ComponentType.FULL, ComponentType.FULL)},
        {"components": (ComponentType.FULL, ComponentType.SWA)},
        {"components": (ComponentType.FULL, SlidingWindowSpec(window=0))},
        {"components": (ComponentType.FULL, MambaSpec(size=0))},
        {"components": (ComponentType.FULL, MambaSpec(size=4), SlidingWindowSpec(window=4))},
        {"eviction_policy": EvictionPolicy.SLRU, "eviction_params": {"threshold": 1}},
        {"eviction_policy": EvictionPolicy.TLRU, "eviction_params": {"threshold": -1}},
        {"eviction_policy": EvictionPolicy.LRU, "eviction_params": {"protected_threshold": 1}},
    ],
)
def test_bad_configs_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(**kwargs)  # type: ignore[arg-type]


def test_negative_evict_amounts_are_rejected() -> None:
    h = Harness(page_size=1, kv_size=64)
    with pytest.raises(InvalidInputError):
        h.cache.evict(EvictParams(num_tokens=-1))


def test_a_device_this_torch_cannot_use_is_a_config_error() -> None:
    """Issue 50 item 9: ``device="cuda"`` on a CPU-only torch raised a bare AssertionError."""
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ConfigError, match="not usable"):
        build_cache(CacheConfig(kv_size=64, device=device))


@pytest.mark.parametrize("device", ["bogus", "cuda:x"])
def test_a_device_that_is_not_a_torch_device_is_a_config_error(device: object) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(kv_size=64, device=device)  # type: ignore[arg-type]


def test_a_bad_session_id_is_named_with_its_type_by_name() -> None:
    """The message says ``got 7 (int)``, never ``<class 'int'>``; nothing is inserted."""
    from urc.reuse_hint import ReuseHint

    with pytest.raises(InvalidInputError, match=r"got 7 \(int\)$"):
        ReuseHint(session_id=7)  # type: ignore[arg-type]
    cache = build_cache(CacheConfig(page_size=1, kv_size=64))
    slots = cache.token_to_kv_pool_allocator.alloc(2)
    # With a hint (which takes the params' session when it names none), the id is checked.
    params = InsertParams(
        key=RadixKey([1, 2]),
        value=slots,
        session_id=7,  # type: ignore[arg-type]
        reuse_hint=ReuseHint(),
    )
    with pytest.raises(InvalidInputError, match=r"got 7 \(int\)$"):
        cache.insert(params)
    assert cache.total_size() == 0
    cache.sanity_check()
