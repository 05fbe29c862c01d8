"""A test fixture standing in for ``sgl_kernel`` in the live-SGLang side environment.

PyPI has no CPU build of ``sgl-kernel``, yet SGLang 0.5.23's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports two of its ops unconditionally:
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``, every batch) and
``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``).  This package
provides exactly those two, in plain torch, with the semantics of SGLang's own Triton kernels
of the same names (``assign_req_to_token_pool``, ``copy_all_layer_kv_cache_tiled``).

Any other name imports (SGLang's CPU engine imports more ops than it calls) and fails loudly
when called: the call writes ``sgl_kernel fixture: missing op <name>`` to stderr -- the server
log, where the live suite looks for it to name the op a model would need -- and raises
``NotImplementedError`` naming it.
"""

from __future__ import annotations

import ctypes
import sys
from typing import NoReturn

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]

MISSING_OP_MARKER = "sgl_kernel fixture: missing op"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new slots into its row of ``req_to_token`` (mutates it).

    Request ``i`` gets ``out_cache_loc[o_i : o_i + n_i]`` at columns
    ``start_offset[i] : end_offset[i]`` of row ``req_pool_indices[i]``, where ``n_i`` is its
    length and ``o_i`` the sum of the lengths before it.
    """
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy rows ``src_loc`` to rows ``tgt_loc`` in every buffer (mutates the buffers).

    Buffer ``b`` starts at address ``data_ptrs[b]`` with rows of ``strides[b]`` bytes; all
    source rows are read before any target row is written, as SGLang's tiled kernel does.
    """
    src = src_loc.tolist()
    tgt = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


class _MissingOp:
    """What ``from sgl_kernel import <other>`` gets: importable, fails loudly when called.

    SGLang's CPU engine imports more names than it calls (the speculative-decoding ops, for
    one, at module import); refusing the import would stop the server before it serves a
    model that never calls them.  A call writes the op's name to stderr (the server log) and
    raises ``NotImplementedError`` naming it.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        print(f"{MISSING_OP_MARKER} {self.name}", file=sys.stderr, flush=True)
        raise NotImplementedError(
            f"{MISSING_OP_MARKER} {self.name}: the live-test sgl_kernel provides only "
            f"{', '.join(__all__)} (PyPI has no CPU build of sgl-kernel)"
        )


def __getattr__(name: str) -> _MissingOp:
    if name.startswith("__"):
        raise AttributeError(name)
    return _MissingOp(name)
