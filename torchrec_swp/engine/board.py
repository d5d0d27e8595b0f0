"""The board: the one place threads of an engine wait on each other.

One condition variable guards every piece of shared progress - task instances finished
(latches), batches drawn, credit, tickets, threads' positions - and every change notifies it.
A wait is a predicate re-checked on each change, bounded by the engine's timeout and broken
by an interrupt (``Interrupted``: the waiting thread parks where it is). With a handful of
threads and a few dozen changes per iteration one condition costs less than it would save, and
an interrupt reaches every waiter at once.

A wait whose predicate already holds takes no lock: a thread that never waits (a plan on one
thread) never touches the board.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Hashable

from torchrec_swp.engine.errors import EngineTimeout, Interrupted, Stopped


class LatchState(enum.Enum):
    """What became of one task instance others wait on."""

    DONE = "done"  # ran, or was skipped (its batch does not exist, its guard said no)
    STOPPED = "stopped"  # the source found the end of data under on_exhausted="stop"


class Board:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.latches: dict[Hashable, LatchState] = {}
        self.interrupt: str | None = None
        self.blocked: set[int] = set()  # threads waiting on the condition right now

    def sleep(self, remaining: float) -> None:
        """Wait on the condition (held) for a change, at most ``remaining`` seconds, counted
        among the blocked threads meanwhile."""
        me = threading.get_ident()
        self.blocked.add(me)
        try:
            self.cond.wait(remaining)
        finally:
            self.blocked.discard(me)

    def changed(self) -> None:
        """Wake every waiter: something they may wait for changed."""
        with self.cond:
            self.cond.notify_all()

    def wait(self, ready: Callable[[], bool], what: Callable[[], str], timeout_s: float) -> None:
        """Return once ``ready()`` holds. Raises Interrupted when the board is interrupted
        first, EngineTimeout (saying ``what()`` it waited for) after ``timeout_s``."""
        if ready():
            return
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not ready():
                if self.interrupt is not None:
                    raise Interrupted(self.interrupt)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineTimeout(f"waited {timeout_s:.1f}s for {what()}")
                self.sleep(remaining)

    # ----------------------------------------------------------------- latches
    def set_latch(self, key: Hashable, state: LatchState = LatchState.DONE) -> None:
        with self.cond:
            self.latches[key] = state
            self.cond.notify_all()

    def wait_latch(self, key: Hashable, what: str, timeout_s: float) -> None:
        """Wait for instance ``key``; Stopped if it stopped (the end of data under a stop)."""
        latches = self.latches
        self.wait(lambda: key in latches, lambda: f"{what} to finish", timeout_s)
        if latches[key] is LatchState.STOPPED:
            raise Stopped

    def clear_latches(self, keep: Callable[[Hashable], bool] | None = None) -> None:
        with self.cond:
            if keep is None:
                self.latches.clear()
            else:
                for key in [k for k in self.latches if not keep(k)]:
                    del self.latches[key]

    # --------------------------------------------------------------- interrupt
    def interrupt_all(self, reason: str) -> None:
        """Every wait, now and until ``resume()``, raises Interrupted."""
        with self.cond:
            if self.interrupt is None:
                self.interrupt = reason
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.interrupt = None
