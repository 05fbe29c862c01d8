"""``cache_finished_req`` / ``cache_unfinished_req``: SGLang's request-level surface
(``kv_len_to_handle``, ``strip_thinking_cache``, the ``pop_*`` protocol, ``fill_ids``)."""

from __future__ import annotations

import copy
import pickle

import pytest
from cache_harness import Harness, components_of, running_request, seq

from urc import ComponentType, Req, UnifiedRadixCache
from urc.errors import InvalidInputError
from urc.specs import SlidingWindowSpec

PAGE_SIZES = [1, 4, 16]


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def h(request: pytest.FixtureRequest) -> Harness:
    return Harness(page_size=request.param, kv_size=64 * 64)


def _finish(h: Harness, req: Req, **kw: object) -> None:
    h.cache.cache_finished_req(req, **kw)  # type: ignore[arg-type]
    h.held = 0
    h.check()


def test_kv_len_to_handle_caps_what_is_cached_and_the_rest_is_freed(h: Harness) -> None:
    ps = h.page_size
    inp, out = seq(0, 3, ps), seq(10_000, 2, ps)
    req = running_request(h, inp, out)
    _finish(h, req, kv_len_to_handle=len(inp) + ps)
    assert h.match_len(inp + out) == len(inp) + ps
    assert h.alloc.available_size() == h.alloc.size - (len(inp) + ps)


def test_kv_len_to_handle_outside_the_committed_range_is_refused_and_changes_nothing(
    h: Harness,
) -> None:
    ps = h.page_size
    req = running_request(h, seq(0, 2, ps), [])
    before = (h.alloc.available_size(), h.cache.protected_size(), req.req_pool_idx)
    with pytest.raises(InvalidInputError):
        h.cache.cache_finished_req(req, kv_len_to_handle=req.kv_committed_len + 1)
    assert (h.alloc.available_size(), h.cache.protected_size(), req.req_pool_idx) == before
    h.check()
    _finish(h, req)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("reasoning_tokens", [0, 3])
def test_strip_thinking_cache_keeps_only_the_prompt(ps: int, reasoning_tokens: int) -> None:
    h = Harness(page_size=ps, kv_size=64 * ps, strip_thinking_cache=True)
    inp, out = [*seq(0, 3, ps), 7], seq(10_000, 2, ps)
    req = running_request(h, inp, out)
    req.reasoning_tokens = reasoning_tokens
    _finish(h, req)
    cached = h.match_len(inp + out)
    if reasoning_tokens:
        assert cached == len(inp) // ps * ps  # the prompt's whole pages; the rest freed
    else:
        assert cached == (len(inp) + len(out)) // ps * ps
    assert h.alloc.available_size() == h.alloc.size - cached


def test_popped_overallocated_range_is_the_callers_to_free(h: Harness) -> None:
    ps = h.page_size
    req = running_request(h, seq(0, 2, ps), seq(10_000, 1, ps), over=2 * ps)
    row = req.req_pool_idx
    assert row is not None
    start, end = req.pop_overallocated_kv_cache()
    assert (start, end) == (req.kv_committed_len, req.kv_allocated_len)
    with pytest.raises(InvalidInputError):
        req.pop_overallocated_kv_cache()
    tail = h.cache.req_to_token_pool.read(row, start, end).clone()
    h.cache.cache_finished_req(req)
    h.held = tail.shape[0]  # still the caller's
    h.check()
    h.alloc.free(tail)
    h.held = 0
    h.check()


def test_overallocated_range_is_freed_when_nobody_popped_it(h: Harness) -> None:
    ps = h.page_size
    req = running_request(h, seq(0, 2, ps), [], over=3 * ps)
    _finish(h, req)
    assert h.alloc.available_size() == h.alloc.size - 2 * ps


def test_popped_committed_range_is_neither_cached_nor_freed(h: Harness) -> None:
    ps = h.page_size
    req = running_request(h, seq(0, 2, ps), seq(10_000, 1, ps))
    row = req.req_pool_idx
    assert row is not None
    assert req.pop_committed_kv_cache() == req.kv_committed_len
    own = h.cache.req_to_token_pool.read(row, 0, req.kv_committed_len).clone()
    h.cache.cache_finished_req(req)
    h.held = own.shape[0]
    h.check()
    assert h.match_len(seq(0, 2, ps)) == 0
    h.alloc.free(own)
    h.held = 0
    h.check()


def test_assigned_fill_ids_are_what_an_unfinished_request_caches(h: Harness) -> None:
    ps = h.page_size
    prompt = seq(0, 4, ps)
    req = running_request(h, prompt, [])
    req.kv_committed_len = 0
    req.fill_ids = prompt[: 2 * ps]  # the first chunk was prefilled
    assert req.kv_committed_len == 2 * ps and req.get_fill_ids() == prompt[: 2 * ps]
    h.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 2 * ps
    assert h.cache.protected_size() == 2 * ps
    h.held = len(prompt) - 2 * ps
    h.check()
    req.fill_ids = prompt
    h.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == len(prompt)
    h.held = 0
    h.check()
    _finish(h, req)
    assert h.match_len(prompt) == len(prompt)


