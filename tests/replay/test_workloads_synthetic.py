"""Synthetic workloads: determinism, shape, and that the intended prefix sharing is there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise

import pytest

from urc.apps.workloads import (
    AgentLoopConfig,
    IntRange,
    MultiTurnChatConfig,
    SharedSystemPromptConfig,
    SyntheticConfig,
    TraceRequest,
    WorkloadKind,
    default_config,
    ideal_token_hits,
    synthetic_workload,
)

SMALL: dict[WorkloadKind, SyntheticConfig] = {
    WorkloadKind.MULTI_TURN_CHAT: MultiTurnChatConfig(num_requests=400, num_users=16),
    WorkloadKind.SHARED_SYSTEM_PROMPT: SharedSystemPromptConfig(num_requests=300),
    WorkloadKind.AGENT_LOOP: AgentLoopConfig(num_requests=400, num_agents=4),
}


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_same_seed_same_workload_other_seed_other_workload(kind: WorkloadKind) -> None:
    config = SMALL[kind]
    first = list(synthetic_workload(config))
    assert first == list(synthetic_workload(config))
    assert first != list(synthetic_workload(replace(config, seed=config.seed + 1)))


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_requests_are_well_formed(kind: WorkloadKind) -> None:
    config = SMALL[kind]
    requests = list(synthetic_workload(config))
    assert len(requests) == config.num_requests
    assert [r.index for r in requests] == list(range(config.num_requests))
    timestamps = [r.timestamp_ms for r in requests]
    assert all(a < b for a, b in pairwise(timestamps))
    for r in requests:
        assert r.input_length == len(r.input_ids) > 0
        assert r.output_length > 0
        assert r.hash_ids is None and r.namespace is None
        assert all(0 <= t < config.vocab_size for t in r.input_ids)
    assert config.kind is kind


@pytest.mark.parametrize(
    ("kind", "min_rate"),
    [
        (WorkloadKind.SHARED_SYSTEM_PROMPT, 0.8),
        (WorkloadKind.MULTI_TURN_CHAT, 0.5),
        (WorkloadKind.AGENT_LOOP, 0.6),
    ],
)
def test_sharing_structure_gives_high_ideal_hit_rate(kind: WorkloadKind, min_rate: float) -> None:
    stats = ideal_token_hits(synthetic_workload(SMALL[kind]), page_size=16)
    assert stats.hit_rate > min_rate


def _extends_an_earlier_prompt(requests: list[TraceRequest]) -> int:
    prompts: set[tuple[int, ...]] = set()
    count = 0
    for r in requests:
        # A continuing turn starts with some earlier prompt of at least that length.
        if any(r.input_ids[:n] in prompts for n in range(1, r.input_length)):
            count += 1
        prompts.add(r.input_ids)
    return count


def test_chat_turns_continue_earlier_prompts() -> None:
    config = MultiTurnChatConfig(num_requests=120, num_users=4)
    requests = list(synthetic_workload(config))
    system = requests[0].input_ids[: config.system_prompt_tokens]
    assert all(r.input_ids[: config.system_prompt_tokens] == system for r in requests)
    assert all(r.input_length <= config.max_context_tokens for r in requests)
    assert _extends_an_earlier_prompt(requests) > len(requests) // 2


def test_agent_steps_continue_earlier_prompts() -> None:
    config = AgentLoopConfig(num_requests=120, num_agents=3)
    requests = list(synthetic_workload(config))
    spec = requests[0].input_ids[: config.tool_spec_tokens]
    assert all(r.input_ids[: config.tool_spec_tokens] == spec for r in requests)
    assert all(r.input_length <= config.max_context_tokens for r in requests)
    assert _extends_an_earlier_prompt(requests) > len(requests) // 2


def test_shared_prompts_are_few_and_questions_unique() -> None:
    config = SharedSystemPromptConfig(num_requests=200, num_prompts=3)
    requests = list(synthetic_workload(config))
    heads = {r.input_ids[: config.system_prompt_tokens.low] for r in requests}
    assert len(heads) <= 3
    assert len({r.input_ids for r in requests}) == len(requests)


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_default_workloads_are_modest(kind: WorkloadKind) -> None:
    # The default replay must stay quick on a Python cache: 1-3 million prompt tokens.
    config = default_config(kind)
    assert config.kind is kind
    total = sum(r.input_length for r in synthetic_workload(config))
    assert 1_000_000 <= total <= 3_000_000


@pytest.mark.parametrize(
    "build",
    [
        lambda: IntRange(0, 3),
        lambda: IntRange(5, 4),
        lambda: MultiTurnChatConfig(num_requests=-1),
        lambda: MultiTurnChatConfig(vocab_size=1),
        lambda: MultiTurnChatConfig(mean_interarrival_ms=0),
        lambda: MultiTurnChatConfig(max_context_tokens=100),
        lambda: SharedSystemPromptConfig(num_prompts=0),
        lambda: AgentLoopConfig(num_agents=0),
        lambda: AgentLoopConfig(tool_spec_tokens=4000),
    ],
)
def test_invalid_configs_are_rejected(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()
