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


@pytest.mark.parametrize("driver", ["calls", "core"])
def test_compare_runs_two_trees_in_one_process_and_prints_ratios(driver: str) -> None:
    """``urc.apps.bench.compare`` swaps whole module sets; run it in a subprocess so that this
    test session keeps its own ``urc``."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    args = ["--rounds", "1", "--num-seqs", "30", "--chunk-len", "16", "--components", "full"]
    args += ["--page-sizes", "1", "--driver", driver]
    out = subprocess.run(
        [sys.executable, "-m", "urc.apps.bench.compare", root, root, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    row = report["full/page1"]
    if driver == "calls":
        assert row.pop("checksums_agree") is True
        assert set(row) == {"robust", "sum"}
        cells = [c for stat in row.values() for c in stat.values()]
        assert set(row["robust"]) == {"insert", "match", "lock", "unlock", "evict"}
    else:
        assert set(row) == set(PHASES)
        cells = list(row.values())
    assert all(cell["old"] > 0 and cell["new"] > 0 and cell["ratio"] > 0 for cell in cells)


@pytest.mark.parametrize("components", ["full", "full+swa", "full+mamba"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_call_phases_time_every_call_and_empty_the_cache(components: str, page_size: int) -> None:
    import urc
    from urc.apps.bench.call_phases import CALL_PHASES, robust_ops, run_call_phases, sum_ops

    seqs = bench.generate_sequences(40, 16, seed=2)
    lat = run_call_phases(urc, components, page_size, seqs, 16)
    matched, *evicted = lat.pop("checksum")
    assert set(lat) == set(CALL_PHASES)
    for phase in ("insert", "match", "lock", "unlock"):
        assert len(lat[phase]) == 40 and all(x >= 0 for x in lat[phase])
    assert matched == sum(len(s) // page_size * page_size for s in seqs)
    assert evicted[0] > 0 and lat["evict"]
    assert robust_ops(lat["insert"]) > 0 and sum_ops(lat["insert"]) > 0


def test_robust_ops_counts_a_descheduled_call_as_the_median() -> None:
    from urc.apps.bench.call_phases import robust_ops, sum_ops

    calls = [100] * 99 + [10_000_000]  # one call descheduled for 10 ms
    assert robust_ops(calls) == pytest.approx(1e7)  # 100 calls of 100 ns
    assert sum_ops(calls) < robust_ops(calls) / 900
    assert robust_ops([]) == 0.0 and sum_ops([]) == 0.0
