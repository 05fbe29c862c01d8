"""urc as SGLang 0.5.23's ``--radix-cache-backend urc``, against the real wheel.

SGLang's own plug-in loader finds urc, its own ``create_tree_cache`` builds it from a
``TreeCacheBuildContext`` on its own pool classes, and its own scheduler-side functions
(``scheduler_steps``) drive requests through it: chunked prefill, decode, finish, abort and
retraction, with pool conservation and ``sanity_check()`` after every step.
"""

from __future__ import annotations

import random
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("sglang")

ROOT = Path(__file__).resolve().parents[2]
GROUP = "sglang.srt.plugins"


def _publish(page_size: int, **fields: Any) -> None:
    import sglang_wheel

    sglang_wheel.publish_server_args(
        radix_cache_backend="urc", page_size=page_size, attention_backend="torch_native",
        **fields,
    )  # fmt: skip


@pytest.fixture
def plugin_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point as pyproject.toml declares it, visible to importlib.metadata even
    where the installed copy of this project predates it (an editable install elsewhere):
    a dist-info written from pyproject.toml's own table."""
    tomllib = pytest.importorskip("tomllib")

    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    declared = table[GROUP]
    if any(ep.name == "urc" for ep in entry_points(group=GROUP)):
        return
    info = tmp_path / "unified_radix_cache_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: urc-plugin-under-test\n")
    lines = "".join(f"{k} = {v}\n" for k, v in declared.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_pyproject_declares_the_plugin_entry_point() -> None:
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][GROUP] == {"urc": "urc.apps.sglang:register"}
    assert any(r.startswith("sglang") for r in project["optional-dependencies"]["sglang"])


@pytest.mark.usefixtures("plugin_on_path")
def test_sglang_load_plugins_registers_the_urc_backend() -> None:
    import sglang.srt.plugins as plugins
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    plugins._plugins_loaded = False  # load_plugins runs once per process
    plugins.load_plugins()
    assert "urc" in registered_radix_cache_backends()
    plugins.load_plugins()  # idempotent, as SGLang calls it in every process
    assert registered_radix_cache_backends().count("urc") == 1


def _register() -> None:
    import urc.apps.sglang

    urc.apps.sglang.register()


@pytest.mark.parametrize(
    ("kind", "page_size"),
    [("full", 1), ("full", 4), ("full", 16), ("swa", 1), ("swa", 4), ("swa", 16), ("mamba", 1)],
)
def test_create_tree_cache_returns_urc_on_sglang_pools(kind: str, page_size: int) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import create_tree_cache

    from urc.apps.sglang._cache import SGLangRadixCache

    _register()
    _publish(page_size)
    pools = Pools(page_size, 256, 4, 128, kind=kind)
    cache = create_tree_cache(make_context(pools))
    assert isinstance(cache, SGLangRadixCache) and isinstance(cache, BasePrefixCache)
    assert cache.token_to_kv_pool_allocator is pools.allocator
    assert cache.req_to_token_pool is pools.req_to_token_pool
    swa, mamba = kind == "swa", kind == "mamba"
    assert (cache.supports_swa(), cache.supports_mamba(), cache.supports_prefix_sharing()) == (
        swa,
        mamba,
        True,
    )
    assert cache.sliding_window_size == (pools.window if swa else None)
    assert cache.full_evictable_size() == cache.full_protected_size() == 0
    assert cache.swa_protected_size() == cache.mamba_evictable_size() == 0
    assert cache.cache_controller is None


@pytest.mark.parametrize(
    "policy", ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "tlru"]
)
def test_sglang_eviction_policy_selects_urcs_policy_of_that_name(policy: str) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    _register()
    _publish(1)
    cache = create_tree_cache(make_context(Pools(1, 64, 2, 64), eviction_policy=policy))
    assert cache.urc.config.eviction_policy.value == policy


@pytest.mark.parametrize(
    ("policy", "config", "attr", "expected"),
    [
        ("slru", {"protected_threshold": 4}, "_threshold", 4),
        ("tlru", {"threshold": 4096, "next_prompt_estimate": 512}, "_slack", 512 - 4096),
    ],
)
def test_sglang_eviction_policy_config_sets_the_policys_parameters(
    policy: str, config: dict[str, int], attr: str, expected: int
) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    _register()
    _publish(1)
    ctx = make_context(Pools(1, 64, 2, 64), eviction_policy=policy, eviction_policy_config=config)
    cache = create_tree_cache(ctx)
    from urc import ComponentType

    # Kept as given, and read by the policy's strategy.
    assert dict(cache.urc.config.eviction_params) == config
    assert getattr(cache.urc.component(ComponentType.FULL).strategy, attr) == expected


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"is_hybrid_ssm": True, "enable_mamba_extra_buffer": True}, "extra_buffer"),
        ({"enable_hierarchical_cache": True, "is_hybrid_ssm": True}, "with a Mamba model"),
        ({"disable_radix_cache": True}, "--disable-radix-cache"),
        ({"eviction_policy": "belady"}, "--radix-eviction-policy belady"),
        (
            {"eviction_policy": "lru", "eviction_policy_config": {"threshold": 8}},
            "--radix-eviction-policy-config",
        ),
    ],
)
def test_an_unsupported_launch_option_fails_at_start_up_naming_it(
    change: dict[str, Any], flag: str
) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    from urc.errors import ConfigError

    _register()
    _publish(4)
    pools = Pools(4, 64, 2, 64)
    init_fields = (
        "eviction_policy",
        "eviction_policy_config",
        "enable_kv_cache_events",
        "enable_mamba_extra_buffer",
    )
    params = {k: v for k, v in change.items() if k in init_fields}
    ctx = make_context(pools, **params)
    for k, v in change.items():
        if k not in params:
            setattr(ctx, k, v)
    with pytest.raises(ConfigError, match=flag.replace("-", r"\-")):
        create_tree_cache(ctx)


