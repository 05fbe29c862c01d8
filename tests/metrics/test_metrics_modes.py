"""The exporter's two write paths: scrape-time collection and direct writes (multiprocess),
their selection, identical output, concurrent scrapes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from metrics_harness import (
    FULL,
    MAMBA,
    ROOT,
    make_stats,
    value,
)
from prometheus_client import CollectorRegistry, generate_latest

from hicache.storage.stats import StorageOp
from metrics import (
    CacheMetrics,
    ExportMode,
    MetricsConfig,
)
from urc import Tier
from urc.service._commands import (
    CommandKind,
)
from urc.service._observer import ServiceObserver, TransferKind
from urc.stats import ComponentStats


# ---------------------------------------------------------------------------- export modes
def test_mode_selection(registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    assert MetricsConfig().mode is ExportMode.AUTO
    assert ExportMode.AUTO.resolve() is ExportMode.SCRAPE
    default = CacheMetrics(registry)
    assert default.mode is ExportMode.SCRAPE and isinstance(default, CacheMetrics)
    default.unregister()
    direct = CacheMetrics(registry, MetricsConfig(mode=ExportMode.DIRECT))
    assert direct.mode is ExportMode.DIRECT and isinstance(direct, ServiceObserver)
    direct.unregister()
    # In multiprocess mode a scrape-time collector would only see the scraping process.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    assert ExportMode.AUTO.resolve() is ExportMode.DIRECT
    assert ExportMode.SCRAPE.resolve() is ExportMode.SCRAPE  # an explicit choice stands
    auto = CacheMetrics(registry)
    assert auto.mode is ExportMode.DIRECT
    auto.unregister()
    assert not [f for f in registry.collect() if f.name.startswith("urc_")]


def _feed(exporter: CacheMetrics) -> None:
    comps = (
        ComponentStats(FULL, Tier.DEVICE, "tokens", 10, 5, 100, 80),
        ComponentStats(FULL, Tier.HOST, "tokens", 300, 7, 1000, 690),
        ComponentStats(MAMBA, Tier.DEVICE, "states", 3, 1, 16, 12),
    )
    for i in range(3):
        exporter.on_batch(
            make_stats(
                comps,
                num_nodes=9 + i,
                match_requests=4 + i,
                query_tokens=100 + 10 * i,
                hit_tokens={Tier.DEVICE: 40 + i, Tier.HOST: 20},
                inserted_tokens=5,
                evicted={(FULL, Tier.DEVICE): 50, (MAMBA, Tier.DEVICE): 2 + i},
                backed_up_tokens=70,
                loaded_back_tokens=20,
            ),
            queued=5 - i,
        )
    for i, kind in enumerate(CommandKind):
        exporter.on_command(kind, 1e-6 * i, 3e-6 * i, KeyError() if i % 3 == 0 else None)
    exporter.on_command(CommandKind.MATCH, 0.3, 2.0, ValueError())
    for k in TransferKind:
        exporter.on_transfer(k, 10, 100, 1e-4)
    exporter.transfer_started(TransferKind.BACKUP)
    exporter.set_transfers_in_flight(TransferKind.LOAD_BACK, 3)
    for op in (StorageOp.PUT, StorageOp.GET, StorageOp.PUT):
        exporter.on_storage_error("valkey", op)


def test_modes_expose_identical_text() -> None:
    """Same events, same exposition (names, HELP, TYPE, labels, buckets, values, order); only
    the ``_created`` timestamps may differ."""
    texts = []
    for mode in (ExportMode.SCRAPE, ExportMode.DIRECT):
        registry = CollectorRegistry()
        _feed(CacheMetrics(registry, MetricsConfig(mode=mode)))
        text = generate_latest(registry).decode()
        texts.append(re.sub(r"^(\S+_created(?:\{[^}]*\})?) \S+$", r"\1 T", text, flags=re.M))
    assert texts[0] == texts[1]
    assert "urc_command_duration_seconds_created" in texts[0]


def test_scrapes_from_another_thread_see_whole_updates(registry: CollectorRegistry) -> None:
    """A scrape in another thread never sees half an observation (bucket, count and sum of
    both command histograms agree) while the actor thread keeps observing."""
    exporter = CacheMetrics(registry)
    assert exporter.mode is ExportMode.SCRAPE
    v = 2.0**-17  # exact sums
    stop = threading.Event()
    torn: list[tuple[float, ...]] = []
    scrapes = 0

    def scraper() -> None:
        nonlocal scrapes
        while not stop.is_set():
            fams = {f.name: f for f in registry.collect()}
            lat = {
                s.name: s.value
                for s in fams["urc_command_duration_seconds"].samples
                if s.labels.get("kind") == "match"
            }
            wait = {s.name: s.value for s in fams["urc_command_queue_wait_seconds"].samples}
            n = lat["urc_command_duration_seconds_count"]
            figures = (
                n,
                lat["urc_command_duration_seconds_sum"] / v,
                wait["urc_command_queue_wait_seconds_count"],
                wait["urc_command_queue_wait_seconds_sum"] / v,
                lat["urc_command_duration_seconds_bucket"],  # le=+Inf: the last one wins
            )
            if any(x != n for x in figures):
                torn.append(figures)
            scrapes += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        observed = 0
        while (scrapes < 30 or observed < 20_000) and time.monotonic() < deadline:
            for _ in range(1000):
                exporter.on_command(CommandKind.MATCH, v, v, None)
            observed += 1000
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old_interval)
    assert scrapes >= 30
    assert torn == []
    assert value(registry, "urc_command_duration_seconds_count", kind="match") == observed


# ---------------------------------------------------------------------------- multiprocess mode
_MP_SCRIPT = r"""
import json
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
import urc
from metrics import CacheMetrics
from urc.service._commands import CommandKind
from urc.params import InsertParams, MatchPrefixParams

