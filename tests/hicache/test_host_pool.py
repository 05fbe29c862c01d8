"""HostPool: page-gathered copies move exactly the right bytes in both directions."""

from __future__ import annotations

import pytest
import torch

from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from urc import InvalidIndicesError, KVShape
from urc.pools import KVPool, TokenSlotAllocator


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("scatter", ["runs", "scattered"])
def test_kv_round_trip_is_byte_exact(ps: int, scatter: str, layout: HostLayout) -> None:
    shape = KVShape(num_layers=3, num_heads=2, head_dim=4, dtype=torch.bfloat16)
    dev = KVPool(64 * ps, shape)
    dev.kv.copy_(torch.randn(dev.kv.shape).to(torch.bfloat16))
    original = dev.kv.clone()
    dev_alloc = TokenSlotAllocator(64 * ps, ps)
    span = dev_alloc.alloc(10 * ps)
    assert span is not None
    if scatter == "scattered":
        pages = torch.randperm(64)[:10]
        span = (pages.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    host = HostPool(dev.slot_buffers(), 32 * ps, ps, layout=layout)
    hidx = host.allocator.alloc(10 * ps)
    assert hidx is not None
    host.backup(span, hidx).wait()
    dev.kv[:, :, span] = 0
    # "runs": load into freshly allocated slots; "scattered": restore the scattered slots.
    back = dev_alloc.alloc(10 * ps) if scatter == "runs" else span
    assert back is not None
    host.load(hidx, back).wait()
    assert torch.equal(dev.kv[:, :, back], original[:, :, span])


def test_state_buffers_with_slot_dim_zero_round_trip() -> None:
    conv = torch.randn(8, 3, 4)
    temporal = torch.randn(8, 2, 2, 2)
    host = HostPool([(conv, 0), (temporal, 0)], 4)
    src = torch.tensor([6, 1])
    dst = host.allocator.alloc(2)
    assert dst is not None
    host.backup(src, dst)
    expect = (conv[src].clone(), temporal[src].clone())
    conv.zero_()
    temporal.zero_()
    host.load(dst, torch.tensor([2, 3]))
    assert torch.equal(conv[2:4], expect[0]) and torch.equal(temporal[2:4], expect[1])
    assert host.bytes_per_slot == (12 + 8) * 4


def test_mismatched_lengths_are_rejected() -> None:
    host = HostPool([(torch.zeros(4, 2), 0)], 4)
    with pytest.raises(InvalidIndicesError):
        host.backup(torch.tensor([0, 1]), torch.tensor([0]))