@pytest.mark.parametrize(
    ("memory", "flag"),
    [
        ({"hicache_storage_backend": "hf3fs"}, "--hicache-storage-backend hf3fs"),
        ({"hicache_mem_layout": "page_head"}, "--hicache-mem-layout page_head"),
        ({"hicache_mem_layout": "page_first_direct"}, "--hicache-mem-layout page_first_direct"),
    ],
)
def test_hicache_options_urc_does_not_serve_fail_at_start_up_naming_the_flag(
    memory: dict[str, Any], flag: str
) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    from urc.errors import ConfigError

    _register()
    _publish(4, enable_hierarchical_cache=True, **memory)
    with pytest.raises(ConfigError, match=flag):
        create_tree_cache(make_context(Pools(4, 64, 2, 64), hicache=True))


@pytest.mark.parametrize(
    ("memory", "host_tokens"),
    [
        # --hicache-ratio: times the device buffers' 68 slots (64 tokens and SGLang's
        # padding page; SGLang's own host pool takes the ratio of the 64).
        ({"hicache_ratio": 3.0}, 204),
        # --hicache-size (GB) over the device's Full KV bytes per token: one layer, one
        # head of 4 bf16 elements, K and V = 16 bytes; 2 KiB is 128 tokens.
        ({"hicache_size": 2 / (1 << 20), "hicache_ratio": 3.0}, 128),
        # ... rounded up to whole pages (4 tokens): 1000 bytes is 62.5 tokens -> 64.
        ({"hicache_size": 1000 / (1 << 30)}, 64),
    ],
)
def test_hicache_size_and_ratio_size_the_host_pool(
    memory: dict[str, Any], host_tokens: int
) -> None:
    from scheduler_steps import Pools, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    from urc.node import ComponentType

    _register()
    _publish(4, enable_hierarchical_cache=True, hicache_write_policy="write_through", **memory)
    cache = create_tree_cache(make_context(Pools(4, 64, 2, 64), hicache=True))
    assert cache.host.host_capacity(ComponentType.FULL) == host_tokens


def _hicache_args(policy: str | None) -> dict[str, Any]:
    if policy is None:
        return {}
    return {"enable_hierarchical_cache": True, "hicache_write_policy": policy, "hicache_ratio": 1.0}


def _drive(
    kind: str, page_size: int, seed: int, steps: int, hicache: str | None = None
) -> tuple[dict[str, int], Any]:
    """A random workload of shared-prefix requests through SGLang's scheduler functions
    (with HiCache: ``hicache`` is its write policy); returns how often each kind of step
    ran, and the loop."""
    from scheduler_steps import Pools, SchedulerLoop, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    _register()
    _publish(page_size, **_hicache_args(hicache))
    pools = Pools(page_size, 512, 8, 256, kind=kind)
    cache = create_tree_cache(make_context(pools, hicache=hicache is not None))
    loop = SchedulerLoop(cache, pools, chunk=16)
    rng = random.Random(seed)
    bases = [[rng.randrange(1, 50) for _ in range(48)] for _ in range(3)]
    waiting: list[Any] = []
    done = dict.fromkeys(("prefill", "chunk", "decode", "finish", "abort", "retract"), 0)
    for n in range(steps):
        if len(waiting) < 3:
            prompt = rng.choice(bases)[: rng.randrange(4, 48)]
            prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            waiting.append(loop.new_req(f"r{n}", prompt, rng.randrange(1, 40)))
        prefilling = list(loop.prefilling)
        decoding = loop.decoding()
        op = rng.random()
        if prefilling and op < 0.3:
            done["chunk"] += loop.prefill(prefilling[0])
        elif waiting and len(loop.running) < 6 and op < 0.5:
            if loop.prefill(waiting[0]):
                waiting.pop(0)
                done["prefill"] += 1
        elif decoding and op < 0.8:
            loop.decode(decoding)
            done["decode"] += 1
            for r in decoding:
                if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                    loop.finish(r)
                    done["finish"] += 1
        elif loop.running and op < 0.9:
            r = rng.choice(loop.running)
            if r in prefilling:
                loop.abort(r)
                done["abort"] += 1
            else:
                loop.retract(r)
                waiting.append(r)
                done["retract"] += 1
        loop.check()
    for _ in range(100):  # drain: everything finishes, the tree keeps only evictable KV
        if not loop.running:
            break
        decoding = loop.decoding()
        for r in loop.running:
            if r not in decoding:
                loop.prefill(r)
        for r in decoding:
            loop.finish(r)
        loop.check()
    assert not loop.running
    loop.cache.wait_for_backups()  # the idle turns' polling, at once
    assert loop.cache.full_protected_size() == 0
    return done, loop


