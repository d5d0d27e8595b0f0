"""Epochs and data: which iterator serves which batch, new data, reset, batches adopted.

An epoch is one pass of the source over its data, batches numbered from 0 (its
``BatchBook``). It ends when the data ends and every batch was returned; new data then starts the
next one (``new_data``). A stop at the end of data (``on_exhausted="stop"``) does not end it:
new data goes on where every thread stopped. ``reset()`` drops what is in flight (listed in
the ledger) and starts again at batch number 0; ``adopt()`` takes batches loaded elsewhere.

The iterator given to ``step()`` reaches the source through its ``data`` argument. A new one
serves the batches that no call had made drawable yet (and the one that found a stop): a
thread that draws an older batch after that call still draws it from the iterator of the call
that made it drawable, as a plan on one thread would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchrec_swp.engine.batches import BatchBook
from torchrec_swp.engine.board import LatchState
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.instructions import PlanInterpreter
from torchrec_swp.engine.source import Draws
from torchrec_swp.plan.task import parse_read


class Epochs(PlanInterpreter):
    """Epoch and data bookkeeping of an ``Engine`` (its public methods are the Engine's)."""

    _slots: dict[int, dict[str, Any]]
    _data: Iterator[Any] | None
    _draws: Draws | None
    _draws_from: list[tuple[int, Draws]]
    _failure_raised: bool
    exhaustion: ExhaustionSync | None

    # ------------------------------------------------------------- epochs
    def reset(self) -> None:
        """Forget every batch in flight and start again at iteration 0 (workers are kept);
        batch numbers (the phases' clock) and collective tickets start again at 0 too.

        Batches in flight are recorded in ``ledger.dropped``: they were drawn, never trained.
        """
        self._settle("reset() was called")
        self._pulls = 0
        for t in self._turnstiles.values():
            t.restart()
        self._start_epoch(first_trained=0)

    @property
    def trained_since_reset(self) -> int:
        """Batches trained (returned by ``step()``) since the engine was built or reset: the
        clock ``"trained"``'s number of the next batch to train."""
        return self.book.first_trained + self.book.returned

    def count_trained_from(self, n: int) -> None:
        """Number the next batch to train ``n`` on the clock ``"trained"``; only before the first
        ``step()`` since the engine was built, reset or loaded (no thread has picked a phase yet)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise EngineError(f"count_trained_from(): n must be an int >= 0, got {n!r}")
        book = self.book
        if book.requested or self.in_flight():
            raise EngineError("count_trained_from(): only before the first step() (or right after reset())")
        book.first_trained = n - book.returned

    def new_data(self) -> None:
        """The source has new data (a new iterator, or a new epoch of the same one).

        Stopped at the end of data: go on where every thread stopped. Drained: start a new
        epoch. Still draining: finish the batches in flight, then start a new epoch without
        raising StopIteration in between. Otherwise nothing changes: the source reads the new
        data from its next batch on.
        """
        book = self.book
        if book.stopped:
            with self.board.lock:
                book.stopped = False
                book.num_batches = None
                book.renumbered += 1
                latches = self.board.latches
                for key in [k for k, v in latches.items() if v is LatchState.STOPPED]:
                    del latches[key]
        elif book.num_batches is None:
            return
        elif book.returned >= book.num_batches:
            self._settle()
            self._start_epoch()
        else:
            book.restart_after_drain = True

    def _settle(self, interrupt: str | None = None) -> None:
        """Wait until no worker walks (interrupting them first if ``interrupt`` says why)."""
        if interrupt is not None and self._threaded:
            self.board.interrupt_all(interrupt)
        try:
            self._wait_idle(list(self._walkers.values()))
        finally:
            if interrupt is not None:
                self.board.resume()

    def _start_epoch(self, start: int = 0, first_trained: int | None = None) -> None:
        """A new epoch; its batches trained count on from the last epoch's (``first_trained``:
        from that number instead)."""
        book = self.book
        if first_trained is None:
            first_trained = book.first_trained + book.returned
        for b in book.in_flight():
            self.ledger.dropped.append((book.serial(b), "in flight when reset() was called"))
        self.failures.clear()
        self._failure_raised = False
        self.board.resume()
        self._epoch_base += max(w.P for w in self._walkers.values())
        self._slots.clear()
        self.book = BatchBook(
            first_number=self._pulls,
            first_serial=self.ledger.drawn,
            first_trained=first_trained,
            start=start,
            slots=self._slots,
        )
        self.board.clear_latches()
        bases = {g: t.next_ticket for g, t in self._turnstiles.items()}
        for w in self._walkers.values():
            w.place(start, bases)
        if self._draws is not None:
            self._draws.positions.clear()
            self._draws_from = [(0, self._draws)]

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
        if self.in_flight():
            raise EngineError(f"cannot adopt batches while batches {self.in_flight()} are in flight")
        if not slots:
            return
        plan, top = self.plan, self._top
        for j, values in enumerate(slots):
            at = max(top - j, 0)
            needed = {
                name
                for t in plan.scheduled()
                if t.stage >= at
                for name, k in map(parse_read, t.io.reads)
                if k == 0 and (w := plan.writer_of(name)) is not None and plan.task(w).stage < at
            }
            lacking = sorted(needed - set(values))
            if lacking:
                raise EngineError(
                    f"cannot adopt batch {j} at stage {at} of plan {plan.name}: its remaining tasks read "
                    f"{', '.join(lacking)}, which the slot given for it lacks"
                )
        self._settle()
        self._start_epoch(start=top)
        book = self.book
        for j, values in enumerate(slots):
            book.slots[j] = dict(values)
            book.loaded.add(j)
        book.next_claim = len(slots)
        self.ledger.drawn += len(slots)
        self._pulls += len(slots)
        if len(slots) < top:
            book.num_batches = len(slots)

    def _data_argument(self, b: int) -> dict[str, Any]:
        draws = self._draws_for(b)
        return {} if draws is None else {"data": draws}

    def _draws_for(self, b: int) -> Draws | None:
        """The data batch ``b`` is drawn from: the iterator of the ``step()`` call that made it
        drawable (a thread may draw it after that call returned)."""
        for first, draws in reversed(self._draws_from):
            if b >= first:
                return draws
        return None

    def _take_data(self, data: Iterator[Any]) -> None:
        if data is self._data:
            if self.book.end_reported:
                self.new_data()
            return
        # the batches it serves: those no call made drawable yet, and the one that found a stop
        book = self.book
        first = 0 if book.requested == 0 else book.requested + self._top + self._lookahead
        if book.stopped and book.num_batches is not None:
            first = min(first, book.num_batches)
        if self._data is not None:
            self.new_data()
        if self.book is not book:  # a new epoch
            first = 0
        self._data = data
        self._draws = Draws(
            data,
            take_turn=self._take_turn,
            turn_taken=self._turn_taken,
            sync=self.exhaustion,
            dropped=self._drawn_past_common_end,
        )
        self._draws_from = [(f, d) for f, d in self._draws_from if f < first] + [(first, self._draws)]

    def _drawn_past_common_end(self, b: int) -> None:
        """This rank drew an item for batch ``b``, which another rank's data lacks (the common end
        under ``exhaustion``): not a batch, never trained, counted in ``ledger.past_end``."""
        with self.board.lock:
            self.ledger.past_end += 1

    def forget_data(self) -> None:
        """Forget the iterator: the next ``step(data)`` takes ``data`` as the first one."""
        self._data = self._draws = None
        self._draws_from = []
