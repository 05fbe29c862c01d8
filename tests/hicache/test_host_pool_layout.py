"""The host pool's ``page_first`` layout: a KV page is one K block and one V block, each
``[page_size, layers, heads, dim]`` (SGLang's ``MHATokenToKVPoolHost`` ``page_first`` data
page, what L3 stores through ``HostPageLayout``), Mamba states keep their shape, and the
host buffers are sized exactly."""

from __future__ import annotations

import pytest
import torch

from hicache.host_pool import HostPool
from hicache.storage_worker import HostPageLayout
from urc.pools.kv_pool import KVPool, KVShape
from urc.pools.mamba import MambaPool


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_a_kv_host_page_is_sglangs_page_first_data_page(ps: int) -> None:
    shape = KVShape(3, 2, 4, torch.bfloat16)
    kv = KVPool(16 * ps, shape)
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 6 * ps, ps)
    host = pool.host_buffers[0][0]
    assert host.shape == (2, 6 * ps, 3, 2, 4) and pool.host_buffers[0][1] == 1
    assert host.numel() * host.element_size() == 6 * ps * shape.bytes_per_token
    dev_pages = [9, 2, 3, 14]
    host_pages = [4, 0, 1, 5]
    dev_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in dev_pages])
    host_idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in host_pages])
    pool.backup(dev_idx, host_idx).wait()
    rows = HostPageLayout(pool).gather(host_idx)
    for i, p in enumerate(dev_pages):
        page = kv.kv[:, :, p * ps : (p + 1) * ps].permute(0, 2, 1, 3, 4)  # [2, P, L, H, D]
        assert torch.equal(rows[i], page.contiguous().view(-1).view(torch.uint8))


def test_mamba_host_states_keep_their_shape() -> None:
    mamba = MambaPool(8, (4, 8), (2, 8, 8))
    mamba.conv.normal_()
    mamba.temporal.normal_()
    pool = HostPool([(mamba.conv, 0), (mamba.temporal, 0)], 5)
    assert [tuple(b.shape) for b, _ in pool.host_buffers] == [(5, 4, 8), (5, 2, 8, 8)]
    pool.backup(torch.tensor([6, 1]), torch.tensor([3, 0])).wait()
    assert torch.equal(pool.host_buffers[0][0][[3, 0]], mamba.conv[[6, 1]])
    assert torch.equal(pool.host_buffers[1][0][[3, 0]], mamba.temporal[[6, 1]])


def _slots(pages: list[int], ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


PATTERNS = {  # (device pages, host pages) of 8-page transfers
    "both-runs": (list(range(3, 11)), list(range(1, 9))),
    "device-scattered": ([14, 2, 9, 5, 0, 11, 7, 3], list(range(2, 10))),
    "host-scattered": (list(range(4, 12)), [9, 0, 4, 2, 11, 6, 1, 8]),
    "both-scattered": ([14, 2, 9, 5, 0, 11, 7, 3], [9, 0, 4, 2, 11, 6, 1, 8]),
    "runs-of-two": ([0, 1, 6, 7, 12, 13, 3, 4], [10, 11, 2, 3, 6, 7, 0, 1]),
}


@pytest.mark.parametrize("ps", [1, 4, 32])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cpu_copies_move_exactly_the_named_pages(pattern: str, ps: int) -> None:
    dev_pages, host_pages = PATTERNS[pattern]
    kv = KVPool(16 * ps, KVShape(3, 2, 4, torch.float16))
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 12 * ps, ps)
    host = pool.host_buffers[0][0]
    host.zero_()
    dev_idx, host_idx = _slots(dev_pages, ps), _slots(host_pages, ps)
    pool.backup(dev_idx, host_idx).wait()
    expected = torch.zeros_like(host)
    expected[:, host_idx] = kv.kv[:, :, dev_idx].transpose(1, 2)
    assert torch.equal(host, expected)  # every named page, and nothing else
    before = kv.kv.clone()
    back = _slots(list(reversed(dev_pages)), ps)
    pool.load(host_idx, back).wait()
    want = before.clone()
    want[:, :, back] = before[:, :, dev_idx]
    assert torch.equal(kv.kv, want)
