"""A live SGLang 0.5.23 server with urc's cache against one with SGLang's default cache.

Full-attention tiny Llama (dummy weights), greedy decoding, the same requests sent to both:
per request the output ids and ``cached_tokens`` must be equal, SGLang's idle leak check must
report nothing, and the KV events each publishes (read back over ZMQ, decoded with SGLang's
own ``KVEventBatch``) must count the same.  At page size 1 and 16; chunked prefill, concurrent
requests, an abort in the middle of a generation, retraction under memory pressure and
``/flush_cache``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from live_server import GenRequest, GenResult, LiveServer, ServerConfig, compare
from pairs import ServerPair, ServerPool, assert_same, event_counts, finish_case, run_both
from workloads import chunked_prompts, concurrent_suffixes, shared_prefix, tokens

pytestmark = [pytest.mark.live_sglang, pytest.mark.timeout(900)]

CHUNK = 256
# Pools small enough that the workloads below overflow them (the caches evict).  At page 16
# SGLang also admits requests estimating their decodes at a tenth of ``max_new_tokens``
# (``SGLANG_INIT_NEW_TOKEN_RATIO``, default 0.7): long decodes then outgrow the pool and it
# retracts (at 0.7 it queues them instead and never needs to).
PAGE_1 = ServerConfig(
    "default", page_size=1, max_total_tokens=2048, chunked_prefill_size=CHUNK, kv_events=True
)
PAGE_16 = ServerConfig(
    "default",
    page_size=16,
    max_total_tokens=1024,
    chunked_prefill_size=CHUNK,
    kv_events=True,
    env=(("SGLANG_INIT_NEW_TOKEN_RATIO", "0.1"),),
)


@pytest.fixture(scope="module", params=[PAGE_1, PAGE_16], ids=["page1", "page16"])
def pair(request: pytest.FixtureRequest, server_pool: ServerPool) -> ServerPair:
    """One pair per page size; pytest groups the cases by it (module-scoped parameter)."""
    config: ServerConfig = request.param
    return server_pool.pair(config)


def test_the_servers_name_their_tree_caches(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    default, urc = pair.default.tree_cache_line(), pair.urc.tree_cache_line()
    report(f"[{pair.config.label}] default: {default}")
    report(f"[{pair.config.label}] urc: {urc}")
    assert "source=registered('urc')" in urc, urc
    assert "registered('urc')" not in default, default


def test_a_shared_prefix_workload_gets_the_same_outputs_and_cached_tokens(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    requests = shared_prefix(seed=45)
    cmp = compare("shared prefix x48", *run_both(pair, lambda s: s.generate_many(requests)))
    counts = finish_case(pair, cmp, report)
    assert_same(cmp)
    assert sum(r.cached_tokens for r in cmp.default) > 0
    assert counts[0] == counts[1]


def test_chunked_prefill_of_prompts_several_chunks_long_agrees(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    requests = chunked_prompts(seed=7, chunk=CHUNK)
    assert min(len(r.input_ids) for r in requests) > 3 * CHUNK
    cmp = compare(
        "chunked prefill 3.3x chunk", *run_both(pair, lambda s: s.generate_many(requests))
    )
    counts = finish_case(pair, cmp, report)
    assert_same(cmp)
    assert counts[0] == counts[1]


def test_concurrent_requests_agree(pair: ServerPair, report: Callable[[str], None]) -> None:
    warm, requests = concurrent_suffixes(seed=11)

    def run(server: LiveServer) -> list[GenResult]:
        return [server.generate(warm), *server.generate_many(requests, concurrency=len(requests))]

    cmp = compare(f"concurrent x{len(requests)}", *run_both(pair, run))
    counts = finish_case(pair, cmp, report)
    assert_same(cmp)
    # Batching depends on arrival times, so event batches may split differently; what was
    # stored and removed may not.
    assert {k: v for k, v in counts[0].items() if "blocks" in k} == {
        k: v for k, v in counts[1].items() if "blocks" in k
    }


def test_an_abort_in_the_middle_of_a_generation_frees_everything(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    prompt = tokens(random.Random(3), 200)

    def run(server: LiveServer) -> list[GenResult]:
        long = GenRequest(prompt, max_new_tokens=4000, rid=f"abort-me-{server.port}")
        got: list[GenResult] = []
        mark = len(server.log())
        worker = threading.Thread(target=lambda: got.append(server.generate(long)))
        worker.start()
        deadline = time.monotonic() + 60
        # Abort once the request is decoding (SGLang logs every 40th decode step).
        while time.monotonic() < deadline and "Decode batch" not in server.log()[mark:]:
            time.sleep(0.1)
        assert server.abort(long.rid or "") == 200
        worker.join(timeout=120)
        assert not worker.is_alive(), "the aborted request never answered"
        # The same prompt again: its prefix is cached whatever the abort left.
        after = server.generate(GenRequest(prompt + tokens(random.Random(4), 5), 4))
        return [*got, after]

    default, urc = run_both(pair, run)
    aborted = (default[0].finish, urc[0].finish)
    cmp = compare("abort mid-generation", default[1:], urc[1:])
    cmp.extra["aborted request finish"] = aborted
    finish_case(pair, cmp, report)
    assert aborted == ("abort", "abort"), (default[0], urc[0])
    assert len(default[0].output_ids) < 4000 and len(urc[0].output_ids) < 4000
    assert_same(cmp)


def test_retraction_under_memory_pressure_agrees(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    if pair.config != PAGE_16:
        pytest.skip("retraction is driven at page 16 (SGLANG_INIT_NEW_TOKEN_RATIO=0.1)")
    rng = random.Random(5)
    common = tokens(rng, 48)
    # Enough 64 + 120 token requests to ask twice the pool: SGLang admits them all on its
    # estimate of their decode lengths, and their decodes outgrow the pool.
    n = -(-pair.config.max_total_tokens * 2 // (64 + 120))
    requests = [GenRequest(common + tokens(rng, 16), max_new_tokens=120) for _ in range(n)]
    default, urc = run_both(pair, lambda s: s.generate_batch(requests))
    cmp = compare(f"retraction x{len(requests)}", default, urc)
    retractions = (sum(r.retractions for r in default), sum(r.retractions for r in urc))
    cmp.extra["retractions"] = retractions
    finish_case(pair, cmp, report)
    assert retractions[0] > 0 and retractions[1] > 0, retractions
    # When a request is retracted depends on timing; what it generates may not.
    assert_same(cmp, cached=False)


def test_flush_cache_empties_both_caches(pair: ServerPair, report: Callable[[str], None]) -> None:
    request = GenRequest(tokens(random.Random(9), 120), max_new_tokens=4)

    def run(server: LiveServer) -> list[GenResult]:
        first = server.generate(request)
        again = server.generate(request)
        server.settle(0.5)
        assert server.flush_cache()
        return [first, again, server.generate(request)]

    # Both start from an empty tree: the abort case before this one leaves trees that differ
    # by how many tokens each server decoded before its abort landed (timing), and the
    # eviction those leftovers cause would be counted here.
    for server in (pair.default, pair.urc):
        assert server.flush_cache()
        server.settle()
    cmp = compare("/flush_cache", *run_both(pair, run))
    counts = finish_case(pair, cmp, report)
    assert_same(cmp)
    assert cmp.default[1].cached_tokens > 0 and cmp.default[2].cached_tokens == 0
    assert counts[0].get("AllBlocksCleared", 0) >= 1
    assert counts[0] == counts[1]


def test_the_start_up_publishes_all_blocks_cleared_as_the_default_does(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    default = event_counts(pair.startup_events["default"])
    urc = event_counts(pair.startup_events["urc"])
    report(f"[{pair.config.label}] start-up (with warm-up request) events: {default} vs {urc}")
    cleared = (default.get("AllBlocksCleared", 0), urc.get("AllBlocksCleared", 0))
    assert cleared[0] >= 1 and cleared[0] == cleared[1], cleared
