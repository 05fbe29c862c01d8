"""Where a replay's requests come from, and the cheap first pass that sizes the cache.

:func:`summarize` reads the workload once before the replay: request count, token totals, the
longest request (it sizes the request rows) and the ideal prefix hits at the replay's page size
(unbounded, prefill-only; :mod:`urc.apps.workloads.ideal`).  ``unique_tokens = input_tokens -
ideal_hit_tokens`` is what capacity fractions are relative to.

For a Mooncake trace the pass works on hash ids only (no token expansion): the 12k-request
conversation trace (145M prompt tokens) takes a few seconds.  It streams the file like the
replay does, so a malformed line is reported (with its line number) before anything runs.
A synthetic workload is generated twice from the same seed (cheaper than keeping it).
Agentic sessions (:mod:`urc.apps.workloads.agentic`) are read once per process and kept
(compactly: each request as its difference from its flow's previous one).

The first pass yields to the event loop every :data:`CHECKPOINT_EVERY` requests even where
no read suspends (a synthetic workload): a Ctrl-C (asyncio cancels the main task) or a
cancelled scope then stops it within milliseconds instead of at its end.  (The replay
itself suspends on every request; :func:`aiter_requests` adds no yields of its own, which
would change the order of the replay's commands.)  ``summarize(progress=True)`` shows the
first pass as a progress bar on stderr.

During the replay a trace is read with blocking reads inside the event loop by default (a
buffered read between two requests costs microseconds, and no worker thread decides when the
next request arrives, so the replay is deterministic); with ``ReplayConfig.realtime`` it is
streamed with aiofiles, like a server reading its input.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncGenerator, Iterable, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass, replace

import anyio.lowlevel
from tqdm import tqdm

from urc.apps.replay.config import ReplayConfig
from urc.apps.workloads import (
    BlockPrefixOracle,
    TokenPrefixOracle,
    TraceRequest,
    aiter_mooncake_records,
    aiter_mooncake_trace,
    default_config,
    expand_hash_ids,
    iter_mooncake_trace,
    synthetic_workload,
)
from urc.apps.workloads.agentic import AgenticConfig, AgenticWorkload, load_agentic

__all__ = [
    "CHECKPOINT_EVERY",
    "EmptyWorkloadError",
    "WorkloadSummary",
    "agentic_workload",
    "aiter_requests",
    "default_requests",
    "summarize",
    "synthetic_requests",
]


CHECKPOINT_EVERY = 256
"""Requests between two yields to the event loop in a pass over the workload."""


class EmptyWorkloadError(ValueError):
    """The workload holds no request (an empty trace, ``--num-requests 0``): there is nothing
    to measure, so a replay refuses to run instead of reporting a 0% hit rate."""


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    """Totals of one workload (see the module docstring)."""

    requests: int
    input_tokens: int
    output_tokens: int
    max_request_tokens: int
    ideal_hit_tokens: int

    @property
    def unique_tokens(self) -> int:
        """Prompt tokens an unbounded cache would have had to compute."""
        return self.input_tokens - self.ideal_hit_tokens

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hit_tokens / self.input_tokens if self.input_tokens else 0.0


@functools.lru_cache(maxsize=2)
def _agentic(config: AgenticConfig) -> AgenticWorkload:
    # Reading 471 sessions takes ~20 s: the first pass, Belady and the replay share one.
    return load_agentic(config)


def agentic_workload(config: ReplayConfig) -> AgenticWorkload:
    """The agentic sessions ``config.trace`` names, laid out in time (loaded once per
    process for the same layout)."""
    return _agentic(config.agentic_config())


def synthetic_requests(config: ReplayConfig) -> Iterator[TraceRequest]:
    """The built-in workload ``config`` names, seeded and sized as it says."""
    wl = default_config(config.workload)
    wl = replace(wl, seed=config.seed)
    if config.num_requests is not None:
        wl = replace(wl, num_requests=config.num_requests)
    return synthetic_workload(wl)


async def summarize(config: ReplayConfig, *, progress: bool = False) -> WorkloadSummary:
    """First pass over the workload (see the module docstring); ``progress`` shows it on
    stderr.

    Raises :class:`~urc.apps.workloads.TraceFormatError` on a malformed trace line and
    ``OSError`` when the trace cannot be read.
    """
    count = tokens_in = tokens_out = longest = hits = 0
    limit = config.num_requests
    ps = config.page_size
    total = limit if config.trace is not None else default_requests(config)
    if config.agentic:
        total = agentic_workload(config).requests
    with tqdm(
        total=total,
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        desc="first pass (sizing the cache)",
    ) as bar:
        if config.trace is None or config.agentic:
            oracle = TokenPrefixOracle(ps)
            for r in _requests(config):
                hits += oracle.observe(r.input_ids, r.namespace)
                count += 1
                tokens_in += r.input_length
                tokens_out += r.output_length
                longest = max(longest, r.input_length + r.output_length)
                if count % CHECKPOINT_EVERY == 0:
                    bar.update(CHECKPOINT_EVERY)
                    await anyio.lowlevel.checkpoint()
                if limit is not None and config.agentic and count >= limit:
                    break
            bar.update(count - bar.n)  # the bar ends at its total, not at the last checkpoint
            return WorkloadSummary(count, tokens_in, tokens_out, longest, hits)
        bs = config.block_size
        block_oracle = BlockPrefixOracle(bs, ps) if bs % ps == 0 else None
        token_oracle = TokenPrefixOracle(ps) if block_oracle is None else None
        records = aiter_mooncake_records(config.trace, block_size=bs)
        async with aclosing(records):
            async for rec in records:
                if limit is not None and count >= limit:
                    break
                if block_oracle is not None:
                    hits += block_oracle.observe(rec.hash_ids, rec.input_length)
                else:
                    assert token_oracle is not None
                    tokens = expand_hash_ids(rec.hash_ids, rec.input_length, bs)
                    hits += token_oracle.observe(tokens)
                count += 1
                tokens_in += rec.input_length
                tokens_out += rec.output_length
                longest = max(longest, rec.input_length + rec.output_length)
                if count % CHECKPOINT_EVERY == 0:
                    bar.update(CHECKPOINT_EVERY)
                    await anyio.lowlevel.checkpoint()
        bar.update(count - bar.n)
    return WorkloadSummary(count, tokens_in, tokens_out, longest, hits)


def _requests(config: ReplayConfig) -> Iterable[TraceRequest]:
    """A synthetic workload's or the agentic sessions' requests (not a Mooncake trace's)."""
    return agentic_workload(config) if config.agentic else synthetic_requests(config)


def default_requests(config: ReplayConfig) -> int:
    """How many requests the synthetic workload ``config`` names holds."""
    if config.num_requests is not None:
        return config.num_requests
    return default_config(config.workload).num_requests


async def aiter_requests(config: ReplayConfig) -> AsyncGenerator[TraceRequest, None]:
    """The workload's requests in order (see the module docstring for how a trace is read)."""
    limit = config.num_requests
    if config.trace is None or config.agentic:
        for r in _requests(config):
            if limit is not None and config.agentic and r.index >= limit:
                break
            yield r
        return
    if not config.realtime:
        with closing(iter_mooncake_trace(config.trace, block_size=config.block_size)) as it:
            for r in it:
                if limit is not None and r.index >= limit:
                    break
                yield r
        return
    trace = aiter_mooncake_trace(config.trace, block_size=config.block_size)
    async with aclosing(trace):
        async for r in trace:
            if limit is not None and r.index >= limit:
                break
            yield r
