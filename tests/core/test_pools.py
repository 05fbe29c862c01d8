"""KV data pool and request-to-token pool."""

from __future__ import annotations

import pytest
import torch

from urc import ConfigError, DoubleFreeError, InvalidInputError, KVShape
from urc.pools import KVPool, ReqToTokenPool


def test_kv_pool_gather_scatter_moves_real_bytes() -> None:
    pool = KVPool(32, KVShape(num_layers=3, num_heads=2, head_dim=4, dtype=torch.bfloat16))
    pool.kv.copy_(torch.randn(pool.kv.shape).to(torch.bfloat16))
    src = torch.tensor([3, 7, 1])
    dst = torch.tensor([20, 21, 22])
    data = pool.gather(src)
    assert data.shape == (2, 3, 3, 2, 4)
    pool.scatter(dst, data)
    assert torch.equal(pool.k[:, dst], pool.k[:, src])
    assert torch.equal(pool.v[:, dst], pool.v[:, src])


def test_kv_shape_bytes_and_validation() -> None:
    assert KVShape(num_layers=2, num_heads=2, head_dim=8).bytes_per_token == 2 * 2 * 2 * 8 * 2
    with pytest.raises(ConfigError):
        KVShape(num_layers=0)
    with pytest.raises(ConfigError):
        KVPool(0, KVShape())


def test_req_to_token_rows_are_allocated_once_and_written() -> None:
    pool = ReqToTokenPool(2, 16)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1} and pool.alloc() is None
    assert a is not None
    pool.write(a, 2, torch.tensor([5, 6, 7]))
    assert pool.read(a, 2, 5).tolist() == [5, 6, 7]
    with pytest.raises(InvalidInputError):
        pool.write(a, 15, torch.tensor([1, 2]))
    pool.free(a)
    with pytest.raises(DoubleFreeError):
        pool.free(a)
    with pytest.raises(InvalidInputError):
        pool.write(a, 0, torch.tensor([1]))
    assert pool.available_size() == 1
