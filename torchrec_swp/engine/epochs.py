"""Epochs and data: when a new epoch starts, which iterator serves which batch, reset, adoption.

An epoch is one pass of the source over its data, batches numbered from 0 (its ``BatchBook``).
It ends when the data ends and every batch was returned; new data then starts the next one
(``new_data``). A stop at the end of data (``on_exhausted="stop"``) does not end it: new data
goes on where every thread stopped. ``reset()`` drops what is in flight (listed in the ledger)
and starts again at batch number 0; ``adopt()`` takes batches loaded elsewhere.

The iterator given to ``step()`` reaches the source through its ``data`` argument (the
``Feed``): a new one serves the batches that no call had made drawable yet (and the one that
found a stop).

``Epochs`` holds no state of its own (but the owner's ``on_new_data`` hook): it decides, and
tells the parts that own the state through their public methods - ``Batches`` (the books, the
end of data), the ``Feed`` (the iterators) and the interpreter (``restart_walkers``: every
thread placed at the new epoch's first iteration; ``park_all``: every thread interrupted and at
rest; ``wait_until_resting``: no thread walking).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torchrec_swp.engine.batches import Batches, BatchLedger
from torchrec_swp.engine.end_of_data import EndEvent, Then
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.installed import InstalledPlans, check_adoptable
from torchrec_swp.engine.interpreter import Interpreter
from torchrec_swp.engine.source import Feed


class Epochs:
    """The epochs of an engine (``interpreter``, running the ``installed`` plans over ``batches``
    from ``feed``)."""

    def __init__(
        self,
        interpreter: Interpreter,
        installed: InstalledPlans,
        batches: Batches,
        feed: Feed,
        on_new_data: Callable[[], None] | None = None,
    ) -> None:
        self._interpreter, self._installed = interpreter, installed
        self._batches = batches
        self._feed = feed
        self._on_new_data = on_new_data  # the engine's owner, told of new data first

    def start(self, why: EndEvent, start: int = 0, first_trained: int | None = None) -> None:
        """A new epoch for ``why`` (the end of data's event that begins it), its threads at internal
        iteration ``start``; its batches trained count on from the last epoch's (``first_trained``:
        from that number instead)."""
        first_iteration = self._batches.book.first_iteration + self._interpreter.restart_walkers(start)
        self._batches.new_epoch(why, start, first_trained, first_iteration, self._feed.kept())
        self._feed.new_epoch()

    def reset(self) -> None:
        """``Engine.reset``: the batches in flight dropped, batch numbers and tickets from 0."""
        self._interpreter.park_all("reset() was called")
        self._batches.restart_numbers(0)
        for t in self._interpreter.turnstiles.values():
            t.restart()
        self.start(EndEvent.RESET, first_trained=0)

    def resume(self, ledger: BatchLedger, number: int, trained: int) -> None:
        """Go on from a cut: its ledger, the batch number and the trained number of its first batch."""
        self._batches.restore_ledger(ledger)
        self._batches.restart_numbers(number)
        self._feed.forget()
        self.start(EndEvent.LOAD, first_trained=trained)

    def count_trained_from(self, n: int) -> None:
        """Number the next batch to train ``n`` on the clock ``"trained"``; only before the first
        ``step()`` since the engine was built, reset or loaded (no thread has picked a phase yet)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise EngineError(f"count_trained_from(): n must be an int >= 0, got {n!r}")
        book = self._batches.book
        if book.requested or book.in_flight:
            raise EngineError("count_trained_from(): only before the first step() (or right after reset())")
        self._batches.count_trained_from(n)

    def new_data(self) -> None:
        """The source has new data (a new iterator, or a new epoch of the same one).

        Stopped at the end of data: go on where every thread stopped. Drained: start a new
        epoch. Still draining: finish the batches in flight, then start a new epoch without
        raising StopIteration in between. Otherwise nothing changes: the source reads the new
        data from its next batch on.
        """
        if self._on_new_data is not None:
            self._on_new_data()
        board = self._interpreter.board
        with board.lock:  # threads ask the end of data under the lock
            then = self._batches.new_data()
            if then is Then.GO_ON:
                board.forget_stopped_latches()
        if then is Then.NEXT_EPOCH:
            self._interpreter.wait_until_resting()
            self.start(EndEvent.EPOCH)

    def take_data(self, data: Iterator[Any]) -> None:
        """``step(data)`` with an iterator that is new, or the same one after the end was reported."""
        feed = self._feed
        end = self._batches.end
        if data is feed.data:
            if end.reported():
                self.new_data()
            return
        # the batches it serves: those no call made drawable yet, and the one that found a stop
        book, shape = self._batches.book, self._installed.shape
        first = 0 if book.requested == 0 else book.requested + shape.top + shape.lookahead
        m = end.end_at()
        if end.stopped() and m is not None:
            first = min(first, m)
        if feed.data is not None:
            self.new_data()
        if self._batches.book is not book:  # a new epoch
            first = 0
        feed.take(data, first)

    def adopt(self, slots: list[dict[str, Any]]) -> None:
        """Take batches loaded outside the engine as the batches in flight.

        Batch 0 is placed at the highest stage, due to leave in the next step, batch ``j`` at
        stage ``max_stage - j``: the tasks of the stages below its own count as done, as if the
        engine had run them. ``slots[j]`` must hold every value that batch ``j``'s remaining
        tasks read from those (for the TorchRec pipelines: the batch and its context, which user
        code put where the pipeline keeps them). Batches placed at or below the source's stage
        are not drawn again. With fewer batches than the stages above the source, the data is
        taken to end after them (the pipeline drains them).

        Only while nothing is in flight (fresh, or after the end of data or a reset()).
        """
        in_flight = sorted(self._batches.book.in_flight)
        if in_flight:
            raise EngineError(f"cannot adopt batches while batches {in_flight} are in flight")
        if not slots:
            return
        top = self._installed.shape.top
        check_adoptable(self._installed.current, top, slots)
        self._interpreter.wait_until_resting()
        self.start(EndEvent.ADOPT, start=top)
        self._batches.adopt(slots)
        if len(slots) < top:
            self._batches.end_after(len(slots))