cache = urc.build_cache(urc.CacheConfig(kv_size=256))
own = CollectorRegistry()
m = CacheMetrics(own)
v = cache.token_to_kv_pool_allocator.alloc(40)
cache.insert(InsertParams(key=urc.RadixKey(list(range(40))), value=v))
cache.match_prefix(MatchPrefixParams(key=urc.RadixKey(list(range(30)))))
m.on_command(CommandKind.MATCH, 1e-6, 2e-6, None)
m.on_command(CommandKind.INSERT, 1e-6, 2e-6, KeyError())
m.on_batch(cache.stats(), 2)
merged = CollectorRegistry()
MultiProcessCollector(merged)
dev = {"component": "full", "tier": "device"}
print(json.dumps({
    "mode": m.mode.value,
    "evictable": merged.get_sample_value("urc_cache_evictable_tokens", dev),
    "expected_evictable": cache.evictable_size(),
    "free": merged.get_sample_value("urc_pool_free_tokens", dev),
    "expected_free": cache.token_to_kv_pool_allocator.available_size(),
    "queued": merged.get_sample_value("urc_service_queued_commands"),
    "matches": merged.get_sample_value("urc_match_requests_total"),
    "hits": merged.get_sample_value("urc_match_hit_tokens_total", {"tier": "device"}),
    "latency_count": merged.get_sample_value(
        "urc_command_duration_seconds_count", {"kind": "match"}),
    "errors": merged.get_sample_value(
        "urc_command_errors_total", {"kind": "insert", "error_type": "KeyError"}),
}))
"""


def test_multiprocess_mode(tmp_path: Path) -> None:
    """Constructed with PROMETHEUS_MULTIPROC_DIR set, the exporter's values reach the
    multiprocess collector (gauges aggregated with ``livesum``)."""
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _MP_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "direct"  # AUTO picks the write path the multiprocess collector reads
    assert out["evictable"] == out["expected_evictable"] == 40
    assert out["free"] == out["expected_free"]
    assert out["queued"] == 2
    assert out["matches"] == 1
    assert out["hits"] == 30
    assert out["latency_count"] == 1
    assert out["errors"] == 1
    assert any(tmp_path.glob("*.db"))
