"""Deterministic expansion of Mooncake block hash ids into token ids.

A Mooncake trace does not carry tokens, only one hash id per block of ``block_size`` tokens.
To replay it through a token-level cache we invent tokens with two properties:

* equal hash ids give equal token blocks (so every prefix the trace shares is shared in tokens);
* different hash ids give blocks that differ already at their first token, so a token-level
  prefix match never runs past a block boundary into a block the trace says is different.
  This holds exactly for hash ids in ``[0, 2**31)`` (every published trace); larger ids are
  folded into that range by a 64-bit mix, so a first-token clash there is possible but has
  probability ``2**-31`` per pair of ids.

The first token of a block is ``start(h)``, a bijection of ``[0, 2**31)``; the others are
``(start(h) + p) mod VOCAB_SIZE`` for offsets ``p >= 1``, taken from one shared table of int
objects (:data:`VOCAB_SIZE` of them, like a tokenizer's vocabulary).  Two properties follow:

* a block is a slice of that table (expanded in C, no per-token Python arithmetic: tens of
  millions of tokens per second on one core);
* the tokens of every request are the *same* int objects, so the tree's keys cost one pointer
  (8 bytes) a token instead of a pointer plus a 32-byte int each, and comparing a request's
  tokens with a cached edge takes CPython's identity shortcut (~2.6 instead of ~7.7 ns a
  token; a real tokenizer's output is distinct int objects, so a server compares at the slower
  rate).  Replaying the conversation trace keeps tens of millions of tokens in the tree: this
  is most of the difference between 1 GB and 4 GB peak memory.

Positions are compared at the same offset within a block (every block but a request's last is
full), so equal first tokens are the only way two blocks can match, and they are equal exactly
when the hash ids are.
"""

from __future__ import annotations

__all__ = ["TOKEN_ID_LIMIT", "VOCAB_SIZE", "block_start_token", "expand_hash_ids"]

TOKEN_ID_LIMIT = 1 << 31
"""Every expanded token id lies in ``[0, TOKEN_ID_LIMIT)``."""

VOCAB_SIZE = 1 << 16
"""Tokens after a block's first are ids below this, shared int objects (see the module doc)."""

_VOCAB = tuple(range(VOCAB_SIZE))
_VOCAB_MASK = VOCAB_SIZE - 1

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
    append = tokens.append
    extend = tokens.extend
    vocab = _VOCAB
    for i, hash_id in enumerate(hash_ids):
        count = block_size if i < full_blocks else last
        start = block_start_token(hash_id)
        append(start)
        lo = (start + 1) & _VOCAB_MASK
        rest = count - 1
        while rest > 0:  # wraps around the table (a block longer than it wraps again)
            take = min(rest, VOCAB_SIZE - lo)
            extend(vocab[lo : lo + take])
            rest -= take
            lo = 0
    return tokens
