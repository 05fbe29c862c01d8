"""Configuration of a cache, and the factory that builds pools and a cache from it."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from urc.errors import ConfigError
from urc.eviction_policy import EvictionPolicy, NextUseOracle, make_strategy, policy_parameters
from urc.fastpath import WalkImpl
from urc.node import ComponentType
from urc.pools.allocator import TokenSlotAllocator, check_page_size
from urc.pools.cache_pools import CachePools
from urc.pools.indices import INDEX_DEVICE
from urc.pools.kv_pool import KVPool, KVShape
from urc.pools.req_to_token import ReqToTokenPool
from urc.specs import ComponentSpec, MambaSpec, PoolContext, SlidingWindowSpec

__all__ = ["CacheConfig", "build_pools"]


S = TypeVar("S")
C = TypeVar("C")

_SWA, _MAMBA = ComponentType.SWA, ComponentType.MAMBA
# The flat spelling of earlier versions (deprecated): each keyword and where its value now
# lives, in an auxiliary component's spec or in a policy's parameters.  Only this
# compatibility layer reads these tables; a new component kind has no flat spelling.
_SPEC_FIELDS: dict[str, tuple[ComponentType, str]] = {
    "sliding_window_size": (_SWA, "window"),
    "swa_kv_size": (_SWA, "kv_size"),
    "mamba_size": (_MAMBA, "size"),
    "mamba_chunk_size": (_MAMBA, "chunk_size"),
    "mamba_conv_shape": (_MAMBA, "conv_shape"),
    "mamba_ssm_shape": (_MAMBA, "ssm_shape"),
}
_SPEC_CLASSES: dict[ComponentType, type[SlidingWindowSpec] | type[MambaSpec]] = {
    _SWA: SlidingWindowSpec,
    _MAMBA: MambaSpec,
}
_POLICY_FIELDS: dict[str, tuple[EvictionPolicy, str]] = {
    "slru_protected_threshold": (EvictionPolicy.SLRU, "protected_threshold"),
    "tlru_threshold": (EvictionPolicy.TLRU, "threshold"),
    "tlru_next_prompt_estimate": (EvictionPolicy.TLRU, "next_prompt_estimate"),
    "session_window_s": (EvictionPolicy.SESSION_AWARE, "window_s"),
    "session_hot_gap_s": (EvictionPolicy.SESSION_AWARE, "hot_gap_s"),
    "session_quantum_s": (EvictionPolicy.SESSION_AWARE, "quantum_s"),
    "return_quantile": (EvictionPolicy.RETURN_TIME, "quantile"),
    "return_horizon_s": (EvictionPolicy.RETURN_TIME, "horizon_s"),
    "return_quantum_s": (EvictionPolicy.RETURN_TIME, "quantum_s"),
}


def _where(name: str) -> str:
    if name in _SPEC_FIELDS:
        ct, attr = _SPEC_FIELDS[name]
        return f"{_SPEC_CLASSES[ct].__name__}.{attr} (in components)"
    policy, param = _POLICY_FIELDS[name]
    return f"eviction_params[{param!r}] (policy {policy.value})"


class _MovedField:
    """A flat ``CacheConfig`` field of earlier versions, read-only and deprecated: derived
    on each read from where its value now lives (a spec, or the policy's parameters)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, config: CacheConfig | None, owner: type | None = None) -> Any:
        if config is None:
            return self
        warnings.warn(
            f"CacheConfig.{self.name} is deprecated: read {_where(self.name)}",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.name in _SPEC_FIELDS:
            ct, attr = _SPEC_FIELDS[self.name]
            for spec in config.specs:
                if spec.component_type is ct:
                    return getattr(spec, attr)
            return _absent(ct, attr)
        policy, param = _POLICY_FIELDS[self.name]
        default = policy_parameters(policy)[param]
        if config.eviction_policy is not policy:
            return default
        return config.eviction_params.get(param, default)


def _absent(ct: ComponentType, attr: str) -> Any:
    """What a flat field read when its component was absent: the spec's default, or the
    earlier default of a required field (no window, no Mamba states)."""
    f = {f.name: f for f in dataclasses.fields(_SPEC_CLASSES[ct])}[attr]
    if f.default is not dataclasses.MISSING:
        return f.default
    return 0 if attr == "size" else None


def _fold_flat_fields(kwargs: dict[str, Any]) -> None:
    """Turn the deprecated flat keywords in ``kwargs`` into specs and policy parameters
    (mutates ``kwargs``): a bare SWA or MAMBA type in ``components`` becomes its spec from
    them; a flat field of an absent component or of another policy is ignored, as before."""
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in _SPEC_FIELDS or k in _POLICY_FIELDS}
    if not flat:
        return
    warnings.warn(
        "CacheConfig: the flat fields "
        + ", ".join(f"{k} (now {_where(k)})" for k in sorted(flat))
        + " are deprecated: give the component's spec and the policy's eviction_params",
        DeprecationWarning,
        stacklevel=3,
    )
    components = []
    for c in kwargs.get("components", (ComponentType.FULL,)):
        if c in _SPEC_CLASSES:
            given = {
                attr: flat[k] for k, (ct, attr) in _SPEC_FIELDS.items() if ct is c and k in flat
            }
            c = _SPEC_CLASSES[c](**given)
        components.append(c)
    kwargs["components"] = tuple(components)
    policy = kwargs.get("eviction_policy", EvictionPolicy.LRU)
    params = {
        param: flat[k] for k, (p, param) in _POLICY_FIELDS.items() if p is policy and k in flat
    }
    if params:
        kwargs["eviction_params"] = {**params, **kwargs.get("eviction_params", {})}


def _accepts_flat_fields(cls: type[C]) -> type[C]:
    """Wrap ``cls.__init__`` so that the deprecated flat keywords still construct the same
    config (with a ``DeprecationWarning``): :func:`_fold_flat_fields`."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _fold_flat_fields(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_accepts_flat_fields
@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything needed to build pools and a cache.

    ``components`` names FULL first, then each auxiliary component as its spec, in FULL,
    SWA, MAMBA order: ``(FULL, SlidingWindowSpec(window=4096), MambaSpec(size=64))``.  The
    specs are kept as given (:attr:`specs`); each component reads its own (:meth:`spec`),
    and each spec checks itself here and builds its own pools (:func:`build_pools`).
    ``eviction_policy`` is kept with its parameters as given, ``eviction_params``: keyword
    arguments of the policy's strategy (SGLang's ``--radix-eviction-policy-config``, e.g.
    ``{"protected_threshold": 3}`` for SLRU; ``urc.eviction_policy.policy_parameters``
    lists each policy's, with defaults).  Sizes are in tokens (``kv_size``).
    ``strip_thinking_cache``: ``cache_finished_req`` of a request with ``reasoning_tokens``
    caches only the prompt (the thinking and the answer after it are not reused verbatim).

    Raises :class:`~urc.errors.ConfigError` on construction for anything unusable (a bare
    SWA or MAMBA type without its spec, a bad spec, a parameter the policy does not take or
    a value its strategy refuses); nothing is built from a config that did not construct.
    """

    components: tuple[ComponentType | ComponentSpec, ...] = (ComponentType.FULL,)
    page_size: int = 1
    kv_size: int = 1 << 16
    max_num_reqs: int = 256
    max_context_len: int = 1 << 16
    kv_shape: KVShape = field(default_factory=KVShape)
    device: str = "cpu"  # the pools' data (KV, states); index tensors stay on the host
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    # The policy's parameters as given (its strategy's keyword arguments; a copy is kept,
    # so a caller's later change to its mapping does not reach the config).
    eviction_params: Mapping[str, Any] = field(default_factory=dict, hash=False)
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

    # The flat fields of earlier versions, read-only and deprecated (derived from the specs
    # and the policy's parameters); as keywords they still construct, with a warning.
    sliding_window_size = _MovedField()
    swa_kv_size = _MovedField()
    mamba_size = _MovedField()
    mamba_chunk_size = _MovedField()
    mamba_conv_shape = _MovedField()
    mamba_ssm_shape = _MovedField()
    slru_protected_threshold = _MovedField()
    tlru_threshold = _MovedField()
    tlru_next_prompt_estimate = _MovedField()
    session_window_s = _MovedField()
    session_hot_gap_s = _MovedField()
    session_quantum_s = _MovedField()
    return_quantile = _MovedField()
    return_horizon_s = _MovedField()
    return_quantum_s = _MovedField()

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        self._check_components()
        for name in ("kv_size", "max_num_reqs", "max_context_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_size % self.page_size:
            raise ConfigError(f"kv_size {self.kv_size} is not a multiple of {self.page_size}")
        if not isinstance(self.eviction_params, Mapping):
            raise ConfigError(f"eviction_params must be a mapping: {self.eviction_params!r}")
        # Frozen: a copy of the caller's mapping, set once here (object.__setattr__).
        object.__setattr__(self, "eviction_params", dict(self.eviction_params))
        # The strategy checks its parameters (the cache builds its own from the same).
        make_strategy(self.eviction_policy, self.next_use, self.eviction_params)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None

    def _check_components(self) -> None:
        """Raise :class:`ConfigError` unless ``components`` is FULL, then valid specs of
        distinct kinds in component order."""
        given: Any = self.components
        if isinstance(given, list):  # kept as a tuple: the config is hashable
            object.__setattr__(self, "components", tuple(given))
        if not isinstance(self.components, tuple) or not self.components:
            raise ConfigError(f"components must be a non-empty tuple: {self.components!r}")
        first, *rest = self.components
        if first is not ComponentType.FULL:
            raise ConfigError(f"components must start with FULL, got {self.components}")
        for c in rest:
            if isinstance(c, ComponentType):
                raise ConfigError(
                    f"{c.name} is given as a bare type: give its spec (urc.specs, e.g. "
                    "SlidingWindowSpec(window=...) or MambaSpec(size=...))"
                )
            if not isinstance(c, ComponentSpec):
                raise ConfigError(f"not a component spec: {c!r}")
            c.validate()
        types = self.types
        if len(set(types)) != len(types):
            raise ConfigError(f"duplicate components in {types}")
        if list(types) != sorted(types):
            raise ConfigError(f"components must be in FULL, SWA, MAMBA order: {types}")

    @property
    def specs(self) -> tuple[ComponentSpec, ...]:
        """The auxiliary components' specs as given, in component order."""
        return self.components[1:]  # type: ignore[return-value]  # checked in __post_init__

    def spec(self, kind: type[S]) -> S:
        """The spec of class ``kind`` in this config (how a component reads its own).

        Raises :class:`ConfigError` when the config has none."""
        for s in self.components[1:]:
            if isinstance(s, kind):
                return s
        raise ConfigError(f"no {kind.__name__} in components {self.components}")

    @property
    def types(self) -> tuple[ComponentType, ...]:
        """The component types, FULL first."""
        return (ComponentType.FULL, *(s.component_type for s in self.specs))


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
