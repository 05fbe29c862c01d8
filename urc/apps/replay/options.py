"""The rules of a replay's options, importable without torch.

``urc replay`` parses and checks its flags with this module alone, so ``--help`` and every
usage error answer before torch, the cache or the service is imported;
:class:`~urc.apps.replay.ReplayConfig` runs the same checks (:func:`check_options`) on
construction, so the command line, tests and embedding programs share one set of rules.

:class:`OptionError` names the field it is about (``field``) and renders the other fields it
mentions either as field names (``str(exc)``, for Python callers) or as command-line flags
(:meth:`OptionError.render` with :func:`flag_name`, for ``urc replay``).

Capacities (:class:`Capacity`) are either a token count (prompt tokens, whatever the workload:
an agentic session replay, which caches one token per block, divides it by the block size) or
a fraction of the workload's *unique tokens*: the prompt tokens an unbounded prefix cache
would have had to compute, ``input tokens - ideal hit tokens`` at the replay's page size
(prefill-only, unbounded, :mod:`urc.apps.workloads.ideal`).  ``--device-tokens 0.25`` is a
device pool a quarter of that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from urc.errors import ConfigError

if TYPE_CHECKING:
    from urc.node import ComponentType

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_L3_BACKUP",
    "DEFAULT_SEED",
    "DEFAULT_SESSION_CONCURRENCY",
    "DEFAULT_SWEEP",
    "DEFAULT_WINDOW",
    "DEFAULT_WRITE_POLICY",
    "EVICTION_POLICY_VALUES",
    "L3_BACKUP_VALUES",
    "TRACE_BLOCK_SIZE",
    "WORKLOAD_VALUES",
    "WRITE_POLICY_VALUES",
    "Capacity",
    "ModelProfile",
    "OptionError",
    "check_options",
    "flag_name",
]

DEFAULT_CHUNK_SIZE = 8192
"""Prefill chunk of ``urc replay``: SGLang's default ``--chunked-prefill-size`` on large GPUs.

A chunk's ``cache_unfinished_req`` resumes the insert at the request's locked node and costs
O(chunk), so a request costs O(prompt) at any chunk size (``python -m
urc.apps.bench.chunk`` measures it)."""

# The values of enums whose modules import torch (urc.eviction_policy.EvictionPolicy,
# urc.host_protocol.WritePolicy, hicache.config.StorageBackupPolicy without OFF) or asyncio
# (urc.apps.workloads.WorkloadKind, and its DEFAULT_BLOCK_SIZE): the parser offers them without
# importing either; tests/replay/test_cli.py pins each to its source, so a new member fails
# the suite until it is listed here.
WORKLOAD_VALUES = ("multi-turn-chat", "shared-system-prompt", "agent-loop")
TRACE_BLOCK_SIZE = 512
EVICTION_POLICY_VALUES = (
    "lru",
    "lfu",
    "fifo",
    "priority",
    "mru",
    "filo",
    "slru",
    "tlru",
    "fork-aware",
    "session-aware",
    "return-time",
    "belady",
)
WRITE_POLICY_VALUES = ("write_through", "write_through_selective", "write_back")
L3_BACKUP_VALUES = ("write_through", "on_host_eviction")

# Defaults shared by ReplayConfig and ``urc replay`` (whose parser leaves these flags unset
# unless given, so that one given where it has no effect is refused).
DEFAULT_SEED = 0
DEFAULT_WINDOW = 4096
DEFAULT_SESSION_CONCURRENCY = 100.0
DEFAULT_WRITE_POLICY = "write_back"
DEFAULT_L3_BACKUP = "on_host_eviction"


def flag_name(field: str) -> str:
    """The ``urc replay`` flag that sets a :class:`~urc.apps.replay.ReplayConfig` field."""
    return "--" + field.replace("_", "-")


class OptionError(ConfigError):
    """A replay option holds a value it cannot take.

    ``field`` is the option at fault; ``problem`` says what is wrong and may mention other
    options as ``{name}`` placeholders, filled in by :meth:`render`.  ``str(exc)`` names them
    as config fields (``chunk_size: ...``)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(self.render(str))

    def render(self, name: Callable[[str], str]) -> str:
        """``"<field>: <problem>"`` with every option named by ``name`` (``flag_name``: as
        the command line spells it)."""
        return f"{name(self.field)}: {self.describe(name)}"

    def describe(self, name: Callable[[str], str]) -> str:
        """The problem alone, other options named by ``name``."""
        return self.problem.format_map(_Names(name))


class _Names(dict[str, str]):
    """``str.format_map`` mapping that names any option a problem mentions."""

    def __init__(self, name: Callable[[str], str]) -> None:
        super().__init__()
        self._name = name

    def __missing__(self, key: str) -> str:
        return self._name(key)


class ModelProfile(Enum):
    """The model whose cache is simulated: which components the tree carries."""

    FULL = "full"  # full attention only: Full KV per token
    SWA = "swa"  # hybrid sliding-window: Full KV + SWA KV (window ``ReplayConfig.window``)
    MAMBA = "mamba"  # hybrid Mamba: Full KV + one recurrent state per checkpoint

    @property
    def components(self) -> tuple[ComponentType, ...]:
        from urc.node import ComponentType  # torch: only when a cache is being built

        if self is ModelProfile.SWA:
            return (ComponentType.FULL, ComponentType.SWA)
        if self is ModelProfile.MAMBA:
            return (ComponentType.FULL, ComponentType.MAMBA)
        return (ComponentType.FULL,)


