"""Request workloads for replaying through the cache: Mooncake traces, synthetic generators,
and the ideal-hit-rate oracles that check a replay's result."""

from urc.apps.workloads.blocks import TOKEN_ID_LIMIT, VOCAB_SIZE, block_start_token, expand_hash_ids
from urc.apps.workloads.ideal import (
    BlockPrefixOracle,
    BlockRequest,
    IdealHitStats,
    TokenPrefixOracle,
    ideal_block_hits,
    ideal_token_hits,
)
from urc.apps.workloads.mooncake import (
    DEFAULT_BLOCK_SIZE,
    MooncakeRecord,
    TraceFormatError,
    TraceOrderError,
    aiter_mooncake_records,
    aiter_mooncake_trace,
    iter_mooncake_records,
    iter_mooncake_trace,
)
from urc.apps.workloads.request import TraceRequest
from urc.apps.workloads.synthetic import (
    AgentLoopConfig,
    IntRange,
    MultiTurnChatConfig,
    SharedSystemPromptConfig,
    SyntheticConfig,
    WorkloadKind,
    agent_loop,
    default_config,
    multi_turn_chat,
    shared_system_prompt,
    synthetic_workload,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "TOKEN_ID_LIMIT",
    "VOCAB_SIZE",
    "AgentLoopConfig",
    "BlockPrefixOracle",
    "BlockRequest",
    "IdealHitStats",
    "IntRange",
    "MooncakeRecord",
    "MultiTurnChatConfig",
    "SharedSystemPromptConfig",
    "SyntheticConfig",
    "TokenPrefixOracle",
    "TraceFormatError",
    "TraceOrderError",
    "TraceRequest",
    "WorkloadKind",
    "agent_loop",
    "aiter_mooncake_records",
    "aiter_mooncake_trace",
    "block_start_token",
    "default_config",
    "expand_hash_ids",
    "ideal_block_hits",
    "ideal_token_hits",
    "iter_mooncake_records",
    "iter_mooncake_trace",
    "multi_turn_chat",
    "shared_system_prompt",
    "synthetic_workload",
]
