"""The interpreter's threads: ``Walker`` (one thread's walk through its program: where it is,
why it stopped), the ops that execute its instructions, a ``Failure`` (where a task failed) and
the persistent ``Worker`` thread that walks in the background. Records of the interpreter
(``torchrec_swp.engine.interpreter``), which places and walks them; besides it, only the
functions a walker walks with, on its own thread, write to it: the program function its
iteration's ``inst`` and ``bases`` (``PlanOps.program`` / ``iteration_done``), the ops its
``current`` and ``waited``."""

from __future__ import annotations

import enum
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchrec_swp.compile import Instr
from torchrec_swp.engine.streams import StreamPool


class WalkState(enum.Enum):
    READY = "ready"  # positioned, not walking
    RUNNING = "running"
    PARKED = "parked"  # stopped where it is: interrupted, stopped at the end of data, or failed
    FINISHED = "finished"  # walked every iteration of the epoch (or of the step)


@dataclass(eq=False, slots=True)
class Walker:
    """One thread's walk: ``thread`` names its program, ``name`` the thread itself (a lane of a
    source with several loads: ``load.1``); ``last_stage``: the highest stage of its tasks (it is
    done with batch ``d`` once it finished iteration ``d + last_stage``; -1: it has no task);
    ``ahead``: how many iterations it may run beyond the current ``step()`` call's (the plan's
    lookahead; 0 for a thread that issues collectives: those are issued only while ``step()`` runs).
    ``prog``: the instructions of iteration ``P`` while it walks them, ``i`` the one it executes (or
    parked at)."""

    thread: str
    name: str
    lane: int = 0
    last_stage: int = 0
    ahead: int = 0
    P: int = 0
    i: int = 0
    start: int = 0
    done_through: int = -1
    state: WalkState = WalkState.READY
    parked_by: str = ""
    prog: tuple[Instr, ...] = ()
    current: tuple[str, int] = ("-", 0)  # (task or instruction, batch) it works on
    bases: dict[str, int] = field(default_factory=dict)  # comm group -> first ticket of iteration P
    waited: dict[str, int] = field(default_factory=dict)  # producer -> latest iteration waited for
    inst: Any = None  # what the engine runs in iteration P (its plan, for a plan engine)

    @property
    def at(self) -> Instr | None:
        """The instruction it executes or parked at (None between iterations)."""
        return self.prog[self.i] if self.i < len(self.prog) else None

    def hold_back(self) -> None:
        """It runs no iteration beyond the current call's any more."""
        self.ahead = 0

    def place(self, start: int, bases: dict[str, int]) -> None:
        self.P, self.i, self.start, self.done_through = start, 0, start, start - 1
        self.state, self.parked_by, self.prog, self.current = WalkState.READY, "", (), ("-", 0)
        self.bases, self.waited = dict(bases), {}

    def position(self) -> str:
        """Where it is, for reports."""
        match self.state:
            case WalkState.PARKED if self.parked_by == "failed":
                return f"failed in {self.current[0]} (internal iteration {self.P})"
            case WalkState.PARKED:
                return f"parked ({self.parked_by}) at {self.at} (internal iteration {self.P})"
            case WalkState.FINISHED:
                return "finished"
            case _ if self.at is not None:
                return f"at {self.at} (internal iteration {self.P})"
            case _:
                return f"not started (internal iteration {self.P})"


#: How an instruction of a thread's program is executed: ``op(walker, P)`` at internal iteration ``P``.
Op = Callable[[Walker, int], None]
#: One iteration of one thread, ready to walk: its instructions and, position by position, their ops.
Walk = tuple[tuple[Instr, ...], tuple[Op, ...]]


@dataclass
class Failure:
    exc: BaseException
    task: str
    batch: int
    thread: str
    iteration: int


class Worker:
    """A persistent thread running the jobs put in its inbox (None stops it)."""

    def __init__(self, name: str, streams: StreamPool) -> None:
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # set while the thread holds no job: a walk says it is at rest before its job returns
        self.idle = threading.Event()
        self.idle.set()
        args = (self.inbox, self.idle, streams)
        self.thread = threading.Thread(target=self._loop, args=args, name=name, daemon=True)
        self.thread.start()

    @staticmethod
    def _loop(
        inbox: queue.SimpleQueue[Callable[[], None] | None], idle: threading.Event, streams: StreamPool
    ) -> None:
        streams.thread_init()
        while (job := inbox.get()) is not None:
            job()
            # a job holds its engine: kept in this frame while the thread waits for the next one,
            # it would keep the engine (and the pipeline that holds it) from ever being collected
            del job
            idle.set()

    def put(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread (``idle`` until it returned and was dropped)."""
        self.idle.clear()
        self.inbox.put(job)

    def stop(self) -> None:
        """Ask the thread to end once its current job, if any, returns (``stop_workers`` joins it)."""
        self.inbox.put(None)


def stop_workers(
    workers: dict[str, Worker], board: Any = None, timeout_s: float = 600.0, since: float | None = None
) -> None:
    """Stop and join ``workers``: an engine's ``close()``, also when the engine is collected or at
    exit (its ``weakref.finalize``, which must not hold the engine: ``board`` is the engine's
    ``Board``, interrupted first so that a worker waiting on it stops where it is).

    A worker inside a task - a draw from a slow loader, a long copy - parks only once that call
    returns: it is waited for, up to ``timeout_s`` (the engine's) for all of them, counted from
    ``since`` (a ``time.monotonic()``; default now: ``close()`` counts its wait before). Returning while
    it runs would leave it to the interpreter's finalization, where its next re-take of the GIL
    ends it by ``pthread_exit`` and a noexcept C++ frame on the way out aborts the process
    (docs/clean_exit.md). A thread still running after ``timeout_s`` is named in a RuntimeWarning."""
    if board is not None:
        board.interrupt_all("the engine was closed")
    for w in workers.values():
        w.stop()
    deadline = (time.monotonic() if since is None else since) + timeout_s
    running = []
    for w in workers.values():
        if w.thread is not threading.current_thread():
            w.thread.join(max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                running.append(w.thread.name)
    workers.clear()
    if running:
        warnings.warn(
            f"engine closed with thread(s) {', '.join(running)} still inside a task after {timeout_s:g}s: "
            "the process may abort at exit if they are still running then",
            RuntimeWarning,
            stacklevel=2,
        )
