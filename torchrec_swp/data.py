"""``MapSource``: a map-style dataset as an iterator whose draws can overlap.

Iterated anywhere, it yields ``dataset[i]`` for ``i`` in ``indices`` (default: every index in
order), like ``map(dataset.__getitem__, indices)``. The engine's source sees more: a draw in two
parts, ``claim()`` (the next index: cheap, taken in batch order) and ``fetch(index)`` (the item:
what takes time), so that a plan with ``loads > 1`` fetches several items at once, on threads,
while batches keep their order and numbers (``torchrec_swp.engine.source``). It is what a
DataLoader's worker processes do for a map-style dataset, on the engine's threads instead:
no pickling between processes, and the GIL is released while an item waits on storage.

``MapSource(dataset, processes=N)`` fetches each item in one of ``N`` worker processes instead
(``dataset[i]`` runs there; the item comes back pickled, its tensors through shared memory as
DataLoader workers send them): for a dataset whose work holds the GIL (parsing rows in Python,
building KJTs from lists), which threads cannot run in parallel. The engine's parallel loads
(``loads N``) then wait on N processes at once, and the training thread keeps the GIL. The
workers start at the first fetch (``context``: a ``multiprocessing`` start method, by default the
platform's: ``fork`` on Linux, where the dataset is inherited; with ``spawn`` or ``forkserver``
it is pickled) and end with ``close()``, when the source is collected, or at exit.

``state_dict()``/``load_state_dict()`` save and restore the position (the next index), so a
pipeline checkpoint can resume it exactly.

``GlobalMapSource``: the same over one order of the items shared by all ranks, rank ``r`` of ``W``
taking item ``start + s * W + r`` at its ``s``-th draw. Its position is global (the items all
ranks consumed), so a checkpoint written on ``W`` ranks resumes on ``W'``: each new rank takes its
share of what is left.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol


class MapDataset(Protocol):
    def __getitem__(self, index: int) -> Any: ...

    def __len__(self) -> int: ...


#: a worker process's dataset (``MapSource(processes=N)``: set once as the worker starts)
_WORKER_DATASET: Any = None


def _start_worker(dataset: MapDataset) -> None:
    """A worker process starts: its dataset, and (as DataLoader's workers do) torch on one
    thread: a process forked from one whose torch ran ops on its thread pool inherits that pool
    in a state it cannot use, and its first parallel op waits forever (seen: a fork after the
    parent's torch ops, the worker at 0% CPU inside the dataset's torch op)."""
    global _WORKER_DATASET
    _WORKER_DATASET = dataset
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _item(index: int) -> Any:
    return _WORKER_DATASET[index]


def _ready() -> None:
    """A worker process has started (its initializer ran): ``MapSource.start_workers``."""


class MapSource:
    """A map-style dataset as an iterator whose draws can overlap (module docstring): on the
    engine's threads, or with ``processes`` > 0 in that many worker processes."""

    def __init__(
        self,
        dataset: MapDataset,
        indices: Iterable[int] | None = None,
        *,
        processes: int = 0,
        context: str | None = None,
    ) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError(f"MapSource: processes must be an int >= 0 (0: no worker processes), got {processes!r}")
        if context is not None and context not in multiprocessing.get_all_start_methods():
            methods = ", ".join(multiprocessing.get_all_start_methods())
            raise ValueError(f"MapSource: context must be a start method of this platform ({methods}), got {context!r}")
        self.dataset = dataset
        self.indices: Sequence[int] = list(range(len(dataset)) if indices is None else indices)
        self.processes = processes
        self.context = context
        self._next = 0
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._finalizer: weakref.finalize[Any, MapSource] | None = None

    def claim(self) -> int:
        """The next index to load; StopIteration when there is none."""
        with self._lock:
            if self._next >= len(self.indices):
                raise StopIteration
            index = self.indices[self._next]
            self._next += 1
            return index

    def fetch(self, index: int) -> Any:
        """Item ``index``: ``dataset[index]``, here or in a worker process (``processes``); an
        error there is raised here, the worker's traceback as its cause."""
        if not self.processes:
            return self.dataset[index]
        try:
            return self._workers().submit(_item, index).result()
        except BrokenProcessPool as e:
            raise RuntimeError(
                f"MapSource: a worker process ended while fetching item {index} ({e}); the source cannot fetch more"
            ) from e

    def _workers(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("MapSource: closed (close()): its worker processes have ended")
            if self._pool is None:
                context = multiprocessing.get_context(self.context)
                if context.get_start_method() != "fork":
                    _picklable(self.dataset, context.get_start_method())
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=context, initializer=_start_worker, initargs=(self.dataset,)
                )
                self._finalizer = weakref.finalize(self, _shut_down, self._pool)
            return self._pool

    def use_processes(self, processes: int) -> None:
        """Fetch from now on in ``processes`` worker processes (0: on the fetching threads), the
        same items in the same order: a self-tuning pipeline tries it where the draw computes
        (``autotune``). Fetches already under way end where they began."""
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError(f"MapSource: processes must be an int >= 0 (0: no worker processes), got {processes!r}")
        with self._lock:
            if processes == self.processes:
                return
            self.processes = processes
            finalizer, pool = self._finalizer, self._pool
            self._finalizer, self._pool = None, None
        if pool is not None and finalizer is not None:
            finalizer.detach()
            pool.shutdown(wait=False)  # what it fetches still arrives; its workers end after

    def close(self) -> None:
        """End the worker processes (``processes``); a later fetch raises. Closing again, or a
        source without processes, does nothing more."""
        with self._lock:
            self._closed = self._closed or self.processes > 0
            finalizer, self._pool = self._finalizer, None
        if finalizer is not None:
            finalizer()

    def start_workers(self) -> None:
        """Start the worker processes (``processes``) now, each with its dataset, rather than at
        the first fetch (inside a step); a DataLoader starts its workers at ``iter()``, and so
        does ``iter()`` of this source. Nothing to do without processes, or once they run."""
        if not self.processes:
            return
        pool = self._workers()
        try:
            for started in [pool.submit(_ready) for _ in range(self.processes)]:
                started.result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"MapSource: a worker process ended as it started ({e}); the source cannot fetch") from e

    def __iter__(self) -> MapSource:
        if self.processes and self._pool is None and not self._closed:
            self.start_workers()
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


