"""``urc.apps.replay.belady``: the workload's future, and ``urc replay --eviction-policy
belady``."""

from __future__ import annotations

import anyio
import pytest

from urc import EvictionPolicy, TreeNode
from urc.apps.replay import Capacity, ReplayConfig, run_replay
from urc.apps.replay.belady import NEVER, NextUseTable
from urc.apps.workloads import WorkloadKind

PAGE = 4


def _node(table_tokens: list[int], start: int, end: int) -> TreeNode:
    """A node holding ``tokens[start:end]`` below a chain of one node per page above it."""
    parent = TreeNode([], None, (None, None, None), None, 0)  # the root
    for p in range(0, start, PAGE):
        child = TreeNode(table_tokens[p : p + PAGE], parent, (None, None, None), None, 0)
        parent = child
    return TreeNode(table_tokens[start:end], parent, (None, None, None), None, 0)


def test_next_use_is_the_first_later_request_containing_the_first_page() -> None:
    shared = list(range(8))
    table = NextUseTable(PAGE)
    table.add(0, [*shared, 100, 101, 102, 103])
    table.add(1, [50, 51, 52, 53])
    table.add(2, [*shared, 200, 201, 202, 203])
    table.add(3, [*shared, 100, 101, 102, 103, 7])
    tail = _node([*shared, 100, 101, 102, 103], 8, 12)
    head = _node(shared, 4, 8)
    table.advance(0)
    assert table.next_use(tail) == 3  # request 2 branches before it
    assert table.next_use(head) == 2
    table.advance(3)
    assert table.next_use(tail) == NEVER and table.next_use(head) == NEVER


def test_namespaces_are_separate_futures() -> None:
    table = NextUseTable(PAGE)
    table.add(0, [1, 2, 3, 4], ("tenant-a",))
    root = TreeNode([], None, (None, None, None), None, 0)
    node = TreeNode([1, 2, 3, 4], root, (None, None, None), ("tenant-b",), 0)
    assert table.next_use(node) == NEVER
    node.namespace = ("tenant-a",)
    table.advance(-1)
    assert table.next_use(node) == 0


@pytest.mark.parametrize("kind", list(WorkloadKind))
@pytest.mark.asyncio
async def test_belady_hits_at_least_as_much_as_lru_and_at_most_the_ideal(
    kind: WorkloadKind,
) -> None:
    rates = {}
    for policy in (EvictionPolicy.LRU, EvictionPolicy.BELADY):
        config = ReplayConfig(
            workload=kind,
            num_requests=400,
            prefill_only=True,
            eviction_policy=policy,
            device_tokens=Capacity(fraction=0.1),
            host_tokens=Capacity(tokens=0),
        )
        with anyio.fail_after(60):
            report = await run_replay(config)
        assert report.check_ok, report.check_error
        rates[policy] = report.hit_rate
    assert rates[EvictionPolicy.LRU] <= rates[EvictionPolicy.BELADY] <= report.ideal_hit_rate
