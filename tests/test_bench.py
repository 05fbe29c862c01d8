"""The benchmark command runs end to end on a tiny workload and reports every phase."""

from __future__ import annotations

import json

import pytest

from urc import bench


def test_reference_workload_is_seeded_and_shares_prefixes() -> None:
    a = bench.generate_sequences(50, 16, seed=1)
    assert a == bench.generate_sequences(50, 16, seed=1)
    assert len(a) == 50 and all(s[:4] == a[0][:4] for s in a)


def test_bench_prints_json_for_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(
        ["--components", "full", "--page-sizes", "1", "4", "--num-seqs", "40", "--chunk-len", "16"]
    )
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n") :])
    for name in ("full/page1", "full/page4"):
        entry = report["results"][name]
        for phase in ("insert", "match_prefix", "lock", "unlock", "evict"):
            assert entry[phase]["ops"] > 0 and entry[phase]["p99_us"] >= entry[phase]["p50_us"]
        assert entry["evict"]["tokens_per_s"] > 0
