"""SGLang 0.5.23's ``InsertParams`` / ``MatchPrefixParams`` / ``EvictParams`` as urc's,
field by field: every field is served (translated) or, when set away from its default,
refused with :class:`~urc.errors.UnsupportedParamError` naming it.  None is dropped
silently: a field this table does not know (a later SGLang) is refused too.

Served, and how:

- ``InsertParams``: ``key`` (its namespace and ``limit``), ``value``, ``mamba_value`` (the
  node adopts the slot; ``mamba_exist`` tells the caller it did not), ``prev_prefix_len``,
  ``component_evicted_seqlens`` (SWA: the request's freed SWA prefix becomes tombstones),
  ``inserted_len`` (only nodes past it count a hit), ``priority``, ``session_id`` (to an
  eviction policy that uses hints), ``swa_branching_seqlen`` (the result's
  ``swa_branch_inserted``).
- ``MatchPrefixParams``: ``key``, ``cow_mamba`` and ``req`` (copy-on-write into the
  request's own slot, through :class:`~urc.apps.sglang._req_view.SGLangRequest`).
- ``EvictParams``: ``num_tokens``, ``swa_num_tokens``, ``mamba_num``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from urc import params as urc_params
from urc.apps.sglang._keys import to_urc_key
from urc.apps.sglang._req_view import SGLangRequest
from urc.errors import UnsupportedParamError
from urc.node import ComponentType

__all__ = ["to_urc_evict", "to_urc_insert", "to_urc_match"]

_SERVED_INSERT = frozenset(
    {
        "key",
        "value",
        "mamba_value",
        "prev_prefix_len",
        "component_evicted_seqlens",
        "inserted_len",
        "priority",
        "session_id",
        "swa_branching_seqlen",
    }
)
_SERVED_MATCH = frozenset({"key", "cow_mamba", "req"})
_SERVED_EVICT = frozenset({"num_tokens", "swa_num_tokens", "mamba_num"})
# Why a field is refused when set (fields not listed here nor served: "unknown to urc").
_WHY = {
    "mamba_keep_idx": "a ping-pong slot of extra_buffer Mamba, which urc does not serve",
    "c128_value": "DeepSeek sparse-attention C128 sidecar pages are not a urc component",
    "track_adopted_ranges": "urc's insert reports no adopted ranges",
    "rotation_base": "logical-page KV sharding is not served (its tree core tracks bases)",
}


def _is_default(value: Any, f: dataclasses.Field[Any]) -> bool:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False  # a required field is always served
    if default is None:
        return value is None
    return type(value) is type(default) and bool(value == default)


def _refuse_unserved(params: Any, served: frozenset[str]) -> None:
    """Raise :class:`UnsupportedParamError` for the first field of ``params`` that is not
    served and not at its default."""
    cls = type(params).__name__
    for f in dataclasses.fields(params):
        if f.name in served or _is_default(getattr(params, f.name), f):
            continue
        raise UnsupportedParamError(
            f"{cls}.{f.name}", _WHY.get(f.name, "a field urc's plug-in does not know")
        )


def _evicted_seqlens(
    params: Any, components: tuple[ComponentType, ...]
) -> dict[ComponentType, int]:
    """urc's ``component_evicted_seqlens`` of SGLang's (same component values).  A kind
    this tree does not have is ignored, as SGLang's tree ignores it -- unless urc has no
    such kind at all and the length is set (refused)."""
    out: dict[ComponentType, int] = {}
    for ct, n in params.component_evicted_seqlens.items():
        try:
            ours = ComponentType(int(ct))
        except ValueError:
            if n:
                raise UnsupportedParamError(
                    f"InsertParams.component_evicted_seqlens[{ct}]", "not a urc component kind"
                ) from None
            continue
        if ours in components:
            out[ours] = int(n)
    return out


def to_urc_insert(
    params: Any, components: tuple[ComponentType, ...], is_eagle: bool
) -> urc_params.InsertParams:
    """urc's insert params for SGLang's ``params`` (see the module docstring)."""
    _refuse_unserved(params, _SERVED_INSERT)
    key = to_urc_key(params.key)
    if is_eagle:
        key = key.bigram()
    mamba_value = params.mamba_value
    if mamba_value is not None and ComponentType.MAMBA in components:
        mamba_value = mamba_value.reshape(-1).to(torch.int64)
    else:
        mamba_value = None  # no Mamba in this tree: SGLang's tree has no one to read it
    return urc_params.InsertParams(
        key=key,
        value=params.value,
        mamba_value=mamba_value,
        prev_prefix_len=params.prev_prefix_len,
        priority=params.priority,
        component_evicted_seqlens=_evicted_seqlens(params, components),
        session_id=params.session_id,
        inserted_len=params.inserted_len,
    )


def to_urc_match(
    params: Any, is_eagle: bool, device: torch.device | str
) -> urc_params.MatchPrefixParams:
    """urc's match params for SGLang's ``params`` (``with_indices=False``: SGLang reads
    the hit's indices later, through ``prefix_device_indices``)."""
    _refuse_unserved(params, _SERVED_MATCH)
    key = to_urc_key(params.key)
    if is_eagle:
        key = key.bigram()
    req = params.req
    return urc_params.MatchPrefixParams(
        key=key,
        cow_mamba=bool(params.cow_mamba),
        req=None if req is None else SGLangRequest(req, device),
        with_indices=False,
    )


def to_urc_evict(params: Any) -> urc_params.EvictParams:
    """urc's eviction request for SGLang's ``params``."""
    _refuse_unserved(params, _SERVED_EVICT)
    return urc_params.EvictParams(
        num_tokens=params.num_tokens,
        swa_num_tokens=params.swa_num_tokens,
        mamba_num=params.mamba_num,
    )
