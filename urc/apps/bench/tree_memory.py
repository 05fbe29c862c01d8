"""Memory a tree of cached tokens holds once the requests that built it are gone.

``python -m urc.apps.bench.core --scaling`` reports it for a 10^6-token tree
(:func:`tree_memory`).  A server's request token lists die with the requests; what stays is
the tree: its nodes and their keys (packed ``array('q')`` keys: 8 bytes a token; lists of
ints held 8 bytes of pointer plus a 32-byte int object a token once nothing else held the
ints) and their index tensors.  Two figures: the Python heap the tree holds (``tracemalloc``,
exact and noise-free; index tensors' storage is torch's and not in it) and the process's
resident memory grown by building it (Linux ``/proc/self/statm`` after ``malloc_trim``, less
tracemalloc's own; ``None`` elsewhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import tracemalloc
from collections.abc import Callable, Generator
from contextlib import closing
from typing import Any

from urc.cache import UnifiedRadixCache

__all__ = ["tree_memory"]


def _rss_bytes() -> int | None:
    """Resident bytes after handing free heap memory back to the OS (glibc ``malloc_trim``:
    the dropped sequences' memory would count otherwise); ``None`` off Linux."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def tree_memory(
    cache: UnifiedRadixCache,
    insert: Callable[[list[int]], None],
    sequences: Generator[list[int], None, None],
    tokens: int = 10**6,
) -> dict[str, Any]:
    """Fill the empty ``cache`` to about ``tokens`` cached tokens from ``sequences``
    (``insert(seq)`` caches one), close the stream so no sequence is left alive, and measure
    what the cache holds then: ``{"tokens", "nodes", "python_heap_mib", "rss_mib"}``.
    Mutates ``cache``."""
    gc.collect()
    rss0 = _rss_bytes()
    tracemalloc.start()
    with closing(sequences):  # close() frees the generator's state (its sequences)
        while cache.total_size() < tokens:
            insert(next(sequences))
    del sequences
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0]
    rss1 = _rss_bytes()
    if rss1 is not None:
        rss1 -= tracemalloc.get_tracemalloc_memory()  # its own traces are resident too
    tracemalloc.stop()
    return {
        "tokens": cache.total_size(),
        "nodes": cache.tree.num_nodes,
        "python_heap_mib": round(heap / 2**20, 1),
        "rss_mib": None if rss0 is None or rss1 is None else round((rss1 - rss0) / 2**20, 1),
    }
