"""The interpreter: threads walking their programs, iteration after iteration.

Every thread of a program has a ``Walker``: its position (internal iteration ``P``, instruction
``i``), the iteration it finished last, and why it stopped walking. The thread that calls the
engine walks the ``"default"`` program itself; every other one has a persistent ``Worker``
thread that walks in the background between calls, until it has to wait for something only a
later call provides. There is no barrier between iterations: a thread starts its part of
iteration ``P + 1`` as soon as its own part of ``P`` is done, and every ordering between
threads is an explicit wait in the program (``wait``/``signal``, collective tickets) or a
gate the engine checks (a batch drawn, credit, the caller's request).

Parking: a thread stops where it is - before the instruction it could not execute - when
interrupted (a failure elsewhere, a reset), when the source stopped at the end of data
(``Stopped``), or when its own task failed; resumed, it executes that instruction again. A
finished instruction is never executed twice, so resuming loses and repeats nothing.

Failures: the first exception of a task (or a timeout) is recorded with where it happened,
every later ticket of every comm group fails (this rank issues no more collectives until a
reset: the others may not be where it is), and every thread is interrupted. The engine's
caller re-raises it, of its own type, with a note naming task, batch, thread and iteration.

What a ``run`` instruction does is the subclass's: ``Engine`` runs plan tasks
(``torchrec_swp.engine.engine``, its ops in ``torchrec_swp.engine.ops``), ``ProgramEngine``
pipeline-parallel actions (``torchrec_swp.engine.programs``). A walker executes each
instruction by its op, ``op(walker, P)``, made once per program (the ``program`` function given
to ``_walk`` hands out both): by default a dispatch through ``_execute``; the plan engine
compiles its instructions into ops that know their task, stage and call, so that the loop below
costs a call per instruction and nothing per iteration. An op may execute the instructions after
its own as well (``PlanOps``' stage op: a stage's plain task calls in a row): it moves ``w.i``
along as it goes and leaves it at the last one it executed, where the loop goes on. ``_walk`` is
the one loop every thread of every engine runs.
"""

from __future__ import annotations

import abc
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

from torchrec_swp.compile import Alias, Instr, Run, RunAction, Signal, WaitTask
from torchrec_swp.engine.board import Board
from torchrec_swp.engine.errors import (
    CollectiveAborted,
    EngineError,
    EngineTimeout,
    Interrupted,
    Stopped,
    TaskAborted,
    describe,
)
from torchrec_swp.engine.streams import NullStreamPool, StreamPool
from torchrec_swp.engine.tasks import Observer
from torchrec_swp.engine.turnstile import Turnstile
from torchrec_swp.engine.walkers import Failure, Op, Walk, Walker, WalkState, Worker, stop_workers
from torchrec_swp.plan import MAIN_THREAD

DEFAULT_TIMEOUT_S = 600.0


_INTERPRETER_IDS = itertools.count(1)


