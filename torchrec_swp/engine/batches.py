"""The life of every batch: drawn, in its slot, trained or dropped; epochs; the ledger.

``Batches`` is the engine's part that keeps them, and the only one that changes them: the
engine, its ops and its epochs tell it what happened (``ask``, ``drawn``, ``found_end``,
``retire``, ``new_epoch``...) and read its records, one ``BatchBook`` per epoch and the
``BatchLedger``. The end of data is its ``end`` (``torchrec_swp.engine.end_of_data``): the one
state machine that says whether a batch exists and whether the data has ended.

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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torchrec_swp.engine.end_of_data import EndEvent, EndOfData, Then
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.tasks import Around, Binding, Invoker, TaskTimer, named
from torchrec_swp.plan import PipelineTask
from torchrec_swp.plan.task import parse_read, read_argument

Slots = dict[int, dict[str, Any]]


@dataclass
class BatchLedger:
    """What became of every batch the source drew, across epochs and resets.

    Batches are numbered by ``serial`` in the order they were drawn (0, 1, ... over the
    engine's life). A batch is trained once it left the highest stage; one that never will is
    listed in ``dropped`` with the reason. ``dropped_past_end`` counts the items drawn for the common end
    of uneven data (``sync_dataloader_exhaustion``: this rank had one, another had none): never
    batches, never trained, not counted in ``drawn``. ``failed_draws`` lists the draws that
    failed inside the iterator's own ``next()`` where it cannot draw the same item again (no
    ``load_state_dict()`` to go back, no ``claim()``/``fetch()``), as (the serial of the batch it
    was drawing, the error): the item that call took, if any, is not trained; the batch was drawn
    again from the next item. A draw whose iterator can go back, or that failed after its
    ``next()`` returned, is retried with the same item and listed nowhere.
    """

    drawn: int = 0
    trained: int = 0
    dropped: list[tuple[int, str]] = field(default_factory=list)
    dropped_past_end: int = 0
    failed_draws: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class BatchBook:
    """The batches of one epoch (numbered ``b`` = 0, 1, ...).

    ``first_number``: the batch number of batch 0; ``first_serial``: its serial; ``first_trained``:
    the batches trained since the engine was built or reset before this epoch; ``start``: the
    internal iteration the threads start at (0, or the highest stage when batches were adopted);
    ``first_iteration``: internal iteration 0 of this epoch counted on over the epochs before it
    (the iteration observers and the stream checker see); ``slots``: batch -> its values (one dict
    for the engine's life, emptied per epoch); ``numbers``: batch -> its number; ``in_flight``:
    batches the source drew (or that were adopted) and ``step()`` has not returned yet;
    ``device_events``: (task, batch) -> the device event recorded after it; ``renumbered``: source
    calls of this epoch that found the end under a stop and were followed by more data (each took
    a batch number); ``next_claim``: the batch whose draw is next (several loads take turns);
    ``requested`` / ``returned``: batches ``step()`` was asked for / handed out. The end of data
    is not the book's: ``Batches.end``.
    """

    first_number: int = 0
    first_serial: int = 0
    first_trained: int = 0
    start: int = 0
    first_iteration: int = 0
    slots: dict[int, dict[str, Any]] = field(default_factory=dict)
    in_flight: set[int] = field(default_factory=set)
    numbers: dict[int, int] = field(default_factory=dict)
    device_events: dict[tuple[str, int], Any] = field(default_factory=dict)
    renumbered: int = 0
    next_claim: int = 0
    requested: int = 0
    returned: int = 0

    def number(self, b: int) -> int:
        """Batch ``b``'s number (its source call since the engine was built or reset)."""
        return self.first_number + b + self.renumbered

    def number_of(self, b: int) -> int:
        """The number batch ``b`` was drawn with (``number(b)`` if not drawn yet)."""
        return self.numbers.get(b, self.number(b))

    def serial(self, b: int) -> int:
        return self.first_serial + b


class Batches:
    """The engine's batches: this epoch's ``book``, the ``ledger`` over its life, the slots, and
    ``next_number``, the batch number the source's next call gets (its calls since the engine was
    built or reset). Every change to them is one of these methods; the engine holds the board's
    lock around those that workers race on."""

    def __init__(self) -> None:
        self.ledger = BatchLedger()
        self.slots: dict[int, dict[str, Any]] = {}  # every epoch's book holds this one dict
        self.book = BatchBook(slots=self.slots)
        self.end = EndOfData(self.book)
        self.next_number = 0

    # ----------------------------------------------------------- the caller
    def ask(self, d: int) -> bool:
        """``step()`` asks for batch ``d``; whether that is a new request (workers may go on)."""
        book = self.book
        if book.requested > d:
            return False
        book.requested = d + 1
        return True

    def report_end(self) -> None:
        """``step()`` raised StopIteration for the end of the data."""
        self.end.report()

    def retire(
        self,
        d: int,
        output: str | None,
        keep_slots: int,
        kept: frozenset[str],
        keep_events: int,
        recorded: tuple[str, ...],
    ) -> Any:
        """Batch ``d`` leaves: its ``output`` value; of its slot, the values a later batch reads
        (``kept``) stay until ``keep_slots`` batches later, the others go now (as upstream drops a
        batch's losses and gradients when its step ends); ``recorded`` tasks' events go once no
        later batch waits for them (``keep_events`` batches back)."""
        book = self.book
        slots = book.slots
        slot = slots[d] if output is not None else slots.get(d)
        value = None if output is None or slot is None else slot.get(output)
        book.returned = d + 1
        book.in_flight.discard(d)
        book.numbers.pop(d, None)
        self.ledger.trained += 1
        if keep_slots and slot:
            for name in [n for n in slot if n not in kept]:
                del slot[name]
        slots.pop(d - keep_slots, None)
        events = book.device_events
        if events:  # batches leave one by one, in order: each pop removes what every earlier one left
            for task in recorded:
                events.pop((task, d - keep_events), None)
        return value

    # ------------------------------------------------------------- task calls
    def invoker(
        self,
        io: PipelineTask,
        fn: Binding,
        extra: Callable[[int], dict[str, Any]] | None = None,
        around: Around | None = None,
        timed: TaskTimer | None = None,
    ) -> Invoker:
        """A task's call ``invoke(b)``: ``fn`` with batch ``b``'s reads from the slots, its writes
        stored back (``make_invoker``): the one code besides these methods that writes a slot."""
        return make_invoker(io, fn, self.slots, extra, around, timed)

    def alias(
        self, pairs: tuple[tuple[str, str], ...], around: Around | None = None, timed: TaskTimer | None = None
    ) -> Invoker:
        """The call-free stand-in of a task that is a no-op on this device (``make_alias``)."""
        return make_alias(pairs, self.slots, around, timed)

    def slot(self, b: int) -> Mapping[str, Any]:
        """Batch ``b``'s values, read-only (empty when it is not in flight)."""
        return MappingProxyType(self.slots.get(b, {}))

    def observed_iteration(self, b: int, s: int) -> int:
        """The iteration observers see for batch ``b``'s task of stage ``s`` (numbered on over epochs)."""
        return self.book.first_iteration + b + s

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        book = self.book
        reason = "left in flight: the plan stopped at the end of data" if self.end.stopped() else "in flight"
        return [*self.ledger.dropped, *((book.serial(b), reason) for b in sorted(book.in_flight))]

    # ----------------------------------------------------------- the source
    def open_slot(self, b: int) -> None:
        """The source is about to draw batch ``b``: its slot, empty."""
        self.slots[b] = {}

    def drop_slot(self, b: int) -> None:
        """Batch ``b``'s draw found nothing or failed: no slot."""
        self.slots.pop(b, None)

    def drawn(self, b: int) -> bool:
        """The source drew batch ``b``: in flight, numbered, counted in the ledger; its draw's turn
        taken (``claimed``), if the draw did not say so itself. False (not in flight) where it
        was retracted while its source call still ran (``retract``: it is past the end)."""
        book = self.book
        if book.next_claim <= b:
            book.next_claim = b + 1
        if self.end.past_end(b):
            return False
        book.in_flight.add(b)
        number = book.numbers[b] = book.first_number + b + book.renumbered  # book.number(b), inline
        self.ledger.drawn += 1
        if number >= self.next_number:
            self.next_number = number + 1
        return True

    def found_end(self, b: int, stop: bool) -> None:
        """The source found the end of data at batch ``b`` (``stop``: under ``on_exhausted="stop"``)."""
        self.end.found(b, stop)
        self.next_number = max(self.next_number, self.book.number(b) + 1)

    def claimed(self, b: int) -> None:
        """Batch ``b``'s draw was made (several loads take turns)."""
        book = self.book
        if book.next_claim <= b:
            book.next_claim = b + 1

    def failed_draw(self, b: int, error: str) -> int:
        """Batch ``b``'s draw failed inside an iterator that cannot draw the same item again
        (``BatchLedger.failed_draws``); the serial it was drawn for."""
        serial = self.book.serial(b)
        self.ledger.failed_draws.append((serial, error))
        return serial

    def count_dropped_past_end(self, b: int) -> None:
        """An item drawn for batch ``b``, the common end of uneven data (``BatchLedger.dropped_past_end``)."""
        self.end.common(b)
        self.ledger.dropped_past_end += 1

    def retract(self, b: int) -> bool:
        """Batch ``b``, drawn or still in its source call, is the common end of uneven data after
        all (the ranks' deferred agreement: ``torchrec_swp.engine.exhaustion``): out of flight and
        of ``drawn``, counted in ``dropped_past_end``, and the data ends there. Whether it was in flight
        (else its source call still runs, and ``drawn(b)`` will say False). Its slot stays until
        the epoch ends."""
        book = self.book
        was = b in book.in_flight
        if was:
            book.in_flight.discard(b)
            book.numbers.pop(b, None)
            self.ledger.drawn -= 1
        self.count_dropped_past_end(b)
        self.found_end(b, False)
        return was

    def record_event(self, task: str, b: int, event: Any) -> None:
        self.book.device_events[(task, b)] = event

    # ------------------------------------------------------------- epochs
    def new_epoch(
        self, why: EndEvent, start: int, first_trained: int | None, first_iteration: int, kept: Sequence[int] = ()
    ) -> None:
        """A new book for ``why`` (an event of ``end`` that begins an epoch; the batches in flight go
        to the ledger as dropped, and so do the batches ``kept``: drawn, their source call failed,
        not retried); batches trained count on from the last epoch's unless ``first_trained`` says
        otherwise."""
        book = self.book
        if first_trained is None:
            first_trained = book.first_trained + book.returned
        new = BatchBook(
            first_number=self.next_number,
            first_serial=self.ledger.drawn,
            first_trained=first_trained,
            start=start,
            first_iteration=first_iteration,
            slots=self.slots,
        )
        self.end.begin(why, new)  # EngineError, changing nothing, where the end of data allows no new epoch
        for b in sorted(book.in_flight):
            self.ledger.dropped.append((book.serial(b), "in flight when reset() was called"))
        for b in kept:
            self.ledger.drawn += 1
            self.ledger.dropped.append((book.serial(b), "drawn, its source call failed, not retried before reset()"))
        self.slots.clear()
        self.book = new

    def restart_numbers(self, number: int = 0) -> None:
        """The source's next call gets batch number ``number`` (a reset: 0; a resume: the cut's)."""
        self.next_number = number

    def restore_ledger(self, ledger: BatchLedger) -> None:
        self.ledger = ledger

    def new_data(self) -> Then:
        """The source has new data (``EndOfData.new_data``); after a stop, the source's call that
        found it took a number."""
        then = self.end.new_data()
        if then is Then.GO_ON:
            self.book.renumbered += 1
        return then

    def count_trained_from(self, n: int) -> None:
        self.book.first_trained = n - self.book.returned

    def rolled_back(self, b: int) -> None:
        """Batch ``b``'s step was rolled back (``Transaction.listen``): on the clock ``"trained"`` it
        does not count, the batches after it are numbered one less."""
        self.book.first_trained -= 1

    def adopt(self, slots: list[dict[str, Any]]) -> None:
        """Batches loaded elsewhere in flight, ``slots[j]`` batch ``j``'s values (in a new book)."""
        book = self.book
        for j, values in enumerate(slots):
            book.slots[j] = dict(values)
            book.in_flight.add(j)
        book.next_claim = len(slots)
        self.ledger.drawn += len(slots)
        self.next_number += len(slots)

    def end_after(self, n: int) -> None:
        """The data ends after batch ``n - 1`` (adopted batches fewer than the stages above the source)."""
        self.end.found(n)


# ----------------------------------------------------------------- task calls
def make_invoker(
    io: PipelineTask,
    fn: Binding,
    slots: Slots,
    extra: Callable[[int], dict[str, Any]] | None = None,
    around: Around | None = None,
    timed: TaskTimer | None = None,
) -> Invoker:
    """``invoke(b)``: call ``fn`` with batch ``b``'s reads and store what it returns as ``b``'s writes.
    ``extra(b)`` gives keyword arguments of its own (the source's ``data``); ``around(b)`` is a
    context manager the reads and the call run in (``task_context``); ``timed`` times each
    instance for an observer (``task_timer``).

    One frame between the engine and ``fn``, named ``<task T>`` in tracebacks."""
    task, writes = io.name, io.writes
    count, first = len(writes), writes[0] if writes else ""
    one = _one_read(io)
    if one is not None and count <= 1 and extra is None and around is None and timed is None:
        return named(_plain_invoker(task, fn, slots, *one, first if count else None), task)
    arguments = _arguments(io, slots, extra)

    def invoke(b: int) -> None:
        mark = timed.start() if timed is not None else None
        try:
            if around is None:
                values = fn(b) if arguments is None else fn(b, **arguments(b))
            else:
                with around(b):
                    values = fn(b) if arguments is None else fn(b, **arguments(b))
            if count == 1:
                slots[b][first] = values
            elif count:
                _store(task, writes, slots[b], values)
        finally:
            if timed is not None:
                timed.stop(b, mark)

    return named(invoke, task)


def _one_read(io: PipelineTask) -> tuple[str, str] | None:
    """``(keyword, data name)`` of a task that reads one value of its own batch, else None."""
    if len(io.reads) != 1:
        return None
    (read,) = io.reads
    data, back = parse_read(read)
    return (read_argument(read), data) if back == 0 else None


def _plain_invoker(task: str, fn: Binding, slots: Slots, arg: str, data: str, write: str | None) -> Invoker:
    """``make_invoker``'s call for the common case - one value of its own batch read, at most one
    written, nothing around it - with no call but ``fn``'s."""

    def invoke(b: int) -> None:
        try:
            slot = slots[b]
            value = slot[data]
        except KeyError as e:
            raise never_written(task, e, b) from None
        if write is None:
            fn(b, **{arg: value})
        else:
            slot[write] = fn(b, **{arg: value})

    return invoke


def _arguments(
    io: PipelineTask, slots: Slots, extra: Callable[[int], dict[str, Any]] | None
) -> Callable[[int], dict[str, Any]] | None:
    """``arguments(b)``: the keyword arguments of ``io``'s call for batch ``b`` (None: it takes none)."""
    task = io.name
    reads = tuple((read_argument(r), *parse_read(r)) for r in io.reads)  # (keyword, data name, batches back)
    if not reads:
        return extra
    if len(reads) == 1 and reads[0][2] == 0 and extra is None:  # the common case, without a loop
        ((arg, data, _),) = reads

        def one(b: int) -> dict[str, Any]:
            try:
                return {arg: slots[b][data]}
            except KeyError as e:
                raise never_written(task, e, b) from None

        return one

    def many(b: int) -> dict[str, Any]:
        args = {}
        try:
            for arg, data, k in reads:
                args[arg] = slots[b][data] if k == 0 else previous(slots, b - k, data)
        except KeyError as e:
            raise never_written(task, e, b) from None
        if extra is not None:
            args.update(extra(b))
        return args

    return many


def never_written(task: str, e: KeyError, b: int) -> EngineError:
    """The error of a read of batch ``b``'s slot that finds nothing (``e``, the KeyError)."""
    return EngineError(f"task {task} reads {e.args[0]!r} of batch {b}, which was never written")


def _store(task: str, writes: tuple[str, ...], slot: dict[str, Any], values: Any) -> None:
    if not isinstance(values, tuple) or len(values) != len(writes):
        raise EngineError(f"task {task} must return a tuple of {len(writes)} values for {writes}, got {values!r}")
    for k, v in zip(writes, values):
        slot[k] = v


def make_alias(
    pairs: tuple[tuple[str, str], ...], slots: Slots, around: Around | None = None, timed: TaskTimer | None = None
) -> Invoker:
    """The call-free stand-in of a task that is a no-op on this device: ``write = read``."""

    def alias(b: int) -> None:
        mark = timed.start() if timed is not None else None
        try:
            if around is None:
                _copy(pairs, slots[b])
            else:
                with around(b):
                    _copy(pairs, slots[b])
        finally:
            if timed is not None:
                timed.stop(b, mark)

    return alias


def _copy(pairs: tuple[tuple[str, str], ...], slot: dict[str, Any]) -> None:
    for write, read in pairs:
        slot[write] = slot[read]


def previous(slots: Slots, b: int, data: str) -> Any:
    """``data`` of batch ``b`` (an earlier one), or None when that batch is not in flight."""
    slot = slots.get(b)
    return None if slot is None else slot[data]
