"""The GPU tools on a machine without CUDA: the transfer bench measures the CPU path (every
copy byte-exact is the engine tests' job; here: the report's fields), and the GPU check
says there is nothing to check and succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hicache.host_layout import HostLayout
from urc.apps import gpu_check
from urc.apps.bench.transfer import measure, significant
from urc.apps.bench.transfer_compare import PHASES, compare, load_module
from urc.pools.kv_pool import KVShape


@pytest.mark.parametrize("layout", [None, *HostLayout], ids=lambda v: getattr(v, "value", "auto"))
@pytest.mark.parametrize("ps", [1, 16])
def test_the_transfer_bench_reports_every_copy_against_its_baseline(
    ps: int, layout: HostLayout | None
) -> None:
    out = measure(64, ps, KVShape(2, 2, 8, torch.bfloat16), "cpu", repeat=1, layout=layout)
    assert out["bytes"] == 64 * 2 * 2 * 2 * 8 * 2 and out["pinned"] is False
    assert out["layout"] == (layout or HostLayout.LAYER_FIRST).value
    for name in ("backup", "backup_scattered", "load_back", "load_back_scattered"):
        assert out[f"{name}_gb_s"] > 0 and out[f"{name}_fraction"] > 0


def test_bandwidth_figures_keep_their_digits_however_small() -> None:
    """A 4 KiB copy slowed to a millisecond by a loaded machine is 0.0041 GB/s, not 0.0 (the
    rounding that failed the test above under load)."""
    assert significant(4096 / 1e9 / 1e-3) == 0.0041
    assert significant(16.789) == 16.8 and significant(0.9994) == 0.999


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the whole check on a GPU")
def test_the_gpu_check_without_cuda_says_so_and_succeeds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert json.loads(out.read_text()) == {"cuda": False, "skipped": "no CUDA device"}


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
def test_the_gpu_checks_round_trip_is_byte_exact_on_the_cpu(layout: HostLayout) -> None:
    out = gpu_check.sync_free_round_trip(1, layout, device="cpu")
    assert out["ok"] and out["byte_exact"] and out["layout"] == layout.value
    assert out["backed_up"] == out["loaded_back"] == 64


def test_the_transfer_comparison_reports_every_phase_against_another_tree() -> None:
    root = Path(__file__).resolve().parents[2]
    old = load_module(root, "hicache/host_pool.py")  # this tree against itself
    old_layout = load_module(root, "hicache/storage_worker/layout.py")
    out = compare(old, old_layout, 4, 64, KVShape(2, 2, 8, torch.float16), rounds=2, repeat=1)
    assert out["layout"] == "layer_first"
    for phase in PHASES:
        assert out[phase] > 0 and out[f"{phase}_new_gb_s"] > 0