class Interpreter(abc.ABC):
    """Walkers, workers, the board, turnstiles, failures and reports; subclasses say what the
    programs are (the ``program`` they walk with) and what their work instructions do (``_run``
    behind the default op, or ops of their own)."""

    def __init__(self, *, streams: StreamPool | None, timeout_s: float, name: str) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        self.streams: StreamPool = streams if streams is not None else NullStreamPool()
        # a checked pool (SWP_STREAM_CHECK, torchrec_swp.streamcheck) watches the tasks' tensor accesses
        self._checker = getattr(self.streams, "checker", None)
        self._uid = next(_INTERPRETER_IDS)  # names this interpreter's hand-offs to the checker
        self.timeout_s = float(timeout_s)
        self.name = name
        self.board = Board()
        self.failures: list[Failure] = []
        self._failure_raised = False  # the first failure went to the caller; its next call resumes
        self._workers: dict[str, Worker] = {}
        self._turnstiles: dict[str, Turnstile] = {}
        # run by close(), when the engine is collected, or at exit (atexit, before the interpreter's
        # finalization) for an engine never closed: its threads never outlive the interpreter (one
        # inside a task is waited for, up to the timeout this engine was built with)
        self._finalizer = weakref.finalize(self, stop_workers, self._workers, self.board, self.timeout_s)
        self._observer: Observer | None = None

    def close(self) -> None:
        """Stop the worker threads (idempotent). First each does what the calls so far entitle it
        to (``wait_until_blocked``; not after a failure): a draw ahead under the exhaustion sync, an
        input dist, is a collective the peers' threads make as well, and a rank that stopped its
        threads short of one would leave a peer waiting in it for the collective's timeout. Then
        each parks where it is, one inside a task once the task returns; returns once every one
        has ended (``walkers.stop_workers``). Both within the engine's timeout, together."""
        if not self._finalizer.alive:
            return
        start = time.monotonic()
        try:
            if not self.failures:
                self.wait_until_blocked(deadline=start + self.timeout_s)
        finally:
            if self._finalizer.detach() is not None:
                stop_workers(self._workers, self.board, self.timeout_s, since=start)

    @property
    def stop_threads(self) -> Callable[[], Any]:
        """``close()`` as a callable that does not hold the engine (its finalizer): what a pipeline's
        teardown keeps, so that it does not keep the engine alive."""
        return self._finalizer

    # ------------------------------------------------------------- the walk
    @property
    @abc.abstractmethod
    def _walkers(self) -> Mapping[str, Walker]:
        """Every thread's walker, the subclass's record of its threads (the calling thread's is
        ``MAIN_THREAD``'s): ``Engine``'s are ``installed.shape``'s, ``ProgramEngine``'s its own."""

    def _walk(
        self,
        w: Walker,
        until: int | None,
        program: Callable[[Walker, int], Walk | None],
        done: Callable[[Walker, int], None] | None = None,
        *,
        threaded: bool,
    ) -> None:
        """Walk ``w``'s program from its position through iteration ``until`` (None: as far as
        it goes): ``program(w, P)`` gives its instructions of internal iteration ``P`` and their
        ops (None: it has walked out); ``done(w, P)`` hears that it finished its part of ``P``.
        ``threaded``: other threads walk (on one thread nothing else waits for this walk's
        progress). Returns with ``w.state`` FINISHED, PARKED, or READY at ``until + 1``."""
        board = self.board
        w.state = WalkState.RUNNING
        if threaded:
            board.walk_began(w.thread == MAIN_THREAD)
        try:
            while until is None or w.P <= until:
                P = w.P
                walk = program(w, P)
                if walk is None:
                    w.state = WalkState.FINISHED
                    break
                w.prog, ops = walk
                i, n = w.i, len(ops)
                while i < n:
                    w.i = i  # parked here, it executes this instruction again when resumed
                    if board.interrupt is not None:
                        raise Interrupted(board.interrupt)
                    ops[i](w, P)
                    i = w.i + 1  # (an op that executes several instructions leaves w.i at its last)
                w.i, w.P, w.prog = 0, P + 1, ()
                w.done_through = P
                if done is not None:
                    done(w, P)
            else:
                w.state = WalkState.READY
        except BaseException:  # noqa: BLE001 - every failure is recorded and re-raised by the caller
            self._walk_stopped(w)
        finally:
            if threaded:
                board.walk_ended()
            if self._checker is not None:  # what the walk did is ordered before who sees it resting
                self._checker.cpu_release(("walk", self._uid, w.name))
            if threaded:
                board.changed()

    def _walk_stopped(self, w: Walker) -> None:
        """``w`` stopped walking on the exception being handled: parked where it is when
        interrupted or stopped at the end of data, else failed (recorded, every thread
        interrupted). Where ``_walk`` ends on an exception."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Interrupted):
            self._park(w, "interrupted")
        elif isinstance(exc, Stopped):
            self._park(w, "stopped at the end of data")
        else:
            self._fail(w)

    def _park(self, w: Walker, why: str) -> None:
        w.state, w.parked_by = WalkState.PARKED, why

    def _fail(self, w: Walker) -> None:
        exc = sys.exc_info()[1]
        assert exc is not None
        task, batch = w.current
        with self.board.lock:
            secondary = isinstance(exc, (TaskAborted, CollectiveAborted)) and self.failures
            if not secondary:
                self.failures.append(Failure(exc, task, batch, w.name, w.P))
        w.state, w.parked_by = WalkState.PARKED, "failed"
        reason = f"{describe(task, batch, w.name, w.P)} failed: {exc!r}"
        for t in self._turnstiles.values():
            t.fail(reason)
        self.board.interrupt_all(reason)

    def _execute(self, w: Walker, P: int, instr: Instr) -> None:
        match instr:
            case Run() | RunAction() | Alias():
                self._run(w, P, instr)
            case WaitTask():
                self._wait_task(w, P, instr)
            case Signal():
                self._signal(w, P, instr)
            case _:
                raise EngineError(f"unknown instruction {instr!r}")

    def _op(self, instr: Instr) -> Op:
        """The call that executes ``instr``: through ``_execute``'s dispatch (subclasses compile
        the instructions they run often into calls of their own)."""
        execute = self._execute

        def op(w: Walker, P: int) -> None:
            execute(w, P, instr)

        return op

    def _ops(self, instrs: tuple[Instr, ...]) -> tuple[Op, ...]:
        return tuple(self._op(i) for i in instrs)

    # ---------------------------------------------------------------- views
    @property
    def worker_threads(self) -> list[threading.Thread]:
        """The worker threads started so far (none for a plan on the calling thread only)."""
        return [w.thread for w in self._workers.values()]

    @property
    def turnstiles(self) -> Mapping[str, Turnstile]:
        """The comm groups' turnstiles made so far, by group (a read-only view)."""
        return MappingProxyType(self._turnstiles)

    @property
    def observer(self) -> Observer | None:
        """The observer attached with ``instrument()``, if any."""
        return self._observer

    # ---------------------------------------------------------------- tickets
    def turnstile(self, group: str) -> Turnstile:
        t = self._turnstiles.get(group)
        if t is None:
            t = self._turnstiles[group] = Turnstile(group, self.board)
        return t

    def ticketed(
        self,
        w: Walker,
        group: str | None,
        ticket: int | None,
        task: str,
        b: int,
        check: Callable[[int], None] | None,
        run: Callable[..., Any],
        *args: Any,
    ) -> None:
        """``run(*args)``, holding ticket ``ticket`` of this iteration of ``group`` if it has one;
        a turn not granted at once is waited for, calling ``check(w.P)`` before each wait (it may
        raise to give up: see ``Turnstile.acquire``)."""
        if ticket is None:
            run(*args)
            return
        turnstile = self.turnstile(group or "")
        number = w.bases.get(group or "", 0) + ticket
        if not turnstile.take(number):
            turnstile.acquire(number, self.timeout_s, None if check is None else partial(check, w.P))
        try:
            run(*args)
        except BaseException:
            turnstile.fail(f"{describe(task, b, w.name, w.P)} failed")
            raise
        turnstile.release(number)

    def skip_ticket(self, w: Walker, group: str | None, ticket: int) -> None:
        """Ticket ``ticket`` of this iteration of ``group`` is not used (its task does not run)."""
        self.turnstile(group or "").skip(w.bases.get(group or "", 0) + ticket)

    # ------------------------------------------------------------- workers
    def _worker(self, thread: str) -> Worker:
        w = self._workers.get(thread)
        if w is None or not w.thread.is_alive():
            w = self._workers[thread] = Worker(f"{self.name}-{thread}", self.streams)
        return w

    def _launch(self, w: Walker, job: Callable[[], None]) -> None:
        w.state = WalkState.RUNNING
        if self._checker is not None:  # what the launcher did is ordered before the job
            self._checker.cpu_release(("launch", self._uid, w.name))
        self._worker(w.name).put(job)

    def wait_until_blocked(self, deadline: float | None = None) -> None:
        """Return once no thread can go on without a later call: every worker that walks is
        blocked (asleep on the board, ``Board.blocked``) on something only a later call provides
        (credit, the caller's request), or is at rest. Between calls the workers otherwise keep
        running ahead within their credit. An EngineTimeout once no thread made progress for the
        timeout; with a ``deadline`` (``time.monotonic()``), return then instead."""
        workers = [w for w in self._walkers.values() if w.name in self._workers]
        board = self.board

        def all_blocked() -> bool:
            running = [w for w in workers if w.state is WalkState.RUNNING]
            return all(self._workers[w.name].thread.ident in board.blocked for w in running)

        began = board.wait_began()
        while True:  # threads do not announce that they block: look every millisecond
            with board.lock:
                if all_blocked() or self.failures:
                    return
                stalled = board.patience(began, self.timeout_s) <= 0  # no thread made progress
            if deadline is not None:
                if time.monotonic() >= deadline:
                    return
            elif stalled:
                raise EngineTimeout(self._timeout_report())
            time.sleep(0.001)

    def park_all(self, why: str) -> None:
        """Interrupt every thread (``why``) so that each parks where it is, wait until every one is
        at rest, and lift the interrupt: the next walk of each resumes where it parked."""
        if len(self._walkers) > 1:
            self.board.interrupt_all(why)
        try:
            self.wait_until_resting()
        finally:
            self.board.resume()

    def wait_until_resting(self, walkers: list[Walker] | None = None) -> None:
        """Wait until none of ``walkers`` (None: every thread's) walks - each at rest: ready,
        parked or finished (interrupts do not end this wait); an EngineTimeout with the report
        once no thread made progress for the timeout (a task that runs on is progress: see
        ``torchrec_swp.engine.board``)."""
        if walkers is None:
            walkers = list(self._walkers.values())
        began = self.board.wait_began()

        def resting() -> bool:
            return all(w.state is not WalkState.RUNNING for w in walkers)

        with self.board.lock:
            while not resting():
                remaining = self.board.patience(began, self.timeout_s)
                if remaining <= 0:
                    cause = self.failures[0].exc if self.failures else None
                    raise EngineTimeout(self._timeout_report()) from cause
                self.board.sleep(remaining, resting)
        if self._checker is not None:
            for w in walkers:
                self._checker.cpu_acquire(("walk", self._uid, w.name))

    def drop_jobs(self) -> None:
        """Wait until every worker whose walk is at rest dropped its job (a job holds the engine:
        a walk says it is at rest just before its job returns). Where the data ended: the caller
        that sees the end may drop the engine, and no thread must hold it then."""
        for w in self._walkers.values():
            worker = self._workers.get(w.name)
            if worker is not None and w.state is not WalkState.RUNNING:
                worker.idle.wait(self.timeout_s)

    def _await_outcome(self, outcome: Callable[[], str | None], what: Callable[[], str], batch: int, topic: Any) -> str:
        """``outcome()`` once it is not None, waiting on the board (``topic``); a timeout is a
        failure of the caller's thread at ``batch`` like any other ("failed")."""
        result = outcome()
        if result is None:
            try:
                self.board.wait(lambda: outcome() is not None, what, self.timeout_s, topic)
            except BaseException as e:  # noqa: BLE001 - a timeout here is a failure like any other
                if not self.failures:
                    self.failures.append(Failure(e, "-", batch, MAIN_THREAD, self._walkers[MAIN_THREAD].P))
            result = outcome() or "failed"
        return result

    # -------------------------------------------------------------- failures
    def _raise_failure(self) -> None:
        """Stop every thread where it is and raise the first failure to the caller."""
        if len(self._walkers) > 1:
            self.board.interrupt_all("a task failed")
        self.wait_until_resting()
        self._failure_raised = True
        raise self._first_failure()

    def _resume_after_failure(self) -> None:
        """The caller calls again after a failure: every thread goes on where it stopped."""
        self.failures.clear()
        self._failure_raised = False
        self.board.resume()

    def restart_walkers(self, start: int) -> int:
        """Every walker placed at internal iteration ``start``, failures and latches forgotten;
        the furthest iteration any walker had reached."""
        self._resume_after_failure()
        furthest = max(w.P for w in self._walkers.values())
        self.board.clear_latches()
        bases = {g: t.next_ticket for g, t in self._turnstiles.items()}
        for w in self._walkers.values():
            w.place(start, bases)
        return furthest

    def _first_failure(self) -> BaseException:
        """The first failure, annotated, with notes naming the others (an EngineTimeout is
        raised as one whose message is the full report)."""
        first = self.failures[0]
        for other in self.failures[1:]:
            first.exc.add_note(
                f"also failed: {describe(other.task, other.batch, other.thread, other.iteration)}: {other.exc!r}"
            )
        self._annotate(first.exc, first)
        if isinstance(first.exc, EngineTimeout):
            report = EngineTimeout(self._timeout_report())
            report.__cause__ = first.exc
            self._annotate(report, first)
            return report
        return first.exc

    def _annotate(self, exc: BaseException, f: Failure) -> None:
        if getattr(exc, "swp_task", None) is not None:
            return
        # (the ignore below: the engine's own attributes, set on the user's exception)
        exc.swp_task, exc.swp_batch, exc.swp_thread, exc.swp_iteration = f.task, f.batch, f.thread, f.iteration  # type: ignore[attr-defined]
        exc.add_note(f"torchrec_swp: {self._describe(f)}")

    # ------------------------------------------------------ what subclasses do
    def _run(self, w: Walker, P: int, instr: Run | RunAction | Alias) -> None:
        raise EngineError(f"{type(self).__name__} cannot run `{instr}`")

    def _wait_task(self, w: Walker, P: int, instr: WaitTask) -> None:
        raise EngineError(f"{type(self).__name__} cannot run `{instr}`")

    def _signal(self, w: Walker, P: int, instr: Signal) -> None:
        raise EngineError(f"{type(self).__name__} cannot run `{instr}`")

    def _describe(self, f: Failure) -> str:
        return describe(f.task, f.batch, f.thread, f.iteration)

    def _timeout_report(self) -> str:
        lines = [f"{self.name} did not finish: no thread made progress for {self.timeout_s:.1f}s"]
        lines += [f"  thread {w.name!r}: {w.position()}" for w in self._walkers.values()]
        return "\n".join(lines)
