"""Configuration of a cache, and the factory that builds pools and a cache from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from urc.errors import ConfigError
from urc.eviction_policy import EvictionPolicy, NextUseOracle
from urc.fastpath import WalkImpl
from urc.node import ComponentType
from urc.pools.allocator import TokenSlotAllocator, check_page_size
from urc.pools.cache_pools import CachePools
from urc.pools.indices import INDEX_DEVICE
from urc.pools.kv_pool import KVPool, KVShape
from urc.pools.req_to_token import ReqToTokenPool
from urc.specs import SPEC_TYPES, ComponentSpec, PoolContext

__all__ = ["CacheConfig", "build_pools"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything needed to build pools and a cache.

    ``components`` names FULL first, then each auxiliary component as its spec
    (:class:`~urc.specs.SlidingWindowSpec`, :class:`~urc.specs.MambaSpec`) or as its bare
    type with the spec's flat fields set (``sliding_window_size``, ``mamba_size``, ...); the
    two spellings build equal configs: after construction ``components`` holds the types
    and the flat fields hold every spec's values (:attr:`specs` gives the specs back).
    Sizes are in tokens (``kv_size``, ``swa_kv_size``) or state slots (``mamba_size``).
    ``sliding_window_size`` is required with SWA; ``mamba_chunk_size`` is the granularity at
    which Mamba state checkpoints are taken (``mamba_branching_seqlen`` is aligned to it).
    ``strip_thinking_cache``: ``cache_finished_req`` of a request with ``reasoning_tokens``
    caches only the prompt (the thinking and the answer after it are not reused verbatim).
    """

    components: tuple[ComponentType | ComponentSpec, ...] = (ComponentType.FULL,)
    page_size: int = 1
    kv_size: int = 1 << 16
    swa_kv_size: int | None = None
    sliding_window_size: int | None = None
    mamba_size: int = 0
    mamba_chunk_size: int = 64
    mamba_conv_shape: tuple[int, ...] = (4, 8)
    mamba_ssm_shape: tuple[int, ...] = (2, 8, 8)
    max_num_reqs: int = 256
    max_context_len: int = 1 << 16
    kv_shape: KVShape = field(default_factory=KVShape)
    device: str = "cpu"  # the pools' data (KV, states); index tensors stay on the host
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    # SLRU: a leaf with at least this many hits is in the protected segment (SGLang's
    # ``protected_threshold``).  TLRU: a conversation keeps ``tlru_threshold`` tokens fewer
    # than its history plus ``tlru_next_prompt_estimate`` (SGLang's ``threshold`` and
    # ``next_prompt_estimate``, in tokens); see ``urc.eviction_policy.TlruStrategy``.
    slru_protected_threshold: int = 2
    tlru_threshold: int = 0
    tlru_next_prompt_estimate: int = 0
    # SESSION_AWARE: how long a session that called a tool is kept ahead of cold ones, and
    # the expected gap (seconds) up to which a hinted session counts as hot; see
    # ``urc.session_eviction.SessionAwareStrategy``.
    session_window_s: float = 600.0
    session_hot_gap_s: float = 60.0
    session_quantum_s: float = 20.0
    # RETURN_TIME: the quantile of the learned reuse gap taken as a path's predicted return,
    # the horizon past which a gap counts as never, and the resolution of predicted returns
    # (seconds); see ``urc.return_time_eviction.ReturnTimeStrategy``.
    return_quantile: float = 0.6
    return_horizon_s: float = 1024.0
    return_quantum_s: float = 5.0
    is_eagle: bool = False
    # Reasoning models: a finished request that produced thinking tokens caches its prompt
    # only (SGLang's ``strip_thinking_cache``); its output KV is freed.
    strip_thinking_cache: bool = False
    # The tree walk of match and insert and a match's tail: the compiled ones when built
    # (AUTO), or the pure-Python twins; both give identical results (see ``urc.fastpath``).
    walk_impl: WalkImpl = WalkImpl.AUTO
    # Eviction takes only the tail pages of a victim leaf that the request still needs
    # (the leaf is split), so an eviction never frees more than a page beyond what it was
    # asked for.  Off: whole leaves, as SGLang does.
    partial_leaf_eviction: bool = False
    # The future, for ``EvictionPolicy.BELADY`` only (an ``urc.eviction_policy.NextUseOracle``
    # such as ``urc replay`` builds from a whole trace).
    next_use: NextUseOracle | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Specs given in ``components`` set their flat fields (frozen: object.__setattr__).
        types: list[ComponentType] = []
        for c in self.components:
            if isinstance(c, ComponentType):
                types.append(c)
                continue
            types.append(c.component_type)
            for attr, flat in c.FIELDS.items():
                object.__setattr__(self, flat, getattr(c, attr))
        object.__setattr__(self, "components", tuple(types))
        check_page_size(self.page_size)
        if not types or types[0] is not ComponentType.FULL:
            raise ConfigError(f"components must start with FULL, got {types}")
        if len(set(types)) != len(types):
            raise ConfigError(f"duplicate components in {types}")
        if types != sorted(types):
            raise ConfigError(f"components must be in FULL, SWA, MAMBA order: {types}")
        for name in ("tlru_threshold", "tlru_next_prompt_estimate", "slru_protected_threshold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("kv_size", "max_num_reqs", "max_context_len", "mamba_chunk_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_size % self.page_size:
            raise ConfigError(f"kv_size {self.kv_size} is not a multiple of {self.page_size}")
        for spec in self.specs:
            spec.validate()
        if (self.eviction_policy is EvictionPolicy.BELADY) != (self.next_use is not None):
            raise ConfigError("next_use is required by, and only by, the belady policy")
        if self.mamba_size < 0:
            raise ConfigError(f"mamba_size must not be negative, got {self.mamba_size}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None

    @property
    def specs(self) -> tuple[ComponentSpec, ...]:
        """One spec per auxiliary component, in component order."""
        return tuple(
            cls(**{attr: getattr(self, flat) for attr, flat in cls.FIELDS.items()})
            for cls in (SPEC_TYPES[ct] for ct in self.types[1:])
        )

    @property
    def types(self) -> tuple[ComponentType, ...]:
        """The component types, FULL first (``components`` after construction)."""
        return self.components  # type: ignore[return-value]  # normalized in __post_init__


def build_pools(config: CacheConfig) -> CachePools:
    """Allocate the pools ``config`` describes: data tensors on ``config.device``, index
    bookkeeping (allocators, request rows) on the host (:mod:`urc.pools.indices`).

    Raises :class:`ConfigError` when this torch cannot use ``config.device`` (``"cuda"`` on
    a CPU-only build, a GPU index that does not exist)."""
    device = torch.device(config.device)
    try:
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as exc:  # torch's own "not compiled with CUDA"
        raise ConfigError(f"device {config.device!r} is not usable here: {exc}") from None
    pools = CachePools(
        token_allocator=TokenSlotAllocator(config.kv_size, config.page_size, INDEX_DEVICE),
        req_to_token_pool=ReqToTokenPool(config.max_num_reqs, config.max_context_len, INDEX_DEVICE),
        kv_pool=KVPool(config.kv_size, config.kv_shape, device),
    )
    ctx = PoolContext(config.kv_size, config.page_size, device, config.kv_shape)
    for spec in config.specs:
        spec.build_pools(pools, ctx)
    return pools
