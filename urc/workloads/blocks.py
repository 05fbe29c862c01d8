"""Deterministic expansion of Mooncake block hash ids into token ids.

A Mooncake trace does not carry tokens, only one hash id per block of ``block_size`` tokens.
To replay it through a token-level cache we invent tokens with two properties:

* equal hash ids give equal token blocks (so every prefix the trace shares is shared in tokens);
* different hash ids give blocks that differ already at their first token, so a token-level
  prefix match never runs past a block boundary into a block the trace says is different.
  This holds exactly for hash ids in ``[0, 2**31)`` (every published trace); larger ids are
  folded into that range by a 64-bit mix, so a first-token clash there is possible but has
  probability ``2**-31`` per pair of ids.

The function is ``token(h, p) = (start(h) + p) mod 2**31`` where ``start`` is a bijection of
``[0, 2**31)``. Consecutive tokens of a block are consecutive integers, so a block is expanded
by ``range`` in C with no per-token Python arithmetic and no cache to bound: measured on the
conversation trace, about 50 million tokens per second on one core.
"""

from __future__ import annotations

__all__ = ["TOKEN_ID_LIMIT", "block_start_token", "expand_hash_ids"]

TOKEN_ID_LIMIT = 1 << 31
"""Every expanded token id lies in ``[0, TOKEN_ID_LIMIT)``."""

_MASK31 = TOKEN_ID_LIMIT - 1
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # Standard splitmix64 finaliser: folds ids >= 2**31 so their high bits still matter.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def block_start_token(hash_id: int) -> int:
    """Return the first token id of the block named ``hash_id``.

    A bijection on ``[0, 2**31)``: each step (multiply by an odd constant, add, xor-shift
    right) is invertible modulo ``2**31``, so distinct ids below ``2**31`` get distinct first
    tokens. The mixing spreads neighbouring ids apart, which keeps blocks of consecutive ids
    from being shifted copies of each other.

    Raises:
        ValueError: if ``hash_id`` is negative.
    """
    if hash_id < 0:
        raise ValueError(f"hash id must be >= 0, got {hash_id}")
    x = hash_id if hash_id < TOKEN_ID_LIMIT else _splitmix64(hash_id) & _MASK31
    x = (x * 0x2545F491 + 0x1B873593) & _MASK31
    x ^= x >> 16
    x = (x * 0x6C8E9CF5) & _MASK31
    x ^= x >> 13
    return x


def expand_hash_ids(hash_ids: tuple[int, ...], input_length: int, block_size: int) -> list[int]:
    """Return the ``input_length`` token ids of a request made of ``hash_ids`` blocks.

    Every block contributes ``block_size`` tokens except the last, which contributes
    ``input_length - (len(hash_ids) - 1) * block_size``. The caller validates that this is in
    ``(0, block_size]`` (the trace reader does, with the line number); here a mismatch raises.

    Raises:
        ValueError: if the lengths are inconsistent or a hash id is negative.
    """
    full_blocks = len(hash_ids) - 1
    last = input_length - full_blocks * block_size
    if not hash_ids:
        if input_length != 0:
            raise ValueError(f"no hash ids for input_length {input_length}")
        return []
    if not 0 < last <= block_size:
        raise ValueError(
            f"{len(hash_ids)} blocks of {block_size} cannot hold {input_length} tokens"
        )
    tokens: list[int] = []
    extend = tokens.extend
    for i, hash_id in enumerate(hash_ids):
        count = block_size if i < full_blocks else last
        start = block_start_token(hash_id)
        end = start + count
        if end <= TOKEN_ID_LIMIT:
            extend(range(start, end))
        else:  # wrap around the top of the id range
            extend(range(start, TOKEN_ID_LIMIT))
            extend(range(end - TOKEN_ID_LIMIT))
    return tokens
