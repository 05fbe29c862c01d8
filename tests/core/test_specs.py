"""Per-component specs and policy parameters, kept as given: the config holds the specs it
was given and each component reads its own; each spec validates itself when the config is
constructed and builds its own pools; the policy's parameters reach its strategy as given."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from urc import CacheConfig, ComponentType, EvictionPolicy
from urc.cache import build_cache
from urc.components.mamba import MambaComponent
from urc.components.swa import SWAComponent
from urc.config import build_pools
from urc.errors import ConfigError
from urc.eviction_policy import SlruStrategy, TlruStrategy, policy_parameters
from urc.specs import ComponentSpec, MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

CASES = [
    ((), (FULL,)),
    ((SlidingWindowSpec(window=32, kv_size=512),), (FULL, SWA)),
    ((MambaSpec(size=8, chunk_size=16),), (FULL, MAMBA)),
    ((SlidingWindowSpec(window=32), MambaSpec(size=8)), (FULL, SWA, MAMBA)),
]


@pytest.mark.parametrize(("specs", "types"), CASES)
def test_the_config_keeps_its_specs_as_given(
    specs: tuple[ComponentSpec, ...], types: tuple[ComponentType, ...]
) -> None:
    config = CacheConfig(components=(FULL, *specs), page_size=4, kv_size=1024)
    assert config.components == (FULL, *specs)
    assert all(a is b for a, b in zip(config.specs, specs, strict=True))
    assert config.types == types
    for spec in specs:
        assert config.spec(type(spec)) is spec
    # Equal specs make equal (and equally hashed) configs; a config survives a pickle.
    again = CacheConfig(components=(FULL, *specs), page_size=4, kv_size=1024)
    assert again == config and hash(again) == hash(config)
    assert pickle.loads(pickle.dumps(config)) == config


def test_each_component_reads_its_own_spec() -> None:
    swa_spec = SlidingWindowSpec(window=12, kv_size=512)
    mamba_spec = MambaSpec(size=8, chunk_size=16)
    cache = build_cache(
        CacheConfig(components=(FULL, swa_spec, mamba_spec), page_size=4, kv_size=1024)
    )
    swa = cache.component(SWA)
    mamba = cache.component(MAMBA)
    assert isinstance(swa, SWAComponent) and isinstance(mamba, MambaComponent)
    assert swa.window == 12 and swa.leaf_cap == 12
    assert mamba.chunk_size == 16
    with pytest.raises(ConfigError, match="no MambaSpec"):
        CacheConfig(components=(FULL, swa_spec)).spec(MambaSpec)


def test_each_spec_builds_its_own_pools() -> None:
    config = CacheConfig(
        components=(FULL, SlidingWindowSpec(window=32, kv_size=512), MambaSpec(size=8)),
        page_size=4,
        kv_size=1024,
    )
    pools = build_pools(config)
    assert pools.swa is not None and pools.mamba is not None
    assert pools.token_allocator.swa_size == 512  # type: ignore[attr-defined]
    assert pools.mamba.size == 8
    cache = build_cache(config, pools)
    assert cache.has_component(SWA) and cache.has_component(MAMBA)
    cache.sanity_check()


@pytest.mark.parametrize(
    "components",
    [
        (FULL, SlidingWindowSpec(window=0)),
        (FULL, SlidingWindowSpec(window=8, kv_size=0)),
        (FULL, SlidingWindowSpec(window=8.0)),  # type: ignore[arg-type]
        (FULL, MambaSpec(size=0)),
        (FULL, MambaSpec(size=4, chunk_size=0)),
        (FULL, MambaSpec(size=4, ssm_shape=(2, 0))),
        (FULL, MambaSpec(size=4), MambaSpec(size=8)),
        (FULL, MambaSpec(size=4), SlidingWindowSpec(window=8)),
        (FULL, SWA),
        (FULL, MAMBA),
        (SlidingWindowSpec(window=8),),
        (FULL, "swa"),
        (),
    ],
    ids=[
        "no-window",
        "no-swa-slots",
        "float-window",
        "no-states",
        "no-chunk",
        "empty-ssm-dim",
        "twice",
        "out-of-order",
        "bare-swa",
        "bare-mamba",
        "no-full",
        "not-a-spec",
        "empty",
    ],
)
def test_a_bad_spec_is_a_config_error_at_construction(components: tuple[object, ...]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(components=components)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "params", "strategy", "attr", "expected"),
    [
        (EvictionPolicy.SLRU, {"protected_threshold": 5}, SlruStrategy, "_threshold", 5),
        (EvictionPolicy.SLRU, {}, SlruStrategy, "_threshold", 2),
        (
            EvictionPolicy.TLRU,
            {"threshold": 8, "next_prompt_estimate": 3},
            TlruStrategy,
            "_slack",
            -5,
        ),
    ],
)
def test_the_policy_gets_its_parameters_as_given(
    policy: EvictionPolicy, params: dict[str, int], strategy: type, attr: str, expected: int
) -> None:
    given = dict(params)
    config = CacheConfig(eviction_policy=policy, eviction_params=given)
    given["unknown"] = 1  # the config kept its own copy
    assert dict(config.eviction_params) == params
    full = build_cache(config).component(FULL)
    assert isinstance(full.strategy, strategy)  # type: ignore[attr-defined]
    assert getattr(full.strategy, attr) == expected  # type: ignore[attr-defined]
    assert set(params) <= set(policy_parameters(policy))


def test_the_flat_fields_of_earlier_versions_read_from_the_specs_deprecated() -> None:
    config = CacheConfig(
        components=(FULL, SlidingWindowSpec(window=32, kv_size=512), MambaSpec(size=8)),
        eviction_policy=EvictionPolicy.TLRU,
        eviction_params={"threshold": 7},
    )
    expected = {
        "sliding_window_size": 32,
        "swa_kv_size": 512,
        "mamba_size": 8,
        "mamba_chunk_size": 64,
        "mamba_conv_shape": (4, 8),
        "tlru_threshold": 7,
        "tlru_next_prompt_estimate": 0,
        "slru_protected_threshold": 2,  # another policy's: its default
        "session_window_s": 600.0,
    }
    for name, value in expected.items():
        with pytest.deprecated_call(match=name):
            assert getattr(config, name) == value
    with pytest.deprecated_call():
        assert CacheConfig().sliding_window_size is None
    with pytest.deprecated_call():
        assert CacheConfig().mamba_size == 0
    # Not fields: the config holds only the specs and the parameters.
    names = {f.name for f in dataclasses.fields(CacheConfig)}
    assert names.isdisjoint(expected)


@pytest.mark.parametrize(
    ("flat", "given"),
    [
        (
            {
                "components": (FULL, SWA, MAMBA),
                "sliding_window_size": 8,
                "swa_kv_size": 64,
                "mamba_size": 4,
                "mamba_chunk_size": 16,
            },
            {"components": (FULL, SlidingWindowSpec(8, 64), MambaSpec(size=4, chunk_size=16))},
        ),
        (
            # Flat fields of absent components and of other policies were ignored.
            {"sliding_window_size": 8, "mamba_size": 4, "slru_protected_threshold": 3},
            {},
        ),
        (
            {"eviction_policy": EvictionPolicy.TLRU, "tlru_threshold": 5},
            {"eviction_policy": EvictionPolicy.TLRU, "eviction_params": {"threshold": 5}},
        ),
        (
            {"eviction_policy": EvictionPolicy.RETURN_TIME, "return_horizon_s": 64.0},
            {"eviction_policy": EvictionPolicy.RETURN_TIME, "eviction_params": {"horizon_s": 64.0}},
        ),
    ],
    ids=["components", "ignored", "tlru", "return-time"],
)
def test_the_flat_keywords_of_earlier_versions_still_construct_deprecated(
    flat: dict[str, object], given: dict[str, object]
) -> None:
    with pytest.deprecated_call(match="deprecated"):
        old = CacheConfig(kv_size=128, **flat)  # type: ignore[arg-type]
    assert old == CacheConfig(kv_size=128, **given)  # type: ignore[arg-type]
    with pytest.deprecated_call(), pytest.raises(ConfigError):
        CacheConfig(components=(FULL, SWA), sliding_window_size=0)  # type: ignore[call-arg]
