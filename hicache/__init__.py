"""HiCache: the tiers below device memory (host memory L2, storage L3) and their transfers.

``hicache.storage`` holds the L3 storage protocol and its backends.
"""

from __future__ import annotations

__all__: list[str] = []
