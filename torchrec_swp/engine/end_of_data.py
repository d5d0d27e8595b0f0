"""The end of data: one state machine, and the only code that says whether a batch exists.

An epoch's data ends when the source's call for some batch ``M`` raises StopIteration. What that
means for every thread is one of four states (``EndState``):

* running: the source has not found the end of this epoch's data.
* draining: it found it at batch ``M`` (``on_exhausted="drain"``): batches ``>= M`` never exist;
  those before it are still to be returned.
* drained: draining, and ``step()`` returned every batch before ``M``: the epoch is over (read
  off the book's ``returned``: no event).
* stopped: it found it at batch ``M`` under ``on_exhausted="stop"``: every thread parks where
  single-thread order stopped (iterations ``> M``); new data goes on from there.

Events, each a method (``TRANSITIONS`` is the table; a pair not in it raises EngineError naming
the state and the event):

| event | method | running | draining | drained | stopped |
|---|---|---|---|---|---|
| end seen at batch ``n`` | ``found(n)`` | draining | draining | drained | stopped |
| end seen at ``n`` under a stop | ``found(n, stop=True)`` | stopped | draining | drained | stopped |
| a common end across ranks at ``n`` | ``common(n)`` | running | - | - | - |
| new data | ``new_data()`` | running | draining, then the next epoch | drained: the next epoch now | running |
| ``step()`` raised StopIteration | ``report()`` | - | - | drained | stopped |
| the next epoch (new data came) | ``begin(EPOCH)`` | - | - | running | - |
| ``reset()`` | ``begin(RESET)`` | running | running | running | running |
| ``load_state_dict`` | ``begin(LOAD)`` | running | - | - | - |
| ``adopt()`` | ``begin(ADOPT)`` | running | - | running | running |

An end seen again once known (``n >= M``: a lane whose turn came after the end) changes nothing;
one seen before the known end is an engine bug (EngineError). A common end (``exhaustion``: this
rank drew an item at ``n``, a peer had none) is followed by the draw's StopIteration, that is by
``found(n)``. New data while stopped takes the batch number of the call that found the stop (the
book's ``renumbered``, which ``Batches`` counts when ``new_data()`` says ``Then.GO_ON``).

The questions (``exists``, ``exists_at``, ``past_end``, ``ended``, ``beyond_stop``...) are plain
int compares on thresholds each transition sets (``NEVER`` while they do not apply): the ops ask
them on every instruction. ``Batches`` holds the one ``EndOfData`` of an engine and tells it each
epoch's book (``begin``): the batches in flight and returned are the book's.
"""

from __future__ import annotations

import enum
import sys
from typing import Protocol

from torchrec_swp.engine.errors import EngineError, Stopped


class Book(Protocol):
    """What the machine reads of an epoch's book (``torchrec_swp.engine.batches.BatchBook``)."""

    in_flight: set[int]
    returned: int


NEVER = sys.maxsize  # a threshold that does not apply


class EndState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPED = "stopped"


class EndEvent(enum.Enum):
    END = "end seen"
    STOP = "end seen under a stop"
    COMMON_END = "a common end across ranks"
    NEW_DATA = "new data"
    REPORT = "StopIteration raised"
    EPOCH = "the next epoch"
    RESET = "reset()"
    LOAD = "load_state_dict()"
    ADOPT = "adopt()"


class Then(enum.Enum):
    """What the owner does after ``new_data()``."""

    NOTHING = "nothing"  # running: the source reads it from its next batch; draining: the next epoch once drained
    NEXT_EPOCH = "next epoch"  # drained: once no thread walks, begin(EPOCH)
    GO_ON = "go on"  # stopped: running again where every thread stopped (renumber, forget the stopped latches)


_R, _DG, _DD, _S = EndState.RUNNING, EndState.DRAINING, EndState.DRAINED, EndState.STOPPED

#: (state, event) -> the state it leads to. A pair not here is illegal.
TRANSITIONS: dict[tuple[EndState, EndEvent], EndState] = {
    (_R, EndEvent.END): _DG,
    (_DG, EndEvent.END): _DG,
    (_DD, EndEvent.END): _DD,
    (_S, EndEvent.END): _S,
    (_R, EndEvent.STOP): _S,
    (_DG, EndEvent.STOP): _DG,
    (_DD, EndEvent.STOP): _DD,
    (_S, EndEvent.STOP): _S,
    (_R, EndEvent.COMMON_END): _R,
    (_R, EndEvent.NEW_DATA): _R,
    (_DG, EndEvent.NEW_DATA): _DG,
    (_DD, EndEvent.NEW_DATA): _DD,
    (_S, EndEvent.NEW_DATA): _R,
    (_DD, EndEvent.REPORT): _DD,
    (_S, EndEvent.REPORT): _S,
    (_DD, EndEvent.EPOCH): _R,
    (_R, EndEvent.RESET): _R,
    (_DG, EndEvent.RESET): _R,
    (_DD, EndEvent.RESET): _R,
    (_S, EndEvent.RESET): _R,
    (_R, EndEvent.LOAD): _R,
    (_R, EndEvent.ADOPT): _R,
    (_DD, EndEvent.ADOPT): _R,
    (_S, EndEvent.ADOPT): _R,
}

_BEGINS = (EndEvent.EPOCH, EndEvent.RESET, EndEvent.LOAD, EndEvent.ADOPT)


