"""The GPU check of HiCache's transfers: one command on a CUDA machine, no network.

Usage: ``python -m urc.apps.gpu_check [--tokens N] [--skip-tests] [--out FILE]`` from the
repository root (build the C extensions first, or the pure-Python page operations run).

Steps, each reported as it finishes (and all of them as JSON at the end, or in ``--out``):

1. **facts**: torch and CUDA versions, the card (``torch.cuda.get_device_properties``),
   ``nvidia-smi``'s PCIe link generation and width (current and max) when it is installed;
2. **tests**: ``pytest -m cuda tests/hicache`` (the HiCache tests on ``device="cuda"``)
   when pytest and the tests are there;
3. **sync-free round trip**: a cache with its pools on the GPU and a host tier (both host
   layouts, pages 1, 16 and 64); backups, device eviction and load-backs run under
   ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises) and the loaded bytes
   must equal the originals;
4. **bandwidth**: :func:`urc.apps.bench.transfer.measure` at pages 16 and 64 (Llama-3-8B
   rows), in both host layouts (``page_first``, the default on CUDA, and ``layer_first``):
   backup and load-back GB/s and their fraction of a plain pinned ``copy_``.

Without CUDA it prints ``no CUDA device: nothing to check`` (``--out`` gets
``{"cuda": false, "skipped": "no CUDA device"}``) and exits 0.  Exit status 1
when a step failed.  Takes about 2-4 minutes on one H100.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from hicache.config import HiCacheConfig
from hicache.host_layout import HostLayout
from hicache.host_tier import attach_hicache
from urc import (
    CacheConfig,
    ComponentType,
    EvictParams,
    InsertParams,
    KVShape,
    MatchPrefixParams,
    RadixKey,
    build_cache,
)
from urc.apps.bench.transfer import LLAMA3_8B, measure

__all__ = ["bandwidth", "facts", "main", "run_tests", "sync_free_round_trip"]

_QUERY = "name,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"


def facts() -> dict[str, Any]:
    """Environment and host-link facts."""
    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "sm": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
    }
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        res = subprocess.run(
            [smi, f"--query-gpu={_QUERY}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        out["nvidia_smi_link"] = res.stdout.strip() or res.stderr.strip()
        drv = subprocess.run([smi], capture_output=True, text=True, timeout=30, check=False)
        out["nvidia_smi_header"] = "\n".join(drv.stdout.splitlines()[:4])
    return out


def run_tests(root: Path) -> dict[str, Any]:
    """``pytest -m cuda tests/hicache``: the HiCache tests on the GPU."""
    tests = root / "tests" / "hicache"
    if not tests.is_dir():
        return {"skipped": f"no {tests}"}
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"skipped": "pytest is not installed"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", str(tests), "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    tail = res.stdout.strip().splitlines()[-15:]
    return {"returncode": res.returncode, "tail": tail}


def sync_free_round_trip(
    ps: int, layout: HostLayout | None = None, device: str = "cuda"
) -> dict[str, Any]:
    """Backup, evict, load back a cache on the GPU under sync debug mode ``error``
    (``layout``: the host pool's, default the device's; ``device="cpu"``: the same steps
    without a sync check, for the tests)."""
    cuda = device == "cuda"
    tokens = 64 * ps
    cache = build_cache(
        CacheConfig(
            page_size=ps,
            kv_size=4 * tokens,
            kv_shape=KVShape(32, 8, 128, torch.bfloat16),
            device=device,
        )
    )
    tier = attach_hicache(cache, HiCacheConfig(host_tokens=2 * tokens, host_layout=layout))
    kv = cache.pools.kv_pool.kv  # type: ignore[union-attr]
    key = RadixKey(list(range(tokens)))
    value = cache.token_to_kv_pool_allocator.alloc(tokens)
    assert value is not None
    on_device = value.to(device)
    kv[:, :, on_device] = torch.randn(kv[:, :, :tokens].shape, device=device).to(kv.dtype)
    cache.insert(InsertParams(key=key, value=value))
    before = kv[:, :, on_device].clone()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    t0 = time.perf_counter()
    try:
        node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
        backed = cache.write_backup(node)
        cache.evict(EvictParams(num_tokens=10**6))
        kv.zero_()
        hit = cache.match_prefix(MatchPrefixParams(key=key))
        loaded = cache.load_back(hit.best_match_node)
        after = cache.match_prefix(MatchPrefixParams(key=key)).device_indices
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    seconds = time.perf_counter() - t0
    exact = after is not None and bool(torch.equal(kv[:, :, after.to(device)], before))
    cache.sanity_check()
    return {
        "page_size": ps,
        "layout": tier.pools[ComponentType.FULL].layout.value,
        "tokens": tokens,
        "backed_up": backed,
        "loaded_back": loaded,
        "byte_exact": exact,
        "no_sync_raised": cuda,
        "seconds": round(seconds, 4),
        "ok": exact and backed == tokens and loaded == tokens,
    }


def bandwidth(tokens: int, page_sizes: list[int]) -> list[dict[str, Any]]:
    """``urc.apps.bench.transfer.measure`` on the GPU at each page size and host layout
    (Llama-3-8B rows)."""
    return [
        measure(tokens, ps, LLAMA3_8B, "cuda", layout=layout)
        for layout in HostLayout
        for ps in page_sizes
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m urc.apps.gpu_check")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per bandwidth transfer")
    ap.add_argument("--skip-tests", action="store_true", help="skip the pytest step")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        if args.out is not None:  # a caller that reads the report finds why it is empty
            args.out.write_text(json.dumps({"cuda": False, "skipped": "no CUDA device"}) + "\n")
        return 0
    root = Path(__file__).resolve().parents[2]
    report: dict[str, Any] = {}
    failed = False
    steps: list[tuple[str, Any]] = [("facts", facts)]
    if not args.skip_tests:
        steps.append(("tests", lambda: run_tests(root)))
    steps.append(
        (
            "round_trip",
            lambda: [sync_free_round_trip(ps, v) for v in HostLayout for ps in (1, 16, 64)],
        )
    )
    steps.append(("bandwidth", lambda: bandwidth(args.tokens, [16, 64])))
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            report[name] = step()
        except Exception:
            report[name] = {"error": traceback.format_exc().splitlines()[-12:]}
            failed = True
        print(f"== {name} ({time.perf_counter() - t0:.1f} s)")
        print(json.dumps(report[name], indent=1, default=str), flush=True)
    tests = report.get("tests")
    if isinstance(tests, dict) and tests.get("returncode", 0) != 0:
        failed = True
    trips = report.get("round_trip")
    if isinstance(trips, list) and not all(t.get("ok") for t in trips):
        failed = True
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print("GPU check:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
