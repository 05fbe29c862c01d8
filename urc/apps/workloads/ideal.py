"""Oracles for the ideal prefix-cache hit rate: unbounded capacity, prefill-only replay.

What "ideal" counts, precisely. Requests are taken one at a time in workload order. A request's
hit tokens are the length of the longest common prefix between its prompt and the prompt of
any earlier request in the same namespace, rounded down to a whole number of pages
(``page_size`` tokens, pages aligned at token 0). After it is counted, the request's prompt is
remembered in full (prefill-only: generated tokens are never added; capacity is unbounded, so
nothing is ever evicted). A request never hits itself. The hit rate is total hit tokens over
total prompt tokens. No cap such as "leave one token to compute" is applied: that is a
scheduler policy, not a property of the cache.

Rounding the common prefix down to pages is exactly what a paged cache can hit: it stores only
the whole pages of earlier prompts and matches whole pages, and
``floor(min(lcp, floor(m/p)*p)/p)*p == floor(lcp/p)*p`` for any earlier prompt of length ``m``.

Two oracles, both deliberately simple (a trie keyed by ``(parent node, edge label)`` in a dict)
because they are what the real cache is checked against:

* :class:`TokenPrefixOracle` works on token ids (any workload, including synthetic ones);
  memory is one dict entry per distinct page-prefix.
* :class:`BlockPrefixOracle` works on Mooncake hash ids without expanding tokens: a block
  hits only if the whole chain of hash ids up to and including it was seen in an earlier
  request; only the real tokens of a partial last block count. With the token expansion of
  :mod:`urc.apps.workloads.blocks` it gives exactly what the token oracle gives on expanded tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from urc.apps.workloads.request import TraceRequest

__all__ = [
    "BlockPrefixOracle",
    "BlockRequest",
    "IdealHitStats",
    "TokenPrefixOracle",
    "ideal_block_hits",
    "ideal_token_hits",
]


@dataclass(frozen=True, slots=True)
class IdealHitStats:
    """Totals of an ideal-cache run: ``hit_rate = hit_tokens / input_tokens`` (0 if empty)."""

    requests: int
    input_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def _check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")


class TokenPrefixOracle:
    """Ideal unbounded prefix cache over token ids, one page-trie per namespace.

    Raises:
        ValueError: if ``page_size`` is not positive.
    """

    __slots__ = ("_edges", "_next_node", "_page_size", "_roots")

    def __init__(self, page_size: int = 1) -> None:
        _check_page_size(page_size)
        self._page_size = page_size
        # (parent node id, page of tokens) -> child node id. Node ids are plain ints.
        self._edges: dict[tuple[int, tuple[int, ...]], int] = {}
        self._roots: dict[tuple[str, ...] | None, int] = {}
        self._next_node = 0

    def _new_node(self) -> int:
        node = self._next_node
        self._next_node += 1
        return node

    def observe(self, tokens: Sequence[int], namespace: tuple[str, ...] | None = None) -> int:
        """Return the ideal hit tokens of ``tokens``, then remember its whole pages.

        The result is a multiple of ``page_size`` and at most ``len(tokens)``.
        """
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = self._new_node()
        page_size = self._page_size
        hit_pages = 0
        matching = True
        for start in range(0, len(tokens) - page_size + 1, page_size):
            key = (node, tuple(tokens[start : start + page_size]))
            child = self._edges.get(key)
            if child is None:
                # A new node has no children, so nothing after this page can hit.
                matching = False
                child = self._edges[key] = self._new_node()
            elif matching:
                hit_pages += 1
            node = child
        return hit_pages * page_size


class BlockRequest(Protocol):
    """What :class:`BlockPrefixOracle` needs from a request (MooncakeRecord, TraceRequest)."""

    @property
    def hash_ids(self) -> Sequence[int] | None: ...

    @property
    def input_length(self) -> int: ...


class BlockPrefixOracle:
    """Ideal unbounded prefix cache over Mooncake block hash ids (no token expansion).

    Raises:
        ValueError: if ``page_size`` is not positive or does not divide ``block_size``.
    """

    __slots__ = ("_block_size", "_edges", "_page_size", "_tokens")

    def __init__(self, block_size: int = 512, page_size: int = 1) -> None:
        _check_page_size(page_size)
        if block_size <= 0 or block_size % page_size:
            raise ValueError(f"page_size {page_size} must divide block_size {block_size}")
        self._block_size = block_size
        self._page_size = page_size
        # (parent node id, hash id) -> child node id; node 0 is the root.
        self._edges: dict[tuple[int, int], int] = {}
        # Most real tokens any request had in this block; below block_size only for blocks
        # that were some request's partial last block.
        self._tokens: list[int] = [0]

    def observe(self, hash_ids: Sequence[int], input_length: int) -> int:
        """Return the ideal hit tokens of one request, then remember its blocks.

        Raises:
            ValueError: if ``len(hash_ids) != ceil(input_length / block_size)``.
        """
        block_size = self._block_size
        if len(hash_ids) != -(-input_length // block_size):
            raise ValueError(
                f"{len(hash_ids)} hash ids do not fit input_length {input_length} "
                f"with block_size {block_size}"
            )
        last = len(hash_ids) - 1
        node = 0
        hit = 0
        matching = True
        for i, hash_id in enumerate(hash_ids):
            count = block_size if i < last else input_length - last * block_size
            key = (node, hash_id)
            child = self._edges.get(key)
            if child is None:
                matching = False
                child = self._edges[key] = len(self._tokens)
                self._tokens.append(count)
            else:
                seen = self._tokens[child]
                if matching:
                    # Only the tokens some earlier request really had in this block can hit,
                    # and a block cached short ends the cached prefix (such a block never has
                    # children, so this only restates that invariant).
                    hit += min(count, seen)
                    matching = seen == block_size
                self._tokens[child] = max(seen, count)
            node = child
        return hit - hit % self._page_size


def ideal_token_hits(requests: Iterable[TraceRequest], page_size: int = 1) -> IdealHitStats:
    """Return the ideal totals of a workload from its token ids, honouring namespaces.

    Raises:
        ValueError: if ``page_size`` is not positive.
    """
    oracle = TokenPrefixOracle(page_size)
    count = tokens = hits = 0
    for request in requests:
        hits += oracle.observe(request.input_ids, request.namespace)
        tokens += request.input_length
        count += 1
    return IdealHitStats(count, tokens, hits)


def ideal_block_hits(
    requests: Iterable[BlockRequest], block_size: int = 512, page_size: int = 1
) -> IdealHitStats:
    """Return the ideal totals of a Mooncake trace from its hash ids (one namespace).

    Raises:
        ValueError: as :class:`BlockPrefixOracle`, or if a request has no ``hash_ids``.
    """
    oracle = BlockPrefixOracle(block_size, page_size)
    count = tokens = hits = 0
    for request in requests:
        if request.hash_ids is None:
            raise ValueError("ideal_block_hits needs requests with hash_ids (a Mooncake trace)")
        hits += oracle.observe(request.hash_ids, request.input_length)
        tokens += request.input_length
        count += 1
    return IdealHitStats(count, tokens, hits)
