"""The ``urc`` command line: parsing, configuration errors, exit statuses, the module entry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from urc.apps.cli import build_parser, main
from urc.apps.replay import Capacity, ModelProfile, ReplayConfig
from urc.apps.replay.arguments import resolved
from urc.errors import ConfigError
from urc.node import ComponentType
from urc.specs import MambaSpec, SlidingWindowSpec


def test_no_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "replay" in capsys.readouterr().err


def test_replay_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--trace", "--workload", "--num-requests", "--block-size", "--model", "--window",
        "--device-tokens", "--host-tokens", "--write-policy", "--page-size", "--chunk-size",
        "--concurrency", "--prefill-only", "--speed", "--json", "--metrics-port",
        "--no-progress",
    ):  # fmt: skip
        assert option in out
    assert "FAST25-release/traces" in out


def test_capacity_parsing() -> None:
    assert Capacity.parse("65536") == Capacity(tokens=65536)
    assert Capacity.parse("1_000") == Capacity(tokens=1000)
    assert Capacity.parse("0.25") == Capacity(fraction=0.25)
    assert Capacity.parse("1e-1") == Capacity(fraction=0.1)
    assert Capacity.parse("2.0") == Capacity(fraction=2.0)
    assert Capacity.parse("0") == Capacity(tokens=0)
    for bad in ("", "x", "-3", "nan", "inf", "-0.5"):
        with pytest.raises(ConfigError):
            Capacity.parse(bad)
    # Fractions are of the unique tokens and round up to whole pages.
    assert Capacity(fraction=0.25).resolve(1000, 16) == 256
    assert Capacity(tokens=100).resolve(10**9, 64) == 128
    assert Capacity(tokens=0).resolve(1000, 16) == 0


def test_model_profiles_pick_components() -> None:
    full, swa, mamba = (ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA)
    assert ModelProfile.FULL.components == (full,)
    assert ModelProfile.SWA.components == (full, swa)
    assert ModelProfile.MAMBA.components == (full, mamba)
    cfg = ReplayConfig(model=ModelProfile.SWA, window=1024).cache_config(4096, 3000)
    assert cfg.types == ModelProfile.SWA.components
    assert cfg.spec(SlidingWindowSpec) == SlidingWindowSpec(window=1024, kv_size=4096)
    assert cfg.max_context_len >= 3000 and cfg.max_context_len % 16 == 0
    cfg = ReplayConfig(model=ModelProfile.MAMBA, mamba_states=77).cache_config(4096, 100)
    assert cfg.types == ModelProfile.MAMBA.components
    assert cfg.spec(MambaSpec).size == 77


def test_defaults_are_documented_values() -> None:
    args = build_parser().parse_args(["replay"])
    assert args.workload == "multi-turn-chat" and args.model == "full"
    # Left unset unless given (a flag given where it has no effect is refused); what applies:
    assert args.block_size is None and resolved(args, "block_size") == 512
    assert args.write_policy is None and resolved(args, "write_policy") == "write_back"
    assert args.chunk_size == 8192 and args.eviction_policy == "lru"
    assert args.trace is None and args.metrics_port is None and not args.realtime


def test_module_entry_point_writes_json_to_stdout(tmp_path: Path) -> None:
    """``python -m urc.apps.cli`` (what the ``urc`` console script runs) in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-m", "urc.apps.cli", "replay", "--num-requests", "30", "--json", "-"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # 30 requests make a tiny default device pool (a quarter of their unique tokens) for 8
    # in flight: some may be rejected, never lost.
    assert report["requests"]["done"] + report["requests"]["rejected"] == 30
    assert report["check"]["ok"] is True
    assert "\r" not in proc.stderr  # no progress bar when stderr is not a terminal


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from urc.apps.cli import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("urc ") and version() in out and version() != ""


def test_eviction_policy_choices_come_from_the_enum(tmp_path: Path) -> None:
    from urc.eviction_policy import EvictionPolicy

    parser = build_parser()
    for policy in EvictionPolicy:
        args = parser.parse_args(["replay", "--eviction-policy", policy.value])
        assert args.eviction_policy == policy.value
    with pytest.raises(SystemExit):
        parser.parse_args(["replay", "--eviction-policy", "random-guess"])
    out = tmp_path / "lfu.json"
    rc = main(["replay", "--no-progress", "--num-requests", "60", "--eviction-policy", "lfu",
               "--device-tokens", "0.1", "--json", str(out)])  # fmt: skip
    assert rc == 0 and json.loads(out.read_text())["config"]["eviction_policy"] == "lfu"


# What ``urc --help`` imports beyond the ``urc`` package itself (whose __init__ is the core's).
_HELP_PROBE = """
import sys, urc
before = set(sys.modules)
import urc.apps.cli
try:
    urc.apps.cli.main([{arg!r}])
except SystemExit:
    pass
light = set(["urc.apps.replay", "urc.apps.replay.arguments", "urc.apps.replay.options"])
heavy = sorted(
    m for m in set(sys.modules) - before - light
    if m.startswith(
        ("urc.apps.replay", "urc.apps.workloads", "hicache", "metrics", "prometheus_client")
    )
)
print("HEAVY", heavy, "TORCH", "torch" in sys.modules)
"""


def _probe(arg: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE.format(arg=arg)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("arg", ["--help", "--version"])
def test_top_level_help_and_version_import_no_replay_machinery(arg: str) -> None:
    assert _probe(arg).startswith("HEAVY []")


def test_top_level_help_does_not_import_torch() -> None:
    assert _probe("--help").endswith("TORCH False")


def test_package_exports_resolve_lazily_to_their_modules() -> None:
    import importlib

    import urc

    assert sorted(urc.__all__) == sorted(urc._EXPORTS)
    for name, module in urc._EXPORTS.items():
        assert getattr(urc, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        _ = urc.no_such_name  # type: ignore[attr-defined]


def test_belady_and_partial_leaf_eviction_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "belady.json"
    args = ["--eviction-policy", "belady", "--partial-leaf-eviction", "--device-tokens", "0.1"]
    rc = main(["replay", "--no-progress", "--num-requests", "60", *args, "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["config"]["eviction_policy"] == "belady+partial"
    assert report["check"]["ok"]


def test_a_token_capacity_is_tokens_whatever_the_unit_of_the_cache() -> None:
    """An agentic replay caches one token per 64-token block: a capacity given in tokens is
    divided by the block size (rounded up, whole pages), a fraction is of the unique units."""
    assert Capacity(tokens=1_000_000).resolve(10**9, 1, tokens_per_unit=64) == 15_625
    assert Capacity(tokens=65).resolve(10**9, 1, tokens_per_unit=64) == 2
    assert Capacity(tokens=1_000_000).resolve(10**9, 16) == 1_000_000
    assert Capacity(fraction=0.5).resolve(1000, 1, tokens_per_unit=64) == 500
