"""``MapSource``: a map-style dataset as an iterator whose draws can overlap.

Iterated anywhere, it yields ``dataset[i]`` for ``i`` in ``indices`` (default: every index in
order), like ``map(dataset.__getitem__, indices)``. The engine's source sees more: a draw in two
parts, ``claim()`` (the next index: cheap, taken in batch order) and ``fetch(index)`` (the item:
what takes time), so that a plan with ``loads > 1`` fetches several items at once, on threads,
while batches keep their order and numbers (``torchrec_swp.engine.source``). It is what a
DataLoader's worker processes do for a map-style dataset, on the engine's threads instead:
no pickling between processes, and the GIL is released while an item waits on storage.

``state_dict()``/``load_state_dict()`` save and restore the position (the next index), so a
pipeline checkpoint can resume it exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class MapDataset(Protocol):
    def __getitem__(self, index: int) -> Any: ...

    def __len__(self) -> int: ...


class MapSource:
    def __init__(self, dataset: MapDataset, indices: Iterable[int] | None = None) -> None:
        self.dataset = dataset
        self.indices: Sequence[int] = list(range(len(dataset)) if indices is None else indices)
        self._next = 0
        self._lock = threading.Lock()

    def claim(self) -> int:
        """The next index to load; StopIteration when there is none."""
        with self._lock:
            if self._next >= len(self.indices):
                raise StopIteration
            index = self.indices[self._next]
            self._next += 1
            return index

    def fetch(self, index: int) -> Any:
        return self.dataset[index]

    def __iter__(self) -> MapSource:
        return self

    def __next__(self) -> Any:
        return self.fetch(self.claim())

    def __len__(self) -> int:
        return len(self.indices)

    def state_dict(self) -> dict[str, int]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._lock:
            self._next = int(state["next"])