class EndOfData:
    """The end of data of an engine's epochs (module docstring): the state, the batch ``M`` the
    end was seen at, whether ``step()`` reported it, whether new data came while draining."""

    __slots__ = ("_book", "_in_flight", "_state", "_at", "_gone", "_stop", "_over", "_reported", "_restart")

    def __init__(self, book: Book) -> None:
        self._book = book
        self._in_flight = book.in_flight  # the book's set, by reference
        self._state = EndState.RUNNING  # never DRAINED: that is DRAINING with every batch returned
        self._at: int | None = None  # M
        self._gone = NEVER  # batches >= it never exist (M while draining)
        self._stop = NEVER  # iterations > it are beyond the stop (M while stopped)
        self._over = NEVER  # the epoch has ended once returned >= it (M draining, 0 stopped)
        self._reported = False
        self._restart = False

    # -------------------------------------------------------------- questions
    @property
    def state(self) -> EndState:
        if self._state is EndState.DRAINING and self._book.returned >= self._gone:
            return EndState.DRAINED
        return self._state

    def exists(self, b: int) -> bool | None:
        """Whether batch ``b`` was drawn (True), never will be (False), or is not known yet (None:
        the source has not looked for it). While stopped, nothing at or past the end is known."""
        if b in self._in_flight or 0 <= b < self._book.returned:
            return True
        if b < 0 or b >= self._gone:
            return False
        return None

    def exists_at(self, b: int, P: int) -> bool | None:
        """``exists(b)`` for a task instance of internal iteration ``P``; Stopped when the plan
        stopped before ``P``, or while stopped when ``b`` is not known (single-thread order would
        not have got there)."""
        if P > self._stop:
            raise Stopped
        if b in self._in_flight:
            return True
        if 0 <= b < self._book.returned:
            return True
        if b < 0 or b >= self._gone:
            return False
        if self._state is EndState.STOPPED:
            raise Stopped
        return None

    def past_end(self, b: int) -> bool:
        """Batch ``b`` is at or past the end of data (no stop): it never exists."""
        return b >= self._gone

    def walks_to(self, P: int, d: int) -> bool:
        """Whether a thread walks internal iteration ``P``, which trains batch ``d``: False past the
        end (the thread walks out of the epoch); Stopped when the plan stopped before ``P``."""
        if P > self._stop:
            raise Stopped
        return d < self._gone

    def beyond_stop(self, P: int) -> bool:
        """The plan stopped at the end of data before internal iteration ``P``."""
        return P > self._stop

    def check_stop(self, P: int) -> None:
        """Park (Stopped) a thread at internal iteration ``P`` if the plan stopped before it."""
        if P > self._stop:
            raise Stopped

    def ended(self) -> bool:
        """No batch is left to return: drained, or stopped."""
        return self._book.returned >= self._over

    def stopped(self) -> bool:
        return self._state is EndState.STOPPED

    def end_at(self) -> int | None:
        """``M``: the batch the end of data was seen at; None while running."""
        return self._at

    def reported(self) -> bool:
        """The last ``step()`` raised StopIteration for the end of data."""
        return self._reported

    def restarts(self) -> bool:
        """New data came while draining: the step after the last batch starts the next epoch."""
        return self._restart

    # ------------------------------------------------------------------ events
    def found(self, n: int, stop: bool = False) -> None:
        """The source found the end of data at batch ``n`` (``stop``: under ``on_exhausted="stop"``)."""
        self._go(EndEvent.STOP if stop else EndEvent.END)
        if self._at is not None:
            if n < self._at:
                raise EngineError(f"end of data seen at batch {n}, before batch {self._at} where it was seen first")
            return
        self._at = n
        if stop:
            self._stop, self._over = n, 0
            self._state = EndState.STOPPED
        else:
            self._gone = self._over = n
            self._state = EndState.DRAINING

    def common(self, n: int) -> None:
        """The ranks agreed that the data ends at batch ``n``, for which this rank drew an item
        (``exhaustion``); the draw's StopIteration follows (``found(n)``)."""
        self._go(EndEvent.COMMON_END)

    def new_data(self) -> Then:
        """The source has new data (module docstring); what the owner does next."""
        before = self.state
        self._go(EndEvent.NEW_DATA)
        if before is EndState.DRAINING:
            self._restart = True
        elif before is EndState.DRAINED:
            return Then.NEXT_EPOCH
        elif before is EndState.STOPPED:
            self._enter_running()
            return Then.GO_ON
        return Then.NOTHING

    def report(self) -> None:
        """``step()`` raised StopIteration for the end of data."""
        self._go(EndEvent.REPORT)
        self._reported = True

    def begin(self, event: EndEvent, book: Book) -> None:
        """A new epoch, its batches in ``book``, for ``event`` (EPOCH, RESET, LOAD or ADOPT)."""
        if event not in _BEGINS:
            raise EngineError(f"end of data: {event.value} does not begin an epoch")
        self._go(event)
        self._book, self._in_flight = book, book.in_flight
        self._enter_running()

    # ---------------------------------------------------------------- internal
    def _go(self, event: EndEvent) -> None:
        if (self.state, event) not in TRANSITIONS:
            raise EngineError(
                f"end of data: {event.value} is not expected while {self.state.value} (end seen at batch {self._at})"
            )

    def _enter_running(self) -> None:
        self._state = EndState.RUNNING
        self._at = None
        self._gone = self._stop = self._over = NEVER
        self._reported = self._restart = False

    def __repr__(self) -> str:
        return f"EndOfData({self.state.value}, end at {self._at})"
