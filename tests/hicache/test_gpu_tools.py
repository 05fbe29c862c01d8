"""The GPU tools on a machine without CUDA: the transfer bench measures the CPU path (every
copy byte-exact is the engine tests' job; here: the report's fields), and the GPU check
says there is nothing to check and succeeds."""

from __future__ import annotations

import pytest
import torch

from urc.apps import gpu_check
from urc.apps.bench.transfer import measure
from urc.pools.kv_pool import KVShape


@pytest.mark.parametrize("ps", [1, 16])
def test_the_transfer_bench_reports_every_copy_against_its_baseline(ps: int) -> None:
    out = measure(64, ps, KVShape(2, 2, 8, torch.bfloat16), "cpu", repeat=1)
    assert out["bytes"] == 64 * 2 * 2 * 2 * 8 * 2 and out["pinned"] is False
    for name in ("backup", "backup_scattered", "load_back", "load_back_scattered"):
        assert out[f"{name}_gb_s"] > 0 and out[f"{name}_fraction"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the whole check on a GPU")
def test_the_gpu_check_without_cuda_says_so_and_succeeds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu_check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