@pytest.mark.parametrize(
    ("kind", "page_size", "seed"),
    [
        ("full", 1, 0),
        ("full", 4, 1),
        ("full", 16, 2),
        ("swa", 1, 3),
        ("swa", 4, 4),
        ("swa", 16, 5),
        ("mamba", 1, 6),
        ("mamba", 1, 7),
    ],
)
def test_sglang_scheduler_functions_drive_many_requests_through_urc(
    kind: str, page_size: int, seed: int
) -> None:
    done, loop = _drive(kind, page_size, seed, steps=300)
    assert all(done.values()), done  # every kind of step ran
    assert loop.min_free < 4 * page_size  # the pool ran full: allocations evicted from urc
    if kind == "swa":
        assert loop.saw_swa_tombstones


@pytest.mark.parametrize(
    ("kind", "policy", "page_size", "seed"),
    [
        ("full", "write_back", 1, 8),
        ("full", "write_through", 4, 9),
        ("full", "write_through_selective", 16, 10),
        ("swa", "write_back", 4, 11),
        ("swa", "write_through", 1, 12),
    ],
)
def test_with_hicache_evicted_prefixes_come_back_from_host_with_their_own_kv(
    kind: str, policy: str, page_size: int, seed: int
) -> None:
    # The loop checks at every admission that a matched prefix's KV is its own tokens'.
    done, loop = _drive(kind, page_size, seed, steps=300, hicache=policy)
    counters = loop.cache.urc.counters
    assert loop.cache.host is not None
    assert counters.backed_up_tokens > 0 and counters.loaded_back_tokens > 0, counters
    assert all(done.values()), done


def test_a_retracted_request_is_readmitted_and_hits_its_own_cached_prefix() -> None:
    from scheduler_steps import Pools, SchedulerLoop, make_context
    from sglang.srt.mem_cache.registry import create_tree_cache

    _register()
    _publish(4)
    pools = Pools(4, 256, 4, 128)
    loop = SchedulerLoop(create_tree_cache(make_context(pools)), pools, chunk=8)
    req = loop.new_req("a", list(range(1, 30)), 8)
    loop.prefill(req)  # first chunk: 8 tokens checkpointed into the tree
    loop.check()
    assert req.kv.cache_protected_len == 8 and loop.cache.full_protected_size() == 8
    while req.prefix_len < len(req.origin_input_ids):
        loop.prefill(req)
        loop.check()
    loop.decode([req])
    loop.check()
    loop.retract(req)
    loop.check()
    assert loop.cache.full_protected_size() == 0 and loop.cache.full_evictable_size() == 24
    loop.prefill(req)  # the match hits the checkpointed chunks; one chunk does the rest
    assert req.kv.cache_protected_len == 24 and req.prefix_len == 29 + 2
    loop.check()


def test_the_schedulers_other_calls_are_served() -> None:
    """touch_prefix, dfs_weight_order, the size and log strings, events, sessions, reset:
    what the scheduler calls besides the request path, on SGLang's own objects."""
    from array import array

    from scheduler_steps import Pools, SchedulerLoop, make_context
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import create_tree_cache

    _register()
    _publish(1)
    pools = Pools(1, 256, 4, 128)
    loop = SchedulerLoop(create_tree_cache(make_context(pools)), pools, chunk=64)
    cache = loop.cache
    reqs = [loop.new_req(f"r{i}", [1, 2, 3, 4 + i, 5, 6], 4) for i in range(3)]
    for r in reqs:
        assert loop.prefill(r)
    assert cache.is_root(cache.root_node) and cache.is_root(reqs[0].last_node)
    for r in reqs:
        loop.finish(r)
    loop.check()
    keys = [RadixKey(array("q", [1, 2, 3, 4 + i, 5, 6]), None) for i in range(3)]
    nodes = [cache.match_prefix(MatchPrefixParams(key=k)).last_device_node for k in keys]
    assert not any(cache.is_root(n) for n in nodes)
    assert sorted(cache.dfs_weight_order(nodes)) == [0, 1, 2]
    clock = nodes[0].last_access_time
    cache.touch_prefix(keys[0])
    assert nodes[0].last_access_time > clock  # the touched path is the newest
    assert "Available full tokens" in cache.available_and_evictable_str()
    assert cache.total_size() == cache.full_evictable_size() + cache.full_protected_size()
    assert cache.take_events() == [] and cache.session_records() == {}
    assert cache.open_radix_session("s") is None and cache.release_radix_session("s") == 0
    assert cache.full_evictable_size() > 0
    cache.reset()
    loop.check()
    assert cache.full_evictable_size() == 0
    assert pools.allocator.available_size() == pools.kv_size
