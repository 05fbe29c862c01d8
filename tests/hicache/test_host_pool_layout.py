"""The host pool's layouts (``HostLayout``): ``PAGE_FIRST`` holds a KV page as one K block and
one V block, each ``[page_size, layers, heads, dim]`` (SGLang's ``MHATokenToKVPoolHost``
``page_first`` data page), ``LAYER_FIRST`` as the device does; either way L3 sees the
``PAGE_FIRST`` page through ``HostPageLayout``, Mamba states keep their shape, the host
buffers are sized exactly, and every CPU copy path moves exactly the named pages."""

from __future__ import annotations

import pytest
import torch

from hicache import HiCacheConfig
from hicache.host_layout import HostLayout
from hicache.host_pool import HostPool
from hicache.storage_worker import HostPageLayout
from urc.errors import ConfigError
from urc.pools.kv_pool import KVPool, KVShape
from urc.pools.mamba import MambaPool

LAYOUTS = list(HostLayout)
HOST_SHAPES = {  # host KV buffer of 6 pages of 3 layers, 2 heads, dim 4
    HostLayout.PAGE_FIRST: lambda slots: (2, slots, 3, 2, 4),
    HostLayout.LAYER_FIRST: lambda slots: (2, 3, slots, 2, 4),
}


def _slots(pages: list[int], ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


def test_the_default_layout_is_page_first_on_an_accelerator_and_layer_first_on_the_cpu() -> None:
    assert HostLayout.for_device(torch.device("cpu")) is HostLayout.LAYER_FIRST
    assert HostLayout.for_device(torch.device("cuda", 0)) is HostLayout.PAGE_FIRST
    kv = KVPool(8, KVShape(3, 2, 4, torch.float16))
    assert HostPool(kv.slot_buffers(), 8).layout is HostLayout.LAYER_FIRST
    assert HiCacheConfig().host_layout is None  # the device's default
    assert HostLayout("page_first") is HostLayout.PAGE_FIRST  # SGLang's spelling


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_l3_sees_sglangs_page_first_data_page_in_either_layout(ps: int, layout: HostLayout) -> None:
    shape = KVShape(3, 2, 4, torch.bfloat16)
    kv = KVPool(16 * ps, shape)
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 6 * ps, ps, layout=layout)
    host = pool.host_buffers[0][0]
    assert tuple(host.shape) == HOST_SHAPES[layout](6 * ps)
    assert host.numel() * host.element_size() == 6 * ps * shape.bytes_per_token
    dev_pages, host_pages = [9, 2, 3, 14], [4, 0, 1, 5]
    dev_idx, host_idx = _slots(dev_pages, ps), _slots(host_pages, ps)
    pool.backup(dev_idx, host_idx).wait()
    pages = HostPageLayout(pool)
    rows = pages.gather(host_idx)
    for i, p in enumerate(dev_pages):
        page = kv.kv[:, :, p * ps : (p + 1) * ps].permute(0, 2, 1, 3, 4)  # [2, P, L, H, D]
        assert torch.equal(rows[i], page.contiguous().view(-1).view(torch.uint8))
    # Scattering the rows back into other host pages and loading them restores the bytes.
    other = _slots([2, 3, 5, 4], ps)
    pages.scatter(rows, other)
    back = _slots([0, 1, 6, 7], ps)
    pool.load(other, back).wait()
    assert torch.equal(kv.kv[:, :, back], kv.kv[:, :, dev_idx])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
def test_mamba_host_states_keep_their_shape(layout: HostLayout) -> None:
    mamba = MambaPool(8, (4, 8), (2, 8, 8))
    mamba.conv.normal_()
    mamba.temporal.normal_()
    pool = HostPool([(mamba.conv, 0), (mamba.temporal, 0)], 5, layout=layout)
    assert [tuple(b.shape) for b, _ in pool.host_buffers] == [(5, 4, 8), (5, 2, 8, 8)]
    pool.backup(torch.tensor([6, 1]), torch.tensor([3, 0])).wait()
    assert torch.equal(pool.host_buffers[0][0][[3, 0]], mamba.conv[[6, 1]])
    assert torch.equal(pool.host_buffers[1][0][[3, 0]], mamba.temporal[[6, 1]])


PATTERNS = {  # (device pages, host pages) of 8-page transfers
    "both-runs": (list(range(3, 11)), list(range(1, 9))),
    "device-scattered": ([14, 2, 9, 5, 0, 11, 7, 3], list(range(2, 10))),
    "host-scattered": (list(range(4, 12)), [9, 0, 4, 2, 11, 6, 1, 8]),
    "both-scattered": ([14, 2, 9, 5, 0, 11, 7, 3], [9, 0, 4, 2, 11, 6, 1, 8]),
    "runs-of-two": ([0, 1, 6, 7, 12, 13, 3, 4], [10, 11, 2, 3, 6, 7, 0, 1]),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.value)