def _picklable(dataset: MapDataset, method: str) -> None:
    import pickle

    try:
        pickle.dumps(dataset)
    except Exception as e:
        raise TypeError(
            f"MapSource: with the {method!r} start method the dataset goes to each worker process pickled, and "
            f"{type(dataset).__name__} cannot be ({type(e).__name__}: {e}); use context='fork' (Linux) or a "
            "picklable dataset"
        ) from e


def _shut_down(pool: ProcessPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


class GlobalMapSource(MapSource):
    """A ``MapSource`` whose position is global: one order of the dataset's items for all ranks,
    rank ``rank`` of ``world_size`` taking item ``order[start + s * world_size + rank]`` at its
    ``s``-th draw (``start``: the items consumed before, 0 for a new epoch).

    Why global: a per-rank position (MapSource's next index) means nothing on another number of
    ranks. This one counts the items consumed by all ranks (Megatron's "consumed samples"), from
    which any ``(rank, world_size)`` splits what is left, so a checkpoint written on ``W`` ranks
    resumes on ``W'``, and on ``W`` itself it gives every rank the items it would have drawn.

    ``state_dict()`` is ``{"consumed": start + next * world_size, "total": ..., "order": digest}``,
    where ``next`` is this rank's draws so far. It is the same on every rank when every rank has
    drawn the same number of items, which is what a pipeline's cut gives in data-parallel training
    (all ranks train in lock step, and the cut records the position just before the first batch
    not yet trained: batches in flight, drawn ahead, are not counted, so they are drawn again,
    by whichever rank their new place gives them). A caller that saves it from one rank should
    check that the ranks agree (``GlobalMapSource.agree``). ``load_state_dict(state)`` takes
    another rank's or world size's state (same ``total`` and ``order``, else ValueError) and
    re-splits the items from ``consumed`` on among this source's ranks.

    Uneven tail: what is left is split into steps of ``world_size`` items; the items of an
    incomplete last step (``tail``, fewer than ``world_size``) are in no rank's share, so every
    rank draws the same number of items (a rank with one more would wait forever in a collective).
    They are not trained in this epoch: give ``total`` a multiple of the world sizes you resume on
    to train every item.
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        rank: int,
        world_size: int,
        order: Iterable[int] | None = None,
        processes: int = 0,
        context: str | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"GlobalMapSource: rank {rank} of world size {world_size} is not a rank")
        self.order: Sequence[int] = list(range(len(dataset)) if order is None else order)
        self.rank = rank
        self.world_size = world_size
        self.start = 0
        self._digest = hashlib.sha256(repr(list(self.order)).encode()).hexdigest()[:16]
        super().__init__(dataset, self._share(), processes=processes, context=context)

    def _share(self) -> list[int]:
        """This rank's items of the complete steps left after ``start``."""
        steps = (len(self.order) - self.start) // self.world_size
        first = self.start + self.rank
        return [self.order[first + s * self.world_size] for s in range(steps)]

    @property
    def tail(self) -> int:
        """Items after ``start`` in no rank's share: those of an incomplete last step."""
        return (len(self.order) - self.start) % self.world_size

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            consumed = self.start + self._next * self.world_size
        return {"consumed": consumed, "total": len(self.order), "order": self._digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"consumed", "total", "order"} <= set(state):
            raise ValueError(
                f"GlobalMapSource.load_state_dict(): not a global position (a GlobalMapSource's state_dict()), got "
                f"{state!r:.80}"
            )
        if (state["total"], state["order"]) != (len(self.order), self._digest):
            raise ValueError(
                f"GlobalMapSource.load_state_dict(): the position is in an order of {state['total']} items "
                f"(digest {state['order']}), this source's has {len(self.order)} (digest {self._digest})"
            )
        consumed = int(state["consumed"])
        if not 0 <= consumed <= len(self.order):
            raise ValueError(f"GlobalMapSource.load_state_dict(): {consumed} items consumed of {len(self.order)}")
        with self._lock:
            self.start = consumed
            self.indices = self._share()
            self._next = 0

    @staticmethod
    def agree(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The one global position of every rank's ``state_dict()``; ValueError naming the first
        rank that disagrees with rank 0 (ranks that drew different numbers of items: no cut)."""
        for rank, state in enumerate(states):
            if state != states[0]:
                raise ValueError(
                    f"GlobalMapSource: the ranks' positions differ (rank 0: {states[0]['consumed']} consumed, "
                    f"rank {rank}: {state['consumed']}): the ranks did not cut at the same step"
                )
        return dict(states[0])
