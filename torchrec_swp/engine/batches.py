"""The life of every batch: drawn, in its slot, trained or dropped; epochs; the ledger.

``Batches`` is the engine's part that keeps them, and the only one that changes them: the
engine, its ops and its epochs tell it what happened (``ask``, ``drawn``, ``found_end``,
``retire``, ``new_epoch``...) and read its records, one ``BatchBook`` per epoch and the
``BatchLedger``.

One ``BatchBook`` per epoch holds the batches in flight: their slots (the values tasks write
and read), the device events recorded after their tasks, what the source found (batches drawn,
the end of data), and how far the caller has got (batches requested and returned). The
``BatchLedger`` outlives epochs: every batch the source drew, trained or dropped with a reason.

Batches are numbered per epoch from 0 (``b``, the index tasks get); their ``serial`` numbers them
over the engine's life in drawing order (the ledger's numbers), their ``number`` counts the
source's calls since the engine was built or reset - the call that found the end of data
included, as TorchRec's context index counts them - and picks the phase of a PhasedPlan (or, for
``clock="trained"``, ``first_trained + b``: the batches trained before it since then). The
glossary of docs/engine.md lists every counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BatchLedger:
    """What became of every batch the source drew, across epochs and resets.

    Batches are numbered by ``serial`` in the order they were drawn (0, 1, ... over the
    engine's life). A batch is trained once it left the highest stage; one that never will is
    listed in ``dropped`` with the reason. ``past_end`` counts the items drawn for the common end
    of uneven data (``sync_dataloader_exhaustion``: this rank had one, another had none): never
    batches, never trained, not counted in ``drawn``.
    """

    drawn: int = 0
    trained: int = 0
    dropped: list[tuple[int, str]] = field(default_factory=list)
    past_end: int = 0


@dataclass
class BatchBook:
    """The batches of one epoch (numbered ``b`` = 0, 1, ...).

    ``first_number``: the batch number of batch 0; ``first_serial``: its serial; ``first_trained``:
    the batches trained since the engine was built or reset before this epoch; ``start``: the
    internal iteration the threads start at (0, or the highest stage when batches were adopted);
    ``first_iteration``: internal iteration 0 of this epoch counted on over the epochs before it
    (the iteration observers and the stream checker see); ``slots``: batch -> its values (one dict
    for the engine's life, emptied per epoch); ``numbers``: batch -> its number; ``held``: batches
    the source drew (or that were adopted) and ``step()`` has not returned yet;
    ``events``: (task, batch) -> the device event recorded after it; ``num_batches`` (M): set
    when the source found the end of data at batch M; ``stopped``: the plan stopped there
    (``on_exhausted="stop"``); ``renumbered``: source calls of this epoch that found the end
    under a stop and were followed by more data (each took a batch number); ``next_claim``: the
    batch whose draw is next (several loads take turns); ``requested`` / ``returned``: batches
    ``step()`` was asked for / handed out; ``end_reported``: the last step() raised
    StopIteration for the end of data; ``restart_after_drain``: new data came while draining.
    """

    first_number: int = 0
    first_serial: int = 0
    first_trained: int = 0
    start: int = 0
    first_iteration: int = 0
    slots: dict[int, dict[str, Any]] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)
    numbers: dict[int, int] = field(default_factory=dict)
    events: dict[tuple[str, int], Any] = field(default_factory=dict)
    num_batches: int | None = None
    stopped: bool = False
    renumbered: int = 0
    next_claim: int = 0
    requested: int = 0
    returned: int = 0
    end_reported: bool = False
    restart_after_drain: bool = False

    def number(self, b: int) -> int:
        """Batch ``b``'s number (its source call since the engine was built or reset)."""
        return self.first_number + b + self.renumbered

    def number_of(self, b: int) -> int:
        """The number batch ``b`` was drawn with (``number(b)`` if not drawn yet)."""
        return self.numbers.get(b, self.number(b))

    def serial(self, b: int) -> int:
        return self.first_serial + b

    def in_flight(self) -> list[int]:
        """Batches drawn and not yet returned, in order."""
        return sorted(b for b in self.held if b >= self.returned)

    @property
    def ended(self) -> bool:
        """The data is exhausted and no batch is left to return (or the plan stopped)."""
        return self.stopped or (self.num_batches is not None and self.returned >= self.num_batches)

    def exists(self, b: int) -> bool | None:
        """Whether batch ``b`` was drawn (True), will never be (False), or is not known yet (None:
        the source has not looked for it). While stopped, nothing at or past the end is known."""
        if b in self.held or 0 <= b < self.returned:
            return True
        if b < 0:
            return False
        m = self.num_batches
        if m is not None and b >= m and not self.stopped:
            return False
        return None


class Batches:
    """The engine's batches: this epoch's ``book``, the ``ledger`` over its life, the slots, and
    ``next_number``, the batch number the source's next call gets (its calls since the engine was
    built or reset). Every change to them is one of these methods; the engine holds the board's
    lock around those that workers race on."""

    def __init__(self) -> None:
        self.ledger = BatchLedger()
        self.slots: dict[int, dict[str, Any]] = {}  # every epoch's book holds this one dict
        self.book = BatchBook(slots=self.slots)
        self.next_number = 0

    # ----------------------------------------------------------- the caller
    def ask(self, d: int) -> bool:
        """``step()`` asks for batch ``d``; whether that is a new request (workers may go on)."""
        book = self.book
        book.end_reported = False
        if book.requested > d:
            return False
        book.requested = d + 1
        return True

    def report_end(self) -> None:
        """``step()`` raised StopIteration for the end of the data."""
        self.book.end_reported = True

    def retire(self, d: int, output: str | None, keep_slots: int, keep_events: int, recorded: tuple[str, ...]) -> Any:
        """Batch ``d`` leaves: its ``output`` value; its slot and ``recorded`` tasks' events go once
        no later batch reads them (``keep_slots`` / ``keep_events`` batches back)."""
        book = self.book
        slots = book.slots
        value = slots[d].get(output) if output is not None else None
        book.returned = d + 1
        book.held.discard(d)
        book.numbers.pop(d, None)
        self.ledger.trained += 1
        slots.pop(d - keep_slots, None)
        events = book.events
        if events:  # batches leave one by one, in order: each pop removes what every earlier one left
            for task in recorded:
                events.pop((task, d - keep_events), None)
        return value

    def observed_iteration(self, b: int, s: int) -> int:
        """The iteration observers see for batch ``b``'s task of stage ``s`` (numbered on over epochs)."""
        return self.book.first_iteration + b + s

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        book = self.book
        reason = "left in flight: the plan stopped at the end of data" if book.stopped else "in flight"
        return [*self.ledger.dropped, *((book.serial(b), reason) for b in book.in_flight())]

    # ----------------------------------------------------------- the source
    def open_slot(self, b: int) -> None:
        """The source is about to draw batch ``b``: its slot, empty."""
        self.slots[b] = {}

    def drop_slot(self, b: int) -> None:
        """Batch ``b``'s draw found nothing or failed: no slot."""
        self.slots.pop(b, None)

    def hold(self, b: int) -> None:
        """The source drew batch ``b``: held, numbered, counted in the ledger."""
        book = self.book
        book.held.add(b)
        number = book.numbers[b] = book.number(b)
        self.ledger.drawn += 1
        if number >= self.next_number:
            self.next_number = number + 1

    def found_end(self, b: int, stop: bool) -> None:
        """The source found the end of data at batch ``b`` (``stop``: under ``on_exhausted="stop"``)."""
        book = self.book
        if book.num_batches is None or b < book.num_batches:
            book.num_batches = b
        self.next_number = max(self.next_number, book.number(b) + 1)
        if stop:
            book.stopped = True

    def claimed(self, b: int) -> None:
        """Batch ``b``'s draw was made (several loads take turns)."""
        book = self.book
        if book.next_claim <= b:
            book.next_claim = b + 1

    def count_past_end(self) -> None:
        """An item drawn for the common end of uneven data (``BatchLedger.past_end``)."""
        self.ledger.past_end += 1

    def record_event(self, task: str, b: int, event: Any) -> None:
        self.book.events[(task, b)] = event

    # ------------------------------------------------------------- epochs
    def new_epoch(self, start: int, first_trained: int | None, first_iteration: int) -> None:
        """A new book (the batches in flight go to the ledger as dropped); batches trained count on
        from the last epoch's unless ``first_trained`` says otherwise."""
        book = self.book
        if first_trained is None:
            first_trained = book.first_trained + book.returned
        for b in book.in_flight():
            self.ledger.dropped.append((book.serial(b), "in flight when reset() was called"))
        self.slots.clear()
        self.book = BatchBook(
            first_number=self.next_number,
            first_serial=self.ledger.drawn,
            first_trained=first_trained,
            start=start,
            first_iteration=first_iteration,
            slots=self.slots,
        )

    def restart_numbers(self, number: int = 0) -> None:
        """The source's next call gets batch number ``number`` (a reset: 0; a resume: the cut's)."""
        self.next_number = number

    def restore_ledger(self, ledger: BatchLedger) -> None:
        self.ledger = ledger

    def resume_after_stop(self) -> None:
        """New data after a stop at the end of data: the source's call that found it took a number."""
        book = self.book
        book.stopped = False
        book.num_batches = None
        book.renumbered += 1

    def restart_after_drain(self) -> None:
        """New data came while draining: the step after the last batch starts the next epoch."""
        self.book.restart_after_drain = True

    def count_trained_from(self, n: int) -> None:
        self.book.first_trained = n - self.book.returned

    def adopt(self, slots: list[dict[str, Any]]) -> None:
        """Batches loaded elsewhere in flight, ``slots[j]`` batch ``j``'s values (in a new book)."""
        book = self.book
        for j, values in enumerate(slots):
            book.slots[j] = dict(values)
            book.held.add(j)
        book.next_claim = len(slots)
        self.ledger.drawn += len(slots)
        self.next_number += len(slots)

    def end_after(self, n: int) -> None:
        """The data ends after batch ``n - 1`` (adopted batches fewer than the stages above the source)."""
        self.book.num_batches = n
