"""What the router knows about each replica: the block hashes its KV events announced.

:class:`ReplicaIndex` is one replica's view, built from decoded SGLang wire events only
(``BlockStored`` / ``BlockRemoved`` per medium, ``AllBlocksCleared``): a set of block hashes
on device (``GPU``) and one on host (``CPU_PINNED``).  SGLang's model gateway and Dynamo's KV
router keep a radix tree of hashes; a set per medium answers the same question here (how
many leading pages of a prompt a replica holds) because block hashes are chained: page ``i``'s
hash covers the whole prefix before it, so "page ``i`` is held" already means "this prefix".

:class:`PrefixHasher` turns a prompt into its chained page hashes (SGLang's hash, the one the
replicas publish: :mod:`urc.kv_events.block_hash`).  A session's next prompt usually extends
its previous one, so the hasher keeps each session's last prompt and hashes only what
changed (the agentic sessions: ~1000 pages a prompt, a few dozen new).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from urc.kv_events.block_hash import hash_to_int64, page_digests

__all__ = ["PrefixHasher", "ReplicaIndex"]

_GPU = "GPU"
_CPU = "CPU_PINNED"


class ReplicaIndex:
    """One replica's blocks as its events announced them (see the module docstring).

    ``apply`` mutates the sets; events of a medium other than GPU / CPU_PINNED (a replica's
    own L3 announcements, if any) are counted in ``ignored`` and otherwise left out: the
    fleet's L3 is shared, so it does not tell replicas apart."""

    __slots__ = ("device", "host", "ignored")

    def __init__(self) -> None:
        self.device: set[int] = set()
        self.host: set[int] = set()
        self.ignored = 0

    def _tier(self, medium: str | None) -> set[int] | None:
        if medium is None or medium == _GPU:  # SGLang's default medium is the GPU
            return self.device
        if medium == _CPU:
            return self.host
        return None

    def apply(self, events: Iterable[dict[str, Any]]) -> None:
        """Apply decoded wire events (msgpack maps tagged ``"type"``) in order."""
        for ev in events:
            kind = ev.get("type")
            if kind == "AllBlocksCleared":
                self.device.clear()
                self.host.clear()
                continue
            tier = self._tier(ev.get("medium"))
            if tier is None:
                self.ignored += 1
            elif kind == "BlockStored":
                tier.update(ev["block_hashes"])
            elif kind == "BlockRemoved":
                tier.difference_update(ev["block_hashes"])

    def overlap(self, hashes: Sequence[int]) -> int:
        """Leading pages of ``hashes`` held on device or host.

        Found by bisection: what a replica announces is prefix-closed (a page is stored
        after its parent and evicted before it, on device and on host alike), so "page
        ``i`` is held" is monotone in ``i``; 11 set lookups for a 2000-page prompt instead
        of 2000."""
        device, host = self.device, self.host
        lo, hi = 0, len(hashes)  # pages [0, lo) held; page hi (if any) not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = hashes[mid - 1]
            if h in device or h in host:
                lo = mid
            else:
                hi = mid - 1
        return lo


class PrefixHasher:
    """Chained page hashes of prompts, remembering the last prompt of up to ``sessions``
    sessions (least recently used dropped) so a session's next prompt hashes only its new
    pages.  ``hashed`` counts the pages actually hashed."""

    def __init__(self, page_size: int, sessions: int = 4096) -> None:
        assert page_size >= 1, f"page_size {page_size}"
        self.page_size = page_size
        self._limit = sessions
        self._last: OrderedDict[str, tuple[np.ndarray, list[bytes], list[int]]] = OrderedDict()
        self.hashed = 0

    def hashes(self, tokens: Sequence[int], session: str | None = None) -> list[int]:
        """The published hashes of ``tokens``' whole pages (a short last page has none)."""
        ps = self.page_size
        full = len(tokens) // ps * ps
        arr = np.asarray(tokens[:full], dtype=np.int64)
        digests: list[bytes] = []
        out: list[int] = []
        if session is not None and (last := self._last.get(session)) is not None:
            prev, prev_digests, prev_out = last
            m = min(len(prev), full)
            diff = np.flatnonzero(prev[:m] != arr[:m])
            common = (int(diff[0]) if diff.size else m) // ps
            digests = prev_digests[:common]
            out = prev_out[:common]
        start = len(digests) * ps
        prior = digests[-1] if digests else None
        new = page_digests(tokens[start:full], prior, ps)
        self.hashed += len(new)
        digests = digests + new
        out = out + [hash_to_int64(d) for d in new]
        if session is not None:
            self._last[session] = (arr, digests, out)
            self._last.move_to_end(session)
            if len(self._last) > self._limit:
                self._last.popitem(last=False)
        return out
