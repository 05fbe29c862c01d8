"""Seeded built-in synthetic workloads: multi-turn chat, shared system prompt, agent loop.

Each generator takes a frozen config and yields :class:`TraceRequest` objects with strictly
increasing timestamps (exponential inter-arrival gaps, at least 1 ms). Everything random comes
from one ``random.Random(config.seed)``, so a config always yields the same requests.
Prompts are built the way a server would see them: a later request's prompt literally starts
with the earlier context it continues, so the prefix sharing is real, token for token.

Defaults keep each workload at 2.1-2.6 million prompt tokens (2000 requests), small enough for
a Python cache to replay in well under two minutes; every size is configurable.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from urc.apps.workloads.request import TraceRequest

__all__ = [
    "AgentLoopConfig",
    "IntRange",
    "MultiTurnChatConfig",
    "SharedSystemPromptConfig",
    "SyntheticConfig",
    "WorkloadKind",
    "agent_loop",
    "default_config",
    "multi_turn_chat",
    "shared_system_prompt",
    "synthetic_workload",
]


class WorkloadKind(Enum):
    """The built-in synthetic workloads; the value is the command-line spelling."""

    MULTI_TURN_CHAT = "multi-turn-chat"
    SHARED_SYSTEM_PROMPT = "shared-system-prompt"
    AGENT_LOOP = "agent-loop"


@dataclass(frozen=True, slots=True)
class IntRange:
    """An inclusive range of token counts, drawn uniformly.

    Raises:
        ValueError: unless ``1 <= low <= high``.
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True, kw_only=True)
class _CommonConfig:
    """Fields every synthetic workload has; subclasses validate their own sizes."""

    seed: int = 0
    num_requests: int = 2000
    vocab_size: int = 32000
    mean_interarrival_ms: float = 20.0

    def __post_init__(self) -> None:
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.mean_interarrival_ms <= 0:
            raise ValueError(f"mean_interarrival_ms must be > 0, got {self.mean_interarrival_ms}")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Raise ValueError if the workload-specific sizes are inconsistent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiTurnChatConfig(_CommonConfig):
    """Users holding conversations; each turn's prompt is the previous turn's prompt, the
    model's reply and a new user message. A conversation that would outgrow
    ``max_context_tokens`` ends and the user starts a new one. All conversations start with
    the same system prompt. Requests from different users interleave at random.
    """

    kind: ClassVar[WorkloadKind] = WorkloadKind.MULTI_TURN_CHAT

    num_users: int = 64
    system_prompt_tokens: int = 256
    user_message_tokens: IntRange = field(default_factory=lambda: IntRange(32, 256))
    reply_tokens: IntRange = field(default_factory=lambda: IntRange(64, 384))
    max_context_tokens: int = 2048

    def _check_sizes(self) -> None:
        if self.num_users < 1 or self.system_prompt_tokens < 1:
            raise ValueError("num_users and system_prompt_tokens must be >= 1")
        if self.system_prompt_tokens + self.user_message_tokens.high > self.max_context_tokens:
            raise ValueError("max_context_tokens cannot hold the system prompt and one message")


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedSystemPromptConfig(_CommonConfig):
    """A few long system prompts, each request one of them plus its own unique question."""

    kind: ClassVar[WorkloadKind] = WorkloadKind.SHARED_SYSTEM_PROMPT

    num_prompts: int = 4
    system_prompt_tokens: IntRange = field(default_factory=lambda: IntRange(512, 1536))
    question_tokens: IntRange = field(default_factory=lambda: IntRange(16, 256))
    output_tokens: IntRange = field(default_factory=lambda: IntRange(16, 256))

    def _check_sizes(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLoopConfig(_CommonConfig):
    """Concurrent agents. Each starts from shared tool definitions plus its own task; each
    step's prompt is the whole context so far, and the step appends the agent's action and
    the tool's output. An agent whose context would pass ``max_context_tokens`` finishes and
    a new task takes its slot.
    """

    kind: ClassVar[WorkloadKind] = WorkloadKind.AGENT_LOOP

    num_agents: int = 8
    tool_spec_tokens: int = 512
    task_tokens: IntRange = field(default_factory=lambda: IntRange(64, 256))
    action_tokens: IntRange = field(default_factory=lambda: IntRange(16, 128))
    tool_output_tokens: IntRange = field(default_factory=lambda: IntRange(32, 384))
    max_context_tokens: int = 2048

    def _check_sizes(self) -> None:
        if self.num_agents < 1 or self.tool_spec_tokens < 1:
            raise ValueError("num_agents and tool_spec_tokens must be >= 1")
        if self.tool_spec_tokens + self.task_tokens.high > self.max_context_tokens:
            raise ValueError("max_context_tokens cannot hold the tool spec and a task")


SyntheticConfig = MultiTurnChatConfig | SharedSystemPromptConfig | AgentLoopConfig


class _Source:
    """The single seeded random source of one workload: tokens, sizes and arrival times."""

    __slots__ = ("_now_ms", "_rate", "_vocab", "rng")

    def __init__(self, config: _CommonConfig) -> None:
        self.rng = random.Random(config.seed)
        self._vocab = range(config.vocab_size)
        self._rate = 1.0 / config.mean_interarrival_ms
        self._now_ms = 0

    def tokens(self, count: int) -> tuple[int, ...]:
        # choices() draws all tokens in one C loop: ~10x faster than randrange per token.
        return tuple(self.rng.choices(self._vocab, k=count))

    def next_timestamp(self) -> int:
        """Return the current time, then advance by an exponential gap of >= 1 ms."""
        now = self._now_ms
        self._now_ms += max(1, round(self.rng.expovariate(self._rate)))
        return now


def _request(index: int, timestamp_ms: int, prompt: tuple[int, ...], output: int) -> TraceRequest:
    return TraceRequest(
        index=index,
        timestamp_ms=timestamp_ms,
        input_ids=prompt,
        output_length=output,
        input_length=len(prompt),
    )


def multi_turn_chat(config: MultiTurnChatConfig) -> Iterator[TraceRequest]:
    """Yield the multi-turn chat workload of ``config`` (see :class:`MultiTurnChatConfig`)."""
    src = _Source(config)
    system = src.tokens(config.system_prompt_tokens)
    contexts = [system] * config.num_users
    for index in range(config.num_requests):
        user = src.rng.randrange(config.num_users)
        prompt = contexts[user] + src.tokens(config.user_message_tokens.draw(src.rng))
        reply = config.reply_tokens.draw(src.rng)
        yield _request(index, src.next_timestamp(), prompt, reply)
        context = prompt + src.tokens(reply)
        fits = len(context) + config.user_message_tokens.high <= config.max_context_tokens
        contexts[user] = context if fits else system


def shared_system_prompt(config: SharedSystemPromptConfig) -> Iterator[TraceRequest]:
    """Yield the shared-system-prompt workload of ``config``."""
    src = _Source(config)
    prompts = [
        src.tokens(config.system_prompt_tokens.draw(src.rng)) for _ in range(config.num_prompts)
    ]
    for index in range(config.num_requests):
        system = prompts[src.rng.randrange(config.num_prompts)]
        prompt = system + src.tokens(config.question_tokens.draw(src.rng))
        output = config.output_tokens.draw(src.rng)
        yield _request(index, src.next_timestamp(), prompt, output)


def agent_loop(config: AgentLoopConfig) -> Iterator[TraceRequest]:
    """Yield the agent-loop workload of ``config`` (see :class:`AgentLoopConfig`)."""
    src = _Source(config)
    tool_spec = src.tokens(config.tool_spec_tokens)

    def new_task() -> tuple[int, ...]:
        return tool_spec + src.tokens(config.task_tokens.draw(src.rng))

    contexts = [new_task() for _ in range(config.num_agents)]
    for index in range(config.num_requests):
        agent = src.rng.randrange(config.num_agents)
        prompt = contexts[agent]
        action = config.action_tokens.draw(src.rng)
        yield _request(index, src.next_timestamp(), prompt, action)
        context = prompt + src.tokens(action) + src.tokens(config.tool_output_tokens.draw(src.rng))
        contexts[agent] = context if len(context) <= config.max_context_tokens else new_task()


def default_config(kind: WorkloadKind) -> SyntheticConfig:
    """Return the default config of ``kind``."""
    if kind is WorkloadKind.MULTI_TURN_CHAT:
        return MultiTurnChatConfig()
    if kind is WorkloadKind.SHARED_SYSTEM_PROMPT:
        return SharedSystemPromptConfig()
    return AgentLoopConfig()


def synthetic_workload(config: SyntheticConfig) -> Iterator[TraceRequest]:
    """Yield the requests of the workload ``config`` describes (dispatch on its type)."""
    if isinstance(config, MultiTurnChatConfig):
        return multi_turn_chat(config)
    if isinstance(config, SharedSystemPromptConfig):
        return shared_system_prompt(config)
    return agent_loop(config)
