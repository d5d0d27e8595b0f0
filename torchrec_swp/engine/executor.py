"""The engine: runs a compiled plan, one internal iteration at a time, on threads and streams.

Contract of ``Engine.step()`` (what a pipeline's ``progress()`` delegates to): run internal
iterations until a batch leaves the highest stage and return its ``plan.output`` slot value;
raise StopIteration when no batch is left (after draining, or at once with
``on_exhausted="stop"``).

Bindings: every task name maps to ``fn(b, **reads)``, called with the index of the batch it
works on (within the epoch) and the values its PipelineTask declares it reads: from that
batch's slot, or for ``x@k`` from batch ``b - k``'s (None when that batch is not in flight),
as keyword ``PipelineTask.arguments``. It returns None (no writes), the value (one write) or a
tuple in declared order (several writes). The source raises StopIteration when the data is
exhausted. A task guarded by ``when`` is called only for the batches its guard admits.

Threads: the thread calling ``step()`` runs thread group ``"default"``; each other group has
a persistent worker. Iterations are separated by a barrier (every thread finishes iteration
``P`` before any starts ``P + 1``), so only same-iteration dependencies need CPU waits, and
those are explicit in the program. A plan on one thread runs as a flat list of calls.

Phases: given a PhasedPlan, each step runs the plan of the phase of the batch it delivers
(batch numbers count the source's calls since the engine was built or reset()).

Failures: an exception in any task on any thread aborts the iteration. Every waiter wakes
(CPU latches and collective tickets fail instead of blocking), every worker returns to idle,
and ``step()`` re-raises the first exception, of its own type, with a note naming task, batch,
thread and internal iteration (also as attributes ``swp_task``, ``swp_batch``, ``swp_thread``,
``swp_iteration``). Every blocking wait honours ``timeout_s``.
"""

from __future__ import annotations

import enum
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from torchrec_swp.compile import (
    Alias,
    CompiledPlan,
    Instr,
    IterationProgram,
    RecordEvent,
    Run,
    RunAction,
    Signal,
    WaitStream,
    WaitTask,
)
from torchrec_swp.engine.errors import CollectiveAborted, EngineError, EngineTimeout, TaskAborted, describe
from torchrec_swp.engine.streams import NullStreamPool, StreamPool
from torchrec_swp.engine.turnstile import Turnstile
from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError, When
from torchrec_swp.plan.phases import switch_problems
from torchrec_swp.plan.table import format_schedule
from torchrec_swp.plan.task import parse_read, read_argument

Binding = Callable[..., Any]
Invoker = Callable[[int], Any]

DEFAULT_TIMEOUT_S = 600.0
MAX_THREADS = 16
MAX_IN_FLIGHT = 8


class Observer(Protocol):
    """Receives timings (``time.perf_counter()`` seconds) while attached with ``Engine.instrument``."""

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None: ...

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None: ...

    def on_iteration(self, iteration: int, start: float, end: float) -> None: ...


class _Stopped(Exception):
    """Internal: the source found no batch under on_exhausted="stop"; stop this thread quietly."""


class LatchState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


