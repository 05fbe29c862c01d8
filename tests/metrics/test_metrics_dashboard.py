"""The Grafana dashboard shipped with the metrics package queries only metrics the exporter
exports."""

from __future__ import annotations

import json
import re
from typing import Any

from metrics_harness import (
    DASHBOARD,
    FULL,
    MAMBA,
    make_stats,
)
from prometheus_client import CollectorRegistry

from metrics import (
    CacheMetrics,
)
from urc import Tier
from urc.service._commands import (
    CommandKind,
)
from urc.service._observer import TransferKind
from urc.stats import ComponentStats


# ---------------------------------------------------------------------------- scripted cache
# ---------------------------------------------------------------------------- dashboard
def _exported_names() -> set[str]:
    registry = CollectorRegistry()
    exporter = CacheMetrics(registry)
    comps = (
        ComponentStats(FULL, Tier.DEVICE, "tokens", 1, 1, 2, 1),
        ComponentStats(MAMBA, Tier.DEVICE, "states", 1, 1, 2, 1),
    )
    exporter.on_batch(
        make_stats(
            comps,
            hit_tokens={Tier.DEVICE: 1},
            evicted={(FULL, Tier.DEVICE): 1, (MAMBA, Tier.DEVICE): 1},
        ),
        0,
    )
    exporter.on_command(CommandKind.MATCH, 0.0, 0.0, KeyError())
    for k in TransferKind:
        exporter.on_transfer(k, 1, 1, 0.0)
    return {s.name for fam in registry.collect() for s in fam.samples}


def test_dashboard_queries_reference_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    names = _exported_names()
    exprs: list[str] = []
    stack: list[Any] = [dash]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            if isinstance(obj.get("expr"), str):
                exprs.append(obj["expr"])
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
    assert exprs
    used = {n for e in exprs for n in re.findall(r"\burc_[a-z_]+", e)}
    assert used <= names, used - names
    joined = "\n".join(exprs)
    # Hit rate by tier from counters, evictable vs protected, tier usage, latency quantiles.
    assert "urc_match_hit_tokens_total" in joined and "urc_match_query_tokens_total" in joined
    assert "urc_cache_evictable_tokens" in used and "urc_cache_protected_tokens" in used
    assert "urc_pool_used_tokens" in used and "urc_pool_capacity_tokens" in used
    assert "histogram_quantile" in joined and "urc_command_duration_seconds_bucket" in used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
