"""The future of a workload, for ``urc replay --eviction-policy belady`` (measurement only).

Belady's MIN evicts what is needed furthest in the future; with the whole workload read up
front the replay can tell the cache exactly that, so users see how far their policy is from
the limit on their own traces.  No server knows its future: this is never a serving policy.

What "the next use of a node" means.  Every tree node starts on a page boundary, so its first
page is a page-prefix: the tokens ``[0, p + page)`` of any path through it.  The next use of
the node is the first request after the current one whose prompt contains that page-prefix
(it would hit at least that page).  Page-prefixes are named by a rolling hash, one per page:

    h(0) = hash(namespace);  h(k + 1) = hash((h(k), tokens[k*page : (k+1)*page]))

The table maps each ``h`` to the ascending indices of the requests containing it; a node's
``h`` comes from its parent's (memoised per node) and its own first page.

Cost: one pass over the workload's tokens before the replay (a hash per page) and a dict
entry per distinct page-prefix (the conversation trace: about 5.7M, under 1 GB).
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

import anyio.lowlevel
from tqdm import tqdm

from urc.apps.replay.config import ReplayConfig
from urc.apps.replay.source import CHECKPOINT_EVERY, aiter_requests
from urc.node import TreeNode

__all__ = ["NextUseTable", "build_next_use"]

NEVER = 1 << 62
"""The next use of a page-prefix no later request contains."""


class NextUseTable:
    """For each page-prefix of a workload, the requests that contain it (``NextUseOracle``).

    ``advance(i)`` says request ``i`` is being served; ``next_use(node)`` is then the index
    of the first later request that contains the node's first page, or :data:`NEVER`.
    """

    __slots__ = ("_ends", "_now", "_page", "_uses")

    def __init__(self, page_size: int) -> None:
        self._page = page_size
        self._uses: dict[int, list[int]] = {}
        self._ends: dict[int, tuple[int, int]] = {}  # node id -> (key_len, h at its end)
        self._now = -1

    def add(self, index: int, tokens: Sequence[int], namespace: Any = None) -> None:
        """Record request ``index`` (added in ascending order) with its prompt ``tokens``."""
        page = self._page
        uses = self._uses
        h = hash(namespace)
        for start in range(0, len(tokens) - page + 1, page):
            h = hash((h, tuple(tokens[start : start + page])))
            u = uses.get(h)
            if u is None:
                uses[h] = [index]
            elif u[-1] != index:
                u.append(index)

    def advance(self, index: int) -> None:
        """Request ``index`` is being served (requests in flight overlap: the latest wins)."""
        if index > self._now:
            self._now = index

    def next_use(self, node: TreeNode) -> int:
        parent = node.parent
        if parent is None or node.key_len < self._page:
            return NEVER
        h = hash((self._end_hash(parent, node.namespace), tuple(node.key[: self._page])))
        u = self._uses.get(h)
        if u is None:
            return NEVER
        i = bisect_right(u, self._now)
        return u[i] if i < len(u) else NEVER

    def _end_hash(self, node: TreeNode, namespace: Any) -> int:
        """``h`` at the end of ``node``'s path in ``namespace`` (memoised; a split node
        changes its key_len, which invalidates its entry)."""
        chain: list[TreeNode] = []
        ends = self._ends
        h = 0
        while True:
            if node.parent is None:
                h = hash(namespace)
                break
            memo = ends.get(node.id)
            if memo is not None and memo[0] == node.key_len:
                h = memo[1]
                break
            chain.append(node)
            node = node.parent
        page = self._page
        for n in reversed(chain):
            key = n.key
            for start in range(0, n.key_len - page + 1, page):
                h = hash((h, tuple(key[start : start + page])))
            ends[n.id] = (n.key_len, h)
        return h


async def build_next_use(
    config: ReplayConfig, *, requests: int | None = None, progress: bool = False
) -> NextUseTable:
    """Read ``config``'s whole workload once and return its table (page size of the replay).

    ``requests`` (the workload's size, when known) and ``progress`` show the pass as a
    progress bar on stderr; it yields to the event loop every ``CHECKPOINT_EVERY`` requests,
    so Ctrl-C and cancelled scopes stop it at once."""
    table = NextUseTable(config.page_size)
    stream = aiter_requests(config)
    with tqdm(
        total=requests,
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        desc="belady (reading the future)",
    ) as bar:
        seen = 0
        async with aclosing(stream):
            async for r in stream:
                table.add(r.index, r.input_ids, r.namespace)
                seen = r.index + 1
                if seen % CHECKPOINT_EVERY == 0:
                    bar.update(CHECKPOINT_EVERY)
                    await anyio.lowlevel.checkpoint()  # interruptible (nothing here suspends)
        bar.update(seen - bar.n)  # ends at its total, not at the last checkpoint
    return table
