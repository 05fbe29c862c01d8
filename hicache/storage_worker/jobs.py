"""The storage worker's write jobs: which pages of a path to put, and where their bytes are."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.storage_worker.layout import PageLayouts
from urc.node import ComponentType, TreeNode

__all__ = ["AuxPages", "WriteJob", "aux_pages_of", "path_of", "path_tokens"]


@dataclass(slots=True, eq=False)
class AuxPages:
    """An auxiliary component's pages of a write job.  ``pages`` are page numbers along the
    path (per-token data: the page's own tokens; a state: the page its position ends); their
    host units (``page_size`` per page for per-token data, one per state) are in ``host``
    (pinned by the job) or already staged as ``rows``."""

    ct: ComponentType
    pages: list[int]
    host: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class WriteJob:
    """Full pages ``[first_page, ...)`` of ``tokens`` to put: read from ``host`` (pinned by
    ``pins``) or already staged in ``rows``; ``aux``: other components' pages of the path."""

    tokens: Sequence[int]
    namespace: Any
    first_page: int
    host: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    pins: list[tuple[TreeNode, int]] = field(default_factory=list)
    aux: list[AuxPages] = field(default_factory=list)
    nbytes: int = 0  # staged bytes (on host eviction)
    attempts: int = 0  # failed writes so far (staged jobs)


def path_of(node: TreeNode) -> list[TreeNode]:
    """The nodes from the root's child down to ``node``."""
    nodes: list[TreeNode] = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def path_tokens(path: Sequence[TreeNode]) -> array[int]:
    """The tokens of ``path``'s keys, one packed ``array('q')`` (a memcpy per node: it runs
    in the actor, where a list of the ids would cost a Python object per token)."""
    tokens = array("q")
    for node in path:
        tokens.extend(node.key)
    return tokens


def aux_pages_of(layouts: PageLayouts, nodes: Sequence[TreeNode], pos: int) -> list[AuxPages]:
    """The auxiliary host copies of ``nodes`` (consecutive, the first at key position
    ``pos``) as write-job pages."""
    ps = layouts.page_size
    out: list[AuxPages] = []
    for ct in layouts.aux:
        per_token = layouts.per_token[ct]
        pages: list[int] = []
        hosts: list[torch.Tensor] = []
        p = pos
        for n in nodes:
            e = p + n.key_len
            cd = n.data[ct]
            assert cd is not None
            if cd.host_value is not None:
                if per_token:
                    pages.extend(range(p // ps, e // ps))
                else:
                    pages.append(e // ps - 1)
                hosts.append(cd.host_value)
            p = e
        if pages:
            out.append(AuxPages(ct, pages, host=torch.cat(hosts)))
    return out