class _Latch:
    """One task instance's completion, seen by threads that wait on it."""

    __slots__ = ("_cond", "_state")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._state = LatchState.PENDING

    def set(self, state: LatchState = LatchState.DONE) -> None:
        with self._cond:
            if self._state is LatchState.PENDING:
                self._state = state
                self._cond.notify_all()

    def wait(self, task: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state is LatchState.PENDING:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineTimeout(f"waited {timeout_s:.1f}s for task {task} to finish")
                self._cond.wait(remaining)
            if self._state is LatchState.FAILED:
                raise TaskAborted(f"not run: {task} failed or the iteration was aborted")
            if self._state is LatchState.STOPPED:
                raise _Stopped


class StepKind(enum.Enum):
    """How the flat path calls one step."""

    CALL = "call"  # call the task
    GUARDED = "guarded"  # call it only if its batch was loaded (stage 0, not the source)
    SOURCE = "source"  # pull a batch (may find the data exhausted)


class FlatStep(NamedTuple):
    """One call of a one-thread program, compiled once per program."""

    invoke: Invoker
    task: str
    stage: int
    kind: StepKind
    when: When


@dataclass
class Epoch:
    """Where the engine is in the current epoch (batches are numbered from 0 per epoch).

    ``loaded``: batches the source produced; ``delivered``: batches that left the highest
    stage; ``num_batches`` (M): set once the source found the data exhausted; ``stopped``: the
    plan stopped at the end of data (``on_exhausted="stop"``); ``resume``: tasks that already
    ran in the iteration that failed or stopped, not to be run again when it is resumed;
    ``end_reported``: step() raised StopIteration for the end of the data;
    ``restart_after_drain``: new data came while draining: start a new epoch when drained.
    """

    iteration: int = 0
    loaded: int = 0
    delivered: int = 0
    num_batches: int | None = None
    stopped: bool = False
    resume: frozenset[str] = frozenset()
    end_reported: bool = False
    restart_after_drain: bool = False
    #: batch (in this epoch) -> its batch number (the source call that drew it)
    numbers: dict[int, int] = field(default_factory=dict)


@dataclass
class BatchLedger:
    """What became of every batch the source drew, across epochs and resets.

    Batches are numbered by ``serial`` in the order they were drawn (0, 1, ... over the
    engine's life). A batch is trained once it left the highest stage; one that never will is
    listed in ``dropped`` with the reason.
    """

    drawn: int = 0
    trained: int = 0
    dropped: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class _Failure:
    exc: BaseException
    task: str
    batch: int
    thread: str
    iteration: int


@dataclass(frozen=True)
class ThreadPosition:
    """Where one thread is in an iteration (for timeout reports)."""

    state: str  # "not started" | "at" | "finished" | "stopped" | "failed"
    instr: Instr | None = None
    task: str | None = None

    def __str__(self) -> str:
        match self.state:
            case "at":
                return f"at {self.instr}"
            case "failed":
                return f"failed in {self.task}"
            case "stopped":
                return "stopped (data exhausted)"
            case _:
                return self.state

    @property
    def running(self) -> str | None:
        """The task this thread is running or about to run (not waiting on a latch)."""
        if self.state != "at":
            return None
        if isinstance(self.instr, Run):
            return self.instr.task
        return self.instr.action if isinstance(self.instr, RunAction) else None


_NOT_STARTED = ThreadPosition("not started")


@dataclass
class _IterationContext:
    iteration: int
    program: IterationProgram
    latches: dict[str, _Latch]
    grad_enabled: bool
    skip: frozenset[str] = frozenset()
    completed: set[str] = field(default_factory=set)
    done: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    failures: list[_Failure] = field(default_factory=list)
    position: dict[str, ThreadPosition] = field(default_factory=dict)
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Worker:
    def __init__(self, name: str, streams: StreamPool) -> None:
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(self.inbox, streams), name=name, daemon=True)
        self.thread.start()

    @staticmethod
    def _loop(inbox: queue.SimpleQueue[Callable[[], None] | None], streams: StreamPool) -> None:
        streams.thread_init()
        while (job := inbox.get()) is not None:
            job()

    def stop(self, timeout_s: float) -> None:
        self.inbox.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)


def _stop_workers(workers: dict[str, _Worker]) -> None:
    for w in workers.values():
        w.stop(5.0)
    workers.clear()


