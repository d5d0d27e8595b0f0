"""The engine: runs a compiled plan, one internal iteration at a time, on threads and streams.

Contract of ``Engine.step()`` (what a pipeline's ``progress()`` delegates to): run internal
iterations until a batch leaves the highest stage and return its ``plan.output`` slot value;
raise StopIteration when no batch is left (after draining, or at once with
``on_exhausted="stop"``).

Bindings: every task name maps to ``fn(b, **reads)``, called with the index of the batch it
works on and the values its PipelineTask declares it reads from that batch's slot. It returns
None (no writes), the value (one write) or a tuple in declared order (several writes). The
source raises StopIteration when the data is exhausted.

Threads: the thread calling ``step()`` runs thread group ``"default"``; each other group has
a persistent worker. Iterations are separated by a barrier (every thread finishes iteration
``P`` before any starts ``P + 1``), so only same-iteration dependencies need CPU waits, and
those are explicit in the program. A plan on one thread runs as a flat list of calls.

Failures: an exception in any task on any thread aborts the iteration. Every waiter wakes
(CPU latches and collective tickets fail instead of blocking), every worker returns to idle,
and ``step()`` re-raises the first exception, of its own type, with a note naming task, batch,
thread and internal iteration (also as attributes ``swp_task``, ``swp_batch``, ``swp_thread``,
``swp_iteration``). Every blocking wait honours ``timeout_s``.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchrec_swp.compile import Alias, CompiledPlan, IterationProgram, RecordEvent, Run, Signal, WaitStream, WaitTask
from torchrec_swp.engine.errors import (
    CollectiveAborted,
    EngineError,
    EngineTimeout,
    TaskAborted,
    describe,
)
from torchrec_swp.engine.streams import NullStreamPool, StreamPool
from torchrec_swp.engine.turnstile import Turnstile
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, PlanError
from torchrec_swp.plan.table import format_schedule

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


class _Latch:
    """One task instance's completion, seen by threads that wait on it."""

    __slots__ = ("_cond", "_state")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._state = "pending"  # pending | done | failed | stopped

    def set(self, state: str = "done") -> None:
        with self._cond:
            if self._state == "pending":
                self._state = state
                self._cond.notify_all()

    def wait(self, task: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state == "pending":
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineTimeout(f"waited {timeout_s:.1f}s for task {task} to finish")
                self._cond.wait(remaining)
            if self._state == "failed":
                raise TaskAborted(f"not run: {task} failed or the iteration was aborted")
            if self._state == "stopped":
                raise _Stopped


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
    position: dict[str, str] = field(default_factory=dict)
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


class Engine:
    """Interprets a plan's compiled programs. One Engine per pipeline instance."""

    def __init__(
        self,
        plan: PipelinePlan,
        bindings: Mapping[str, Binding],
        *,
        streams: StreamPool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "swp",
        max_threads: int = MAX_THREADS,
        max_in_flight: int = MAX_IN_FLIGHT,
        device_type: str | None = None,
    ) -> None:
        if not isinstance(plan, PipelinePlan):
            raise TypeError(f"plan must be a PipelinePlan, got {type(plan).__name__}")
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
        missing = [t for t in plan.fire_order if t not in bindings]
        if missing:
            raise PlanError(f"no function bound to task {missing[0]} of plan {plan.name}", culprit=missing[0])
        extra = [t for t in bindings if t not in plan.schedule]
        if extra:
            raise PlanError(f"a function is bound to {extra[0]!r}, which is not a task of plan {plan.name}", culprit=extra[0])
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        for name_, fn in bindings.items():
            if not callable(fn):
                raise TypeError(f"the function bound to task {name_} is not callable: {fn!r}")
        self.streams: StreamPool = streams if streams is not None else NullStreamPool()
        self.device_type = device_type
        self.shortcuts = 0  # calls saved: pure tasks handed the same inputs again
        self.timeout_s = float(timeout_s)
        self.name = name
        self.slots: dict[int, dict[str, Any]] = {}
        self._workers: dict[str, _Worker] = {}
        self._turnstiles: dict[str, Turnstile] = {}
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._observer: Observer | None = None
        self._labels = False
        self.ledger = BatchLedger()
        self._epoch_serial = 0
        self.loaded = self.delivered = 0
        self._install(plan, bindings)
        self.reset()

    def _install(self, plan: PipelinePlan, bindings: Mapping[str, Binding]) -> None:
        self.plan = plan
        self.compiled = CompiledPlan(plan, device_streams=self.streams.has_streams, device_type=self.device_type)
        self._bindings = dict(bindings)
        self._invokers = {t: self._instrumented(t, self._make_invoker(t, self._bindings[t])) for t in plan.fire_order}
        self._flat_cache: dict[int, list[tuple[Invoker, int, int, str]]] = {}
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
        self._install(self.plan, self._bindings)

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
                    observer.on_run(task, b, thread, self.iteration, start, time.perf_counter())

        return timed

    def switch_plan(self, plan: PipelinePlan, bindings: Mapping[str, Binding] | None = None) -> None:
        """Run ``plan`` from the next internal iteration on, keeping the batches in flight.

        Allowed between steps when the plans agree on what the batches in flight hold: same
        source, output and stages; every task in both has the same stage and reads/writes; a
        task in only one of them writes nothing. ``bindings`` adds functions for new tasks.
        """
        old = self.plan
        problems = []
        if (old.source, old.output, old.max_stage) != (plan.source, plan.output, plan.max_stage):
            problems.append("source, output and highest stage must stay the same")
        for task in set(old.fire_order) | set(plan.fire_order):
            if task in old.schedule and task in plan.schedule:
                if old.task(task).stage != plan.task(task).stage or old.tasks[task] != plan.tasks[task]:
                    problems.append(f"task {task} changes its stage or its reads/writes")
            elif (old.tasks.get(task) or plan.tasks[task]).writes:
                problems.append(f"task {task}, in only one plan, writes data")
        merged = {**self._bindings, **(bindings or {})}
        missing = [t for t in plan.fire_order if t not in merged]
        if missing:
            problems.append(f"no function bound to task {missing[0]}")
        if problems:
            raise PlanError(f"cannot switch from plan {old.name} to {plan.name}: " + "; ".join(problems), culprit=plan.name)
        self._install(plan, {t: merged[t] for t in plan.fire_order})

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every batch in flight and start again at iteration 0 (workers are kept).

        Batches in flight are recorded in ``ledger.dropped``: they were drawn, never trained.
        """
        for b in self.in_flight():
            self.ledger.dropped.append((self._epoch_serial + b, "in flight when reset() was called"))
        self._epoch_serial = self.ledger.drawn
        self._resume: frozenset[str] = frozenset()  # tasks done in a failed or stopped iteration
        self._end_reported = False  # step() raised StopIteration for the end of the data
        self._restart_after_drain = False
        self.iteration = 0
        self.loaded = 0  # batches the source produced
        self.num_batches: int | None = None  # M, once the source found the data exhausted
        self.delivered = 0  # batches that left the highest stage
        self.stopped = False
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
                r
                for t in self.plan.scheduled()
                if t.stage >= at
                for r in t.io.reads
                if (w := self.plan.writer_of(r)) is not None and self.plan.task(w).stage < at
            }
            missing = sorted(needed - set(values))
            if missing:
                raise EngineError(
                    f"cannot adopt batch {j} at stage {at} of plan {self.plan.name}: its remaining tasks read "
                    f"{', '.join(missing)}, which the slot given for it lacks"
                )
        self.reset()
        for j, values in enumerate(slots):
            self.slots[j] = dict(values)
        self.loaded = len(slots)
        self.ledger.drawn += len(slots)
        self.iteration = top
        if len(slots) < top - src:
            self.num_batches = len(slots)

    def in_flight(self) -> list[int]:
        """Batches loaded but not delivered (in order), by index in this epoch."""
        return list(range(self.delivered, self.loaded))

    def new_data(self) -> None:
        """The source has new data (a new iterator, or a new epoch of the same one).

        Stopped at the end of data: resume the iteration that stopped, where it stopped.
        Drained: start a new epoch. Still draining: finish the batches in flight, then start a
        new epoch without raising StopIteration in between. Otherwise nothing changes: the
        source reads the new data from its next batch on.
        """
        if self.stopped:
            self.stopped = False
            self.num_batches = None
        elif self.num_batches is None:
            return
        elif self.delivered >= self.num_batches:
            self.reset()
        else:
            self._restart_after_drain = True

    @property
    def end_reported(self) -> bool:
        """The last step() raised StopIteration because the data ended."""
        return self._end_reported

    @property
    def ended(self) -> bool:
        """The data is exhausted and no batch is left to deliver (or the plan stopped)."""
        return self.stopped or (self.num_batches is not None and self.delivered >= self.num_batches)

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        reason = "left in flight: the plan stopped at the end of data" if self.stopped else "in flight"
        return [*self.ledger.dropped, *((self._epoch_serial + b, reason) for b in self.in_flight())]

    def close(self) -> None:
        """Stop the worker threads (idempotent)."""
        self._finalizer()

    # ------------------------------------------------------------------- step
    def step(self) -> Any:
        top = self.plan.max_stage
        while True:
            if self.ended:
                if not self._restart_after_drain:
                    self._end_reported = True
                    raise StopIteration
                self.reset()
            self._end_reported = False
            p = self.iteration
            program = self.compiled.program(p, self.num_batches)
            start = time.perf_counter() if self._observer is not None else 0.0
            if program.flat:
                self._run_flat(p, program)
            else:
                self._run_threaded(p, program)
            if self._observer is not None:
                self._observer.on_iteration(p, start, time.perf_counter())
            self.iteration = p + 1
            self._forget_events(p)
            if top in program.active_stages and p - top < self.loaded:
                b = p - top
                self.delivered += 1
                self.ledger.trained += 1
                slot = self.slots.pop(b, {})
                return slot.get(self.plan.output) if self.plan.output is not None else None

    def run_to_end(self) -> list[Any]:
        """Step until the data ends; the outputs in order."""
        outputs = []
        while True:
            try:
                outputs.append(self.step())
            except StopIteration:
                return outputs

    # -------------------------------------------------------------- flat path
    def _run_flat(self, p: int, program: IterationProgram) -> None:
        steps = self._flat_cache.get(id(program))
        if steps is None:
            steps = [
                (self._invokers[i.task], i.stage, 2 if i.source else 1 if i.guarded else 0, i.task)
                if isinstance(i, Run)
                else (self._alias_invoker(i), i.stage, 1, i.task)
                for i in program.instructions(MAIN_THREAD)
                if isinstance(i, (Run, Alias))
            ]
            self._flat_cache[id(program)] = steps
        if self._resume:
            # resuming an iteration that failed: what already ran must not run twice
            steps = [step for step in steps if step[3] not in self._resume]
        for k, (invoke, stage, kind, task) in enumerate(steps):
            b = p - stage
            try:
                if kind == 2:
                    if not self._pull(invoke, b):
                        break
                elif kind == 1 and b >= self.loaded:
                    continue
                else:
                    invoke(b)
            except BaseException as e:
                self._resume = self._resume | {step[3] for step in steps[:k]}
                if isinstance(e, StopIteration):
                    raise RuntimeError(f"{describe(task, b, MAIN_THREAD, p)} raised StopIteration") from e
                self._annotate(e, _Failure(e, task, b, MAIN_THREAD, p))
                raise
        else:
            self._resume = frozenset()
            return
        # stopped at the end of data: if data comes again, resume from the source
        self._resume = self._resume | {step[3] for step in steps[:k]}
        raise StopIteration

    def _pull(self, invoke: Invoker, b: int) -> bool:
        """Run the source for batch ``b``; False when the data is exhausted and the plan stops."""
        if self.num_batches is not None or b < self.loaded:  # exhausted, or adopted
            return True
        self.slots[b] = {}
        try:
            invoke(b)
        except StopIteration:
            del self.slots[b]
            self.num_batches = b
            self.stopped = self.plan.on_exhausted == "stop"
            return not self.stopped
        self.loaded = b + 1
        self.ledger.drawn += 1
        return True

    # ---------------------------------------------------------- threaded path
    def _run_threaded(self, p: int, program: IterationProgram) -> None:
        signalled = self._signalled.get(id(program))
        if signalled is None:
            signalled = frozenset(i.task for _, instrs in program.threads for i in instrs if isinstance(i, Signal))
            self._signalled[id(program)] = signalled
        ctx = _IterationContext(p, program, {t: _Latch() for t in signalled}, torch.is_grad_enabled(), self._resume)
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
        if ctx.failures:
            self._resume = ctx.skip | ctx.completed
            first = ctx.failures[0]
            for other in ctx.failures[1:]:
                first.exc.add_note(f"also failed: {describe(other.task, other.batch, other.thread, other.iteration)}: {other.exc!r}")
            self._annotate(first.exc, first)
            raise first.exc
        if ctx.stopped:
            self._resume = ctx.skip | ctx.completed
            raise StopIteration
        self._resume = frozenset()

    def _worker_job(self, group: str, instrs: tuple[Any, ...], ctx: _IterationContext) -> None:
        try:
            with torch.set_grad_enabled(ctx.grad_enabled):
                self._interpret(group, instrs, ctx)
        finally:
            ctx.done.put(group)

    def _interpret(self, thread: str, instrs: tuple[Any, ...], ctx: _IterationContext) -> None:
        p = ctx.iteration
        task, b, at = "-", p, 0
        try:
            for at, instr in enumerate(instrs):
                ctx.position[thread] = str(instr)
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
                    case Alias(task=task, stage=stage):
                        b = p - stage
                        if b < self.loaded and task not in ctx.skip:
                            self._alias_invoker(instr)(b)
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
                    case WaitStream(stream=stream, task=producer, distance=k, consumer_stage=cs):
                        event = self._events.get((producer, p - cs - k))
                        if event is not None:
                            self.streams.wait(stream, event)
                    case RecordEvent(task=producer, stream=stream, stage=stage):
                        if p - stage < self.loaded:  # not for a batch that was never loaded
                            self._events[(producer, p - stage)] = self.streams.record(stream)
                    case _:
                        raise EngineError(f"unknown instruction {instr!r}")
            ctx.position[thread] = "finished"
        except _Stopped:
            # the tasks left on this thread are cancelled: let whoever waits on them stop too
            for rest in instrs[at:]:
                if isinstance(rest, Signal):
                    ctx.latches[rest.task].set("stopped")
            ctx.position[thread] = "stopped (data exhausted)"
        except BaseException:
            self._record_failure(ctx, thread, task, b)

    def _record_failure(self, ctx: _IterationContext, thread: str, task: str, b: int) -> None:
        import sys

        exc = sys.exc_info()[1]
        assert exc is not None
        with ctx.lock:
            secondary = isinstance(exc, (TaskAborted, CollectiveAborted)) and ctx.failures
            if not secondary:
                ctx.failures.append(_Failure(exc, task, b, thread, ctx.iteration))
            ctx.position[thread] = f"failed in {task}"
        self._abort(ctx, f"{describe(task, b, thread, ctx.iteration)} failed: {exc!r}")

    def _abort(self, ctx: _IterationContext, reason: str) -> None:
        for latch in ctx.latches.values():
            latch.set("failed")
        for group, _ in ctx.program.tickets:
            self._turnstile(group).fail(reason)

    def _run_one(self, instr: Run, b: int, ctx: _IterationContext) -> None:
        invoke = self._invokers[instr.task]
        if instr.source:
            if self.num_batches is not None or b < self.loaded:  # exhausted, or adopted
                return
            self.slots[b] = {}
            try:
                with self.streams.context(self._stream_of[instr.task]):
                    invoke(b)
            except StopIteration:
                del self.slots[b]
                self.num_batches = b
                if self.plan.on_exhausted == "stop":
                    # Everything firing after the source waits on it (the compiler makes sure),
                    # so stopping its latch cancels exactly what single-thread order would.
                    self.stopped = ctx.stopped = True
                    raise _Stopped from None
                return
            self.loaded = b + 1
            self.ledger.drawn += 1
            return
        if instr.guarded and b >= self.loaded:
            return
        try:
            with self.streams.context(self._stream_of[instr.task]):
                invoke(b)
        except StopIteration as e:
            raise RuntimeError(f"task {instr.task} raised StopIteration") from e

    def _pass_ticket(self, group: str | None, ticket: int) -> None:
        """Take ``ticket``'s turn without running anything (its task already ran)."""
        turnstile = self._turnstile(group or "")
        turnstile.acquire(ticket, self.timeout_s)
        turnstile.release(ticket)

    def _run_ticketed(self, instr: Run, b: int, ctx: _IterationContext, group: str | None, ticket: int) -> None:
        turnstile = self._turnstile(group or "")
        turnstile.acquire(ticket, self.timeout_s)
        try:
            self._run_one(instr, b, ctx)
        except BaseException:
            turnstile.fail(f"{describe(instr.task, b, threading.current_thread().name, ctx.iteration)} failed")
            raise
        turnstile.release(ticket)

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
        reads, writes, slots = io.reads, io.writes, self.slots
        if io.pure and reads and writes:
            fn = self._memoized(fn, reads, writes)

        def call(b: int) -> Any:
            if not reads:
                return fn(b)
            slot = slots[b]
            try:
                args = {r: slot[r] for r in reads}
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

    def _memoized(self, fn: Binding, reads: tuple[str, ...], writes: tuple[str, ...]) -> Binding:
        """A pure task handed the very same input objects as last time returns what it
        returned then, without being called (the objects are kept, so identity is exact)."""
        last: list[Any] = [None, None]  # [inputs, result]

        def key(value: Any) -> tuple[Any, int]:
            # a tensor changed in place keeps its identity but not its version counter
            return value, value._version if isinstance(value, torch.Tensor) else 0

        def memo(b: int, **kwargs: Any) -> Any:
            inputs = tuple(key(kwargs[r]) for r in reads)
            previous = last[0]
            if previous is not None and all(x is y and v == w for (x, v), (y, w) in zip(inputs, previous)):
                self.shortcuts += 1
                return last[1]
            result = fn(b, **kwargs)
            last[0], last[1] = inputs, result
            return result

        return memo

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

    def _forget_events(self, p: int) -> None:
        if not self._events:
            return
        horizon = p - self.plan.max_stage - self._max_distance - 1
        for key in [k for k in self._events if k[1] < horizon]:
            del self._events[key]

    def _annotate(self, exc: BaseException, f: _Failure) -> None:
        if getattr(exc, "swp_task", None) is not None:
            return
        exc.swp_task, exc.swp_batch, exc.swp_thread, exc.swp_iteration = f.task, f.batch, f.thread, f.iteration  # type: ignore[attr-defined]
        exc.add_note(f"torchrec_swp: {describe(f.task, f.batch, f.thread, f.iteration)} of plan {self.plan.name}")

    def _timeout_report(self, ctx: _IterationContext) -> str:
        lines = [f"internal iteration {ctx.iteration} of plan {self.plan.name} did not finish within {self.timeout_s:.1f}s"]
        for thread, _ in ctx.program.threads:
            lines.append(f"  thread {thread!r}: at {ctx.position.get(thread, 'not started')}")
        for group, t in self._turnstiles.items():
            lines.append(f"  comm group {group!r}: next ticket {t.next_ticket}, waiting {t.waiting or 'none'}")
        stuck = [pos.split(" ", 1)[1] for pos in ctx.position.values() if pos.startswith("run")]
        mark = (stuck[0].split()[0], ctx.iteration) if stuck else None
        lines.append(format_schedule(self.plan, ctx.iteration + 2, self.num_batches, mark=mark))
        return "\n".join(lines)
