"""``LinkedLRUList``: the SWA LRU's order rules, against a plain Python list as the model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from urc.components.swa_data import SWAData
from urc.lru import LinkedLRUList
from urc.node import TreeNode


def _nodes(n: int) -> list[tuple[TreeNode, SWAData]]:
    """``n`` bare nodes, each with an unlinked SWA data (the list's links)."""
    out = []
    for i in range(n):
        link = SWAData()
        out.append((TreeNode([i], None, (None, link, None), None, i), link))
    return out


def test_push_move_insert_before_and_remove_keep_the_documented_order() -> None:
    (a, la), (b, lb), (c, lc), (d, ld) = _nodes(4)
    lru = LinkedLRUList()
    lru.push_mru(la, a)
    lru.push_mru(lb, b)
    lru.push_mru(lc, c)
    assert [n for n in lru.oldest(10)] == [a, b, c]
    lru.move_to_mru(la)
    assert lru.oldest(10) == [b, c, a]
    lru.insert_before(lc, ld, d)
    assert lru.oldest(10) == [b, d, c, a] and len(lru) == 4
    assert lru.oldest(2) == [b, d]
    lru.remove(lb)
    assert lru.oldest(10) == [d, c, a] and not LinkedLRUList.is_linked(lb)
    assert lb.lru_node is None and len(lru) == 3
    lru.clear()
    assert lru.oldest(10) == [] and len(lru) == 0
    assert not any(LinkedLRUList.is_linked(x) for x in (la, lc, ld))


@pytest.mark.parametrize("first", [True, False])
def test_insert_before_the_oldest_or_the_newest(first: bool) -> None:
    (a, la), (b, lb), (c, lc) = _nodes(3)
    lru = LinkedLRUList()
    lru.push_mru(la, a)
    lru.push_mru(lb, b)
    anchor = la if first else lb
    lru.insert_before(anchor, lc, c)
    assert lru.oldest(10) == ([c, a, b] if first else [a, c, b])


_OPS = st.lists(
    st.tuples(st.sampled_from(["push", "move", "before", "remove"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, anchor_pick=st.lists(st.integers(0, 7), min_size=60, max_size=60))
def test_any_sequence_of_operations_matches_a_list_model(
    ops: list[tuple[str, int]], anchor_pick: list[int]
) -> None:
    nodes = _nodes(8)
    lru = LinkedLRUList()
    model: list[int] = []
    for step, (op, i) in enumerate(ops):
        node, link = nodes[i]
        if op == "push" and i not in model:
            lru.push_mru(link, node)
            model.append(i)
        elif op == "move" and i in model:
            lru.move_to_mru(link)
            model.remove(i)
            model.append(i)
        elif op == "remove" and i in model:
            lru.remove(link)
            model.remove(i)
        elif op == "before" and i not in model and model:
            j = model[anchor_pick[step] % len(model)]
            lru.insert_before(nodes[j][1], link, node)
            model.insert(model.index(j), i)
        assert lru.oldest(100) == [nodes[k][0] for k in model]
        assert len(lru) == len(model)
        assert all(LinkedLRUList.is_linked(nodes[k][1]) == (k in model) for k in range(8))
