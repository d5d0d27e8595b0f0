"""The ticketed collective lock: collectives of a comm group in one fixed order on every rank.

Tasks of one comm group hold tickets numbered in fire order when the plan is compiled. A task
may start only when every lower ticket has been released, so every rank issues the group's
collectives in the same order whatever thread submits them. A failure (or an abort) makes
every later ``acquire`` raise CollectiveAborted instead of blocking: ranks cannot desync and
no thread hangs.
"""

from __future__ import annotations

import threading
import time

from torchrec_swp.engine.errors import CollectiveAborted, EngineTimeout


class Turnstile:
    def __init__(self, group: str) -> None:
        self.group = group
        self._cond = threading.Condition()
        self._next = 0
        self._failed: str | None = None
        self.waiting: dict[str, int] = {}  # thread name -> ticket it waits for (diagnostics)

    @property
    def next_ticket(self) -> int:
        return self._next

    @property
    def failed(self) -> str | None:
        return self._failed

    def restart(self) -> None:
        """Start numbering again at 0 (between iterations, when nobody holds a ticket)."""
        with self._cond:
            self._next = 0

    def clear_failure(self) -> None:
        with self._cond:
            self._failed = None
            self._next = 0

    def acquire(self, ticket: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        me = threading.current_thread().name
        with self._cond:
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
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise EngineTimeout(
                            f"waited {timeout_s:.1f}s for collective ticket {ticket} of comm group "
                            f"{self.group!r}; the turnstile is at ticket {self._next}"
                        )
                    self._cond.wait(remaining)
            finally:
                del self.waiting[me]

    def release(self, ticket: int) -> None:
        with self._cond:
            if self._next == ticket:
                self._next = ticket + 1
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """Abort every ticket not yet granted."""
        with self._cond:
            if self._failed is None:
                self._failed = reason
            self._cond.notify_all()
