"""Hybrid models in a live SGLang 0.5.23 server: urc against SGLang's default cache.

A hybrid sliding-window model runs on SGLang's CPU path: ``MellumForCausalLM`` (a class SGLang
treats as hybrid SWA) with one sliding-window layer and one full-attention layer, dummy
weights.  SGLang then builds its paired Full/SWA allocator and the tree caches their SWA
components (urc: FULL+SWA on SGLang's pools); SGLang's idle leak check covers both pools and
its tree-cache sanity check runs on every idle turn (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``).
Prompts stay inside the window (1024): SGLang's CPU attention cannot run a request whose
out-of-window SWA slots were freed (see ``MELLUM_SWA``), so SWA tombstones are not reached
live; ``tests/sglang/`` drives them through SGLang's scheduler functions.

Mamba hybrids do not run on SGLang 0.5.23's CPU path, so none is started here
(``docs/sglang.md`` names the missing ops; ``test_mamba_hybrids_lack_cpu_ops`` keeps that
claim checked against the installed wheel).
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Callable

import pytest
from live_server import (
    MELLUM_SWA,
    SWA_POOL_AS_LARGE_AS_FULL,
    GenRequest,
    GenResult,
    LiveServer,
    ServerConfig,
    compare,
)
from pairs import ServerPair, ServerPool, assert_same, finish_case, run_both
from side_env import SideEnv
from workloads import chunked_prompts, concurrent_suffixes, shared_prefix, tokens

pytestmark = [pytest.mark.live_sglang, pytest.mark.timeout(900)]

CHUNK = 256
SWA = ServerConfig(
    "default",
    model=MELLUM_SWA,
    page_size=1,
    max_total_tokens=4096,
    chunked_prefill_size=CHUNK,
    extra_args=SWA_POOL_AS_LARGE_AS_FULL,
    env=(("SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", "1"),),
)


@pytest.fixture(scope="module")
def pair(server_pool: ServerPool) -> ServerPair:
    return server_pool.pair(SWA)


def test_both_servers_run_the_model_as_hybrid_swa(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    default, urc = pair.default.tree_cache_line(), pair.urc.tree_cache_line()
    report(f"[{pair.config.label}] default: {default}")
    report(f"[{pair.config.label}] urc: {urc}")
    assert "hybrid_swa=True" in default and "hybrid_swa=True" in urc, (default, urc)
    assert "source=registered('urc')" in urc, urc


def test_swa_shared_prefixes_past_the_window_agree(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    requests = shared_prefix(seed=46, groups=4, per_group=6, prefix=160, new=6)
    cmp = compare("swa shared prefix x24", *run_both(pair, lambda s: s.generate_many(requests)))
    finish_case(pair, cmp, report)
    assert_same(cmp)
    assert sum(r.cached_tokens for r in cmp.default) > 0


def test_swa_chunked_prefill_agrees(pair: ServerPair, report: Callable[[str], None]) -> None:
    requests = chunked_prompts(seed=8, chunk=CHUNK)
    cmp = compare("swa chunked prefill", *run_both(pair, lambda s: s.generate_many(requests)))
    finish_case(pair, cmp, report)
    assert_same(cmp)


def test_swa_concurrent_requests_and_flush_agree(
    pair: ServerPair, report: Callable[[str], None]
) -> None:
    warm, requests = concurrent_suffixes(seed=12, n=12, prefix=128, new=40)
    again = GenRequest(tokens(random.Random(13), 100), max_new_tokens=4)

    def run(server: LiveServer) -> list[GenResult]:
        return [server.generate(warm), *server.generate_many(requests, concurrency=len(requests))]

    def after_flush(server: LiveServer) -> list[GenResult]:
        return [server.generate(again), server.generate(again)]

    cmp = compare("swa concurrent x12", *run_both(pair, run))
    finish_case(pair, cmp, report)
    assert_same(cmp)
    # Both caches must accept the flush: an earlier run saw the default refuse it only because
    # its scheduler had died on SGLang's CPU SWA read (see SWA_POOL_AS_LARGE_AS_FULL).
    accepted = (pair.default.flush_cache(), pair.urc.flush_cache())
    report(f"[{pair.config.label}] /flush_cache accepted (default, urc): {accepted}")
    assert accepted == (True, True), accepted
    cmp = compare("swa after /flush_cache", *run_both(pair, after_flush))
    finish_case(pair, cmp, report)
    assert_same(cmp)


def test_mamba_hybrids_lack_cpu_ops(side_env: SideEnv, report: Callable[[str], None]) -> None:
    """SGLang 0.5.23 has no CPU path for a Mamba hybrid's state kernels: Mamba2 mixers
    (NemotronH, FalconH1, GraniteMoeHybrid, ...) import ``causal_conv1d_fn`` only on
    CUDA/NPU/XPU, LFM2's short conv runs SGLang's Triton ``causal_conv1d`` (no CPU driver),
    and Qwen3-Next's GDN backend imports ``sgl_kernel.mamba`` and ``torch.ops.sgl_kernel``
    CPU kernels that only a CPU build of sgl-kernel has.  Fails when one of them appears."""
    probe = """
import torch
from sglang.srt.layers.attention.mamba import mamba
print("mamba2", hasattr(mamba, "causal_conv1d_fn"))
from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_fn
x = torch.randn(8, 5)
try:
    causal_conv1d_fn(x, torch.randn(8, 3), None, query_start_loc=torch.tensor([0, 5]).int(),
                     cache_indices=torch.tensor([0]).int(),
                     has_initial_state=torch.tensor([False]), conv_states=torch.zeros(1, 8, 2))
    print("lfm2 True")
except RuntimeError:
    print("lfm2 False")
try:
    import sglang.srt.layers.attention.linear.gdn_backend
    print("gdn True")
except ImportError:
    print("gdn False")
"""
    done = subprocess.run(
        [str(side_env.python), "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env={"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"},
    )
    found = dict(line.split() for line in done.stdout.splitlines() if line.count(" ") == 1)
    report(f"[mamba hybrids] CPU path available: {found or done.stderr.strip()[-300:]}")
    assert found == {"mamba2": "False", "lfm2": "False", "gdn": "False"}, done.stderr[-500:]
