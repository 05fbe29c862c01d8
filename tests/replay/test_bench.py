"""The benchmark command runs end to end on a tiny workload and reports every phase."""

from __future__ import annotations

import json

import pytest

from urc.apps.bench import core as bench

PHASES = ("insert", "match_prefix", "match_prefix_without_indices", "lock", "unlock", "evict")


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
        for phase in PHASES:
            assert entry[phase]["ops"] > 0 and entry[phase]["p99_us"] >= entry[phase]["p50_us"]
        assert entry["evict"]["tokens_per_s"] > 0


def test_long_context_workload_is_seeded_within_its_lengths_and_shares_turns() -> None:
    kw = {"min_len": 512, "max_len": 2048, "turn_len": 128, "num_system": 2, "system_len": 256}
    a = bench.generate_long_context(30, seed=3, **kw)
    assert a == bench.generate_long_context(30, seed=3, **kw)
    assert len(a) == 30 and all(512 <= len(s) <= 2048 for s in a)
    # Every later turn extends an earlier prompt of its conversation by one turn.
    extends = sum(any(s[: len(s) - 128] == t for t in a[:i]) for i, s in enumerate(a))
    assert extends >= 20


def test_unique_tokens_is_what_a_page_one_tree_holds() -> None:
    seqs = bench.generate_long_context(
        12, min_len=256, max_len=1024, turn_len=64, num_system=2, system_len=128, seed=5
    )
    cache = bench.build_cache(bench.make_config(bench.COMPONENT_SETS["full"], 1, 20000))
    for s in seqs:
        value = cache.token_to_kv_pool_allocator.alloc(len(s))
        cache.insert(bench.InsertParams(key=bench.RadixKey(s), value=value))
    assert bench.unique_tokens(seqs) == cache.total_size()


def test_key_scaling_reports_per_token_costs_and_their_ratio() -> None:
    out = bench.run_key_scaling(bench.COMPONENT_SETS["full"], 1, [256, 2048])
    for n in ("256", "2048"):
        assert out[n]["match_ns_per_token"] > 0 and out[n]["insert_ns_per_token"] > 0
    assert set(out["ratio_longest_to_shortest"]) == {"match_ns_per_token", "insert_ns_per_token"}


def test_compare_runs_two_trees_in_one_process_and_prints_ratios() -> None:
    """``urc.apps.bench.compare`` swaps whole module sets; run it in a subprocess so that this
    test session keeps its own ``urc``."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    args = ["--rounds", "1", "--num-seqs", "30", "--chunk-len", "16", "--components", "full"]
    out = subprocess.run(
        [sys.executable, "-m", "urc.apps.bench.compare", root, root, *args, "--page-sizes", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    row = report["full/page1"]
    assert set(row) == set(PHASES)
    assert all(cell["old"] > 0 and cell["new"] > 0 and cell["ratio"] > 0 for cell in row.values())
