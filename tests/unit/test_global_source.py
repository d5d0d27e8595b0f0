"""``GlobalMapSource``: a data position shared by all ranks, re-split on another world size.

The invariant a resize rests on: over an epoch cut at any step on ``W`` ranks and resumed on
``W'``, every item is drawn exactly once by the steps that are trained (the items of an
incomplete last step excepted, which no rank draws), and resumed on ``W`` itself every rank draws
what it would have drawn without the cut.
"""

from __future__ import annotations

import itertools
import random

import pytest

from torchrec_swp.data import GlobalMapSource


def _sources(n: int, world_size: int, order: list[int] | None = None) -> list[GlobalMapSource]:
    return [GlobalMapSource(list(range(n)), rank=r, world_size=world_size, order=order) for r in range(world_size)]


def _draw(sources: list[GlobalMapSource], steps: int) -> list[int]:
    """``steps`` lock steps: each rank draws one item per step."""
    return [next(s) for _ in range(steps) for s in sources]


def test_ranks_take_their_share_of_each_step() -> None:
    sources = _sources(10, 3)
    assert [list(s) for s in sources] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert sources[0].tail == 1  # item 9: an incomplete last step


@pytest.mark.parametrize("w, w2, cut", [(2, 1, 3), (1, 2, 5), (2, 3, 2), (4, 2, 1), (3, 3, 2), (2, 2, 0)])
def test_every_item_once_across_a_resize(w: int, w2: int, cut: int) -> None:
    n = 24  # a multiple of 1, 2, 3 and 4: no tail
    order = random.Random(7).sample(range(n), n)
    before = _sources(n, w, order)
    trained = _draw(before, cut)
    # batches in flight: drawn ahead of the cut, not trained, so not in the position the cut records
    positions = [s.state_dict() for s in before]
    for s in before:
        next(s)
    state = GlobalMapSource.agree(positions)
    assert state["consumed"] == cut * w
    after = _sources(n, w2, order)
    for s in after:
        s.load_state_dict(state)
    rest = [list(s) for s in after]
    assert len({len(r) for r in rest}) == 1, "every new rank draws the same number of items"
    trained += [item for step in zip(*rest) for item in step]
    tail = order[len(order) - after[0].tail :]  # an incomplete last step: drawn by no rank
    assert after[0].tail == (n - cut * w) % w2
    assert sorted(trained + tail) == sorted(order), "every item drawn once, or in the tail"
    assert len(trained) == len(set(trained))


def test_same_world_size_draws_what_it_would_have() -> None:
    n, w, cut = 20, 2, 4
    whole = [list(s) for s in _sources(n, w)]
    before = _sources(n, w)
    _draw(before, cut)
    state = before[1].state_dict()
    after = _sources(n, w)
    for s in after:
        s.load_state_dict(state)
    assert [list(s) for s in after] == [items[cut:] for items in whole]


def test_the_tail_is_what_no_rank_draws() -> None:
    n = 11
    before = _sources(n, 2)
    _draw(before, 2)
    after = _sources(n, 3)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    drawn = [list(s) for s in after]
    assert drawn == [[4, 7], [5, 8], [6, 9]]
    assert after[0].tail == 1  # item 10
    assert set(itertools.chain([0, 1, 2, 3], *drawn)) | {10} == set(range(n))


def test_refusals_name_why() -> None:
    source = _sources(8, 2)[0]
    with pytest.raises(ValueError, match="order of 9 items"):
        source.load_state_dict(_sources(9, 2)[0].state_dict())
    with pytest.raises(ValueError, match="digest"):
        source.load_state_dict(_sources(8, 2, order=list(reversed(range(8))))[0].state_dict())
    with pytest.raises(ValueError, match="not a global position"):
        source.load_state_dict({"next": 3})
    a, b = _sources(8, 2)
    next(a)
    with pytest.raises(ValueError, match="rank 0: 2 consumed, rank 1: 0"):
        GlobalMapSource.agree([a.state_dict(), b.state_dict()])
    with pytest.raises(ValueError, match="not a rank"):
        GlobalMapSource([1], rank=2, world_size=2)
