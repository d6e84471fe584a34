"""The relay's merging (pure): the bounded per-node buffer and the sort window."""

from __future__ import annotations

import pytest

from flagella.relay.merge import NodeBuffer, SortWindow, last_n


def test_a_full_node_buffer_drops_the_oldest_and_counts_them() -> None:
    buf: NodeBuffer[int] = NodeBuffer(3)
    for i in range(5):
        buf.put(i)
    assert len(buf) == 3
    assert buf.take() == [2, 3, 4]  # the oldest two dropped
    assert buf.take_lost() == 2
    assert buf.take_lost() == 0  # counted once
    assert buf.take() == []
    buf.put(9)
    assert (buf.take(), buf.take_lost()) == ([9], 0)
    with pytest.raises(ValueError, match="at least one"):
        NodeBuffer(0)


def test_the_sort_window_releases_the_oldest_beyond_its_length_and_all_on_drain() -> None:
    window: SortWindow[str] = SortWindow(3)
    # Two nodes' flows arriving out of time order.
    assert window.push(30, "n1@30") == []
    assert window.push(10, "n2@10") == []
    assert window.push(20, "n1@20") == []
    assert window.push(40, "n2@40") == ["n2@10"]  # the 4th pushes out the oldest
    assert window.push(5, "late@5") == ["late@5"]  # older than all held: out at once
    assert len(window) == 3
    assert window.drain() == ["n1@20", "n1@30", "n2@40"]
    assert window.drain() == []
    # Equal times keep their arrival order.
    for name in "abc":
        window.push(7, name)
    assert window.drain() == ["a", "b", "c"]
    with pytest.raises(ValueError, match="at least one"):
        SortWindow(0)


def test_last_n_merges_nodes_by_time_and_keeps_the_newest() -> None:
    n1 = [(1, "n1@1"), (4, "n1@4"), (6, "n1@6")]
    n2 = [(2, "n2@2"), (5, "n2@5")]
    assert last_n([n1, n2], 3) == ["n1@4", "n2@5", "n1@6"]
    assert last_n([n1, n2], 0) == ["n1@1", "n2@2", "n1@4", "n2@5", "n1@6"]
    assert last_n([[], n2], 10) == ["n2@2", "n2@5"]
