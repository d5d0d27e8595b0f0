"""The source: how its task sees the data (``Draws``, the iterator given to ``step()``, drawn in
batch order), which iterator serves which batch (``Feed``), and when it may draw (``Source``:
the credit, the turns of several loads, the end of data).

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

Uneven data: given an ``ExhaustionSync`` (``sync_dataloader_exhaustion``), every draw begins,
within its turn, the ranks' agreement on whether every rank has the batch
(``torchrec_swp.engine.exhaustion``). It is deferred (``retractor(b)`` gives the callback): the
draw goes on, and the first task of the batch that needs the answer waits for it (the ops'
gate); where one rank has not the batch, it is retracted on every rank that drew it
(``Source.retract``) and the data ends there. Where the plan needs the answer in the draw itself
(``retractor(b)`` gives None: a source task that is a collective, a plan that stops at the
end), the draw waits for it and raises StopIteration on every rank, and an item this rank drew
for it is dropped (``dropped(b)``). Either way the item is never trained.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torchrec_swp.compile import Run
from torchrec_swp.engine.batches import Batches
from torchrec_swp.engine.errors import FailedDrawWarning, Stopped
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.installed import InstalledPlans
from torchrec_swp.engine.walkers import Op, Walker
from torchrec_swp.plan import PipelinePlan

if TYPE_CHECKING:
    from torchrec_swp.engine.interpreter import Interpreter
    from torchrec_swp.engine.tasks import Invoker


class Draws:
    """``iterator`` as the source task draws it; ``take_turn(b)`` blocks until batch ``b`` may
    draw, ``turn_taken(b, ended)`` says it drew (or found the end); with ``sync``, the ranks agree
    on the end, and ``dropped(b)`` hears of an item drawn for batch ``b`` past the common end.

    A draw that fails is never silently lost (``pulled``, ``failed``): an item drawn for batch
    ``b`` whose source call then failed (its fetch, its copy, ...) is kept and handed out again
    when batch ``b`` is drawn again (the next ``step()`` retries it); a failure inside the
    iterator's own ``next()`` (or ``claim()``) is undone where the iterator can go back
    (``load_state_dict()`` of the position recorded before the draw), so the retry draws the same
    item; where it cannot, ``failed(b, error)`` hears of it: the item, if the failed call took
    one, is not trained (the engine's ledger lists it in ``failed_draws``)."""

    def __init__(
        self,
        iterator: Iterator[Any],
        *,
        take_turn: Callable[[int], None],
        turn_taken: Callable[[int, bool], None],
        sync: ExhaustionSync | None = None,
        dropped: Callable[[int], None] | None = None,
        failed: Callable[[int, BaseException, bool], None] | None = None,
        retractor: Callable[[int], Callable[[], None] | None] | None = None,
    ) -> None:
        # the user's iterator, duck-typed: its claim/fetch/state_dict are asked only where a feature checked
        # it has them (the type: ignore[attr-defined] below)
        self.iterator = iterator
        self._retractor = retractor
        self._take_turn = take_turn
        self._turn_taken = turn_taken
        self._sync = sync
        self._dropped = dropped
        self._failed = failed
        self._local = threading.local()
        self._split = callable(getattr(iterator, "claim", None)) and callable(getattr(iterator, "fetch", None))
        self._stateful = callable(getattr(iterator, "state_dict", None))
        self._rewinds = self._stateful and callable(getattr(iterator, "load_state_dict", None))
        self.positions: dict[int, Any] = {}
        #: batch -> what its draw took from the iterator (the item, or a split draw's claim) while
        #: its source call has not succeeded: the same item is handed out again on a retry
        self.pulled: dict[int, Any] = {}

    @property
    def splits(self) -> bool:
        """Whether the iterator splits a draw into ``claim()`` and ``fetch()`` (several loads then
        fetch at once; ``torchrec_swp.data.MapSource`` does)."""
        return self._split

    @property
    def stateful(self) -> bool:
        """Whether the iterator has ``state_dict()`` (its positions are recorded)."""
        return self._stateful

    def drawing(self, b: int) -> None:
        """The calling thread's source call draws batch ``b``."""
        self._local.batch = b

    def called(self, b: int, ok: bool) -> None:
        """The calling thread's source call for batch ``b`` returned (``ok``: or found the end, and
        nothing of it is to be handed out again) or failed (what it drew is kept for the retry)."""
        self._local.batch = None
        if ok:
            self.pulled.pop(b, None)

    def __iter__(self) -> Draws:
        return self

    def __next__(self) -> Any:
        b = getattr(self._local, "batch", None)
        if b is None:  # not inside a source call: the iterator as it is
            return next(self.iterator)
        pulled = self.pulled
        if b in pulled:  # batch b's source call failed after its draw: the same item again
            drawn = pulled[b]
        else:
            self._take_turn(b)
            if self._stateful:
                self.positions[b] = self.iterator.state_dict()  # type: ignore[attr-defined]
            try:
                if self._sync is None:
                    drawn = self.iterator.claim() if self._split else next(self.iterator)  # type: ignore[attr-defined]
                else:
                    retract = None if self._retractor is None else self._retractor(b)
                    if retract is not None:  # deferred: the batch's first task that needs the answer waits
                        drawn = self._sync.begin(b, self._pull, retract)
                    else:
                        drawn = self._sync.draw(self._pull, lambda _: self._drop(b))
            except StopIteration:
                self._turn_taken(b, True)
                raise
            except Exception as e:
                self._draw_failed(b, e)
                raise
            pulled[b] = drawn
            self._turn_taken(b, False)
        return self.iterator.fetch(drawn) if self._split else drawn  # type: ignore[attr-defined]

    def _pull(self) -> Any:
        return self.iterator.claim() if self._split else next(self.iterator)  # type: ignore[attr-defined]

    def _draw_failed(self, b: int, error: BaseException) -> None:
        """The iterator raised ``error`` drawing batch ``b``: back to the position before the
        draw where it can go back (the retry draws the same item), else ``failed(b, error, ended)``
        (``ended``: the iterator is a generator, which the error finished)."""
        if self._rewinds and b in self.positions:
            try:
                self.iterator.load_state_dict(self.positions[b])  # type: ignore[attr-defined]
                return
            except Exception as rewind:  # cannot go back after all: as if it had no positions
                error.add_note(f"torchrec_swp: going back to the position before batch {b} failed: {rewind!r}")
        if self._failed is not None:
            # a generator that raised is finished: its next() only says StopIteration
            ended = inspect.isgenerator(self.iterator) and self.iterator.gi_frame is None
            self._failed(b, error, ended)

    def _drop(self, b: int) -> None:
        if self._dropped is not None:
            self._dropped(b)

    def forget_positions(self, before: int | None = None) -> None:
        """Drop the positions of batches before ``before`` (trained; None: every batch's)."""
        if before is None:
            self.positions.clear()
            return
        for b in [k for k in self.positions if k < before]:
            del self.positions[b]


class Feed:
    """The data the engine's source draws from: the iterator the last ``step(data)`` gave, and
    which ``Draws`` serves which batch. A new iterator serves the batches no ``step()`` call had
    made drawable yet (and the one that found a stop): a thread that draws an older batch after
    that call still draws it from the iterator of the call that made it drawable, as a plan on one
    thread would have. ``take_turn``, ``turn_taken``, ``sync``, ``dropped`` and ``failed`` go to
    every ``Draws`` it makes."""

    def __init__(
        self,
        *,
        take_turn: Callable[[int], None],
        turn_taken: Callable[[int, bool], None],
        sync: ExhaustionSync | None,
        dropped: Callable[[int], None],
        failed: Callable[[int, BaseException, bool], None],
        retractor: Callable[[int], Callable[[], None] | None] | None = None,
    ) -> None:
        self._take_turn, self._turn_taken, self._sync, self._dropped = take_turn, turn_taken, sync, dropped
        self._failed, self._retractor = failed, retractor
        self.data: Iterator[Any] | None = None  # the iterator the last step(data) gave
        self.draws: Draws | None = None  # its Draws
        self._from: list[tuple[int, Draws]] = []  # (first batch, its Draws), in order

    def take(self, data: Iterator[Any], first: int) -> None:
        """``data`` serves batch ``first`` and the later ones."""
        self.data = data
        self.draws = Draws(
            data,
            take_turn=self._take_turn,
            turn_taken=self._turn_taken,
            sync=self._sync,
            dropped=self._dropped,
            failed=self._failed,
            retractor=self._retractor,
        )
        self._from = [(f, d) for f, d in self._from if f < first] + [(first, self.draws)]

    def draws_for(self, b: int) -> Draws | None:
        """The data batch ``b`` is drawn from: the iterator of the ``step()`` call that made it
        drawable (a thread may draw it after that call returned)."""
        for first, draws in reversed(self._from):
            if b >= first:
                return draws
        return None

    def argument(self, b: int) -> dict[str, Any]:
        """The source's keyword arguments for batch ``b``: ``data`` (``draws_for(b)``), once
        there is some."""
        draws = self.draws_for(b)
        return {} if draws is None else {"data": draws}

    def kept(self) -> list[int]:
        """The batches whose item was drawn and whose source call failed, not retried since (a
        ``reset()`` drops them: ``Batches.new_epoch``)."""
        return sorted({b for _, draws in self._from for b in draws.pulled})

    def new_epoch(self) -> None:
        """Batches are numbered from 0 again: the current iterator serves them all (an item kept
        for a retry is for an old number: dropped, ``kept()`` names them first)."""
        for _, draws in self._from:
            draws.pulled.clear()
        if self.draws is not None:
            self.draws.forget_positions()
            self._from = [(0, self.draws)]

    def forget(self) -> None:
        """Forget the iterator: the next ``step(data)`` takes ``data`` as the first one."""
        self.data = self.draws = None
        self._from = []


class Source:
    """The source task's side of the engine: the op of ``run! S`` (its lane, the ``credit``, the
    draw into the batch's slot, the end of data), the turns several loads take, and the ``Feed``
    it draws from. ``check_stop`` is the end of data's (``EndOfData.check_stop``: park past the
    plan's stop), ``wait`` and ``in_task`` the plan ops' (``torchrec_swp.engine.ops.PlanOps``,
    which makes the source: wait at an internal iteration, run a task inside the checker's label)."""

    def __init__(
        self,
        interpreter: Interpreter,
        batches: Batches,
        installed: InstalledPlans,
        *,
        check_stop: Callable[[int], None],
        wait: Callable[[int, Callable[[], bool], Callable[[], str]], None],
        in_task: Callable[[Walker, str, int, Invoker], None],
        checker: Any,
        exhaustion: ExhaustionSync | None,
        undo_draw: Callable[[int, Mapping[str, Any]], None] | None = None,
    ) -> None:
        self._interpreter = interpreter
        self._undo_draw = undo_draw
        self._board = interpreter.board
        self._batches = batches
        self._installed = installed  # their shape: the highest stage, the lanes, whether other threads walk
        self._check_stop, self._wait, self._in_task = check_stop, wait, in_task
        self._checker = checker
        self.feed = Feed(
            take_turn=self.take_turn,
            turn_taken=self.turn_taken,
            sync=exhaustion,
            dropped=self.past_common_end,
            failed=self.draw_failed,
            retractor=self.retractor,
        )

    def op(self, instr: Run) -> Op:
        """``run! S``: batch ``b``'s draw on its lane, once the credit allows; the end of data."""
        task, stage, lanes, ticket, group = instr.task, instr.stage, instr.lanes, instr.ticket, instr.comm_group
        wait, end = self._wait, self._batches.end
        exists_at, end_at = end.exists_at, end.end_at
        draw_batch = self.drawer(instr)

        def draw(w: Walker, P: int) -> None:
            b = P - stage
            w.current = (task, b)
            if b < 0 or (lanes > 1 and b % lanes != w.lane):
                end.check_stop(P)
                return
            known = exists_at(b, P)  # Stopped past a stop
            if known:
                return
            if known is False:  # past the end
                if ticket is not None:
                    self._interpreter.skip_ticket(w, group, ticket)
                return
            plan = w.inst.plan
            if not self.credit(b, plan):
                wait(
                    P,
                    lambda: self.credit(b, plan) or end_at() is not None,
                    lambda: f"credit to draw batch {b} (depth {plan.pipeline_depth}, lookahead {plan.lookahead})",
                )
                if exists_at(b, P) is not None:  # the end came meanwhile (Stopped past a stop)
                    return
            draw_batch(w, b, plan)

        return draw

    def drawer(self, instr: Run) -> Callable[[Walker, int, PipelinePlan], None]:
        """``draw_batch(w, b, plan)``: batch ``b``'s draw once its gates passed (its lane, its
        existence not known yet, the credit): its slot opened, the source's call (holding its
        ticket if it has one), the batch in flight, or the end of data found. What ``op`` runs
        after its gates."""
        task, ticket, group = instr.task, instr.ticket, instr.comm_group
        batches, board, draws_for, installed = self._batches, self._board, self.feed.draws_for, self._installed
        check_stop, in_task = self._check_stop, self._in_task
        plain = ticket is None and self._checker is None

        def draw_batch(w: Walker, b: int, plan: PipelinePlan) -> None:
            invoke = w.inst.invokers[task]
            batches.open_slot(b)
            draws = draws_for(b)
            if draws is not None:
                draws.drawing(b)  # its next(): its turn, its position, the ranks' agreement, a retry's item
            try:
                if plain:
                    invoke(b)
                elif self._checker is not None:
                    self._interpreter.ticketed(w, group, ticket, task, b, check_stop, in_task, w, task, b, invoke)
                else:
                    self._interpreter.ticketed(w, group, ticket, task, b, check_stop, invoke, b)
            except StopIteration:
                batches.drop_slot(b)
                if draws is not None:
                    draws.called(b, True)
                self.found_end(b, plan)
                return
            except BaseException:
                batches.drop_slot(b)
                if draws is not None:
                    draws.called(b, False)  # what it drew is kept: the retry gets it
                raise
            if draws is not None:
                draws.called(b, True)
            if not installed.shape.threaded:  # nobody else reads the book: no lock, nobody to wake
                if not batches.drawn(b):
                    self.undo(b)
                return
            with board.lock:
                if not batches.drawn(b):
                    self.undo(b)
                board.notify()

        return draw_batch

    def credit(self, b: int, plan: PipelinePlan) -> bool:
        """Whether the source may draw batch ``b``: at most ``pipeline_depth + lookahead`` batches
        in flight, and no earlier than ``lookahead`` batches before the ``step()`` call that
        single-thread order draws it in (with lookahead 0, in that very call)."""
        book = self._batches.book
        return (
            b < book.returned + plan.pipeline_depth + plan.lookahead
            and b < book.requested + self._installed.shape.top + plan.lookahead
        )

    def found_end(self, b: int, plan: PipelinePlan) -> None:
        """Batch ``b``'s draw found the end of data (its slot dropped): the end recorded; Stopped
        under ``on_exhausted="stop"``, with the source's latch of ``b`` stopped."""
        board = self._board
        stop = plan.on_exhausted == "stop"
        with board.lock:
            self._batches.found_end(b, stop)
            if stop:
                board.latch_stopped((plan.source, b))
            board.notify()
        if stop:
            raise Stopped

    def take_turn(self, b: int) -> None:
        """Batch ``b`` may draw once batch ``b - 1`` drew (several loads take turns); StopIteration
        when an earlier batch found the end."""
        book, end_at = self._batches.book, self._batches.end.end_at

        def before_end() -> bool:  # an earlier batch found the end
            m = end_at()
            return m is not None and m < b

        if self._installed.shape.lanes > 1:
            self._board.wait(
                lambda: book.next_claim >= b or before_end(),
                lambda: f"batch {b - 1} to be drawn first",
                self._interpreter.timeout_s,
            )
        if book.next_claim != b and before_end():  # one load draws in order: next_claim is b
            raise StopIteration

    def turn_taken(self, b: int, ended: bool) -> None:
        if ended or self._installed.shape.lanes == 1:  # one load: Batches.drawn moves next_claim on
            return
        if not self._installed.shape.threaded:  # nobody else reads the book: no lock, nobody to wake
            self._batches.claimed(b)
            return
        with self._board.lock:
            self._batches.claimed(b)
            self._board.notify()

    def draw_failed(self, b: int, error: BaseException, ended: bool) -> None:
        """The iterator raised ``error`` inside its own ``next()`` (or ``claim()``) drawing batch
        ``b`` and cannot go back to the position before it (``Draws``): the item that call may
        have taken is not trained. One warning line, and the ledger's ``failed_draws``; the next
        ``step()`` draws batch ``b`` from the iterator's next item, or, ``ended`` (a generator,
        which the error finished), finds the end of the data there."""
        with self._board.lock:
            serial = self._batches.failed_draw(b, repr(error))
        then = (
            "it is a generator, which an exception ends: its later items are never drawn and the next progress() "
            "finds the end of the data"
            if ended
            else "the item that call took, if any, is not trained; the next progress() draws the next item"
        )
        warnings.warn_explicit(
            f"torchrec_swp: the data iterator raised {error!r} drawing batch {b} of the epoch (serial {serial}) and "
            f"cannot draw the same item again (no load_state_dict() to go back, no claim()/fetch()): {then} "
            "(listed in batch_ledger.failed_draws)",
            FailedDrawWarning,
            filename="torchrec_swp",  # one line: no source line of ours under it
            lineno=0,
            module="torchrec_swp",
        )

    def retractor(self, b: int) -> Callable[[], None] | None:
        """What retracts batch ``b`` if the ranks' agreement on it says "not every rank" (the
        agreement then deferred: ``ExhaustionSync.begin``); None where the answer is needed in
        the draw: the pipeline cannot undo its source task's call (no ``undo_draw``), the current
        plan's source task is a collective (its own collective of ``b`` follows the draw at once)
        or the plan stops at the end of data (``on_exhausted="stop"``, whose parked threads a
        retraction would not find where single-thread order parks them)."""
        plan = self._installed.current
        if (
            self._undo_draw is None
            or plan.on_exhausted == "stop"
            or plan.source is None
            or plan.task(plan.source).comm_group is not None
        ):
            return None
        book = self._batches.book
        return lambda: self.retract(b, book)

    def retract(self, b: int, book: Any) -> None:
        """Batch ``b`` of the epoch of ``book``, which this rank drew (or is drawing), lacks on
        another rank (``exhaustion``): it leaves the batches in flight (or never enters them) and
        the data ends there; counted in ``ledger.dropped_past_end``. Nothing, if the epoch is over."""
        with self._board.lock:
            if self._batches.book is book and self._batches.retract(b):
                self.undo(b)
            self._board.notify()

    def undo(self, b: int) -> None:
        """What the source task's call for retracted batch ``b`` did outside its slot, undone by
        the pipeline (``undo_draw(b, slot)``; with the board's lock held where threads walk)."""
        if self._undo_draw is not None:
            self._undo_draw(b, self._batches.slot(b))

    def past_common_end(self, b: int) -> None:
        """This rank drew an item for batch ``b``, which another rank's data lacks (the common end
        under ``exhaustion``): not a batch, never trained, counted in ``ledger.dropped_past_end``."""
        with self._board.lock:
            self._batches.count_dropped_past_end(b)