class Interpreter:
    """Runs the threads of an ``IterationProgram``: the calling thread runs ``"default"``, a
    persistent worker each other thread group; latches for ``wait``/``signal``, one turnstile per
    comm group for collective tickets, the stream pool, the timeout, failures and timeout reports.

    What the instructions that name work do is the subclass's: ``Engine`` runs plan tasks
    (``run``/``alias`` and the device syncs between them), ``ProgramEngine``
    (``torchrec_swp.engine.programs``) pipeline-parallel actions (``run 0F3``). An instruction a
    subclass does not run fails loudly.
    """

    def __init__(self, *, streams: StreamPool | None, timeout_s: float, name: str) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        self.streams: StreamPool = streams if streams is not None else NullStreamPool()
        self.timeout_s = float(timeout_s)
        self.name = name
        self._workers: dict[str, _Worker] = {}
        self._turnstiles: dict[str, Turnstile] = {}
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._observer: Observer | None = None
        self._labels = False

    def close(self) -> None:
        """Stop the worker threads (idempotent)."""
        self._finalizer()

    def _execute(self, ctx: _IterationContext) -> None:
        """Run every thread of ``ctx.program`` once and wait for all of them.

        Failures are left in ``ctx.failures`` (``_first_failure`` makes the one to raise); a
        worker that does not finish within the timeout aborts the rest and raises EngineTimeout
        with ``_timeout_report``.
        """
        program = ctx.program
        for group, _ in program.tickets:
            self._turnstile(group).restart()
        workers = [(g, instrs) for g, instrs in program.threads if g != MAIN_THREAD and instrs]
        for group, instrs in workers:
            worker = self._worker(group)
            worker.inbox.put(lambda g=group, i=instrs: self._worker_job(g, i, ctx))
        self._interpret(MAIN_THREAD, program.instructions(MAIN_THREAD), ctx)
        deadline = time.monotonic() + self.timeout_s
        for _ in workers:
            try:
                ctx.done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._abort(ctx, "timeout")
                cause = ctx.failures[0].exc if ctx.failures else None
                raise EngineTimeout(self._timeout_report(ctx)) from cause

    def _first_failure(self, ctx: _IterationContext) -> BaseException:
        """The first failure of the iteration, annotated, with notes naming the others."""
        first = ctx.failures[0]
        for other in ctx.failures[1:]:
            first.exc.add_note(
                f"also failed: {describe(other.task, other.batch, other.thread, other.iteration)}: {other.exc!r}"
            )
        self._annotate(first.exc, first)
        return first.exc

    def _worker_job(self, group: str, instrs: tuple[Instr, ...], ctx: _IterationContext) -> None:
        try:
            with torch.set_grad_enabled(ctx.grad_enabled):
                self._interpret(group, instrs, ctx)
        finally:
            ctx.done.put(group)

    def _interpret(self, thread: str, instrs: tuple[Instr, ...], ctx: _IterationContext) -> None:
        p = ctx.iteration
        task, b, at = "-", p, 0
        try:
            for at, instr in enumerate(instrs):
                ctx.position[thread] = ThreadPosition("at", instr)
                match instr:
                    case Run(task=task, stage=stage, ticket=ticket, comm_group=group):
                        b = p - stage
                        if task in ctx.skip:
                            # it ran before a failure or stop: its collective was issued then, but
                            # its ticket in this (restarted) numbering must still be passed on
                            if ticket is not None:
                                self._pass_ticket(group, ticket)
                            continue
                        if ticket is None:
                            self._run_one(instr, b, ctx)
                        else:
                            self._run_ticketed(instr, b, ctx, group, ticket)
                        with ctx.lock:
                            ctx.completed.add(task)
                    case RunAction(action=task, microbatch=mb, ticket=ticket, comm_group=group):
                        b = -1 if mb is None else mb
                        if ticket is None:
                            self._run_action(instr, ctx)
                        else:
                            self._run_ticketed(instr, b, ctx, group, ticket)
                        with ctx.lock:
                            ctx.completed.add(task)
                    case Alias(task=task, stage=stage):
                        b = p - stage
                        if task not in ctx.skip:
                            self._run_alias(instr, b)
                    case WaitTask(task=producer):
                        task = f"wait {producer}"
                        if self._observer is None:
                            ctx.latches[producer].wait(producer, self.timeout_s)
                        else:
                            start = time.perf_counter()
                            ctx.latches[producer].wait(producer, self.timeout_s)
                            self._observer.on_wait(producer, thread, p, start, time.perf_counter())
                    case Signal(task=producer):
                        ctx.latches[producer].set()
                    case WaitStream() | RecordEvent():
                        self._device_sync(instr, p)
                    case _:
                        raise EngineError(f"unknown instruction {instr!r}")
            ctx.position[thread] = ThreadPosition("finished")
        except _Stopped:
            # the tasks left on this thread are cancelled: let whoever waits on them stop too
            for rest in instrs[at:]:
                if isinstance(rest, Signal):
                    ctx.latches[rest.task].set(LatchState.STOPPED)
            ctx.position[thread] = ThreadPosition("stopped")
        except BaseException:
            self._record_failure(ctx, thread, task, b)

    def _record_failure(self, ctx: _IterationContext, thread: str, task: str, b: int) -> None:
        exc = sys.exc_info()[1]
        assert exc is not None
        with ctx.lock:
            secondary = isinstance(exc, (TaskAborted, CollectiveAborted)) and ctx.failures
            if not secondary:
                ctx.failures.append(_Failure(exc, task, b, thread, ctx.iteration))
            ctx.position[thread] = ThreadPosition("failed", task=task)
        self._abort(ctx, f"{describe(task, b, thread, ctx.iteration)} failed: {exc!r}")

    def _abort(self, ctx: _IterationContext, reason: str) -> None:
        for latch in ctx.latches.values():
            latch.set(LatchState.FAILED)
        for group, _ in ctx.program.tickets:
            self._turnstile(group).fail(reason)

    def _pass_ticket(self, group: str | None, ticket: int) -> None:
        """Take ``ticket``'s turn without running anything (its task already ran)."""
        turnstile = self._turnstile(group or "")
        turnstile.acquire(ticket, self.timeout_s)
        turnstile.release(ticket)

    def _run_ticketed(
        self, instr: Run | RunAction, b: int, ctx: _IterationContext, group: str | None, ticket: int
    ) -> None:
        turnstile = self._turnstile(group or "")
        turnstile.acquire(ticket, self.timeout_s)
        try:
            if isinstance(instr, Run):
                self._run_one(instr, b, ctx)
            else:
                self._run_action(instr, ctx)
        except BaseException:
            task = instr.task if isinstance(instr, Run) else instr.action
            turnstile.fail(f"{describe(task, b, threading.current_thread().name, ctx.iteration)} failed")
            raise
        turnstile.release(ticket)

    def _worker(self, group: str) -> _Worker:
        w = self._workers.get(group)
        if w is None or not w.thread.is_alive():
            w = self._workers[group] = _Worker(f"{self.name}-{group}", self.streams)
        return w

    def _turnstile(self, group: str) -> Turnstile:
        t = self._turnstiles.get(group)
        if t is None:
            t = self._turnstiles[group] = Turnstile(group)
        return t

    def _annotate(self, exc: BaseException, f: _Failure) -> None:
        if getattr(exc, "swp_task", None) is not None:
            return
        exc.swp_task, exc.swp_batch, exc.swp_thread, exc.swp_iteration = f.task, f.batch, f.thread, f.iteration  # type: ignore[attr-defined]
        exc.add_note(f"torchrec_swp: {self._describe(f)}")

    # ------------------------------------------------- what a subclass runs
    def _run_one(self, instr: Run, b: int, ctx: _IterationContext) -> None:
        raise EngineError(f"{type(self).__name__} runs no plan task: cannot run `{instr}`")

    def _run_action(self, instr: RunAction, ctx: _IterationContext) -> None:
        raise EngineError(f"{type(self).__name__} runs no pipeline-parallel action: cannot run `{instr}`")

    def _run_alias(self, instr: Alias, b: int) -> None:
        raise EngineError(f"{type(self).__name__} runs no plan task: cannot run `{instr}`")

    def _device_sync(self, instr: WaitStream | RecordEvent, p: int) -> None:
        raise EngineError(f"{type(self).__name__} has no device syncs between plan tasks: cannot run `{instr}`")

    def _describe(self, f: _Failure) -> str:
        return describe(f.task, f.batch, f.thread, f.iteration)

    def _timeout_report(self, ctx: _IterationContext) -> str:
        lines = [f"iteration {ctx.iteration} did not finish within {self.timeout_s:.1f}s"]
        for thread, _ in ctx.program.threads:
            lines.append(f"  thread {thread!r}: {ctx.position.get(thread, _NOT_STARTED)}")
        return "\n".join(lines)


