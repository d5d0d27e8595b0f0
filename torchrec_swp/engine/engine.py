"""Engine: runs a plan (or a PhasedPlan) on threads and streams; ``step()`` is ``progress()``.

``step(data)`` returns batch ``d``'s ``plan.output`` value once every task of batch ``d`` is done
(``d``: the batches returned so far this epoch), or raises StopIteration when no batch is left.
The calling thread runs its part of internal iteration ``d + top``, exactly what a plan on one
thread runs in one call; the other threads walk on in the background, as far as their
dependencies, their tickets and the source's credit let them (a thread that issues collectives
never runs ahead of the call). ``data`` is the iterator the source draws from; a new one, or the
same one after StopIteration, is new data. A failure in any task on any thread stops every
thread where it is and comes out of ``step()`` with its own type and a note naming task, batch,
thread and internal iteration; ``step()`` again resumes. docs/engine.md has the whole contract,
the path of one batch through one call, the glossary and the parts ``Engine`` holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import torch

from torchrec_swp.compile import CompiledPlan, Run
from torchrec_swp.engine import cuts
from torchrec_swp.engine.batches import BatchBook, Batches, BatchLedger
from torchrec_swp.engine.board import ITERATION
from torchrec_swp.engine.end_of_data import EndEvent
from torchrec_swp.engine.epochs import Epochs
from torchrec_swp.engine.errors import EngineError, describe
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.installed import InstalledPlan, InstalledPlans, check_bindings, check_rollback_clock
from torchrec_swp.engine.interpreter import DEFAULT_TIMEOUT_S, Interpreter
from torchrec_swp.engine.ops import PlanOps
from torchrec_swp.engine.source import Draws
from torchrec_swp.engine.streams import StreamPool
from torchrec_swp.engine.tasks import Binding, Observer
from torchrec_swp.engine.transaction import Transaction
from torchrec_swp.engine.walkers import Failure, Walker, WalkState
from torchrec_swp.plan import MAIN_THREAD, PhasedPlan, PipelinePlan
from torchrec_swp.plan.table import format_schedule

MAX_THREADS = 16
MAX_IN_FLIGHT = 8

#: ``Engine._finish``'s answer where batch ``d`` does not exist (drained): the step goes on
_AGAIN = object()


class Engine(Interpreter):
    """Runs a plan's programs. One Engine per pipeline instance.

    ``training``: whether the model trains, asked at the start of every ``step()``; tasks guarded
    ``when=train`` run for the batch that call trains only if it said so (without it, always).
    ``on_new_data``: called whenever the source gets new data (``Epochs.new_data``: a new
    iterator given to ``step()``, the same one after StopIteration, ``new_data()``), before any
    task draws from it (a pipeline clears its upstream class's end-of-data flag there).
    ``transaction``: each batch's step is undone where it goes non-finite: the plan's declared
    effects captured before their tasks, the step decided after its deciding task
    (``torchrec_swp.engine.transaction``; the plan must pass its ``check_plan``).
    """

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
        training: Callable[[], bool] | None = None,
        exhaustion: ExhaustionSync | None = None,
        on_new_data: Callable[[], None] | None = None,
        undo_draw: Callable[[int, Mapping[str, Any]], None] | None = None,
        transaction: Transaction | None = None,
    ) -> None:
        super().__init__(streams=streams, timeout_s=timeout_s, name=name)
        self.transaction = transaction
        self.installed = InstalledPlans(
            plan, streams=self.streams, device_type=device_type, max_threads=max_threads, max_in_flight=max_in_flight
        )
        check_bindings(self.installed.phased, bindings)
        self.device_type, self.exhaustion = device_type, exhaustion
        self.batches = Batches()
        self._plan_ops = PlanOps(
            self, self.batches, self.installed, uid=self._uid, checker=self._checker, exhaustion=exhaustion,
            undo_draw=undo_draw,
        )  # fmt: skip
        self._feed = self._plan_ops.source.feed
        self._epochs = Epochs(self, self.installed, self.batches, self._feed, on_new_data)
        self._bindings = dict(bindings)
        self._training_mode, self._labels = training, False
        self._on_step: Callable[[float, float, float, float], None] | None = None  # the observer's, if it has one
        self._bind_all()
        self.reset()

    # ------------------------------------------------------------------ plans
    @property
    def _walkers(self) -> Mapping[str, Walker]:
        """The installed plans' walkers (``InstalledPlans.shape``, the one record of threads and stages)."""
        return self.installed.shape.walkers

    def _bind_all(self) -> None:
        """The installed plans' task calls and ops; the transaction's rollbacks told to the book
        (the clock ``"trained"`` skips them: at once where the phases go by that clock, checked
        to differ only on the thread that decides a step, ``check_rollback_clock``)."""
        for inst in self.installed.by_id.values():
            self._bind(inst)
        if self.transaction is not None:
            at_once = self.phased.clock == "trained" and len(self.phased.phases) > 1
            if at_once:
                check_rollback_clock(self.installed, self.transaction)
            self.transaction.listen(self.batches.rolled_back, at_once=at_once)

    def _bind(self, inst: InstalledPlan) -> None:
        """``inst``'s (instrumented) task calls, then its programs' ops, which hold them."""
        inst.bind(
            self._bindings, self.batches, self._feed.argument, self.batches.observed_iteration,
            streams=self.streams, device_type=self.device_type, observer=self._observer, labels=self._labels,
            transaction=self.transaction,
        )  # fmt: skip
        self._plan_ops.compile(inst, self._observer)

    @property
    def phased(self) -> PhasedPlan:
        return self.installed.phased

    @property
    def plan(self) -> PipelinePlan:
        """The plan the calling thread's iteration runs (its phase's)."""
        return self.installed.current

    def switch_plan(self, plan: PipelinePlan | PhasedPlan) -> bool:
        """Run ``plan`` from a batch boundary every thread stands at; between steps only: now (True)
        where every thread stands at the calling thread's internal iteration, else (False,
        ``switch_pending``) at the first ``step()`` that finds them there, at most ``lookahead``
        steps later, threads no longer running ahead. ``plan`` keeps every task, its stage and its
        stream (``installed.check_switch``; EngineError naming what does not hold), and its rows
        fit the task functions (``check_bindings``; PlanError naming the task)."""
        new = self.installed.checked(plan)
        check_bindings(new, self._bindings)
        if self.failures:
            raise EngineError("switch_plan: a task failed; call step() again (or reset()) before switching")
        self.installed.request(new)
        self.installed.shape.hold_back()  # nobody runs ahead any more: the calling thread catches up
        return self._switch_if_ready()

    @property
    def switch_pending(self) -> bool:
        """A ``switch_plan`` waits for threads that ran ahead to stand at the calling thread's boundary."""
        return self.installed.pending is not None

    def _switch_if_ready(self) -> bool:
        """Switch to the pending plan if every thread stands at the calling thread's boundary."""
        shape = self.installed.shape
        main = shape.main
        if any(w.done_through != main.P - 1 for w in shape.tasked if w is not main):
            return False  # a thread is ahead (or, after a failure, behind): a later step() switches
        self.park_all("switching plans")
        P = main.P
        if any(w.state is WalkState.FINISHED or w.P != P or w.i != 0 for w in shape.tasked):
            return False
        self.installed.switch()  # a new shape: new walkers
        self._bind_all()
        bases = {g: t.next_ticket for g, t in self._turnstiles.items()}
        for w in self._walkers.values():
            w.place(P, bases)
        return True

    def instrument(self, observer: Observer | None = None, *, labels: bool = False) -> None:
        """Attach (or, with no arguments, detach) instrumentation.

        ``observer`` gets every task run, every cross-thread wait and every iteration of the
        calling thread with its times (iterations numbered on over epochs), and, if it has
        ``on_step``, every ``step()`` call's wall and CPU clocks at its start and end; ``labels`` wraps each task in
        ``torch.profiler.record_function("## Task b ##")`` so profiler traces show the plan's
        tasks. Detached, the engine runs the bare calls. Only between steps.
        """
        self._observer, self._labels = observer, labels
        self._on_step = getattr(observer, "on_step", None)
        for inst in self.installed.by_id.values():
            self._bind(inst)

    def program_texts(self) -> list[str]:
        """The steady programs of each installed plan (one per phase) as text
        (``compile.format_program``): what ``edit_program`` takes back."""
        return [self.installed.program_text(k) for k in range(len(self.installed.by_id))]

    def edit_program(self, plan_index: int, text: str) -> None:
        """Run ``text``'s programs for the ``plan_index``-th installed plan, for mutation testing
        only (a mutant engine: call it before the first step; tools/stream_check.py removes one
        stream wait or event record line at a time). PlanError naming the line when ``text``
        does not parse against that plan. Everything compiled from the programs is made again:
        the walks' ops."""
        self._bind(self.installed.edit_program(plan_index, text))

    @property
    def compiled(self) -> CompiledPlan:
        return self.installed.compiled

    @property
    def book(self) -> BatchBook:
        """This epoch's batches (``Batches.book``)."""
        return self.batches.book

    @property
    def ledger(self) -> BatchLedger:
        return self.batches.ledger

    @property
    def slots(self) -> Mapping[int, dict[str, Any]]:
        """The batches in flight's slots, read-only (only ``Batches`` writes them)."""
        return MappingProxyType(self.batches.slots)

    def slot(self, b: int) -> Mapping[str, Any]:
        """Batch ``b``'s values, read-only (empty when it is not in flight)."""
        return self.batches.slot(b)

    @property
    def iteration(self) -> int:
        """The next internal iteration the calling thread runs."""
        return self.installed.shape.main.P

    @property
    def end_reported(self) -> bool:
        """The last step() raised StopIteration because the data ended."""
        return self.batches.end.reported()

    @property
    def draws(self) -> Draws | None:
        """The data the source draws from (None before ``step()`` got an iterator)."""
        return self._feed.draws

    def in_flight(self) -> list[int]:
        """Batches loaded but not delivered (in order), by index in this epoch."""
        return sorted(self.batches.book.in_flight)

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        return self.batches.untrained()

    # ------------------------------------------------------------------- step
    def step(self, data: Iterator[Any] | None = None) -> Any:
        """Batch ``d``'s output (module docstring); StopIteration when no batch is left. An
        observer with ``on_step`` gets the call's clocks (``instrument``)."""
        on_step = self._on_step
        if on_step is not None:
            start, cpu = time.perf_counter(), time.thread_time()
        try:
            batches, end = self.batches, self.batches.end
            ended = end.ended()  # (a report comes only once ended: one question in the common case)
            if data is not None and (data is not self._feed.data or (ended and end.reported())):
                self._epochs.take_data(data)
                ended = end.ended()
            if self._failure_raised:  # step() again after a failure: go on where every thread stopped
                self._resume_after_failure()
            if self.installed.pending is not None:
                self._switch_if_ready()
                ended = end.ended()
            self._plan_ops.begin_step(
                torch.is_grad_enabled(), True if self._training_mode is None else bool(self._training_mode())
            )
            shape = self.installed.shape
            main, threaded = shape.main, shape.threaded
            while True:
                if ended:
                    if end.restarts():
                        self.wait_until_resting()
                        self._epochs.start(EndEvent.EPOCH)
                        ended = end.ended()
                        continue
                    self._report_end()
                    raise StopIteration
                d = batches.book.returned
                if batches.ask(d) and threaded:
                    self.board.changed()
                if threaded:
                    self._start_workers()
                if main.state is not WalkState.FINISHED:
                    ops = self._plan_ops
                    self._walk(main, d + shape.top, ops.program, ops.iteration_done, threaded=threaded)
                output = self._finish(d)
                if output is not _AGAIN:
                    if self.transaction is not None:
                        self.transaction.after_step()  # (mode "raise": the step of d rolled back)
                    return output
                ended = end.ended()
        finally:
            if on_step is not None:
                on_step(start, time.perf_counter(), cpu, time.thread_time())

    def _finish(self, d: int) -> Any:
        """Once the calling thread walked through batch ``d``'s iteration: ``d``'s output when it is
        done, the failure raised, StopIteration for a stop that leaves it in flight, or, where
        there is no batch ``d`` (drained), ``_AGAIN`` once every thread walked out of the epoch."""
        outcome = self._outcome(d) or self._await(d)
        if outcome == "done":
            if self._checker is not None:
                self._ordered(d)
            return self._retire(d)
        if outcome == "failed":
            self._raise_failure()
        if outcome == "stopped":
            self._report_end()
            raise StopIteration
        self.wait_until_resting()  # drained: no batch d; every thread walks out of the epoch
        return _AGAIN

    def _report_end(self) -> None:
        """StopIteration for the end of data, once no thread holds the engine: drained, every
        thread walks out of the epoch (waited for, as a new epoch would); stopped, a thread at
        rest dropped its job (one still in flight is not waited for). A caller who drops the engine
        then leaves it to the garbage collector, which then finds nothing else holding it."""
        if not self.batches.end.stopped():
            self.wait_until_resting()
        self.drop_jobs()
        self.batches.report_end()

    def run_to_end(self) -> list[Any]:
        """Step until the data ends; the outputs in order."""
        outputs = []
        while True:
            try:
                outputs.append(self.step())
            except StopIteration:
                return outputs

    def _start_workers(self) -> None:
        if self.failures:
            return
        main = self.installed.shape.main
        for w in self._walkers.values():
            if w is not main and w.state in (WalkState.READY, WalkState.PARKED):
                self._launch(w, partial(self._background, w))

    def _background(self, w: Walker) -> None:
        torch.set_grad_enabled(self._plan_ops.grad)
        if self._checker is not None:
            self._checker.cpu_acquire(("launch", self._uid, w.name))
        self._walk(w, None, self._plan_ops.program, self._plan_ops.iteration_done, threaded=True)

    def _await(self, d: int) -> str:
        """Wait until batch ``d`` is done - with lookahead 0, every thread's part of internal
        iteration ``d + top`` - ("done"), a failure ("failed"), the end of data with no
        batch ``d`` ("drained"), or a stop that leaves it in flight ("stopped"): ``_outcome``
        once it has an answer."""
        return self._await_outcome(lambda: self._outcome(d), lambda: f"batch {d} to be trained", d, ITERATION)

    def _ordered(self, d: int) -> None:
        """In checked mode: each thread's part of batch ``d`` is ordered before the caller."""
        shape, base, checker = self.installed.shape, self.batches.book.first_iteration, self._checker
        assert checker is not None
        top = shape.top
        for w in shape.tasked:
            if w is not shape.main:
                checker.cpu_acquire(("iter", self._uid, w.name, base + d + (w.last_stage if w.ahead else top)))

    def _outcome(self, d: int) -> str | None:
        """``_await``'s answer for batch ``d`` now (None: not yet)."""
        if self.failures:
            return "failed"
        book = self.batches.book
        if d in book.in_flight:
            # a thread that may run ahead is done with d after its own part; the others (with
            # lookahead 0, every thread) finish iteration d + top, collectives included
            shape = self.installed.shape
            top = shape.top
            for w in shape.tasked:
                if w.done_through < d + (w.last_stage if w.ahead else top):
                    break
            else:
                return "done"
        end = self.batches.end
        if end.past_end(d):
            return "drained"
        resting = all(w.state is not WalkState.RUNNING for w in self._walkers.values())
        if resting and end.stopped():
            return "stopped"
        if resting:  # nobody can make batch d: a bug of the engine's, not a wait
            stuck = EngineError(f"no thread can go on:\n{self._timeout_report()}")
            self.failures.append(Failure(stuck, "-", d, MAIN_THREAD, self.installed.shape.main.P))
            return "failed"
        return None

    def _retire(self, d: int) -> Any:
        """Return batch ``d``'s output and forget what only it needed: its latches, its slot and
        events once no later batch reads them, its data position. Under the board's lock where
        other threads walk (on one thread nobody else reads the book: no lock, nobody to wake)."""
        installed, shape, board = self.installed, self.installed.shape, self.board
        threaded = shape.threaded
        if threaded:
            board.lock.acquire()
        try:
            output = self.batches.retire(
                d, installed.current.output, shape.keep_slots, shape.kept, shape.keep_events, installed.recorded
            )
            if installed.latched:  # (no latch on one thread, unless a plan on threads ran before)
                board.forget_latches(installed.latched, d)
            draws = self._feed.draws
            if draws is not None and draws.positions:
                draws.forget_positions(d + 1)
            if threaded:
                board.notify()
        finally:
            if threaded:
                board.lock.release()
        return output

    # ----------------------------------------------------------- epochs, cuts
    def reset(self) -> None:
        """Drop the batches in flight (``ledger.dropped``); start again at iteration 0, batch number
        0 and ticket 0 (``Epochs.reset``)."""
        self._epochs.reset()
        if self.transaction is not None:
            self.transaction.reset()

    def new_data(self) -> None:
        """The source has new data (``Epochs.new_data``)."""
        self._epochs.new_data()

    def adopt(self, slots: list[dict[str, Any]]) -> None:
        """Take batches loaded outside the engine as the batches in flight (``Epochs.adopt``)."""
        self._epochs.adopt(slots)

    def forget_data(self) -> None:
        """Forget the iterator: the next ``step(data)`` takes ``data`` as the first one."""
        self._feed.forget()

    @property
    def trained_since_reset(self) -> int:
        """Batches trained (returned by ``step()``, a step rolled back not counted: ``on_nonfinite``)
        since the engine was built or reset: the clock ``"trained"``'s number of the next batch to train."""
        return self.batches.book.first_trained + self.batches.book.returned

    def count_trained_from(self, n: int) -> None:
        """Number the next batch to train ``n`` on the clock ``"trained"`` (``Epochs.count_trained_from``)."""
        self._epochs.count_trained_from(n)

    def state_dict(self) -> dict[str, Any]:
        """The cut at the first batch not yet returned (``torchrec_swp.engine.cuts``)."""
        if self.failures or self._failure_raised:
            raise EngineError(
                "state_dict(): a task failed and its step was not resumed; the batches in flight are not at a cut"
            )
        self.wait_until_blocked()
        with self.board.lock:
            return cuts.take(self.batches, self._feed, self.phased.name)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a cut: the next batch drawn gets the cut's batch number and serial. Only on
        an engine with nothing in flight that has not stepped since it was built or reset."""
        ledger, number, trained = cuts.read(state, self.phased.name)
        if self.batches.book.requested or self.in_flight():
            raise EngineError("load_state_dict(): only before the first progress() (or right after reset())")
        self._epochs.resume(ledger, number, trained)

    # ---------------------------------------------------------------- reports
    def _describe(self, f: Failure) -> str:
        return f"{describe(f.task, f.batch, f.thread, f.iteration)} of plan {self.plan.name}"

    def _timeout_report(self) -> str:
        main, walkers = self.installed.shape.main, self._walkers.values()
        lines = [
            f"internal iteration {main.P} of plan {self.plan.name} did not finish: "
            f"no thread made progress for {self.timeout_s:.1f}s"
        ]
        lines += [f"  thread {w.name!r}: {w.position()}" for w in walkers]
        for group, t in self._turnstiles.items():
            lines.append(f"  comm group {group!r}: next ticket {t.next_ticket}, waiting {t.waiting or 'none'}")
        running = [(w.at.task, w.P) for w in walkers if w.state is WalkState.RUNNING and isinstance(w.at, Run)]
        last = max(w.P for w in walkers)
        lines.append(
            format_schedule(self.plan, last + 2, self.batches.end.end_at(), mark=running[0] if running else None)
        )
        return "\n".join(lines)
