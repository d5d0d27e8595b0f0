"""The ticketed collective lock: collectives of a comm group in one fixed order on every rank.

Every instance of a task of the comm group holds a ticket: its iteration's first ticket (the
group's tickets of the earlier iterations, counted by every thread as it walks them) plus its
place among the group's tasks in fire order. A task may start only when every lower ticket was
released or skipped (an instance that does not run - its batch does not exist, its guard says
no - skips its ticket without waiting), so every rank issues the group's collectives in the same
order whatever thread submits them. The numbering never restarts within an engine's life but
for ``restart()`` (a reset, with nobody holding a ticket).

A failure (or an abort) makes every later ``acquire`` raise CollectiveAborted instead of
blocking: ranks cannot desync and no thread hangs. Waits are bounded by a timeout and, given
the engine's board, broken by its interrupts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from torchrec_swp.engine.errors import CollectiveAborted, EngineTimeout, Interrupted

if TYPE_CHECKING:
    from torchrec_swp.engine.board import Board


class Turnstile:
    def __init__(self, group: str, board: Board | None = None) -> None:
        self.group = group
        self._board = board
        self._lock = board.lock if board is not None else threading.Lock()
        self._cond = threading.Condition(self._lock)  # its waiters when it has no board
        self._next = 0
        self._skipped: set[int] = set()
        self._failed: str | None = None
        self.waiting: dict[str, int] = {}  # thread name -> ticket it waits for (diagnostics)

    @property
    def next_ticket(self) -> int:
        return self._next

    @property
    def failed(self) -> str | None:
        return self._failed

    def restart(self) -> None:
        """Start numbering again at 0 (nobody holds a ticket) and forget a failure."""
        with self._lock:
            self._next = 0
            self._skipped.clear()
            self._failed = None

    clear_failure = restart

    def take(self, ticket: int) -> bool:
        """Whether ``ticket``'s turn is now (then it is held, as after ``acquire``); False when it
        has to wait, or ``acquire`` would raise."""
        with self._lock:
            return self._failed is None and self._next == ticket

    def acquire(self, ticket: int, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Wait for ``ticket``'s turn. ``check()``, called before every wait, may raise to give up
        (the engine's threads park when the plan stopped before their iteration)."""
        began = self._board.wait_began() if self._board is not None else time.monotonic()
        me = threading.current_thread().name

        def turn() -> bool:  # what wakes it on the board: its turn, an abort, or check() giving up
            if check is not None:
                check()
            return self._failed is not None or self._next >= ticket

        with self._lock:
            self.waiting[me] = ticket
            try:
                while True:
                    if self._failed is not None:
                        raise CollectiveAborted(
                            f"collective ticket {ticket} of comm group {self.group!r} aborted: {self._failed}"
                        )
                    if self._next == ticket:
                        return
                    if self._next > ticket:
                        raise CollectiveAborted(
                            f"collective ticket {ticket} of comm group {self.group!r} was passed "
                            f"(next ticket is {self._next})"
                        )
                    if self._board is not None and self._board.interrupt is not None:
                        raise Interrupted(self._board.interrupt)
                    if check is not None:
                        check()
                    # with a board: no thread made progress for timeout_s (torchrec_swp.engine.board)
                    remaining = (
                        self._board.patience(began, timeout_s)
                        if self._board is not None
                        else began + timeout_s - time.monotonic()
                    )
                    if remaining <= 0:
                        raise EngineTimeout(
                            f"no progress for {timeout_s:.1f}s while waiting for collective ticket {ticket} of comm "
                            f"group {self.group!r}; the turnstile is at ticket {self._next}"
                        )
                    if self._board is not None:
                        self._board.sleep(remaining, turn)
                    else:
                        self._cond.wait(remaining)
            finally:
                del self.waiting[me]

    def release(self, ticket: int) -> None:
        with self._lock:
            if self._next == ticket:
                self._next = ticket + 1
                self._advance()
            self._notify()

    def skip(self, ticket: int) -> None:
        """Ticket ``ticket`` will not be used: pass it on when its turn comes, without waiting."""
        with self._lock:
            if ticket == self._next:
                self._next += 1
                self._advance()
                self._notify()
            elif ticket > self._next:
                self._skipped.add(ticket)

    def _notify(self) -> None:
        if self._board is not None:
            self._board.notify()
        else:
            self._cond.notify_all()

    def _advance(self) -> None:
        while self._next in self._skipped:
            self._skipped.remove(self._next)
            self._next += 1

    def fail(self, reason: str) -> None:
        """Abort every ticket not yet granted."""
        with self._lock:
            if self._failed is None:
                self._failed = reason
            self._notify()
