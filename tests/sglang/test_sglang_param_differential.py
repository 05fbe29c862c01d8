"""The plug-in honours every field of SGLang 0.5.23's ``InsertParams`` /
``MatchPrefixParams`` / ``EvictParams`` or refuses it by name, and agrees with SGLang's own
cache on random operation scripts driven through those param objects (urc's core API runs
the same scripts: :mod:`sglang_differential`)."""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("sglang")

KINDS_PAGES = [(k, p) for k in ("full", "swa", "mamba") for p in (1, 4, 16)]


@pytest.mark.parametrize(("kind", "ps"), KINDS_PAGES, ids=lambda x: str(x))
def test_plugin_and_core_agree_with_sglangs_cache_through_sglangs_params(
    kind: str, ps: int
) -> None:
    from sglang_differential import Mismatch, run_kind

    misses: list[str] = []

    def note(s: int, m: Mismatch) -> None:
        misses.append(f"script {s} step {m.step} {m.op}: {m.views}")

    agree, run = run_kind(kind, ps, seed=0, scripts=3, n_ops=80, on_mismatch=note)
    assert agree == run, misses[0]


def _plugin(kind: str, ps: int = 1, events: bool = False) -> tuple[Any, Any]:
    import sglang_wheel
    from scheduler_steps import Pools, make_context

    from urc.apps.sglang import create_cache

    sglang_wheel.publish_server_args(page_size=ps, attention_backend="torch_native")
    pools = Pools(ps, 64 * ps, 4, 256, kind=kind)
    return create_cache(make_context(pools, enable_kv_cache_events=events)), pools


def _key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


@pytest.mark.parametrize("kind", ["full", "swa", "mamba"])
def test_with_kv_events_on_the_plugin_publishes_all_blocks_cleared_at_construction(
    kind: str,
) -> None:
    cache, _ = _plugin(kind, events=True)
    assert [type(e).__name__ for e in cache.take_events()] == ["AllBlocksCleared"]
    quiet, _ = _plugin(kind, events=False)
    assert quiet.take_events() == []


def test_an_insert_with_a_mamba_value_gives_the_node_that_state() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    cache, pools = _plugin("mamba")
    mamba = pools.req_to_token_pool.mamba_allocator
    free = mamba.available_size()
    slot = mamba.alloc(1)
    r = cache.insert(
        InsertParams(key=_key([1, 2, 3, 4]), value=pools.allocator.alloc(4), mamba_value=slot)
    )
    assert not r.mamba_exist
    assert cache.mamba_evictable_size() == 1 and mamba.available_size() == free - 1
    # A match may end there: the node has the state.
    assert cache.match_prefix(MatchPrefixParams(key=_key([1, 2, 3, 4, 5]))).device_prefix_len == 4
    again = mamba.alloc(1)
    r = cache.insert(
        InsertParams(key=_key([1, 2, 3, 4]), value=pools.allocator.alloc(4), mamba_value=again)
    )
    assert r.mamba_exist and r.prefix_len == 4  # the caller still owns ``again``
    mamba.free(again)
    cache.sanity_check()


def test_an_insert_naming_the_swa_evicted_prefix_keeps_no_swa_slot_there() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    cache, pools = _plugin("swa")
    value = pools.allocator.alloc(32)
    pools.allocator.free_swa(value[:16])  # the request's window slid past them
    params = InsertParams(key=_key(list(range(1, 33))), value=value)
    params.component_evicted_seqlens[ComponentType.SWA] = 16
    cache.insert(params)
    assert cache.full_evictable_size() == 32
    assert cache.swa_evictable_size() == 16  # tombstones below 16, none kept by mistake
    cache.sanity_check()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mamba_keep_idx", 0),
        ("c128_value", "pages"),
        ("track_adopted_ranges", True),
        ("rotation_base", 3),
    ],
)
def test_an_insert_field_urc_does_not_serve_is_refused_by_name_and_changes_nothing(
    field: str, value: Any
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    from urc.errors import UnsupportedParamError

    cache, pools = _plugin("full")
    slots = pools.allocator.alloc(4)
    free = pools.allocator.available_size()
    params = dataclasses.replace(
        InsertParams(key=_key([1, 2, 3, 4]), value=slots), **{field: value}
    )
    with pytest.raises(UnsupportedParamError) as info:
        cache.insert(params)
    assert info.value.field == f"InsertParams.{field}"
    assert cache.total_size() == 0 and pools.allocator.available_size() == free


def test_every_field_of_sglangs_params_is_served_or_refused() -> None:
    """The table in ``urc.apps.sglang._params`` names every field SGLang 0.5.23 defines: a
    field it does not know would be refused as unknown (none is dropped silently)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

    from urc.apps.sglang import _params

    known = _params._SERVED_INSERT | set(_params._WHY)
    assert {f.name for f in dataclasses.fields(InsertParams)} == known
    assert {f.name for f in dataclasses.fields(MatchPrefixParams)} == _params._SERVED_MATCH
    assert {f.name for f in dataclasses.fields(EvictParams)} == _params._SERVED_EVICT


def test_inserted_len_counts_a_hit_only_on_nodes_past_it() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    cache, pools = _plugin("full")
    cache.insert(InsertParams(key=_key([1, 2, 3, 4]), value=pools.allocator.alloc(4)))
    core = cache.urc
    (first,) = core.iter_nodes()
    hits = first.hit_count
    cache.insert(
        InsertParams(
            key=_key([1, 2, 3, 4, 5, 6]),
            value=pools.allocator.alloc(6),
            prev_prefix_len=0,
            inserted_len=4,
        )
    )
    assert first.hit_count == hits  # [0, 4) was this request's own earlier insert
    cache.insert(InsertParams(key=_key([1, 2, 3, 4, 5, 6, 7]), value=pools.allocator.alloc(7)))
    assert first.hit_count == hits + 1
