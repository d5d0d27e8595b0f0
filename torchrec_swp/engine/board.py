"""The board: the one place threads of an engine wait on each other.

One lock guards every piece of shared progress - task instances finished (latches), batches
drawn, credit, tickets, threads' positions - and every change notifies the board. A wait is a
predicate, bounded by the engine's timeout and broken by an interrupt (``Interrupted``: the
waiting thread parks where it is). A change wakes only the waiters whose predicate now holds:
the thread that made the change checks them, under the lock, so that a hand-off from one
thread to another wakes that other thread and no one else (with eight threads, waking them all
on every change cost more than the work). A waiter with no predicate (``sleep(remaining)``)
wakes on every change; an interrupt wakes every waiter.

Topics spare the checks a change cannot concern: a waiter may name the one kind of change its
predicate depends on beyond the general ones (a latch's key; ``ITERATION``: threads' finished
iterations), and a change of that kind alone checks only the waiters of its topic. Every other
change checks every waiter. So a topic is a promise: nothing else that changes only with a
topic's notification is read by any predicate outside that topic.

A wait whose predicate already holds takes no lock: a thread that never waits (a plan on one
thread) never takes the board's lock.

Timeouts: a wait gives up (EngineTimeout) only once no thread made progress for ``timeout_s``:
every thread of the engine waited all that time and nothing on the board changed. A thread makes
progress while it walks its program and does not wait on the board (a task that runs for long,
on any thread, is progress, not a timeout), and the caller's thread (the one walking the plan's
``default`` group) whenever it does not wait on the board, inside the engine or out of it (user
code between two calls); a worker between walks waits for a job and is not counted. So a slow
loader is no timeout whatever the thread map, as it is none on the calling thread alone; a
timeout is a deadlock: threads waiting on each other, or on something the board never gets. A
task stuck inside itself (a hung collective, a receive whose sender died) is bounded by that
library's own timeout, not the engine's. ``wait_began`` / ``patience`` give the same rule to
the engine's other waiting loops (turnstiles, waiting for workers to rest)."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Hashable

from torchrec_swp.engine.errors import EngineTimeout, Interrupted, Stopped

#: The topic of a change to a thread's finished iterations (``Walker.done_through``).
ITERATION = "iteration"


class LatchState(enum.Enum):
    """What became of one task instance others wait on."""

    DONE = "done"  # ran, or was skipped (its batch does not exist, its guard said no)
    STOPPED = "stopped"  # the source found the end of data under on_exhausted="stop"


class Board:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latches: dict[Hashable, LatchState] = {}
        self.interrupt: str | None = None
        self.blocked: set[int] = set()  # threads waiting on the board right now
        self._walking: dict[int, None] = {}  # worker threads walking a program (each adds and removes itself)
        self._caller: int | None = None  # the thread that walks the calling thread's part
        self._stirred = time.monotonic()  # the last sign of progress: a change, a walk ending, a wait beginning
        # sleeping threads: the lock each blocks on (held while it sleeps), what it waits for, its topic, itself
        self._sleepers: list[tuple[threading.Lock, Callable[[], bool] | None, Hashable, int]] = []

    def sleep(self, remaining: float, ready: Callable[[], bool] | None = None, topic: Hashable = None) -> None:
        """With the lock held: release it until a change for which ``ready()`` holds (any change
        when None, or an interrupt) or for ``remaining`` seconds; counted among the blocked
        threads meanwhile. The caller checks again what it waits for."""
        me = threading.get_ident()
        waiter = threading.Lock()
        waiter.acquire()
        sleeper = (waiter, ready, topic, me)
        self._sleepers.append(sleeper)
        self.blocked.add(me)
        self.lock.release()
        try:
            waiter.acquire(True, remaining)
        finally:
            self.lock.acquire()
            self.blocked.discard(me)
            if sleeper in self._sleepers:  # timed out: nobody woke it
                self._sleepers.remove(sleeper)

    def notify(self, topic: Hashable = None) -> None:
        """With the lock held: something changed (only what concerns ``topic``'s waiters, if
        given); wake the waiters it may concern."""
        self._stirred = time.monotonic()
        if not self._sleepers:
            return
        everyone = self.interrupt is not None
        asleep = []
        for sleeper in self._sleepers:
            waiter, ready, their, thread = sleeper
            if everyone or ((topic is None or their == topic) and (ready is None or _holds(ready))):
                waiter.release()
                # woken, it goes on once it gets the lock: no longer blocked (wait_until_blocked
                # would otherwise count a thread just given credit as one that waits for a call)
                self.blocked.discard(thread)
            else:
                asleep.append(sleeper)
        self._sleepers = asleep

    def changed(self, topic: Hashable = None) -> None:
        """Something waiters may wait for changed (outside the lock): wake those it concerns."""
        with self.lock:
            self.notify(topic)

    def wait(
        self, ready: Callable[[], bool], what: Callable[[], str], timeout_s: float, topic: Hashable = None
    ) -> None:
        """Return once ``ready()`` holds. Raises Interrupted when the board is interrupted
        first, EngineTimeout (saying ``what()`` it waited for) once no thread made progress for
        ``timeout_s`` (see the module's docstring). ``topic``: the one kind of change, beyond
        the general ones, ``ready()`` depends on."""
        if ready():
            return
        with self.lock:
            began = self.wait_began()
            while not ready():
                if self.interrupt is not None:
                    raise Interrupted(self.interrupt)
                remaining = self.patience(began, timeout_s)
                if remaining <= 0:
                    raise EngineTimeout(f"no thread made progress for {timeout_s:.1f}s while waiting for {what()}")
                self.sleep(remaining, ready, topic)

    # ---------------------------------------------------------------- progress
    def walk_began(self, caller: bool) -> None:
        """The calling thread starts walking its program (``caller``: it is the caller's thread,
        walking the ``default`` group's part). No lock: a thread adds and removes only itself."""
        me = threading.get_ident()
        if caller:
            self._caller = me
        else:
            self._walking[me] = None

    def walk_ended(self) -> None:
        """The calling thread's walk ended (a worker then waits for its next job)."""
        self._walking.pop(threading.get_ident(), None)
        self._stirred = time.monotonic()

    def wait_began(self) -> float:
        """The calling thread begins a wait (it stops making progress): the time, for ``patience``."""
        self._stirred = now = time.monotonic()
        return now

    def patience(self, began: float, timeout_s: float) -> float:
        """With the lock held: how long a wait that began at ``began`` (``wait_began()``) may
        still sleep before it gives up; <= 0: no thread made progress for ``timeout_s``. While
        another thread makes progress, ``timeout_s`` (it looks again after that)."""
        left = max(began, self._stirred) + timeout_s - time.monotonic()
        if left > 0:  # something changed lately (the common case): no need to look at the threads yet
            return left
        me, blocked, caller = threading.get_ident(), self.blocked, self._caller
        if (caller is not None and caller != me and caller not in blocked) or any(
            t != me and t not in blocked for t in list(self._walking)
        ):
            return timeout_s
        return left

    # ----------------------------------------------------------------- latches
    def set_latch(self, key: Hashable, state: LatchState = LatchState.DONE) -> None:
        """Instance ``key`` is done (or stopped): only its waiters (topic ``key``) are told."""
        with self.lock:
            self.latches[key] = state
            self.notify(key)

    def wait_latch(self, key: Hashable, what: str, timeout_s: float) -> None:
        """Wait for instance ``key``; Stopped if it stopped (the end of data under a stop)."""
        latches = self.latches
        self.wait(lambda: key in latches, lambda: f"{what} to finish", timeout_s, topic=key)
        if latches[key] is LatchState.STOPPED:
            raise Stopped

    def latch_stopped(self, key: Hashable) -> None:
        """With the lock held: instance ``key`` stopped (the end of data under a stop); the
        caller notifies once the rest of its change is in place."""
        self.latches[key] = LatchState.STOPPED

    def forget_stopped_latches(self) -> None:
        """With the lock held: the stopped latches dropped (new data after a stop)."""
        for key in [k for k, v in self.latches.items() if v is LatchState.STOPPED]:
            del self.latches[key]

    def forget_latches(self, tasks: tuple[str, ...], b: int) -> None:
        """With the lock held (or on one thread): batch ``b``'s latches of ``tasks`` dropped (it was
        returned)."""
        latches = self.latches
        if latches:
            for task in tasks:
                latches.pop((task, b), None)

    def clear_latches(self, keep: Callable[[Hashable], bool] | None = None) -> None:
        with self.lock:
            if keep is None:
                self.latches.clear()
            else:
                for key in [k for k in self.latches if not keep(k)]:
                    del self.latches[key]

    # --------------------------------------------------------------- interrupt
    def interrupt_all(self, reason: str) -> None:
        """Every wait, now and until ``resume()``, raises Interrupted."""
        with self.lock:
            if self.interrupt is None:
                self.interrupt = reason
            self.notify()

    def resume(self) -> None:
        with self.lock:
            self.interrupt = None


def _holds(ready: Callable[[], bool]) -> bool:
    """``ready()`` checked for a waiter by the thread that changed something: an error there
    is the waiter's to meet, so it wakes to meet it."""
    try:
        return bool(ready())
    except Exception:  # noqa: BLE001 - the waiter raises it when it checks again
        return True
