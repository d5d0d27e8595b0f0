"""What a plan's instructions do: the gates a task instance passes, the source, the waits.

``PlanInterpreter`` is the ``Interpreter`` of plan programs (``Engine`` adds the caller's side:
``step()``, epochs, data). For the walker at internal iteration ``P`` it picks the program
(``_program``: the phase's plan, the caller's gate: a worker runs iteration ``P`` only once
``step()`` asked for the batch ``P - top - lookahead``) and runs each instruction:

* ``run T`` for batch ``b = P - stage``: nothing if ``b`` does not exist (waiting until the
  source has looked for it) or its guard says no (its ticket, if any, is skipped); a training
  step (highest stage) only once ``step()`` asked for ``b``; then, holding its ticket if it has
  one, the call - inside its stream.
* ``run! S`` (the source): on its lane, once the credit allows (``_credit``), draws batch ``b``
  into its slot, or finds the end of data (a stop parks every thread where single-thread order
  would have stopped).
* ``wait T@P-k`` / ``signal T``: the latches of the board, keyed ``(task, batch)``.
* ``stream S <- T@k`` / ``record T``: device events, kept per ``(task, batch)``.

Every wait is broken by a stop before its iteration (``Stopped``: the thread parks) and by the
end of the epoch before its iteration (the thread finishes).

Each instruction of an installed plan's programs is compiled once into an op (``_compile``,
again whenever the task calls or the programs change): a closure holding what the instruction
needs (its task's call, stage, guard, ticket), so that a task instance on one thread is its op
and its task's call, with a lambda built only when something must be waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_swp.compile import Alias, CompiledPlan, Instr, RecordEvent, Run, Signal, WaitStream, WaitTask
from torchrec_swp.engine.batches import BatchBook, BatchLedger
from torchrec_swp.engine.board import ITERATION, LatchState
from torchrec_swp.engine.errors import Stopped, describe
from torchrec_swp.engine.interpreter import Failure, Interpreter, Op, Walk, Walker, WalkState
from torchrec_swp.engine.tasks import Invoker
from torchrec_swp.plan import MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError, When
from torchrec_swp.plan.table import format_schedule


@dataclass
class InstalledPlan:
    """One plan, ready to run: its compiled steady-state program per thread, tickets per
    iteration, its tasks' calls, and per thread the program with each instruction's op
    (``PlanInterpreter._compile``: made again whenever the programs or the calls change)."""

    plan: PipelinePlan
    compiled: CompiledPlan
    programs: dict[str, tuple[Instr, ...]]
    tickets: tuple[tuple[str, int], ...]
    invokers: dict[str, Invoker]
    aliases: dict[str, Invoker]
    walks: dict[str, Walk] = field(default_factory=dict)


_NOTHING: Walk = ((), ())  # a thread with no part in a plan


class PlanInterpreter(Interpreter):
    """Runs plan programs; the state it reads is set up by ``Engine``."""

    phased: PhasedPlan
    plan: PipelinePlan
    book: BatchBook
    ledger: BatchLedger
    _installed: dict[int, InstalledPlan]
    _main: Walker
    _top: int
    _lookahead: int
    _lanes: int
    _source: str | None
    _stage: dict[str, int]
    _threaded: bool
    _pulls: int
    _epoch_base: int
    _checker: Any  # the stream checker of a checked stream pool (torchrec_swp.streamcheck), or None
    _iteration_start: float
    _grad: bool
    _training: bool

    # ------------------------------------------------------------ the program
    def _plan_at(self, P: int) -> PipelinePlan:
        """The plan internal iteration ``P`` runs: its phase's, by the batch it trains (numbered
        by the phases' clock: its source call, its serial for ``clock="drawn"``, the batches
        trained before it for ``clock="trained"``)."""
        if len(self.phased.phases) == 1:
            return self.plan
        d = P - self._top
        book = self.book
        if self.phased.clock == "drawn":
            return self.phased.plan_for(book.serial(max(d, 0)))
        if self.phased.clock == "trained":  # batches of an epoch are trained in order
            return self.phased.plan_for(book.first_trained + max(d, 0))
        if d < 0:
            return self.phased.plan_for(book.number(0))
        if self._source is None or self._stage[self._source] < self._top:
            self._exists(d, P)  # drawn in an earlier iteration: wait for the number it got
        # else the source draws batch d in this very iteration (a plan of one stage): its number
        # is the next one
        return self.phased.plan_for(book.number_of(d))

    def _program(self, w: Walker, P: int) -> Walk | None:
        book = self.book
        m = book.num_batches
        if m is not None:
            if book.stopped:
                if P > m:
                    raise Stopped
            elif self._past_end(P):
                return None
        w.current = ("-", P - self._top)
        if w is not self._main and P > book.requested - 1 + self._top + w.ahead:
            self._wait(
                P,
                lambda: P <= book.requested - 1 + self._top + w.ahead or self._past_end(P),
                lambda: f"step() to be called for batch {P - self._top - w.ahead} (internal iteration {P})",
            )
            if self._past_end(P):
                return None
        plan = self._plan_at(P)
        if w is self._main:
            self.plan = plan
            if self._observer is not None:
                self._iteration_start = time.perf_counter()
        inst = self._installed[id(plan)]
        w.inst = inst
        return inst.walks.get(w.thread, _NOTHING)

    def _iteration_done(self, w: Walker, P: int) -> None:
        if self._checker is not None and w is not self._main:
            self._checker.cpu_release(("iter", self._uid, w.name, self._epoch_base + P))
        for group, count in w.inst.tickets:
            w.bases[group] = w.bases.get(group, 0) + count
        if w is self._main:
            if self._observer is not None:
                self._observer.on_iteration(self._epoch_base + P, self._iteration_start, time.perf_counter())
        elif self._threaded:  # only the caller's wait for a batch reads how far threads got
            self.board.changed(ITERATION)

    # ------------------------------------------------------------ instructions
    def _compile(self, inst: InstalledPlan) -> None:
        """Every thread's program of ``inst`` with its ops: each instruction becomes one call
        that knows its task, stage, guard and task call, so that a task instance on a thread of
        its own is two calls (its op, its task call) before the bound function."""
        inst.walks = {
            thread: (instrs, tuple(self._plan_op(inst, thread, i) for i in instrs)) for thread, instrs in inst.programs.items()
        }

    def _plan_op(self, inst: InstalledPlan, thread: str, instr: Instr) -> Op:
        match instr:
            case Run(source=False):
                return self._run_op(instr, inst.invokers[instr.task], main=thread == MAIN_THREAD)
            case Run():
                return self._source_op(instr)
            case Alias():
                return self._alias_op(instr, inst.aliases[instr.task])
            case WaitTask():
                return self._wait_op(instr)
            case Signal():
                return self._signal_op(instr)
            case _:  # device syncs, and what no op knows (rejected when executed)
                return self._op(instr)

    def _run_op(self, instr: Run, invoke: Invoker, main: bool) -> Op:
        """``run T``: nothing if batch ``b`` does not exist or the guard says no (its ticket
        skipped); a training step on a worker waits for the ``step()`` that asks for it; then
        the call (holding its ticket; in checked mode inside the checker's label)."""
        task, stage, when, ticket, group = instr.task, instr.stage, instr.when, instr.ticket, instr.comm_group
        guarded = when is not When.ALWAYS
        trains = not main and stage == self._top
        checked = self._checker is not None
        plain = ticket is None and not checked

        def run(w: Walker, P: int) -> None:
            book = self.book
            if book.stopped:
                self._stop_check(P)
            b = P - stage
            w.current = (task, b)
            if not (b in book.loaded or self._exists(b, P)) or (guarded and not self._admits(when, b, P)):
                if ticket is not None:
                    self._skip_ticket(w, group, ticket)
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
                    self._ticketed(w, group, ticket, task, b, self._in_task, w, task, b, invoke)
                else:
                    self._ticketed(w, group, ticket, task, b, invoke, b)
            except StopIteration as e:  # would end a generator up the stack silently
                raise RuntimeError(f"{describe(task, b, w.name, w.P)} raised StopIteration") from e

        return run

    def _in_task(self, w: Walker, task: str, b: int, invoke: Invoker) -> None:
        """``invoke(b)`` in checked mode: inside the checker's label of this task, so that every
        tensor operation inside is recorded as this task's, on this thread."""
        with self._checker.task(task, b, w.name):
            invoke(b)

    def _ticket_check(self, w: Walker) -> Callable[[], None]:
        P = w.P
        return lambda: self._stop_check(P)

    def _source_op(self, instr: Run) -> Op:
        task, stage = instr.task, instr.stage

        def draw(w: Walker, P: int) -> None:
            self._stop_check(P)
            b = P - stage
            w.current = (task, b)
            self._run_source(w, P, b, instr)

        return draw

    def _alias_op(self, instr: Alias, alias: Invoker) -> Op:
        task, stage = instr.task, instr.stage

        def run_alias(w: Walker, P: int) -> None:
            self._stop_check(P)
            b = P - stage
            w.current = (task, b)
            if self._exists(b, P):
                alias(b)

        return run_alias

    def _exists(self, b: int, P: int) -> bool:
        """Whether batch ``b`` exists, waiting (at internal iteration ``P``) until the source has
        looked for it. Stopped when it never will while the plan is stopped."""
        book = self.book
        known = book.exists(b)
        if known is None:
            self._wait(P, lambda: book.exists(b) is not None or book.stopped, lambda: f"batch {b} to be drawn")
            known = book.exists(b)
            if known is None:
                raise Stopped
        return known

    def _admits(self, when: When, b: int, P: int) -> bool:
        if when.needs_next:
            self._exists(b + 1, P)
        if when is When.TRAIN:  # the mode of the step() that trains batch b: wait for that call
            self._requested(b, P)
        return when.admits(b, self.book.num_batches, P, self._top, training=self._training)

    def _requested(self, b: int, P: int) -> None:
        """The training step of batch ``b`` waits for the ``step()`` call that asks for it."""
        book = self.book
        if b < book.requested and not book.stopped:  # asked for already: nothing to wait for
            return
        self._wait(P, lambda: b < book.requested, lambda: f"step() to be called for batch {b}")

    def _beyond_stop(self, P: int) -> bool:
        """The plan stopped at the end of data before internal iteration ``P``."""
        book = self.book
        return book.stopped and book.num_batches is not None and P > book.num_batches

    def _past_end(self, P: int) -> bool:
        """Internal iteration ``P`` is past the epoch's last (the data ended, no stop)."""
        book = self.book
        return book.num_batches is not None and not book.stopped and P >= book.num_batches + self._top

    def _stop_check(self, P: int) -> None:
        """Park a thread at internal iteration ``P`` if the plan stopped before it: single-thread
        order would not have got there."""
        if self._beyond_stop(P):
            raise Stopped

    def _wait(self, P: int, ready: Callable[[], bool], what: Callable[[], str], topic: Hashable = None) -> None:
        """Wait, at internal iteration ``P``, until ``ready()``; park if the plan stops before ``P``
        (``topic``: see ``torchrec_swp.engine.board``)."""
        self.board.wait(lambda: ready() or self._beyond_stop(P), what, self.timeout_s, topic)
        self._stop_check(P)

    def _run_source(self, w: Walker, P: int, b: int, instr: Run) -> None:
        book, board = self.book, self.board
        if b < 0 or (instr.lanes > 1 and b % instr.lanes != w.lane) or b in book.loaded:
            return
        if book.num_batches is not None:
            if book.stopped:
                raise Stopped
            if b >= book.num_batches:
                if instr.ticket is not None:
                    self._skip_ticket(w, instr.comm_group, instr.ticket)
                return
        plan = w.inst.plan
        if not self._credit(b, plan):
            self._wait(
                P,
                lambda: self._credit(b, plan) or book.num_batches is not None,
                lambda: f"credit to draw batch {b} (depth {plan.pipeline_depth}, lookahead {plan.lookahead})",
            )
            if book.stopped:
                raise Stopped
            if book.num_batches is not None and b >= book.num_batches:
                return
        invoke = w.inst.invokers[instr.task]
        book.slots[b] = {}
        draws = self._draws_for(b)
        if draws is not None:
            draws.drawing(b)
        try:
            if self._checker is not None:
                self._ticketed(w, instr.comm_group, instr.ticket, instr.task, b, self._in_task, w, instr.task, b, invoke)
            else:
                self._ticketed(w, instr.comm_group, instr.ticket, instr.task, b, invoke, b)
        except StopIteration:
            book.slots.pop(b, None)
            self._found_end(b, plan)
            return
        except BaseException:
            book.slots.pop(b, None)
            raise
        finally:
            if draws is not None:
                draws.drawing(None)
        if not self._threaded:  # nobody else reads the book: no lock, nobody to wake
            self._drawn(b)
            return
        with board.lock:
            self._drawn(b)
            board.notify()

    def _drawn(self, b: int) -> None:
        book = self.book
        book.loaded.add(b)
        book.numbers[b] = book.number(b)
        self.ledger.drawn += 1
        self._pulls = max(self._pulls, book.numbers[b] + 1)

    def _credit(self, b: int, plan: PipelinePlan) -> bool:
        """Whether the source may draw batch ``b``: at most ``pipeline_depth + lookahead`` batches
        in flight, and no earlier than ``lookahead`` batches before the ``step()`` call that
        single-thread order draws it in (with lookahead 0, in that very call)."""
        book = self.book
        return b < book.returned + plan.pipeline_depth + plan.lookahead and b < book.requested + self._top + plan.lookahead

    def _found_end(self, b: int, plan: PipelinePlan) -> None:
        book, board = self.book, self.board
        with board.lock:
            if book.num_batches is None or b < book.num_batches:
                book.num_batches = b
            self._pulls = max(self._pulls, book.number(b) + 1)
            if plan.on_exhausted == "stop":
                book.stopped = True
                board.latches[(plan.source, b)] = LatchState.STOPPED
            board.notify()
        if plan.on_exhausted == "stop":
            raise Stopped

    def _take_turn(self, b: int) -> None:
        """Batch ``b`` may draw once batch ``b - 1`` drew (several loads take turns); StopIteration
        when an earlier batch found the end."""
        book = self.book
        if self._lanes > 1:
            self.board.wait(
                lambda: book.next_claim >= b or (book.num_batches is not None and book.num_batches < b),
                lambda: f"batch {b - 1} to be drawn first",
                self.timeout_s,
            )
        if book.next_claim != b and book.num_batches is not None and book.num_batches < b:
            raise StopIteration

    def _turn_taken(self, b: int, ended: bool) -> None:
        if ended:
            return
        if not self._threaded:  # nobody else reads the book: no lock, nobody to wake
            self.book.next_claim = max(self.book.next_claim, b + 1)
            return
        with self.board.lock:
            self.book.next_claim = max(self.book.next_claim, b + 1)
            self.board.notify()

    def _wait_op(self, instr: WaitTask) -> Op:
        """``wait T@P-k``: T's instance of iteration ``q = P - k`` (batch ``q - stage(T)``), unless
        it does not exist, an earlier wait of this thread covered it, or it is ready already."""
        producer, lag = instr.task, instr.lag
        back = lag + self._stage[producer]  # its batch: P - back
        lanes = self._lanes > 1 and producer == self._source
        what = str(instr)
        latches = self.board.latches

        def wait(w: Walker, P: int) -> None:
            q, pb = P - lag, P - back
            if q < w.start or pb < 0:
                return
            if not lanes and w.waited.get(producer, -1) >= q:
                return  # instances of one thread finish in order: an earlier wait covered it
            book = self.book
            if book.num_batches is not None and pb >= book.num_batches and not book.stopped:
                return  # no such batch
            w.current = (what, pb)
            key: Hashable = (producer, pb)
            self._stop_check(P)
            start = time.perf_counter() if self._observer is not None else 0.0
            if key in latches or pb < book.returned:  # done already: no wait
                self._stop_check(P)
            else:
                self._wait(
                    P,
                    lambda: key in latches or pb < book.returned or self._beyond_stop(q),
                    lambda: f"task {producer} (batch {pb}) to finish",
                    key,
                )
            if self._observer is not None:
                self._observer.on_wait(producer, w.thread, self._epoch_base + P, start, time.perf_counter())
            if latches.get(key) is LatchState.STOPPED or (key not in latches and self._beyond_stop(q)):
                raise Stopped
            if self._checker is not None and (key in latches or pb < book.returned):
                # what the producer's thread did is ordered before us: through its latch, or through
                # the batch's return (its latch already cleared), which came after every signal of it
                self._checker.cpu_acquire(("latch", self._epoch_base, producer, pb))
            if not lanes:
                w.waited[producer] = q

        return wait

    def _signal_op(self, instr: Signal) -> Op:
        """``signal T``: T's instance of this iteration is done (a lane signals its own batches)."""
        task, stage = instr.task, self._stage[instr.task]
        lanes = self._lanes if self._lanes > 1 and task == self._source else 0
        board = self.board

        def signal(w: Walker, P: int) -> None:
            if self.book.stopped:
                self._stop_check(P)
            b = P - stage
            if b < 0 or (lanes and b % lanes != w.lane):
                return
            if self._checker is not None:
                self._checker.cpu_release(("latch", self._epoch_base, task, b))
            board.set_latch((task, b))

        return signal

    def _device_sync(self, w: Walker, P: int, instr: WaitStream | RecordEvent) -> None:
        self._stop_check(P)
        book = self.book
        if isinstance(instr, WaitStream):
            event = book.events.get((instr.task, P - instr.consumer_stage - instr.distance))
            if event is not None:
                self.streams.wait(instr.stream, event)
        else:
            b = P - instr.stage
            if b not in book.loaded:  # not for a batch that was never loaded
                return
            if self._lanes > 1 and instr.task == self._source and b % self._lanes != w.lane:
                return  # another lane loaded it and records after it (as it signals)
            book.events[(instr.task, b)] = self.streams.record(instr.stream)

    # ---------------------------------------------------------------- reports
    def _describe(self, f: Failure) -> str:
        return f"{describe(f.task, f.batch, f.thread, f.iteration)} of plan {self.plan.name}"

    def _timeout_report(self) -> str:
        main = self._main
        lines = [f"internal iteration {main.P} of plan {self.plan.name} did not finish within {self.timeout_s:.1f}s"]
        lines += [f"  thread {w.name!r}: {w.position()}" for w in self._walkers.values()]
        for group, t in self._turnstiles.items():
            lines.append(f"  comm group {group!r}: next ticket {t.next_ticket}, waiting {t.waiting or 'none'}")
        running = [
            (w.at.task, w.P)
            for w in self._walkers.values()
            if w.state is WalkState.RUNNING and isinstance(w.at, Run)
        ]
        last = max(w.P for w in self._walkers.values())
        lines.append(format_schedule(self.plan, last + 2, self.book.num_batches, mark=running[0] if running else None))
        return "\n".join(lines)


def check_limits(plan: PipelinePlan, max_threads: int, max_in_flight: int) -> None:
    threads = len(plan.thread_groups) + plan.loads - 1
    if threads > max_threads:
        raise PlanError(
            f"plan {plan.name} uses {threads} threads ({', '.join(plan.thread_groups)}"
            f"{f', {plan.loads} loads' if plan.loads > 1 else ''}); at most {max_threads} are allowed (max_threads)",
            culprit="thread_map",
        )
    in_flight = plan.pipeline_depth + plan.lookahead
    if in_flight > max_in_flight:
        raise PlanError(
            f"plan {plan.name} keeps {in_flight} batches in flight (depth {plan.pipeline_depth} + lookahead "
            f"{plan.lookahead}); at most {max_in_flight} are allowed (max_in_flight)",
            culprit="pipeline_depth",
        )
    if plan.source is None:
        raise PlanError(f"plan {plan.name} has no source task: the engine needs one to pull batches", culprit="source")