@dataclass(frozen=True, slots=True)
class Capacity:
    """A pool size: ``tokens`` (absolute) or ``fraction`` of the workload's unique tokens.

    ``Capacity.parse("65536")`` is 65536 tokens, ``Capacity.parse("0.25")`` a quarter of the
    unique tokens (any number written with a ``.`` or an exponent is a fraction; it may exceed
    1).  ``"0"`` is zero tokens (for the host tier: no host tier).
    """

    tokens: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.fraction is None):
            raise ConfigError("a capacity is either tokens or a fraction, not both or neither")
        if self.tokens is not None and self.tokens < 0:
            raise ConfigError(f"capacity must be >= 0 tokens, got {self.tokens}")
        if self.fraction is not None and not (math.isfinite(self.fraction) and self.fraction >= 0):
            raise ConfigError(f"capacity fraction must be finite and >= 0, got {self.fraction}")

    @classmethod
    def parse(cls, text: str) -> Capacity:
        """``"123"`` -> 123 tokens; ``"0.5"`` / ``"1e-1"`` -> a fraction.  Raises ConfigError."""
        s = text.strip().replace("_", "")
        try:
            if s.isdigit():
                return cls(tokens=int(s))
            return cls(fraction=float(s))
        except ValueError:
            raise ConfigError(
                f"capacity must be a token count (65536) or a fraction of the unique tokens "
                f"(0.25), got {text!r}"
            ) from None

    @property
    def is_zero(self) -> bool:
        return self.tokens == 0 or self.fraction == 0

    def resolve(self, unique_tokens: int, page_size: int, tokens_per_unit: int = 1) -> int:
        """The pool size in the cache's units, rounded up to whole pages (0 stays 0).

        ``tokens_per_unit``: prompt tokens per cache token (an agentic session replay caches
        one token per 64-token block): a token count is divided by it, rounded up, so a
        capacity means tokens whatever the workload; a fraction is of ``unique_tokens``,
        which is already in the cache's units."""
        if self.tokens is not None:
            n = -(-self.tokens // tokens_per_unit)
        else:
            assert self.fraction is not None
            n = math.ceil(self.fraction * unique_tokens)
        return -(-n // page_size) * page_size

    def __str__(self) -> str:
        return str(self.tokens) if self.tokens is not None else f"{self.fraction:g}"


DEFAULT_SWEEP: tuple[Capacity, ...] = tuple(
    Capacity(fraction=f) for f in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
)
"""Device capacities of a plain ``--sweep``, as fractions of the unique prompt tokens."""


def check_options(
    *,
    model: ModelProfile,
    num_requests: int | None,
    block_size: int,
    window: int,
    swa_tokens: Capacity | None,
    mamba_states: int | None,
    device_tokens: Capacity,
    host_tokens: Capacity,
    l3_dir: Path | None,
    page_size: int,
    chunk_size: int,
    concurrency: int,
    speed: float,
) -> None:
    """Raise :class:`OptionError` (the first problem found) unless the options fit together.

    Reads nothing but its arguments (no file system, no torch)."""
    if page_size <= 0 or page_size & (page_size - 1):
        raise OptionError("page_size", f"must be a power of two, got {page_size}")
    if num_requests is not None and num_requests < 1:
        raise OptionError("num_requests", f"must be > 0, got {num_requests}")
    for name, value in (("block_size", block_size), ("window", window)):
        if value <= 0:
            raise OptionError(name, f"must be > 0, got {value}")
    if mamba_states is not None:
        if model is not ModelProfile.MAMBA:
            raise OptionError("mamba_states", "has no effect without {model} mamba")
        if mamba_states <= 0:
            raise OptionError("mamba_states", f"must be > 0, got {mamba_states}")
    if chunk_size <= 0 or chunk_size % page_size:
        raise OptionError(
            "chunk_size",
            f"must be a positive multiple of {{page_size}} ({page_size}), got {chunk_size}",
        )
    if concurrency < 1:
        raise OptionError("concurrency", f"must be >= 1, got {concurrency}")
    if not (math.isfinite(speed) and speed >= 0):
        raise OptionError("speed", f"must be finite and >= 0, got {speed}")
    if device_tokens.is_zero:
        raise OptionError("device_tokens", "must be > 0 (the device pool holds every request)")
    if swa_tokens is not None:
        if model is not ModelProfile.SWA:
            raise OptionError("swa_tokens", "has no effect without {model} swa")
        if swa_tokens.is_zero:
            raise OptionError("swa_tokens", "must be > 0")
    if l3_dir is not None:
        if model is not ModelProfile.FULL:
            raise OptionError(
                "l3_dir", f"the L3 storage tier supports {{model}} full only, not {model.value}"
            )
        if host_tokens.is_zero:
            raise OptionError("l3_dir", "the L3 tier needs the host tier ({host_tokens} > 0)")
