"""Per-component specs: specs in ``components`` give the same config as the flat fields,
``config.specs`` gives the specs back, each spec validates itself and builds its own pools."""

from __future__ import annotations

import pytest

from urc import CacheConfig, ComponentType
from urc.cache import build_cache
from urc.config import build_pools
from urc.errors import ConfigError
from urc.specs import MambaSpec, SlidingWindowSpec

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

CASES = [
    ((), (FULL,)),
    ((SlidingWindowSpec(window=32, kv_size=512),), (FULL, SWA)),
    ((MambaSpec(size=8, chunk_size=16),), (FULL, MAMBA)),
    ((MambaSpec(size=8), SlidingWindowSpec(window=32)), (FULL, SWA, MAMBA)),
]


@pytest.mark.parametrize(("specs", "components"), CASES)
def test_specs_spell_the_flat_config_and_come_back(
    specs: tuple[SlidingWindowSpec | MambaSpec, ...], components: tuple[ComponentType, ...]
) -> None:
    ordered = sorted(specs, key=lambda s: s.component_type)
    config = CacheConfig(components=(FULL, *ordered), page_size=4, kv_size=1024)
    assert config.components == components
    assert set(config.specs) == set(specs)
    assert [s.component_type for s in config.specs] == list(components[1:])
    flat = CacheConfig(
        components=components,
        page_size=4,
        kv_size=1024,
        **{
            k: v
            for s in specs
            for k, v in (
                {"sliding_window_size": s.window, "swa_kv_size": s.kv_size}
                if isinstance(s, SlidingWindowSpec)
                else {"mamba_size": s.size, "mamba_chunk_size": s.chunk_size}
            ).items()
        },
    )
    assert flat == config


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
    "specs",
    [
        (SlidingWindowSpec(window=0),),
        (SlidingWindowSpec(window=8, kv_size=0),),
        (MambaSpec(size=0),),
        (MambaSpec(size=4), MambaSpec(size=8)),
    ],
    ids=["no-window", "no-swa-slots", "no-states", "twice"],
)
def test_a_bad_spec_is_a_config_error(specs: tuple[SlidingWindowSpec | MambaSpec, ...]) -> None:
    with pytest.raises(ConfigError):
        CacheConfig(components=(FULL, *specs))
