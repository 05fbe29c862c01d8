"""KV data pool: the tensors that token slots index into.

The tree only ever holds slot indices; the bytes live here, so the HiCache tiers can copy real
data between devices.  Layout: ``k`` and ``v`` are ``[layers, slots, heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from urc.errors import ConfigError

__all__ = ["KVPool", "KVShape"]


@dataclass(frozen=True, slots=True)
class KVShape:
    """Geometry of one KV pool (defaults are tiny: enough to move real bytes in tests)."""

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 8
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_heads, self.head_dim) <= 0:
            raise ConfigError(f"KV dimensions must be positive, got {self}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token across all layers."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_heads * self.head_dim * itemsize


class KVPool:
    """Holds ``size`` token slots of K and V for every layer.

    ``gather(indices)`` returns the K/V of those slots as one ``[2, layers, n, heads, dim]``
    tensor and ``scatter(indices, data)`` writes such a tensor back: the two copies HiCache
    makes between tiers.
    """

    __slots__ = ("device", "kv", "shape", "size")

    def __init__(self, size: int, shape: KVShape, device: str | torch.device = "cpu") -> None:
        if size <= 0:
            raise ConfigError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.shape = shape
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (2, shape.num_layers, size, shape.num_heads, shape.head_dim),
            dtype=shape.dtype,
            device=self.device,
        )

    @property
    def k(self) -> torch.Tensor:
        """K buffer, ``[layers, slots, heads, head_dim]``."""
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        """V buffer, ``[layers, slots, heads, head_dim]``."""
        return self.kv[1]

    def slot_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The buffers a host mirror copies, with the dimension that indexes slots."""
        return [(self.kv, 2)]

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Copy the K/V of ``indices`` (host or device) out as ``[2, layers, n, heads,
        head_dim]`` on the pool's device."""
        return self.kv.index_select(2, indices.to(self.device, non_blocking=True))

    def scatter(self, indices: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (as returned by :meth:`gather`) into the slots ``indices``."""
        self.kv.index_copy_(2, indices.to(self.device, non_blocking=True), data)
