"""How the source task sees the data: ``Draws``, the iterator given to ``step()``, drawn in
batch order.

The source's function gets it as keyword ``data`` (``fn(b, data=...)``) and draws one item per
batch with ``next(data)``. With one load in flight that is the user's iterator's ``next()``. With
several (``plan.loads``) the lanes take turns: batch ``b``'s draw waits until batch ``b - 1``'s
was made, so items are drawn in batch order whatever lane is faster; everything the function
does after the draw runs concurrently.

A draw can be split in two, so that what takes time also runs concurrently: an iterator that
has ``claim()`` (cheap, called in batch order; raises StopIteration at the end) and
``fetch(token)`` (the item for a claimed token) is drawn as ``fetch(claim())`` with only the
claim taking turns (``torchrec_swp.data.MapSource`` reads a map-style dataset so).

Positions: when the iterator has ``state_dict()`` (torchdata's StatefulDataLoader iterators
do), ``positions[b]`` keeps its state just before batch ``b`` was drawn: resuming from it draws
batch ``b`` again (a checkpoint's cut).

Uneven data: given an ``ExhaustionSync`` (``sync_dataloader_exhaustion=True``), every draw is
followed, within its turn, by the ranks agreeing whether every rank has the batch
(``torchrec_swp.engine.exhaustion``); where one has not, the draw raises StopIteration on every
rank, and an item this rank drew for it is dropped (``dropped(b)``) and never trained.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchrec_swp.engine.exhaustion import ExhaustionSync


class Draws:
    """``iterator`` as the source task draws it; ``take_turn(b)`` blocks until batch ``b`` may
    draw, ``turn_taken(b, ended)`` says it drew (or found the end); with ``sync``, the ranks agree
    on the end, and ``dropped(b)`` hears of an item drawn for batch ``b`` past the common end."""

    def __init__(
        self,
        iterator: Iterator[Any],
        *,
        take_turn: Callable[[int], None],
        turn_taken: Callable[[int, bool], None],
        sync: ExhaustionSync | None = None,
        dropped: Callable[[int], None] | None = None,
    ) -> None:
        self.iterator = iterator
        self._take_turn = take_turn
        self._turn_taken = turn_taken
        self._sync = sync
        self._dropped = dropped
        self._local = threading.local()
        self._split = callable(getattr(iterator, "claim", None)) and callable(getattr(iterator, "fetch", None))
        self._stateful = callable(getattr(iterator, "state_dict", None))
        self.positions: dict[int, Any] = {}

    @property
    def splits(self) -> bool:
        """Whether the iterator splits a draw into ``claim()`` and ``fetch()`` (several loads then
        fetch at once; ``torchrec_swp.data.MapSource`` does)."""
        return self._split

    @property
    def stateful(self) -> bool:
        """Whether the iterator has ``state_dict()`` (its positions are recorded)."""
        return self._stateful

    def drawing(self, b: int | None) -> None:
        """The calling thread draws batch ``b`` next (None: it draws no batch)."""
        self._local.batch = b

    def __iter__(self) -> Draws:
        return self

    def __next__(self) -> Any:
        b = getattr(self._local, "batch", None)
        if b is None:  # not inside a source call: the iterator as it is
            return next(self.iterator)
        self._take_turn(b)
        if self._stateful:
            self.positions[b] = self.iterator.state_dict()  # type: ignore[attr-defined]
        try:
            if self._sync is None:
                drawn = self.iterator.claim() if self._split else next(self.iterator)  # type: ignore[attr-defined]
            else:
                drawn = self._sync.draw(self._pull, lambda _: self._drop(b))
        except StopIteration:
            self._turn_taken(b, True)
            raise
        self._turn_taken(b, False)
        return self.iterator.fetch(drawn) if self._split else drawn  # type: ignore[attr-defined]

    def _pull(self) -> Any:
        return self.iterator.claim() if self._split else next(self.iterator)  # type: ignore[attr-defined]

    def _drop(self, b: int) -> None:
        if self._dropped is not None:
            self._dropped(b)

    def forget(self, before: int) -> None:
        """Drop the positions of batches before ``before`` (trained)."""
        for b in [k for k in self.positions if k < before]:
            del self.positions[b]
