"""Shared helpers of the metrics tests: a command-applying actor, value readers, checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import urc
from urc import CacheConfig, ComponentType, RadixKey, Tier, UnifiedRadixCache
from urc.errors import URCError
from urc.service._commands import (
    Alloc,
    Call,
    Command,
    CommandKind,
    Insert,
    InsertOutcome,
)
from urc.service._executor import CommandExecutor
from urc.service._observer import ServiceObserver
from urc.specs import MambaSpec, SlidingWindowSpec
from urc.stats import CacheStats, ComponentStats

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "examples" / "grafana-dashboard.json"

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
NAMES = {FULL: "full", SWA: "swa", MAMBA: "mamba"}


# ---------------------------------------------------------------------------- helpers
COMPONENT_SETS: dict[str, dict[str, Any]] = {
    "full": {"components": (FULL,)},
    "full+swa": {"components": (FULL, SlidingWindowSpec(window=8, kv_size=1024))},
    "full+mamba": {"components": (FULL, MambaSpec(size=32))},
}


def build(name: str = "full", kv_size: int = 1024) -> UnifiedRadixCache:
    """A cache of component set ``name``; skips when that component is not available yet."""
    try:
        return urc.build_cache(CacheConfig(kv_size=kv_size, **COMPONENT_SETS[name]))
    except (ImportError, NotImplementedError, URCError) as exc:
        pytest.skip(f"component set {name} not available: {exc!r}")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; 0 when absent (an unlabelled child not yet touched)."""
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def sum_samples(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for fam in registry.collect() for s in fam.samples if s.name == name)


class Actor:
    """Applies commands in batches and reports to ``observer`` like the service's actor."""

    def __init__(self, cache: UnifiedRadixCache, observer: ServiceObserver) -> None:
        self.cache = cache
        self.executor = CommandExecutor(cache)
        self.observer = observer
        self.applied: dict[CommandKind, int] = {}
        self.errors: list[tuple[CommandKind, str]] = []

    def batch(self, commands: Sequence[Command]) -> list[Any]:
        """Apply ``commands`` as one batch; results (or the ``URCError`` raised) in order."""
        out: list[Any] = []
        sent = time.perf_counter()
        for cmd in commands:
            t0 = time.perf_counter()
            error: URCError | None = None
            result: Any = None
            try:
                result = self.executor.apply(cmd)
            except URCError as exc:
                error = exc
                self.errors.append((cmd.kind, type(exc).__name__))
            self.observer.on_command(cmd.kind, t0 - sent, time.perf_counter() - t0, error)
            self.applied[cmd.kind] = self.applied.get(cmd.kind, 0) + 1
            out.append(error if error is not None else result)
        self.observer.on_batch(self.cache.stats(), 0)
        return out

    def one(self, cmd: Command) -> Any:
        return self.batch([cmd])[0]

    def insert(self, tokens: list[int]) -> InsertOutcome:
        """Allocate slots (and a Mamba state when the cache has one) and insert ``tokens``."""
        value = self.one(Alloc(len(tokens)))
        assert isinstance(value, torch.Tensor)
        mamba_value = None
        if self.cache.has_component(MAMBA):
            mamba_value = self.one(Call(lambda c: c.pools.mamba.alloc(1)))
        res = self.one(Insert(RadixKey(tokens), value, mamba_value=mamba_value))
        assert isinstance(res, InsertOutcome), res
        if mamba_value is not None and res.mamba_exist:
            self.one(Call(lambda c: c.pools.mamba.free(mamba_value)))
        return res


def assert_gauges_match(registry: CollectorRegistry, cache: UnifiedRadixCache) -> None:
    """Every size gauge equals the cache's own figure, in the component's own unit."""
    for comp in cache.components:
        ct = comp.component_type
        unit = "states" if ct is MAMBA else "tokens"
        other = "tokens" if unit == "states" else "states"
        labels = {"component": NAMES[ct], "tier": "device"}
        assert comp.unit == unit
        assert value(registry, f"urc_cache_evictable_{unit}", **labels) == (
            cache.component_evictable_size(ct)
        )
        assert value(registry, f"urc_cache_protected_{unit}", **labels) == (
            cache.component_protected_size(ct)
        )
        cap, free = comp.pool_capacity(), comp.pool_available()
        assert value(registry, f"urc_pool_capacity_{unit}", **labels) == cap
        assert value(registry, f"urc_pool_free_{unit}", **labels) == free
        assert value(registry, f"urc_pool_used_{unit}", **labels) == cap - free
        # Never the same component in both units.
        assert registry.get_sample_value(f"urc_cache_evictable_{other}", labels) is None
    assert value(registry, "urc_cache_evictable_tokens", component="full", tier="device") == (
        cache.evictable_size()
    )
    assert value(registry, "urc_cache_protected_tokens", component="full", tier="device") == (
        cache.protected_size()
    )
    assert value(registry, "urc_tree_nodes") == cache.num_nodes


def assert_counters_match(registry: CollectorRegistry, cache: UnifiedRadixCache) -> None:
    """Every cumulative counter equals the cache's own counter."""
    k = cache.counters
    assert value(registry, "urc_match_requests_total") == k.match_requests
    assert value(registry, "urc_match_query_tokens_total") == k.query_tokens
    for tier, n in k.hit_tokens.items():
        assert value(registry, "urc_match_hit_tokens_total", tier=tier.name.lower()) == n
    assert value(registry, "urc_inserted_tokens_total") == k.inserted_tokens
    for (ct, where), n in k.evicted.items():
        unit = "states" if ct is MAMBA else "tokens"
        labels = {"component": NAMES[ct], "tier": where.name.lower()}
        assert value(registry, f"urc_evicted_{unit}_total", **labels) == n
    assert value(registry, "urc_backed_up_tokens_total") == k.backed_up_tokens
    assert value(registry, "urc_loaded_back_tokens_total") == k.loaded_back_tokens
    hits = sum_samples(registry, "urc_match_hit_tokens_total")
    assert hits <= value(registry, "urc_match_query_tokens_total")


def assert_histograms_match(registry: CollectorRegistry, actor: Actor) -> None:
    """One latency observation per applied command (per kind) and one queue-wait each."""
    for kind in CommandKind:
        n = actor.applied.get(kind, 0)
        assert value(registry, "urc_command_duration_seconds_count", kind=kind.value) == n
        inf = value(registry, "urc_command_duration_seconds_bucket", kind=kind.value, le="+Inf")
        assert inf == n
    total = sum(actor.applied.values())
    assert sum_samples(registry, "urc_command_duration_seconds_count") == total
    assert value(registry, "urc_command_queue_wait_seconds_count") == total


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make_stats(
    components: tuple[ComponentStats, ...] = (),
    *,
    num_nodes: int = 0,
    match_requests: int = 0,
    query_tokens: int = 0,
    hit_tokens: dict[Tier, int] | None = None,
    inserted_tokens: int = 0,
    evicted: dict[tuple[ComponentType, Tier], int] | None = None,
    backed_up_tokens: int = 0,
    loaded_back_tokens: int = 0,
) -> CacheStats:
    return CacheStats(
        components=components,
        num_nodes=num_nodes,
        match_requests=match_requests,
        query_tokens=query_tokens,
        hit_tokens=hit_tokens if hit_tokens is not None else {},
        inserted_tokens=inserted_tokens,
        evicted=evicted if evicted is not None else {},
        backed_up_tokens=backed_up_tokens,
        loaded_back_tokens=loaded_back_tokens,
    )
