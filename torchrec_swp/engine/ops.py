"""What a plan's instructions do: the gates a task instance passes, the source's draw, the waits.

``PlanOps`` compiles each instruction of an installed plan's programs once into an op
(``compile``, again whenever the task calls or the programs change): a closure holding what the
instruction needs (its task's call, stage, guard, ticket), so that a task instance on a thread is
its op and its task's call, with a lambda built only when something must be waited for. For the
walker at internal iteration ``P``:

* ``run T`` for batch ``b = P - stage``: nothing if ``b`` does not exist (waiting until the
  source has looked for it) or its guard says no (its ticket, if any, is skipped); a training
  step (highest stage) on a worker only once ``step()`` asked for ``b``; then, holding its ticket
  if it has one, the call - inside its stream.
* two or more plain ``run`` of one stage in a row on the calling thread (no ticket, no guard,
  no agreement across ranks): one op, the stage op, that asks once whether ``b`` exists and
  calls the tasks in order.
* ``run! S`` (the source, ``torchrec_swp.engine.source.Source``): on its lane, once the credit
  allows, draws batch ``b`` into its slot, or finds the end of data (a stop parks every thread
  where single-thread order would have stopped).
* ``wait T@P-k`` / ``signal T``: the latches of the board, keyed ``(task, batch)``.
* ``stream S <- T@k`` / ``record T``: device events, kept per ``(task, batch)`` in the book.

Every wait is broken by a stop before its iteration (``Stopped``: the thread parks) and
by the end of the epoch before its iteration (the thread finishes). The ops change batches only through
``Batches``' methods; ``PlanOps`` owns the caller's mode for the step (``begin_step``) and the
``Source``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchrec_swp.compile import Alias, Instr, RecordEvent, Run, Signal, WaitStream, WaitTask
from torchrec_swp.engine.batches import Batches
from torchrec_swp.engine.board import ITERATION, LatchState
from torchrec_swp.engine.errors import EngineError, Interrupted, Stopped, describe
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.installed import InstalledPlan, InstalledPlans
from torchrec_swp.engine.source import Source
from torchrec_swp.engine.tasks import Invoker, Observer
from torchrec_swp.engine.walkers import Op, Walk, Walker
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, When

if TYPE_CHECKING:
    from torchrec_swp.engine.interpreter import Interpreter

_NOTHING: Walk = ((), ())  # a thread with no part in a plan


class PlanOps:
    """The ops of the ``installed`` plans' programs, run by ``interpreter``'s walkers over ``batches``; what a
    walker runs at each internal iteration (``program``) and what follows it (``iteration_done``)."""

    def __init__(
        self,
        interpreter: Interpreter,
        batches: Batches,
        installed: InstalledPlans,
        *,
        uid: int,
        checker: Any,
        exhaustion: ExhaustionSync | None,
        undo_draw: Callable[[int, Mapping[str, Any]], None] | None = None,
    ) -> None:
        self._interpreter = interpreter
        self._board = interpreter.board
        self._batches = batches
        self._end = batches.end  # the end of data: the one answer to "does batch b exist"
        self._installed = installed
        self._uid = uid  # names the interpreter's hand-offs to the checker
        self._checker = checker  # the stream checker of a checked stream pool (torchrec_swp.streamcheck), or None
        self.source = Source(
            interpreter, batches, installed, check_stop=self._end.check_stop, wait=self.wait, in_task=self.in_task,
            checker=checker, exhaustion=exhaustion, undo_draw=undo_draw,
        )  # fmt: skip
        self._exhaustion = exhaustion
        if exhaustion is not None and checker is not None:
            exhaustion.check_with(checker)
        self._observer: Observer | None = None
        self._iteration_start = 0.0  # when the calling thread's iteration started (for the observer)
        self._grad = True  # the caller's grad mode and training mode at this step() (begin_step)
        self._training = True

    @property
    def grad(self) -> bool:
        """The grad mode of the current ``step()`` call (its workers take it)."""
        return self._grad

    def begin_step(self, grad: bool, training: bool) -> None:
        """What this ``step()`` call's tasks run under: its grad mode, its model's training mode."""
        self._grad, self._training = grad, training

    # ------------------------------------------------------------ the walk
    def program(self, w: Walker, P: int) -> Walk | None:
        """Walker ``w``'s instructions of internal iteration ``P``: those of the phase's plan, once
        the caller's gate lets it (a worker runs iteration ``P`` only once ``step()`` asked for
        batch ``P - top - ahead``); None past the epoch's end."""
        book, installed, end = self._batches.book, self._installed, self._end
        shape = installed.shape
        top = shape.top
        if not end.walks_to(P, P - top):
            return None
        w.current = ("-", P - top)
        main = w is shape.main
        if not main and P > book.requested - 1 + top + w.ahead:
            self.wait(
                P,
                lambda: P <= book.requested - 1 + top + w.ahead or end.past_end(P - top),
                lambda: f"step() to be called for batch {P - top - w.ahead} (internal iteration {P})",
            )
            if end.past_end(P - top):
                return None
        if len(installed.phased.phases) == 1:
            plan = installed.current
        else:
            plan = self.plan_at(P)
            if main:
                installed.make_current(plan)
        if main and self._observer is not None:
            self._iteration_start = time.perf_counter()
        inst = installed.by_id[id(plan)]
        w.inst = inst
        return inst.walks.get(w.thread, _NOTHING)

    def plan_at(self, P: int) -> PipelinePlan:
        """The plan internal iteration ``P`` runs: its phase's, by the batch it trains (numbered
        by the phases' clock: its source call, its serial for ``clock="drawn"``, the batches
        trained before it for ``clock="trained"``)."""
        phased, shape, book = self._installed.phased, self._installed.shape, self._batches.book
        d = P - shape.top
        if phased.clock == "drawn":
            return phased.plan_for(book.serial(max(d, 0)))
        if phased.clock == "trained":  # batches of an epoch are trained in order
            return phased.plan_for(book.first_trained + max(d, 0))
        if d < 0:
            return phased.plan_for(book.number(0))
        if shape.source is None or shape.stage[shape.source] < shape.top:
            self.await_exists(d, P)  # drawn in an earlier iteration: wait for the number it got
        # else the source draws batch d in this very iteration (a plan of one stage): its number is the next one
        return phased.plan_for(book.number_of(d))

    def iteration_done(self, w: Walker, P: int) -> None:
        """``w`` finished its part of internal iteration ``P``: its tickets counted on; the
        observer told (the calling thread's), or the caller's wait for a batch (a worker's)."""
        shape = self._installed.shape
        main = w is shape.main
        if self._checker is not None and not main:
            self._checker.cpu_release(("iter", self._uid, w.name, self._batches.book.first_iteration + P))
        for group, count in w.inst.tickets:
            w.bases[group] = w.bases.get(group, 0) + count
        if main:
            if self._observer is not None:
                self._observer.on_iteration(
                    self._batches.book.first_iteration + P, self._iteration_start, time.perf_counter()
                )
        elif shape.threaded:  # only the caller's wait for a batch reads how far threads got
            self._board.changed(ITERATION)

    # ------------------------------------------------------------ compiling
    def compile(self, inst: InstalledPlan, observer: Observer | None) -> None:
        """Every thread's program of ``inst`` with its ops (told of ``observer``)."""
        self._observer = observer
        inst.make_walks(lambda thread, instrs: self._ops(inst, thread, instrs, observer))

    def _ops(
        self, inst: InstalledPlan, thread: str, instrs: tuple[Instr, ...], observer: Observer | None
    ) -> tuple[Op, ...]:
        """The op of each instruction of ``thread``'s program; on the calling thread, the first
        of two or more plain runs of one stage in a row executes them all (``_stage_op``)."""
        ops = [self._op(inst, thread, instr, observer) for instr in instrs]
        if thread != MAIN_THREAD or self._checker is not None:
            return tuple(ops)
        rows: list[list[tuple[int, Run]]] = [[]]  # plain runs in a row, of one stage each, at their positions
        for i, instr in enumerate(instrs):
            if not (isinstance(instr, Run) and self._plain(inst, instr)):
                rows.append([])
            elif rows[-1] and instr.stage == rows[-1][0][1].stage:
                rows[-1].append((i, instr))
            else:
                rows.append([(i, instr)])
        for row in rows:
            if len(row) > 1:
                first = row[0][0]
                ops[first] = self._stage_op(tuple(r for _, r in row), first, inst.invokers)
        return tuple(ops)

    def _plain(self, inst: InstalledPlan, instr: Run) -> bool:
        """``run T`` with nothing between the existence of its batch and its call: not the
        source, no ticket, no guard, no agreement across ranks."""
        return not instr.source and instr.ticket is None and instr.when is When.ALWAYS and not self._gated(inst, instr)

    def _op(self, inst: InstalledPlan, thread: str, instr: Instr, observer: Observer | None) -> Op:
        match instr:
            case Run(source=False):
                gated = self._gated(inst, instr)
                return self._run_op(instr, inst.invokers[instr.task], main=thread == MAIN_THREAD, gated=gated)
            case Run():
                return self.source.op(instr)
            case Alias():
                return self._alias_op(instr, inst.aliases[instr.task])
            case WaitTask():
                return self._wait_op(instr, observer)
            case Signal():
                return self._signal_op(instr)
            case WaitStream() | RecordEvent():
                return lambda w, P: self._device_sync(w, P, instr)
            case _:  # rejected when executed, as the interpreter's dispatch does
                return lambda w, P: _unknown(instr)

    def _gated(self, inst: InstalledPlan, instr: Run) -> bool:
        """Whether ``run T`` waits for its batch's agreement across ranks (``exhaustion``'s
        ``settle``) once the batch exists, and asks again: every task but the source's, so that
        a batch the agreement retracts had nothing run for it but its draw (which the pipeline's
        ``undo_draw`` undoes)."""
        return self._exhaustion is not None and inst.plan.source is not None and instr.task != inst.plan.source

    def _run_op(self, instr: Run, invoke: Invoker, main: bool, gated: bool = False) -> Op:
        """``run T``: nothing if batch ``b`` does not exist or the guard says no (its ticket
        skipped); a training step on a worker waits for the ``step()`` that asks for it; then
        the call (holding its ticket; in checked mode inside the checker's label). ``gated``:
        once ``b`` exists, the ranks' agreement on it (``ExhaustionSync.settle``), which may retract it."""
        task, stage, when, ticket, group = instr.task, instr.stage, instr.when, instr.ticket, instr.comm_group
        guarded, needs_next = when is not When.ALWAYS, when.needs_next
        trains = not main and stage == self._installed.shape.top
        checked = self._checker is not None
        plain = ticket is None and not checked
        ticketed, check_stop, exists_at = self._interpreter.ticketed, self._end.check_stop, self._end.exists_at
        sync = self._exhaustion if gated else None

        def run(w: Walker, P: int) -> None:
            b = P - stage
            w.current = (task, b)
            known = exists_at(b, P)
            if known is None:
                known = self.await_exists(b, P)
            if known and sync is not None and b >= sync.gated_from:  # drawn: its agreement has begun
                sync.settle()
                known = exists_at(b, P)  # False where it retracted b
            if not known or (guarded and not self._admits(when, needs_next, b, P)):
                if ticket is not None:
                    self._interpreter.skip_ticket(w, group, ticket)
                return
            if not main:
                if trains:
                    self._requested(b, P)
                if torch.is_grad_enabled() != self._grad:
                    torch.set_grad_enabled(self._grad)
            try:
                if plain:
                    invoke(b)
                elif checked:
                    ticketed(w, group, ticket, task, b, check_stop, self.in_task, w, task, b, invoke)
                else:
                    ticketed(w, group, ticket, task, b, check_stop, invoke, b)
            except StopIteration as e:  # would end a generator up the stack silently
                raise RuntimeError(f"{describe(task, b, w.name, w.P)} raised StopIteration") from e

        return run

    def _stage_op(self, runs: tuple[Run, ...], first: int, invokers: Mapping[str, Invoker]) -> Op:
        """Plain runs of one stage in a row on the calling thread (``_plain``), at positions
        ``first``, ``first + 1``, ...: what their ``run`` ops do, with their batch's existence
        asked once and one op call. The walker is moved to each one's position before its call, so
        that a task that fails parks the walk there and the walk resumes with that task's own op:
        the tasks before it are not run again."""
        stage = runs[0].stage
        calls = tuple((first + k, r.task, invokers[r.task]) for k, r in enumerate(runs))
        last = first + len(runs) - 1
        board, exists_at = self._board, self._end.exists_at

        def run_stage(w: Walker, P: int) -> None:
            b = P - stage
            w.current = (calls[0][1], b)
            known = exists_at(b, P)
            if known is None:
                known = self.await_exists(b, P)
            if not known:
                w.i = last
                return
            for i, task, invoke in calls:
                if i != first:
                    w.i, w.current = i, (task, b)
                    if board.interrupt is not None:
                        raise Interrupted(board.interrupt)
                try:
                    invoke(b)
                except StopIteration as e:  # would end a generator up the stack silently
                    raise RuntimeError(f"{describe(task, b, w.name, w.P)} raised StopIteration") from e

        return run_stage

    def in_task(self, w: Walker, task: str, b: int, invoke: Invoker) -> None:
        """``invoke(b)`` in checked mode: inside the checker's label of this task, so that every
        tensor operation inside is recorded as this task's, on this thread."""
        with self._checker.task(task, b, w.name):
            invoke(b)

    def _alias_op(self, instr: Alias, alias: Invoker) -> Op:
        task, stage = instr.task, instr.stage

        def run_alias(w: Walker, P: int) -> None:
            self._end.check_stop(P)
            b = P - stage
            w.current = (task, b)
            if self.await_exists(b, P):
                alias(b)

        return run_alias

    # --------------------------------------------------------------- gates
    def await_exists(self, b: int, P: int) -> bool:
        """Whether batch ``b`` exists, waiting (at internal iteration ``P``) until the source has
        looked for it. Stopped when it never will while the plan is stopped."""
        end = self._end
        known = end.exists_at(b, P)
        if known is None:
            self.wait(P, lambda: end.exists(b) is not None or end.stopped(), lambda: f"batch {b} to be drawn")
            known = end.exists_at(b, P)
            if known is None:
                raise Stopped
        return known

    def _admits(self, when: When, needs_next: bool, b: int, P: int) -> bool:
        if needs_next:  # (``when.needs_next``, read once per op)
            self.await_exists(b + 1, P)
        if when is When.TRAIN:  # the mode of the step() that trains batch b: wait for that call
            self._requested(b, P)
        return when.admits(b, self._end.end_at(), P, self._installed.shape.top, training=self._training)

    def _requested(self, b: int, P: int) -> None:
        """The training step of batch ``b`` waits for the ``step()`` call that asks for it."""
        book = self._batches.book
        if b < book.requested and not self._end.beyond_stop(P):  # asked for already: nothing to wait for
            return
        self.wait(P, lambda: b < book.requested, lambda: f"step() to be called for batch {b}")

    def wait(self, P: int, ready: Callable[[], bool], what: Callable[[], str], topic: Hashable = None) -> None:
        """Wait, at internal iteration ``P``, until ``ready()``; park if the plan stops before ``P``
        (``topic``: see ``torchrec_swp.engine.board``)."""
        beyond_stop = self._end.beyond_stop
        self._board.wait(lambda: ready() or beyond_stop(P), what, self._interpreter.timeout_s, topic)
        self._end.check_stop(P)

    # ------------------------------------------------------ waits, signals
    def _wait_op(self, instr: WaitTask, observer: Observer | None) -> Op:
        """``wait T@P-k``: T's instance of iteration ``q = P - k`` (batch ``q - stage(T)``), unless
        it does not exist, an earlier wait of this thread covered it, or it is ready already."""
        producer, lag = instr.task, instr.lag
        shape = self._installed.shape
        back = lag + shape.stage[producer]  # its batch: P - back
        lanes = shape.lanes > 1 and producer == shape.source
        what = str(instr)
        latches = self._board.latches
        batches, checker, end = self._batches, self._checker, self._end

        def wait_task(w: Walker, P: int) -> None:
            q, pb = P - lag, P - back
            if q < w.start or pb < 0:
                return
            if not lanes and w.waited.get(producer, -1) >= q:
                return  # instances of one thread finish in order: an earlier wait covered it
            if end.past_end(pb):
                return  # no such batch
            book = batches.book
            w.current = (what, pb)
            key: Hashable = (producer, pb)
            self._end.check_stop(P)
            start = time.perf_counter() if observer is not None else 0.0
            if key in latches or pb < book.returned:  # done already: no wait
                self._end.check_stop(P)
            else:
                self.wait(
                    P,
                    lambda: key in latches or pb < book.returned or end.beyond_stop(q),
                    lambda: f"task {producer} (batch {pb}) to finish",
                    key,
                )
            if observer is not None:
                observer.on_wait(producer, w.thread, book.first_iteration + P, start, time.perf_counter())
            if latches.get(key) is LatchState.STOPPED or (key not in latches and end.beyond_stop(q)):
                raise Stopped
            if checker is not None and (key in latches or pb < book.returned):
                # what the producer's thread did is ordered before us: through its latch, or through
                # the batch's return (its latch already cleared), which came after every signal of it
                checker.cpu_acquire(("latch", book.first_iteration, producer, pb))
            if not lanes:
                w.waited[producer] = q

        return wait_task

    def _signal_op(self, instr: Signal) -> Op:
        """``signal T``: T's instance of this iteration is done (a lane signals its own batches)."""
        shape = self._installed.shape
        task, stage = instr.task, shape.stage[instr.task]
        lanes = shape.lanes if shape.lanes > 1 and task == shape.source else 0
        board, batches, checker, check_stop = self._board, self._batches, self._checker, self._end.check_stop

        def signal(w: Walker, P: int) -> None:
            check_stop(P)
            b = P - stage
            if b < 0 or (lanes and b % lanes != w.lane):
                return
            if checker is not None:
                checker.cpu_release(("latch", batches.book.first_iteration, task, b))
            board.set_latch((task, b))

        return signal

    def _device_sync(self, w: Walker, P: int, instr: Instr) -> None:
        self._end.check_stop(P)
        book, streams, shape = self._batches.book, self._interpreter.streams, self._installed.shape
        if isinstance(instr, WaitStream):
            event = book.device_events.get((instr.task, P - instr.consumer_stage - instr.distance))
            if event is not None:
                streams.wait(instr.stream, event)
        elif isinstance(instr, RecordEvent):
            b = P - instr.stage
            if b not in book.in_flight:  # not for a batch that was never loaded
                return
            if shape.lanes > 1 and instr.task == shape.source and b % shape.lanes != w.lane:
                return  # another lane loaded it and records after it (as it signals)
            self._batches.record_event(instr.task, b, streams.record(instr.stream))


def _unknown(instr: Instr) -> None:
    raise EngineError(f"unknown instruction {instr!r}")
