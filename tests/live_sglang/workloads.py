"""Deterministic request workloads for the live suite (token ids for a 2048-token vocabulary).

Each builder returns the requests in the order they are sent.  Where requests run one at a
time the cache state each one meets is fixed, so ``cached_tokens`` must agree request by
request between two caches; concurrent workloads are built so that it still does (they share
only a prefix that an earlier, sequential request cached).
"""

from __future__ import annotations

import random

from live_server import GenRequest

__all__ = ["chunked_prompts", "concurrent_suffixes", "shared_prefix", "tokens"]

_VOCAB = 2048
_LOW = 3  # ids below are special (bos/eos/pad) in the tiny models


def tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_LOW, _VOCAB) for _ in range(n))


def shared_prefix(
    seed: int, groups: int = 6, per_group: int = 8, prefix: int = 96, new: int = 4
) -> list[GenRequest]:
    """``groups`` system prompts, each followed by ``per_group`` questions of 8-40 tokens;
    some questions repeat an earlier one of their group (a full hit plus new tokens)."""
    rng = random.Random(seed)
    out: list[GenRequest] = []
    for _ in range(groups):
        system = tokens(rng, prefix)
        asked: list[tuple[int, ...]] = []
        for _ in range(per_group):
            if asked and rng.random() < 0.25:
                question = rng.choice(asked) + tokens(rng, 3)
            else:
                question = tokens(rng, rng.randrange(8, 40))
            asked.append(question)
            out.append(GenRequest(system + question, max_new_tokens=new))
    return out


def chunked_prompts(seed: int, chunk: int, n: int = 3, new: int = 4) -> list[GenRequest]:
    """``n`` prompts of about 3.3 chunks each (several chunked-prefill rounds), sharing their
    first 1.6 chunks, then the first prompt again with a new tail."""
    rng = random.Random(seed)
    common = tokens(rng, chunk * 8 // 5)
    prompts = [common + tokens(rng, chunk * 17 // 10 + i) for i in range(n)]
    prompts.append(prompts[0] + tokens(rng, chunk // 3))
    return [GenRequest(p, max_new_tokens=new) for p in prompts]


def concurrent_suffixes(
    seed: int, n: int = 16, prefix: int = 160, new: int = 12
) -> tuple[GenRequest, list[GenRequest]]:
    """A warm-up request for a shared prefix, then ``n`` requests extending it with
    distinct first tokens (so they share nothing among themselves beyond the prefix)."""
    rng = random.Random(seed)
    common = tokens(rng, prefix)
    tail = tokens(rng, 5)
    firsts = rng.sample([t for t in range(_LOW, _VOCAB) if t != tail[0]], n)
    warm = GenRequest(common + tail, max_new_tokens=2)
    return warm, [
        GenRequest((*common, f, *tokens(rng, rng.randrange(4, 30))), max_new_tokens=new)
        for f in firsts
    ]