class Engine(Interpreter):
    """Interprets a plan's compiled programs. One Engine per pipeline instance."""

    def __init__(
        self,
        plan: PipelinePlan | PhasedPlan,
        bindings: Mapping[str, Binding],
        *,
        streams: StreamPool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "swp",
        max_threads: int = MAX_THREADS,
        max_in_flight: int = MAX_IN_FLIGHT,
        device_type: str | None = None,
    ) -> None:
        if isinstance(plan, PipelinePlan):
            phased = PhasedPlan([(0, plan)])
        elif isinstance(plan, PhasedPlan):
            phased = plan
        else:
            raise TypeError(f"plan must be a PipelinePlan or a PhasedPlan, got {type(plan).__name__}")
        for p in phased.plans:
            self._check_limits(p, max_threads, max_in_flight)
        tasks = list(dict.fromkeys(t for p in phased.plans for t in p.fire_order))
        missing = [t for t in tasks if t not in bindings]
        if missing:
            raise PlanError(f"no function bound to task {missing[0]} of plan {phased.name}", culprit=missing[0])
        extra = [t for t in bindings if t not in tasks]
        if extra:
            raise PlanError(f"a function is bound to {extra[0]!r}, which is not a task of plan {phased.name}", culprit=extra[0])
        super().__init__(streams=streams, timeout_s=timeout_s, name=name)
        for name_, fn in bindings.items():
            if not callable(fn):
                raise TypeError(f"the function bound to task {name_} is not callable: {fn!r}")
        self.device_type = device_type
        self.slots: dict[int, dict[str, Any]] = {}
        self.ledger = BatchLedger()
        self._epoch_serial = 0
        self.epoch = Epoch()
        self._pulls = 0  # source calls since construction or reset(): the next batch number
        self.phased = phased
        self._bindings = dict(bindings)
        self._compiled: dict[int, CompiledPlan] = {}
        self._install(phased.plan_for(0))
        self.reset()

    @staticmethod
    def _check_limits(plan: PipelinePlan, max_threads: int, max_in_flight: int) -> None:
        if len(plan.thread_groups) > max_threads:
            raise PlanError(
                f"plan {plan.name} uses {len(plan.thread_groups)} threads ({', '.join(plan.thread_groups)}); "
                f"at most {max_threads} are allowed (max_threads)",
                culprit="thread_map",
            )
        if plan.pipeline_depth > max_in_flight:
            raise PlanError(
                f"plan {plan.name} keeps {plan.pipeline_depth} batches in flight; at most {max_in_flight} are allowed "
                "(max_in_flight)",
                culprit="pipeline_depth",
            )
        if plan.source is None:
            raise PlanError(f"plan {plan.name} has no source task: the engine needs one to pull batches", culprit="source")

    def _install(self, plan: PipelinePlan) -> None:
        """Make ``plan`` the one the next iterations run (its programs are compiled once)."""
        self.plan = plan
        compiled = self._compiled.get(id(plan))
        if compiled is None or compiled.plan is not plan:
            compiled = CompiledPlan(plan, device_streams=self.streams.has_streams, device_type=self.device_type)
            self._compiled[id(plan)] = compiled
        self.compiled = compiled
        self._invokers = {t: self._instrumented(t, self._make_invoker(t, self._bindings[t])) for t in plan.fire_order}
        self._flat_cache: dict[int, list[FlatStep]] = {}
        # per task, looked up on every threaded run: its stream, and its alias where it is one
        self._stream_of = {t: plan.task(t).stream for t in plan.fire_order}
        self._alias_invokers: dict[str, Invoker] = {}
        self._signalled: dict[int, frozenset[str]] = {}
        self._max_distance = max((d.distance for d in plan.deps), default=0)

    def instrument(self, observer: Observer | None = None, *, labels: bool = False) -> None:
        """Attach (or, with no arguments, detach) instrumentation.

        ``observer`` gets every task run, every cross-thread wait and every iteration with its
        times; ``labels`` wraps each task in ``torch.profiler.record_function("## Task b ##")``
        so profiler traces show the plan's tasks. Detached, the engine runs the bare calls.
        """
        self._observer = observer
        self._labels = labels
        self._install(self.plan)

    def _instrumented(self, task: str, invoke: Invoker) -> Invoker:
        observer, labels = self._observer, self._labels
        if observer is None and not labels:
            return invoke
        thread = self.plan.task(task).thread_group
        record_function = torch.profiler.record_function

        def timed(b: int) -> Any:
            start = time.perf_counter()
            try:
                if labels:
                    with record_function(f"## {task} {b} ##"):
                        return invoke(b)
                return invoke(b)
            finally:
                if observer is not None:
                    observer.on_run(task, b, thread, self.epoch.iteration, start, time.perf_counter())

        return timed

    def switch_plan(self, plan: PipelinePlan, bindings: Mapping[str, Binding] | None = None) -> None:
        """Run ``plan`` from the next internal iteration on, keeping the batches in flight.

        Allowed between steps when the plans agree on what the batches in flight hold
        (``plan.phases.switch_problems``). ``bindings`` adds functions for new tasks. The
        engine then runs ``plan`` in every phase.
        """
        old = self.plan
        problems = switch_problems(old, plan)
        merged = {**self._bindings, **(bindings or {})}
        missing = [t for t in plan.fire_order if t not in merged]
        if missing:
            problems.append(f"no function bound to task {missing[0]}")
        if problems:
            raise PlanError(f"cannot switch from plan {old.name} to {plan.name}: " + "; ".join(problems), culprit=plan.name)
        self._bindings = {t: merged[t] for t in plan.fire_order}
        self.phased = PhasedPlan([(0, plan)])
        self._install(plan)

    # ------------------------------------------------------------------ state
    @property
    def iteration(self) -> int:
        return self.epoch.iteration

    @property
    def loaded(self) -> int:
        return self.epoch.loaded

    @property
    def delivered(self) -> int:
        return self.epoch.delivered

    @property
    def num_batches(self) -> int | None:
        return self.epoch.num_batches

    @property
    def stopped(self) -> bool:
        return self.epoch.stopped

    def reset(self) -> None:
        """Forget every batch in flight and start again at iteration 0 (workers are kept);
        batch numbers (the phases' clock) start again at 0 too.

        Batches in flight are recorded in ``ledger.dropped``: they were drawn, never trained.
        """
        self._start_epoch()
        self._pulls = 0

    def _start_epoch(self) -> None:
        for b in self.in_flight():
            self.ledger.dropped.append((self._epoch_serial + b, "in flight when reset() was called"))
        self._epoch_serial = self.ledger.drawn
        self.epoch = Epoch()
        self.slots.clear()
        self._events: dict[tuple[str, int], Any] = {}
        for t in self._turnstiles.values():
            t.clear_failure()

    def adopt(self, slots: list[dict[str, Any]]) -> None:
        """Take batches loaded outside the engine as the batches in flight.

        Batch 0 is placed at the highest stage, due to leave in the next step, batch ``j`` at
        stage ``max_stage - j``: the tasks of the stages below its own count as done, as if the
        engine had run them. ``slots[j]`` must hold every value that batch ``j``'s remaining
        tasks read from those (for the TorchRec pipelines: the batch and its context, which user
        code put where the pipeline keeps them). Batches placed at or below the source's stage
        are not drawn again. With fewer batches than the stages above the source, the data is
        taken to end after them (the pipeline drains them).

        Only while nothing is in flight (fresh, or after the end of data or a reset()).
        """
        if self.in_flight():
            raise EngineError(f"cannot adopt batches while batches {self.in_flight()} are in flight")
        if not slots:
            return
        top, src = self.plan.max_stage, self.plan.task(self.plan.source or "").stage
        for j, values in enumerate(slots):
            at = max(top - j, 0)
            needed = {
                name
                for t in self.plan.scheduled()
                if t.stage >= at
                for name, k in map(parse_read, t.io.reads)
                if k == 0 and (w := self.plan.writer_of(name)) is not None and self.plan.task(w).stage < at
            }
            missing = sorted(needed - set(values))
            if missing:
                raise EngineError(
                    f"cannot adopt batch {j} at stage {at} of plan {self.plan.name}: its remaining tasks read "
                    f"{', '.join(missing)}, which the slot given for it lacks"
                )
        self._start_epoch()
        epoch = self.epoch
        for j, values in enumerate(slots):
            self.slots[j] = dict(values)
            epoch.numbers[j] = self._pulls
            self._pulls += 1
        epoch.loaded = len(slots)
        self.ledger.drawn += len(slots)
        epoch.iteration = top
        if len(slots) < top - src:
            epoch.num_batches = len(slots)

    def in_flight(self) -> list[int]:
        """Batches loaded but not delivered (in order), by index in this epoch."""
        return list(range(self.epoch.delivered, self.epoch.loaded))

    def new_data(self) -> None:
        """The source has new data (a new iterator, or a new epoch of the same one).

        Stopped at the end of data: resume the iteration that stopped, where it stopped.
        Drained: start a new epoch. Still draining: finish the batches in flight, then start a
        new epoch without raising StopIteration in between. Otherwise nothing changes: the
        source reads the new data from its next batch on.
        """
        epoch = self.epoch
        if epoch.stopped:
            epoch.stopped = False
            epoch.num_batches = None
        elif epoch.num_batches is None:
            return
        elif epoch.delivered >= epoch.num_batches:
            self._start_epoch()
        else:
            epoch.restart_after_drain = True

    @property
    def end_reported(self) -> bool:
        """The last step() raised StopIteration because the data ended."""
        return self.epoch.end_reported

    @property
    def ended(self) -> bool:
        """The data is exhausted and no batch is left to deliver (or the plan stopped)."""
        e = self.epoch
        return e.stopped or (e.num_batches is not None and e.delivered >= e.num_batches)

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        reason = "left in flight: the plan stopped at the end of data" if self.epoch.stopped else "in flight"
        return [*self.ledger.dropped, *((self._epoch_serial + b, reason) for b in self.in_flight())]

    # ------------------------------------------------------------------- step
    def step(self) -> Any:
        while True:
            if self.ended:
                if not self.epoch.restart_after_drain:
                    self.epoch.end_reported = True
                    raise StopIteration
                self._start_epoch()
            epoch = self.epoch
            epoch.end_reported = False
            self._enter_phase()
            top = self.plan.max_stage
            p = epoch.iteration
            program = self.compiled.program(p, epoch.num_batches)
            start = time.perf_counter() if self._observer is not None else 0.0
            if program.flat:
                self._run_flat(p, program)
            else:
                self._run_threaded(p, program)
            if self._observer is not None:
                self._observer.on_iteration(p, start, time.perf_counter())
            epoch.iteration = p + 1
            self._forget_events(p)
            if top in program.active_stages and p - top < epoch.loaded:
                b = p - top
                epoch.delivered += 1
                epoch.numbers.pop(b, None)
                self.ledger.trained += 1
                slot = self.slots.pop(b, {})
                return slot.get(self.plan.output) if self.plan.output is not None else None

    def _enter_phase(self) -> None:
        """Run the plan of the phase of the batch this step delivers (the oldest in flight, or
        the next to be drawn)."""
        if len(self.phased.phases) == 1:
            return
        epoch = self.epoch
        number = epoch.numbers.get(epoch.delivered, self._pulls)
        plan = self.phased.plan_for(number)
        if plan is not self.plan:
            self._install(plan)

    def run_to_end(self) -> list[Any]:
        """Step until the data ends; the outputs in order."""
        outputs = []
        while True:
            try:
                outputs.append(self.step())
            except StopIteration:
                return outputs

    def _admits(self, when: When, b: int) -> bool:
        """Whether a task guarded by ``when`` runs for batch ``b`` now (the source has looked
        for every batch it may ask about: plan validation)."""
        epoch = self.epoch
        return when.admits(b, epoch.num_batches, epoch.iteration, self.plan.max_stage)

    # -------------------------------------------------------------- flat path
    def _flat_steps(self, program: IterationProgram) -> list[FlatStep]:
        steps = self._flat_cache.get(id(program))
        if steps is None:
            steps = []
            for i in program.instructions(MAIN_THREAD):
                if isinstance(i, Run):
                    kind = StepKind.SOURCE if i.source else StepKind.GUARDED if i.guarded else StepKind.CALL
                    steps.append(FlatStep(self._in_stream(i.task), i.task, i.stage, kind, i.when))
                elif isinstance(i, Alias):
                    steps.append(FlatStep(self._alias_invoker(i), i.task, i.stage, StepKind.GUARDED, When.ALWAYS))
            self._flat_cache[id(program)] = steps
        return steps

    def _in_stream(self, task: str) -> Invoker:
        """The task's invoker, entering its stream first where the device has streams and the
        task is not on the current (default) one (the threaded path does this per call)."""
        invoke, stream = self._invokers[task], self._stream_of[task]
        if not self.streams.has_streams or stream == DEFAULT_STREAM:
            return invoke
        context = self.streams.context

        def in_stream(b: int) -> Any:
            with context(stream):
                return invoke(b)

        return in_stream

    def _run_flat(self, p: int, program: IterationProgram) -> None:
        epoch = self.epoch
        steps = self._flat_steps(program)
        if epoch.resume:
            # resuming an iteration that failed: what already ran must not run twice
            steps = [s for s in steps if s.task not in epoch.resume]
        for k, step in enumerate(steps):
            b = p - step.stage
            try:
                if step.kind is StepKind.SOURCE:
                    if not self._pull(step.invoke, b):
                        break
                elif step.kind is StepKind.GUARDED and b >= epoch.loaded:
                    continue
                elif step.when is When.ALWAYS or self._admits(step.when, b):
                    step.invoke(b)
            except BaseException as e:
                epoch.resume = epoch.resume | {s.task for s in steps[:k]}
                if isinstance(e, StopIteration):
                    raise RuntimeError(f"{describe(step.task, b, MAIN_THREAD, p)} raised StopIteration") from e
                self._annotate(e, _Failure(e, step.task, b, MAIN_THREAD, p))
                raise
        else:
            epoch.resume = frozenset()
            return
        # stopped at the end of data: if data comes again, resume from the source
        epoch.resume = epoch.resume | {s.task for s in steps[:k]}
        raise StopIteration

    def _pull(self, invoke: Invoker, b: int) -> bool:
        """Run the source for batch ``b``; False when the data is exhausted and the plan stops."""
        epoch = self.epoch
        if epoch.num_batches is not None or b < epoch.loaded:  # exhausted, or adopted
            return True
        self.slots[b] = {}
        number = self._pulls
        self._pulls += 1
        try:
            invoke(b)
        except StopIteration:
            del self.slots[b]
            epoch.num_batches = b
            epoch.stopped = self.plan.on_exhausted == "stop"
            return not epoch.stopped
        epoch.loaded = b + 1
        epoch.numbers[b] = number
        self.ledger.drawn += 1
        return True

    # ---------------------------------------------------------- threaded path
    def _run_threaded(self, p: int, program: IterationProgram) -> None:
        epoch = self.epoch
        signalled = self._signalled.get(id(program))
        if signalled is None:
            signalled = frozenset(i.task for _, instrs in program.threads for i in instrs if isinstance(i, Signal))
            self._signalled[id(program)] = signalled
        ctx = _IterationContext(p, program, {t: _Latch() for t in signalled}, torch.is_grad_enabled(), epoch.resume)
        self._execute(ctx)
        if ctx.failures:
            epoch.resume = ctx.skip | ctx.completed
            raise self._first_failure(ctx)
        if ctx.stopped:
            epoch.resume = ctx.skip | ctx.completed
            raise StopIteration
        epoch.resume = frozenset()

    def _run_one(self, instr: Run, b: int, ctx: _IterationContext) -> None:
        invoke = self._invokers[instr.task]
        epoch = self.epoch
        if instr.source:
            if epoch.num_batches is not None or b < epoch.loaded:  # exhausted, or adopted
                return
            self.slots[b] = {}
            number = self._pulls
            self._pulls += 1
            try:
                with self.streams.context(self._stream_of[instr.task]):
                    invoke(b)
            except StopIteration:
                del self.slots[b]
                epoch.num_batches = b
                if self.plan.on_exhausted == "stop":
                    # Everything firing after the source waits on it (the compiler makes sure),
                    # so stopping its latch cancels exactly what single-thread order would.
                    epoch.stopped = ctx.stopped = True
                    raise _Stopped from None
                return
            epoch.loaded = b + 1
            epoch.numbers[b] = number
            self.ledger.drawn += 1
            return
        if (instr.guarded and b >= epoch.loaded) or not self._admits(instr.when, b):
            return
        try:
            with self.streams.context(self._stream_of[instr.task]):
                invoke(b)
        except StopIteration as e:
            raise RuntimeError(f"task {instr.task} raised StopIteration") from e

    def _run_alias(self, instr: Alias, b: int) -> None:
        if b < self.epoch.loaded:
            self._alias_invoker(instr)(b)

    def _device_sync(self, instr: WaitStream | RecordEvent, p: int) -> None:
        if isinstance(instr, WaitStream):
            event = self._events.get((instr.task, p - instr.consumer_stage - instr.distance))
            if event is not None:
                self.streams.wait(instr.stream, event)
        elif p - instr.stage < self.epoch.loaded:  # not for a batch that was never loaded
            self._events[(instr.task, p - instr.stage)] = self.streams.record(instr.stream)

    # ---------------------------------------------------------------- helpers
    def _alias_invoker(self, instr: Alias) -> Invoker:
        """The (instrumented) alias of a task, built once per plan and instrumentation."""
        invoke = self._alias_invokers.get(instr.task)
        if invoke is None:
            invoke = self._alias_invokers[instr.task] = self._instrumented(instr.task, self._aliaser(instr))
        return invoke

    def _aliaser(self, instr: Alias) -> Invoker:
        """The call-free stand-in of a task that is a no-op on this device."""
        slots, pairs = self.slots, instr.pairs

        def alias(b: int) -> None:
            slot = slots[b]
            for write, read in pairs:
                slot[write] = slot[read]

        return alias

    def _make_invoker(self, task: str, fn: Binding) -> Invoker:
        io = self.plan.tasks[task]
        writes, slots = io.writes, self.slots
        # (keyword, data name, batches back) per read
        reads = [(read_argument(r), *parse_read(r)) for r in io.reads]
        same_batch = all(k == 0 for _, _, k in reads)

        def call(b: int) -> Any:
            if not reads:
                return fn(b)
            try:
                if same_batch:
                    slot = slots[b]
                    args = {arg: slot[data] for arg, data, _ in reads}
                else:
                    args = {arg: slots[b][data] if k == 0 else _previous(slots, b - k, data) for arg, data, k in reads}
            except KeyError as e:
                raise EngineError(f"task {task} reads {e.args[0]!r} of batch {b}, which was never written") from None
            return fn(b, **args)

        if not writes:
            return call
        if len(writes) == 1:
            (w,) = writes

            def invoke_one(b: int) -> None:
                slots[b][w] = call(b)

            return invoke_one

        def invoke_many(b: int) -> None:
            values = call(b)
            if not isinstance(values, tuple) or len(values) != len(writes):
                raise EngineError(f"task {task} must return a tuple of {len(writes)} values for {writes}, got {values!r}")
            slot = slots[b]
            for k, v in zip(writes, values):
                slot[k] = v

        return invoke_many

    def _forget_events(self, p: int) -> None:
        if not self._events:
            return
        horizon = p - self.plan.max_stage - self._max_distance - 1
        for key in [k for k in self._events if k[1] < horizon]:
            del self._events[key]

    def _describe(self, f: _Failure) -> str:
        return f"{describe(f.task, f.batch, f.thread, f.iteration)} of plan {self.plan.name}"

    def _timeout_report(self, ctx: _IterationContext) -> str:
        lines = [f"internal iteration {ctx.iteration} of plan {self.plan.name} did not finish within {self.timeout_s:.1f}s"]
        for thread, _ in ctx.program.threads:
            lines.append(f"  thread {thread!r}: {ctx.position.get(thread, _NOT_STARTED)}")
        for group, t in self._turnstiles.items():
            lines.append(f"  comm group {group!r}: next ticket {t.next_ticket}, waiting {t.waiting or 'none'}")
        running = [pos.running for pos in ctx.position.values() if pos.running is not None]
        mark = (running[0], ctx.iteration) if running else None
        lines.append(format_schedule(self.plan, ctx.iteration + 2, self.epoch.num_batches, mark=mark))
        return "\n".join(lines)


def _previous(slots: dict[int, dict[str, Any]], b: int, data: str) -> Any:
    """``data`` of batch ``b`` (an earlier one), or None when that batch is not in flight."""
    slot = slots.get(b)
    return None if slot is None else slot[data]
