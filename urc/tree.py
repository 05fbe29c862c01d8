"""``Tree``: the logical radix tree's structure — root, clock, node count, child keys and
namespaces, the walk, split, link and unlink.

The cache, eviction, request caching, the HiCache protocol, the checks and the components use
the tree through these methods; only this module (with :func:`urc.fastpath.page_key` and
its compiled twin) knows how child keys are spelled.  A child key is the child's first token
(page size 1) or first page: its bytes (packed keys) or a tuple of pairs (EAGLE); children of
the root
in a namespace (``RadixKey.extra_key``) are keyed ``(NAMESPACE, extra_key, first page)``, so
namespaces are disjoint subtrees.  Node classes live in :mod:`urc.node` (re-exported here).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from urc.fastpath import MatchTailFn, WalkFn, common_len, page_key, py_match_tail, py_walk
from urc.gc_keys import untrack_key
from urc.key import RadixKey, TokenIds
from urc.node import ComponentData, ComponentType, TreeNode

__all__ = ["SplitHook", "Tree"]

# The sentinel that starts namespaced child keys: never equal to a token or a page.
_NAMESPACE = object()

# ``hook(upper, lower)``: a split just cut ``lower``'s key; components move their data.
SplitHook = Callable[[TreeNode, TreeNode], None]


class Tree:
    """Root, logical clock and node structure of one cache.

    ``clock`` only grows: each :meth:`touch` (and each node creation) takes the next tick,
    so access times are unique and a parent stamped before its child is older.
    ``new_data`` makes a node's per-component data; ``split_hooks`` run on every split;
    ``walk`` is the descent, ``match_tail`` a match's stamps once walked (see
    :mod:`urc.fastpath`).
    Mutating methods say so; none touches pool tensors.
    """

    __slots__ = (
        "clock",
        "device",
        "is_eagle",
        "match_tail",
        "new_data",
        "num_nodes",
        "page_size",
        "root",
        "split_hooks",
        "walk",
    )

    def __init__(
        self,
        page_size: int,
        is_eagle: bool,
        device: torch.device,
        walk: WalkFn = py_walk,
        match_tail: MatchTailFn = py_match_tail,
    ) -> None:
        self.page_size = page_size
        self.is_eagle = is_eagle
        self.device = device
        # ``walk(node, ck, tokens, pos, page_size)``: the read-only descent of match and
        # insert (:func:`urc.fastpath.py_walk` or its compiled twin); splits are the caller's.
        self.walk = walk
        # ``match_tail(path, rules, clock, with_values)``: a device-only match's hit, stamps
        # and values (:func:`urc.fastpath.py_match_tail` or its compiled twin).
        self.match_tail = match_tail
        self.clock = 0
        self.num_nodes = 0

    def bind(
        self,
        new_data: Callable[[], tuple[ComponentData | None, ...]],
        split_hooks: Sequence[SplitHook] = (),
    ) -> None:
        """Complete the tree once its components exist (they are built with the tree):
        ``new_data`` makes a node's per-component data, ``split_hooks`` run on every split.
        Creates the root; nothing else may be called before."""
        self.new_data = new_data
        self.split_hooks = tuple(split_hooks)
        self.root = self.new_root()

    # ------------------------------------------------------------------ clock
    def tick(self) -> int:
        """The next clock value (mutates the clock)."""
        self.clock += 1
        return self.clock

    def touch(self, node: TreeNode) -> None:
        """Stamp ``node`` with a fresh tick (it was just used)."""
        self.clock += 1
        node.last_access_time = self.clock

    def stamp_path(self, path: Sequence[TreeNode]) -> None:
        """Stamp ``path`` root first (parent < child), one tick each."""
        clock = self.clock
        for node in path:
            clock += 1
            node.last_access_time = clock
        self.clock = clock

    # ------------------------------------------------------------------ keys
    def tokens_of(self, key: RadixKey) -> TokenIds:
        """The tree view of ``key``: bigrams in EAGLE mode, truncated to whole pages."""
        if self.is_eagle and not key.is_bigram:
            key = key.bigram()
        tokens = key.token_ids
        n = len(tokens)
        return tokens if n % self.page_size == 0 else tokens[: n - n % self.page_size]

    def page_key(self, tokens: TokenIds, pos: int) -> Any:
        """The child key of a node whose key starts at ``tokens[pos]`` (below the root's
        namespaced level)."""
        return page_key(tokens, pos, self.page_size)

    def root_child_key(self, tokens: TokenIds, namespace: Any) -> Any:
        """The key under which the root holds the child starting ``tokens`` in
        ``namespace``."""
        k = self.page_key(tokens, 0)
        return k if namespace is None else (_NAMESPACE, namespace, k)

    def child_key(self, parent: TreeNode, tokens: TokenIds, pos: int, namespace: Any) -> Any:
        """The key under which ``parent`` holds a child starting ``tokens[pos]``."""
        if parent.parent is None:
            return self.root_child_key(tokens[pos:] if pos else tokens, namespace)
        return self.page_key(tokens, pos)

    def child_key_of(self, node: TreeNode) -> Any:
        """The key ``node`` belongs under in its parent's children (recomputed)."""
        k = self.page_key(node.key, 0)
        parent = node.parent
        if parent is not None and parent.parent is None and node.namespace is not None:
            return (_NAMESPACE, node.namespace, k)
        return k

    def match_len(self, edge: TokenIds, tokens: TokenIds, pos: int) -> int:
        """Page-aligned length of the common prefix of ``edge`` and ``tokens[pos:]``."""
        m = common_len(edge, tokens, pos)
        return m - m % self.page_size

    # ------------------------------------------------------------------ walk
    def path_to(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ structure
    def new_root(self) -> TreeNode:
        """A fresh root (locked by every component, an empty Full value); the caller
        installs it as :attr:`root` (``reset``)."""
        root = TreeNode(array("q"), None, self.new_data(), None, 0)
        for cd in root.data:
            if cd is not None:
                cd.lock_ref = 1
        full = root.data[ComponentType.FULL]
        assert full is not None
        full.value = torch.empty(0, dtype=torch.int64, device=self.device)
        return root

    def new_node(self, parent: TreeNode, key: TokenIds, namespace: Any) -> TreeNode:
        """A stamped node below ``parent`` with empty data, not linked yet (see
        :meth:`link`)."""
        self.clock += 1
        if type(key) is memoryview:  # a view of the caller's buffer: the node owns a copy
            key = array("q", key.tobytes())
        untrack_key(key)  # the tree never mutates it (urc.gc_keys)
        return TreeNode(key, parent, self.new_data(), namespace, self.clock)

    def link(self, parent: TreeNode, node: TreeNode) -> None:
        """Hang the new ``node`` (whose ``parent`` is already ``parent``) under ``parent``,
        remembering its child key so unlinking needs no key arithmetic (mutates)."""
        ck = node.child_key = self.child_key_of(node)
        parent.children[ck] = node
        self.num_nodes += 1

    def unlink(self, node: TreeNode) -> None:
        """Remove the childless ``node`` from the tree and mark it deleted (mutates)."""
        assert not node.children, f"deleting node {node.id} with {len(node.children)} children"
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key]
        node.deleted = True
        self.num_nodes -= 1

    def split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after ``k`` tokens; returns the new upper node (``child`` keeps
        the rest).  Both halves are stamped, upper first (SGLang's order: the untouched tail
        below a split point counts as just used); the split hooks move component data."""
        parent = child.parent
        assert parent is not None
        upper = self.new_node(parent, child.key[:k], child.namespace)
        upper.creation_time = child.creation_time
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.child_key = child.child_key
        parent.children[child.child_key] = upper
        child.key = tail = child.key[k:]
        untrack_key(tail)
        child.key_len -= k
        child.parent = upper
        ck = child.child_key = self.page_key(child.key, 0)
        upper.children[ck] = child
        if child.hash_value is not None:
            pages = k // self.page_size
            upper.hash_value = child.hash_value[:pages]
            child.hash_value = child.hash_value[pages:]
        for hook in self.split_hooks:
            hook(upper, child)
        self.touch(child)
        self.num_nodes += 1
        return upper

    def reset(self) -> None:
        """Start empty: a new root, no nodes (the caller freed what the old nodes held)."""
        self.num_nodes = 0
        self.root = self.new_root()