def test_unfinished_caching_rematches_so_the_path_is_the_newest(h: Harness) -> None:
    ps = h.page_size
    prompt = seq(0, 4, ps)
    h.insert(prompt[: 2 * ps] + seq(5000, 2, ps))
    req = running_request(h, prompt, [])
    h.cache.cache_unfinished_req(req)  # inserts (splitting nothing new), then matches
    path = []
    node = req.last_node
    assert node is not None
    while node.parent is not None:
        path.append(node.last_access_time)
        node = node.parent
    newest = max(n.last_access_time for n in h.cache.iter_nodes())
    assert path[0] == newest and path == sorted(path, reverse=True)
    h.held = 0
    _finish(h, req)


def test_fill_ids_of_a_request_without_output_is_its_prompt_list_itself() -> None:
    """Each chunk commit reads ``fill_ids``: no O(prompt) concatenation per chunk."""
    prompt = list(range(1000, 1600))
    req = Req("r0", prompt)
    assert req.fill_ids is prompt
    req.output_ids = [7, 8]
    assert req.fill_ids == [*prompt, 7, 8] and req.fill_ids is not prompt


def _tree_state(cache: UnifiedRadixCache) -> list[tuple[object, ...]]:
    """Every node's key path, stamps, counts and per-component values and locks."""
    rows = []
    for node in cache.iter_nodes():
        path = tuple(tuple(p.key) for p in cache.path_to(node))
        data = tuple(
            None if cd is None else (None if cd.value is None else cd.value.tolist(), cd.lock_ref)
            for cd in node.data
        )
        rows.append((path, node.last_access_time, node.hit_count, node.priority, data))
    return sorted(rows, key=repr)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_resumed_chunk_commit_equals_a_walk_from_the_root(
    ps: int, swa: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's commit resumes at the request's locked node and re-matches the inserted
    path; the tree must end exactly as with SGLang's insert and match from the root."""

    comps = (ComponentType.FULL, ComponentType.SWA) if swa else (ComponentType.FULL,)

    class PairedHarness(Harness):
        def check(self) -> None:  # the request holds as many SWA slots as Full ones
            self.cache.sanity_check()
            self.cache.check_pools({ct: self.held for ct in comps})

    def run(from_root: bool) -> list[tuple[object, ...]]:
        h = PairedHarness(
            page_size=ps, kv_size=512 * ps, components=components_of(comps, SlidingWindowSpec(3))
        )
        cache = h.cache
        if from_root:
            plain_insert, plain_match = cache.insert, cache.match_prefix
            monkeypatch.setattr(cache, "insert", lambda p, resume_from=None: plain_insert(p))
            monkeypatch.setattr(cache, "match_path", lambda p, path, known=None: plain_match(p))
        h.insert(seq(0, 3, ps))
        h.insert(seq(0, 2, ps) + seq(900, 2, ps))
        prompt = seq(0, 2, ps) + seq(5000, 7, ps)
        req = running_request(h, prompt, [])
        for end in range(3 * ps, len(prompt) + 1, 2 * ps):
            req.kv_committed_len = end
            cache.cache_unfinished_req(req)
            h.held = len(prompt) - req.cache_protected_len
            h.check()
        req.kv_committed_len = len(prompt)
        _finish(h, req)
        return _tree_state(cache)

    assert run(from_root=False) == run(from_root=True)


def test_fill_prefix_packs_the_prompt_once_and_hands_out_views_of_it() -> None:
    prompt = list(range(100))
    req = Req("r0", prompt)
    first = req.fill_prefix(16)
    assert type(first) is memoryview and first.format == "q" and first.tolist() == prompt[:16]
    again = req.fill_prefix(48)
    assert again.obj is first.obj and again.tolist() == prompt[:48]  # the same buffer
    assert req.fill_prefix(32).tolist() == prompt[:32]
    assert req.fill_prefix(1000).tolist() == prompt  # all of it
    assert first.tolist() == prompt[:16]  # an earlier view keeps its bytes
    prompt.append(7)  # the same list, grown: packed again (the old buffer is left alone)
    grown = req.fill_prefix(101)
    assert grown.obj is not first.obj and grown.tolist() == prompt and first.tolist() == prompt[:16]
    req.output_ids = [8]
    rebuilt = req.fill_prefix(64)  # fill_ids is a new list now: packed again
    assert rebuilt.obj is not grown.obj and rebuilt.tolist() == prompt[:64]
    req.fill_ids = [5, 6, 7]
    assert req.fill_prefix(2).tolist() == [5, 6]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_chunk_commit_result_is_the_request_row_not_a_copy(ps: int) -> None:
    """After a chunk commit the prefix indices are the row's first ``a`` slots (a view):
    a commit copies the chunk, never the whole prompt so far."""
    h = Harness(page_size=ps, kv_size=64 * ps)
    prompt = seq(0, 8, ps)
    req = running_request(h, prompt, [])
    row = req.req_pool_idx
    assert row is not None
    for end in range(2 * ps, len(prompt) + 1, 2 * ps):
        req.kv_committed_len = end
        h.cache.cache_unfinished_req(req, chunked=True)
        view = h.cache.req_to_token_pool.read(row, 0, end)
        assert req.cache_protected_len == end
        assert req.prefix_indices.data_ptr() == view.data_ptr()
        assert req.prefix_indices.tolist() == view.tolist()
        h.held = len(prompt) - end
        h.check()
    _finish(h, req)


def test_a_request_with_a_packed_prompt_can_be_deep_copied_and_pickled() -> None:
    req = Req("r0", list(range(64)))
    assert req.fill_prefix(32).tolist() == list(range(32))
    for twin in (copy.deepcopy(req), pickle.loads(pickle.dumps(req))):
        assert twin.fill_prefix(48).tolist() == list(range(48))
