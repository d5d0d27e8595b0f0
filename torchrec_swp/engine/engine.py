"""Engine: runs a plan (or a PhasedPlan) on threads and streams; ``step()`` is ``progress()``.

Contract of ``step(data)``: return batch ``d``'s ``plan.output`` value once every task of batch
``d`` is done (``d``: the batches returned so far this epoch; with ``lookahead`` 0, once every
thread finished internal iteration ``d + top``, so that a call does exactly what it does on one
thread, only concurrently), or raise StopIteration when no
batch is left (after draining, or as soon as the source finds none under
``on_exhausted="stop"``). The calling thread runs its part of internal iteration ``d + top``
(and of the earlier ones it has not run), exactly what a plan on one thread runs in one call;
the other threads walk on in the background between calls, each as far as its dependencies,
its tickets and the source's credit let it: batches in flight at most ``pipeline_depth +
lookahead``, and the source draws a batch at most ``lookahead`` calls before the call a plan on
one thread draws it in (so with lookahead 0, in that very call). A thread that issues collectives
(a task in a comm group) never runs ahead of the call: every collective is issued while
``step()`` runs, as upstream's are, so none interleaves with what the caller does on the same
process group between calls (an eval, a metric all-reduce, another pipeline). No thread starts the training
step (the highest stage) of a batch ``step()`` was not asked for yet.

``data``: the iterator the source draws from (its function gets it as keyword ``data``; see
``torchrec_swp.engine.source``). A new iterator, or the same one again after StopIteration,
is new data (``new_data()``): nothing in flight is lost.

Phases: with a PhasedPlan, internal iteration ``P`` runs the plan of the phase of the batch it
trains (``P - top``; the epoch's first batch during the fill).

Failures: an exception in any task on any thread stops every thread where it is and comes out
of the current (or next) ``step()`` with its own type and a note naming task, batch, thread and
internal iteration (attributes ``swp_task``, ``swp_batch``, ``swp_thread``, ``swp_iteration``).
``step()`` again resumes where every thread stopped: nothing runs twice, nothing is skipped (but
a rank that failed issues no more collectives of a comm group spread over threads until
``reset()``). A wait times out once no thread made progress for ``timeout_s`` (``engine.board``).

Uneven data: with ``exhaustion`` (an ``ExhaustionSync``, the pipelines'
``sync_dataloader_exhaustion=True``) the ranks agree on every draw whether every rank has the
batch (``torchrec_swp.engine.exhaustion``): all of them find the end of data at the same batch.
An item drawn there by a rank that had one is never trained (``ledger.past_end`` counts it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch

from torchrec_swp.compile import Alias, CompiledPlan, RecordEvent, Run, Signal, WaitStream
from torchrec_swp.engine.batches import BatchBook, BatchLedger
from torchrec_swp.engine.board import ITERATION
from torchrec_swp.engine.cuts import Cuts
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.engine.instructions import InstalledPlan, check_limits
from torchrec_swp.engine.interpreter import DEFAULT_TIMEOUT_S, Failure, Walker, WalkState
from torchrec_swp.engine.source import Draws
from torchrec_swp.engine.streams import StreamPool
from torchrec_swp.engine.tasks import Binding, Observer, make_alias, make_invoker, task_context, task_timer
from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.plan.task import parse_read

MAX_THREADS = 16
MAX_IN_FLIGHT = 8


class Engine(Cuts):
    """Runs a plan's programs. One Engine per pipeline instance.

    ``training``: whether the model trains, asked at the start of every ``step()``; tasks guarded
    ``when=train`` run for the batch that call trains only if it said so (without it, always).
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
    ) -> None:
        if isinstance(plan, PipelinePlan):
            phased = PhasedPlan([(0, plan)])
        elif isinstance(plan, PhasedPlan):
            phased = plan
        else:
            raise TypeError(f"plan must be a PipelinePlan or a PhasedPlan, got {type(plan).__name__}")
        for p in phased.plans:
            check_limits(p, max_threads, max_in_flight)
        tasks = list(dict.fromkeys(t for p in phased.plans for t in p.fire_order))
        missing = [t for t in tasks if t not in bindings]
        if missing:
            raise PlanError(f"no function bound to task {missing[0]} of plan {phased.name}", culprit=missing[0])
        extra = [t for t in bindings if t not in tasks]
        if extra:
            raise PlanError(f"a function is bound to {extra[0]!r}, which is not a task of plan {phased.name}", culprit=extra[0])
        for task, fn in bindings.items():
            if not callable(fn):
                raise TypeError(f"the function bound to task {task} is not callable: {fn!r}")
        super().__init__(streams=streams, timeout_s=timeout_s, name=name)
        self.device_type = device_type
        self.exhaustion = exhaustion
        self.max_threads, self.max_in_flight = max_threads, max_in_flight
        self.phased = phased
        self.plan: PipelinePlan = phased.plans[0]
        self._bindings = dict(bindings)
        self._top = phased.max_stage
        self._source = self.plan.source
        self._stage = {t: s.stage for p in phased.plans for t, s in p.schedule.items()}
        self._lanes = max(p.loads for p in phased.plans)
        self._lookahead = max(p.lookahead for p in phased.plans)
        # how many batches back values and events are read: slots and events kept that long
        self._keep_slots = max((parse_read(r)[1] for p in phased.plans for io in p.tasks.values() for r in io.reads), default=0)
        self._keep_events = max((d.distance for p in phased.plans for d in p.deps), default=0)
        self.ledger = BatchLedger()
        self._slots: dict[int, dict[str, Any]] = {}  # every epoch's book holds this one dict
        self.book = BatchBook(slots=self._slots)
        self._pulls = 0  # source calls since construction or reset(): the next batch number
        self._data: Iterator[Any] | None = None
        self._draws: Draws | None = None
        # (first batch, its Draws): a new iterator serves the batches a step() call makes drawable
        self._draws_from: list[tuple[int, Draws]] = []
        self._grad = torch.is_grad_enabled()
        self._training_mode = training
        self._training = True  # asked at every step()
        self._iteration_start = 0.0
        self._epoch_base = 0  # observers count iterations on over epochs: this epoch's iteration 0
        self._failure_raised = False
        self._signalled: tuple[str, ...] = ()
        self._recorded: tuple[str, ...] = ()
        self._pending: PhasedPlan | None = None  # a switch_plan waiting for threads that ran ahead
        self._installed = self._install_all(phased)
        self._make_walkers()
        self.reset()

    # ------------------------------------------------------------------ setup
    def _install_all(self, phased: PhasedPlan) -> dict[int, InstalledPlan]:
        """Every phase's plan installed; the tasks whose latches and events batches leave behind
        (in any phase's programs, those installed before included) noted for ``_forget``."""
        installed = {id(p): self._install(p) for p in phased.plans}
        programs = [i for inst in installed.values() for instrs in inst.programs.values() for i in instrs]
        self._signalled = tuple(dict.fromkeys([*self._signalled, *(i.task for i in programs if isinstance(i, Signal))]))
        self._recorded = tuple(dict.fromkeys([*self._recorded, *(i.task for i in programs if isinstance(i, RecordEvent))]))
        return installed

    def switch_plan(self, plan: PipelinePlan | PhasedPlan) -> bool:
        """Run ``plan`` from a batch boundary every thread stands at; between steps only.

        Where every thread that has tasks stands at the calling thread's internal iteration, none
        in the middle of one (before the first step, or after a step of a plan without lookahead),
        the switch happens now (True). Where threads ran ahead, they run ahead no more, and the
        first ``step()`` that finds every thread at the calling thread's boundary switches, at
        most ``lookahead`` steps later (False until then; ``switch_pending`` says so): a thread
        that ran ahead has started iterations the new plan must not run again. ``plan`` keeps
        every task, its stage and its stream (and the phases' batch numbers): only threads, fire
        order, comm groups, lookahead and loads change, so every task instance runs once, in the
        plan it falls in, and device events recorded before the switch are those the new
        programs wait on. Raises EngineError naming what does not hold.
        """
        new = PhasedPlan([(0, plan)]) if isinstance(plan, PipelinePlan) else plan
        if not isinstance(new, PhasedPlan):
            raise TypeError(f"plan must be a PipelinePlan or a PhasedPlan, got {type(plan).__name__}")
        old = self.phased
        if [n for n, _ in new.phases] != [n for n, _ in old.phases]:
            raise EngineError(
                f"switch_plan: the new plan's phases start at batches {[n for n, _ in new.phases]}, the running "
                f"plan's at {[n for n, _ in old.phases]}"
            )
        if (new.clock, new.cycle) != (old.clock, old.cycle):
            raise EngineError(
                f"switch_plan: the new plan's phases run on clock {new.clock} with cycle {new.cycle}, the running "
                f"plan's on clock {old.clock} with cycle {old.cycle}"
            )
        for before, after in zip(old.plans, new.plans, strict=True):
            check_limits(after, self.max_threads, self.max_in_flight)
            if set(after.fire_order) != set(before.fire_order):
                raise EngineError(
                    f"switch_plan: plan {after.name} has tasks {sorted(after.fire_order)}, the running plan "
                    f"{sorted(before.fire_order)}: a switch keeps the tasks"
                )
            for t in before.fire_order:
                a, b = before.task(t), after.task(t)
                if (a.stage, a.stream) != (b.stage, b.stream):
                    raise EngineError(
                        f"switch_plan: task {t} runs at stage {b.stage} on stream {b.stream} in plan {after.name}, at "
                        f"stage {a.stage} on stream {a.stream} now: a switch keeps every task's stage and stream"
                    )
        if self.failures:
            raise EngineError("switch_plan: a task failed; call step() again (or reset()) before switching")
        self._pending = new
        for w in self._walkers.values():  # nobody runs ahead any more: the calling thread catches up
            w.ahead = 0
        return self._switch_if_ready()

    @property
    def switch_pending(self) -> bool:
        """A ``switch_plan`` waits for threads that ran ahead to stand at the calling thread's boundary."""
        return self._pending is not None

    def _switch_if_ready(self) -> bool:
        """Switch to the pending plan if every thread stands at the calling thread's boundary."""
        new, main = self._pending, self._main
        assert new is not None
        if any(w.done_through != main.P - 1 for w in self._tasked if w is not main):
            return False  # a thread is ahead (or, after a failure, behind): a later step() switches
        self._settle("switching plans")
        P = main.P
        for w in self._tasked:
            if w.state is WalkState.FINISHED or w.P != P or w.i != 0:
                return False
        self._pending = None
        old = self.phased
        index = old.plans.index(self.plan)
        self.phased = new
        self.plan = new.plans[index]
        self._source = self.plan.source
        self._stage = {t: s.stage for p in new.plans for t, s in p.schedule.items()}
        self._lanes = max(p.loads for p in new.plans)
        self._lookahead = max(p.lookahead for p in new.plans)
        self._keep_slots = max([self._keep_slots, *(parse_read(r)[1] for p in new.plans for io in p.tasks.values() for r in io.reads)])
        self._keep_events = max([self._keep_events, *(d.distance for p in new.plans for d in p.deps)])
        self._installed = self._install_all(new)
        self._make_walkers()
        bases = {g: t.next_ticket for g, t in self._turnstiles.items()}
        for w in self._walkers.values():
            w.place(P, bases)
        return True

    def _install(self, plan: PipelinePlan) -> InstalledPlan:
        compiled = CompiledPlan(plan, device_streams=self.streams.has_streams, device_type=self.device_type)
        steady = compiled.steady
        installed = InstalledPlan(plan, compiled, {t: i for t, i in steady.threads if i}, steady.tickets, {}, {})
        self._bind(installed)
        return installed

    def _bind(self, inst: InstalledPlan) -> None:
        """The (instrumented) calls of ``inst``'s tasks, entering each task's stream where the
        device has streams; then its programs' ops, which hold them."""
        plan, slots = inst.plan, self._slots
        observer, labels = self._observer, self._labels
        streams = self.streams
        for task in plan.fire_order:
            t = plan.task(task)
            extra = self._data_argument if task == plan.source else None
            stream = partial(streams.context, t.stream) if streams.has_streams and t.stream != DEFAULT_STREAM else None
            iteration = lambda b, s=t.stage: self._epoch_base + b + s
            timed = task_timer(task, t.thread_group, iteration, observer)
            around = task_context(task, labels, stream)
            inst.invokers[task] = make_invoker(t.io, self._bindings[task], slots, extra, around, timed)
            if self.device_type in t.io.noop_on:  # no call, no stream: labelled and timed all the same
                pairs = tuple(zip(t.io.writes, t.io.reads))
                inst.aliases[task] = make_alias(pairs, slots, task_context(task, labels, None), timed)
        self._compile(inst)

    def _make_walkers(self) -> None:
        threads: dict[str, int] = {MAIN_THREAD: -1}  # thread -> highest stage of its tasks
        collective: set[str] = set()  # threads that issue collectives (a task in a comm group)
        for inst in self._installed.values():
            for thread, instrs in inst.programs.items():
                stages = [i.stage for i in instrs if isinstance(i, (Run, Alias))]
                threads[thread] = max(threads.get(thread, -1), *stages)
                if any(getattr(i, "comm_group", None) is not None for i in instrs):
                    collective.add(thread)
        self._main = Walker(MAIN_THREAD, MAIN_THREAD, top=threads[MAIN_THREAD])
        self._walkers = {MAIN_THREAD: self._main}
        source_thread = self.plan.task(self._source).thread_group if self._source else None
        for thread, top in threads.items():
            if thread == MAIN_THREAD:
                continue
            lanes = self._lanes if thread == source_thread else 1
            for lane in range(lanes):
                name = thread if lane == 0 else f"{thread}.{lane}"
                ahead = 0 if thread in collective else self._lookahead
                self._walkers[name] = Walker(thread, name, lane=lane, top=top, ahead=ahead)
        self._tasked = [w for w in self._walkers.values() if w.top >= 0]
        self._threaded = len(self._walkers) > 1

    def instrument(self, observer: Observer | None = None, *, labels: bool = False) -> None:
        """Attach (or, with no arguments, detach) instrumentation.

        ``observer`` gets every task run, every cross-thread wait and every iteration of the
        calling thread with its times (iterations numbered on over epochs), and, if it has
        ``on_step``, every ``step()`` call's wall and CPU clocks at its start and end; ``labels`` wraps each task in
        ``torch.profiler.record_function("## Task b ##")`` so profiler traces show the plan's
        tasks. Detached, the engine runs the bare calls. Only between steps.
        """
        self._observer = observer
        self._labels = labels
        self._on_step = getattr(observer, "on_step", None)
        for inst in self._installed.values():
            self._bind(inst)

    # ------------------------------------------------------------------ mutation testing
    def device_syncs(self) -> list[tuple[int, str, int, str]]:
        """Every stream wait and event record of the installed programs, as ``(plan index,
        thread, position, text)``: what ``drop_instruction`` can remove (tools/stream_check.py)."""
        found = []
        for k, inst in enumerate(self._installed.values()):
            for thread, prog in inst.programs.items():
                found += [(k, thread, i, str(x)) for i, x in enumerate(prog) if isinstance(x, (WaitStream, RecordEvent))]
        return found

    def drop_instruction(self, plan_index: int, thread: str, position: int) -> str:
        """Remove one instruction from an installed program, for mutation testing only (a
        mutant engine: call it before the first step). Returns the instruction's text."""
        inst = list(self._installed.values())[plan_index]
        prog = inst.programs[thread]
        inst.programs[thread] = prog[:position] + prog[position + 1 :]
        self._compile(inst)
        return str(prog[position])

    # ------------------------------------------------------------------ state
    @property
    def compiled(self) -> CompiledPlan:
        return self._installed[id(self.plan)].compiled

    @property
    def slots(self) -> dict[int, dict[str, Any]]:
        return self.book.slots

    @property
    def iteration(self) -> int:
        """The next internal iteration the calling thread runs."""
        return self._main.P

    @property
    def loaded(self) -> int:
        return self.book.returned + len(self.book.in_flight())

    @property
    def delivered(self) -> int:
        return self.book.returned

    @property
    def num_batches(self) -> int | None:
        return self.book.num_batches

    @property
    def stopped(self) -> bool:
        return self.book.stopped

    @property
    def end_reported(self) -> bool:
        """The last step() raised StopIteration because the data ended."""
        return self.book.end_reported

    @property
    def ended(self) -> bool:
        """The data is exhausted and no batch is left to deliver (or the plan stopped)."""
        return self.book.ended

    @property
    def draws(self) -> Draws | None:
        """The data the source draws from (None before ``step()`` got an iterator)."""
        return self._draws

    def in_flight(self) -> list[int]:
        """Batches loaded but not delivered (in order), by index in this epoch."""
        return self.book.in_flight()

    def untrained(self) -> list[tuple[int, str]]:
        """Every batch drawn and not trained, by serial: dropped ones, then those in flight."""
        book = self.book
        reason = "left in flight: the plan stopped at the end of data" if book.stopped else "in flight"
        return [*self.ledger.dropped, *((book.serial(b), reason) for b in book.in_flight())]

    # ------------------------------------------------------------------- step
    def step(self, data: Iterator[Any] | None = None) -> Any:
        on_step = self._on_step
        if on_step is None:
            return self._step(data)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._step(data)
        finally:
            on_step(start, time.perf_counter(), cpu, time.thread_time())

    def _step(self, data: Iterator[Any] | None) -> Any:
        if data is not None:
            self._take_data(data)
        if self._failure_raised:  # step() again after a failure: go on where every thread stopped
            self.failures.clear()
            self._failure_raised = False
            self.board.resume()
        if self._pending is not None:
            self._switch_if_ready()
        self._grad = torch.is_grad_enabled()
        if self._training_mode is not None:  # before this call's batch is requested (``when=train``)
            self._training = bool(self._training_mode())
        main = self._main
        while True:
            book = self.book
            if book.ended:
                if book.restart_after_drain:
                    self._settle()
                    self._start_epoch()
                    continue
                book.end_reported = True
                raise StopIteration
            book.end_reported = False
            d = book.returned
            if book.requested <= d:
                book.requested = d + 1
                if self._threaded:
                    self.board.changed()
            if self._threaded:
                self._start_workers()
            if main.state is not WalkState.FINISHED:
                self._walk(main, d + self._top)
            outcome = self._await(d)
            if outcome == "done":
                return self._retire(d)
            if outcome == "failed":
                self._raise_failure()
            if outcome == "stopped":
                book.end_reported = True
                raise StopIteration
            # drained: no batch d; every thread walks out of the epoch
            self._settle()

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
        for w in self._walkers.values():
            if w is not self._main and w.state in (WalkState.READY, WalkState.PARKED):
                self._launch(w, lambda w=w: self._background(w))

    def _background(self, w: Walker) -> None:
        torch.set_grad_enabled(self._grad)
        if self._checker is not None:
            self._checker.cpu_acquire(("launch", self._uid, w.name))
        self._walk(w, None)

    def _await(self, d: int) -> str:
        """Wait until batch ``d`` is done - with lookahead 0, every thread's part of internal
        iteration ``d + top`` - ("done"), a failure ("failed"), the end of data with no
        batch ``d`` ("drained"), or a stop that leaves it in flight ("stopped")."""
        result = self._outcome(d)
        if result is None:
            try:
                ready = lambda: self._outcome(d) is not None
                self.board.wait(ready, lambda: f"batch {d} to be trained", self.timeout_s, ITERATION)
            except BaseException as e:  # noqa: BLE001 - a timeout here is a failure like any other
                if not self.failures:
                    self.failures.append(Failure(e, "-", d, MAIN_THREAD, self._main.P))
            result = self._outcome(d) or "failed"
        if result == "done" and self._checker is not None:  # each thread's part of batch d is ordered before us
            top = self._top
            for w in self._tasked:
                if w is not self._main:
                    self._checker.cpu_acquire(("iter", self._uid, w.name, self._epoch_base + d + (w.top if w.ahead else top)))
        return result

    def _outcome(self, d: int) -> str | None:
        """``_await``'s answer for batch ``d`` now (None: not yet)."""
        if self.failures:
            return "failed"
        book = self.book
        if d in book.loaded:
            # a thread that may run ahead is done with d after its own part; the others (with
            # lookahead 0, every thread) finish iteration d + top, collectives included
            top = self._top
            for w in self._tasked:
                if w.done_through < d + (w.top if w.ahead else top):
                    break
            else:
                return "done"
        m = book.num_batches
        if m is not None and d >= m and not book.stopped:
            return "drained"
        resting = all(w.state is not WalkState.RUNNING for w in self._walkers.values())
        if book.stopped and resting:
            return "stopped"
        if resting:  # nobody can make batch d: a bug of the engine's, not a wait
            self.failures.append(Failure(EngineError(f"no thread can go on:\n{self._timeout_report()}"), "-", d, MAIN_THREAD, self._main.P))
            return "failed"
        return None

    def _raise_failure(self) -> None:
        if self._threaded:
            self.board.interrupt_all("a task failed")
        self._wait_idle(list(self._walkers.values()))
        self._failure_raised = True
        raise self._first_failure()

    def _retire(self, d: int) -> Any:
        """Return batch ``d``'s output and forget what only it needed: its latches, its slot and
        events once no later batch reads them, its data position."""
        if not self._threaded:  # nobody else reads the book: no lock, nobody to wake
            return self._forget(d)
        with self.board.lock:
            output = self._forget(d)
            self.board.notify()
        return output

    def _forget(self, d: int) -> Any:
        book, inst = self.book, self._installed[id(self.plan)]
        output = book.slots[d].get(inst.plan.output) if inst.plan.output is not None else None
        book.returned = d + 1
        book.loaded.discard(d)
        book.numbers.pop(d, None)
        self.ledger.trained += 1
        book.slots.pop(d - self._keep_slots, None)
        # batches leave one by one, in order: each pop removes what every earlier one left
        if book.events:
            for task in self._recorded:
                book.events.pop((task, d - self._keep_events), None)
        latches = self.board.latches
        if latches:
            for task in self._signalled:
                latches.pop((task, d), None)
        if self._draws is not None:
            self._draws.forget(d + 1)
        return output