@pytest.mark.parametrize("ps", [1, 4, 32])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cpu_copies_move_exactly_the_named_pages(pattern: str, ps: int, layout: HostLayout) -> None:
    dev_pages, host_pages = PATTERNS[pattern]
    kv = KVPool(16 * ps, KVShape(3, 2, 4, torch.float16))
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 12 * ps, ps, layout=layout)
    host = pool.host_buffers[0][0]
    host.zero_()
    dev_idx, host_idx = _slots(dev_pages, ps), _slots(host_pages, ps)
    pool.backup(dev_idx, host_idx).wait()
    expected = torch.zeros_like(host)
    if layout is HostLayout.PAGE_FIRST:
        expected[:, host_idx] = kv.kv[:, :, dev_idx].transpose(1, 2)
    else:
        expected[:, :, host_idx] = kv.kv[:, :, dev_idx]
    assert torch.equal(host, expected)  # every named page, and nothing else
    before = kv.kv.clone()
    back = _slots(list(reversed(dev_pages)), ps)
    pool.load(host_idx, back).wait()
    want = before.clone()
    want[:, :, back] = before[:, :, dev_idx]
    assert torch.equal(kv.kv, want)


@pytest.mark.parametrize("ps", [1, 4])
def test_pages_of_rows_with_odd_byte_sizes_gather_and_scatter_byte_exact(ps: int) -> None:
    """Rows of 3 and 6 bytes (copied byte-wise) next to rows of 16 (copied in words)."""
    slots = 8 * ps
    small = torch.randint(0, 255, (slots, 3), dtype=torch.uint8)
    half = torch.randn(slots, 3).to(torch.float16)
    wide = torch.randn(slots, 4)
    pool = HostPool([(small, 0), (half, 0), (wide, 0)], slots, ps)
    picked = _slots([5, 1, 2, 6], ps)
    pool.backup(picked, picked).wait()
    pages = HostPageLayout(pool)
    assert pages.page_bytes == ps * (3 + 6 + 16)
    rows = pages.gather(picked)
    for i, p in enumerate([5, 1, 2, 6]):
        at = slice(p * ps, (p + 1) * ps)
        parts = [small[at].reshape(-1), half[at].reshape(-1), wide[at].reshape(-1)]
        assert torch.equal(rows[i], torch.cat([t.view(torch.uint8) for t in parts]))
    for buf, _ in pool.host_buffers:
        buf.zero_()
    pages.scatter(rows, picked)
    assert torch.equal(pages.gather(picked), rows)


@pytest.mark.parametrize("ps", [1, 2])
def test_page_first_cpu_copies_of_large_scattered_slots_move_exactly_the_named_slots(
    ps: int,
) -> None:
    """Slots of 16 KiB scattered on both sides: one strided copy per slot."""
    kv = KVPool(16 * ps, KVShape(2, 8, 128, torch.float32))  # 16 KiB a slot
    kv.kv.normal_()
    pool = HostPool(kv.slot_buffers(), 12 * ps, ps, layout=HostLayout.PAGE_FIRST)
    host = pool.host_buffers[0][0]
    host.zero_()
    dev_pages, host_pages = PATTERNS["both-scattered"]
    dev_idx, host_idx = _slots(dev_pages, ps), _slots(host_pages, ps)
    pool.backup(dev_idx, host_idx).wait()
    expected = torch.zeros_like(host)
    expected[:, host_idx] = kv.kv[:, :, dev_idx].transpose(1, 2)
    assert torch.equal(host, expected)
    before = kv.kv.clone()
    back = _slots([1, 12, 4, 15, 6, 9, 2, 13], ps)
    pool.load(host_idx, back).wait()
    want = before.clone()
    want[:, :, back] = before[:, :, dev_idx]
    assert torch.equal(kv.kv, want)


@pytest.mark.parametrize("layout", ["page_first", 1, HostLayout])
def test_a_layout_that_is_not_a_host_layout_is_a_config_error(layout: object) -> None:
    """A misspelt layout must not quietly fall back to ``LAYER_FIRST``."""
    with pytest.raises(ConfigError, match="HostLayout"):
        HiCacheConfig(host_layout=layout)  # type: ignore[arg-type]
    kv = KVPool(8, KVShape(3, 2, 4, torch.float16))
    with pytest.raises(ConfigError, match="HostLayout"):
        HostPool(kv.slot_buffers(), 8, layout=layout)  # type: ignore[arg-type]
