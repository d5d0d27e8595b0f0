"""Pipeline-parallel programs on the engine: one rank's optimizer step is one IterationProgram.

``torchrec_swp.pp.lower_rank.lower_rank`` turns one rank's actions (``0F3``, ``1RB0``, ``0G``...)
into an ``IterationProgram`` whose work instructions are ``run 0F3`` (``RunAction``) and whose
cross-thread dependencies are the ``wait``/``signal`` pairs plan programs use, keyed by the
action's text. ``ProgramEngine.run_program`` runs such a program once, with the interpreter,
latches, turnstiles, workers, failure and timeout handling of the plan ``Engine``
(``torchrec_swp.engine.interpreter``: each thread walks its part of the step once).

Bindings: ``actions`` maps an action kind (``"F"``, ``"B"``, ``"SF"``, ``"RB"``, ``"G"``, ...) to
``fn(stage, microbatch)`` (``microbatch`` is None for ``G`` and ``O``). Where an action's kind runs
(which thread) is the program's; what it does is the binding's. A ``run 0G #k@dp`` holds ticket
``k`` of comm group ``dp``: every rank issues that group's collectives in ticket order whatever
thread runs them.

Checks before anything runs (``EngineError`` naming the culprit): only ``run``/``wait``/``signal``
instructions, every kind bound, every ``wait`` has its ``signal`` on another thread, no action
twice, tickets numbered ``0..n-1`` per comm group as ``program.tickets`` says.

Failures: an exception in any action on any thread aborts the step: every waiting thread wakes
(``TaskAborted``), later tickets fail (``CollectiveAborted``) until ``reset()``, every walker
comes to rest, and ``run_program`` re-raises the first exception, of its own type, with a
note naming action, microbatch, thread and step (attributes ``swp_task`` = the action's text,
``swp_batch`` = its microbatch or -1, ``swp_thread``, ``swp_iteration`` = the step). A wait
times out once no thread made progress for ``timeout_s`` (``engine.board``); it reports what each thread is at and
the program with those instructions marked. A binding that blocks inside a library call (a
receive whose sender died) is bounded by that library's own timeout, not the engine's: bindings
that wait on the network should pass ``timeout_s`` on (``torchrec_swp.integrations.torchrec.maglev``
does).

Device streams: every action runs on its thread's current stream. On CUDA that is correct
without events: a collective or P2P call orders itself after the work already queued on the
issuing thread's current stream, and the ``wait``/``signal`` pairs order the issuing. Actions on
named side streams (and the events between them) are not supported yet.

Checked mode (``streams`` a ``CheckedStreamPool``, e.g. ``stream_pool_for(cpu)`` with
``SWP_STREAM_CHECK=1``): every action runs inside the checker's label ``checker.task(action,
microbatch, thread)``, and each ``signal``/``wait`` pair publishes and acquires the thread's
clocks (the CPU-side edge a latch is), as the plan engine's latches do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from torchrec_swp.compile import Instr, IterationProgram, RunAction, Signal, WaitTask
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.interpreter import DEFAULT_TIMEOUT_S, Interpreter
from torchrec_swp.engine.streams import StreamPool
from torchrec_swp.engine.tasks import Observer
from torchrec_swp.engine.walkers import Failure, Op, Walk, Walker, WalkState
from torchrec_swp.plan import MAIN_THREAD

ActionBinding = Callable[[int, "int | None"], Any]


class ProgramEngine(Interpreter):
    """Runs one rank's pipeline-parallel programs (module docstring). One per rank and pipeline."""

    def __init__(
        self,
        actions: Mapping[str, ActionBinding],
        *,
        streams: StreamPool | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        name: str = "pp",
    ) -> None:
        super().__init__(streams=streams, timeout_s=timeout_s, name=name)
        for kind, fn in actions.items():
            if not callable(fn):
                raise TypeError(f"the function bound to action kind {kind!r} is not callable: {fn!r}")
        self._actions = dict(actions)
        self._bound: dict[str, ActionBinding] = dict(actions)
        # id -> (program, its ops per thread): checked once, compiled once
        self._checked: dict[int, tuple[IterationProgram, dict[str, tuple[Op, ...]]]] = {}
        self._program_now: IterationProgram | None = None
        self._bases: dict[str, int] = {}  # comm group -> first ticket of the next step
        self._threads: dict[str, Walker] = {}  # thread -> its walker, made when a program first has it
        #: programs run so far (the step number in reports and notes)
        self.steps = 0

    def instrument(self, observer: Observer | None = None) -> None:
        """Attach (or, with no argument, detach) an observer: it gets every action as
        ``on_run(action, microbatch, thread, step, start, end)``, every cross-thread wait and every
        step (``on_iteration``), timed with ``time.perf_counter()``."""
        self._observer = observer
        self._bound = (
            dict(self._actions) if observer is None else {k: self._timed(k, fn) for k, fn in self._actions.items()}
        )

    def rebind(self, kind: str, fn: ActionBinding) -> None:
        """Bind ``fn`` to action kind ``kind`` in place of its function (fault injection, a
        wrapper); an attached observer times it as before. Only between steps.

        Raises:
            KeyError: no action kind ``kind`` is bound.
            TypeError: ``fn`` is not callable.
        """
        if kind not in self._actions:
            raise KeyError(f"no action kind {kind!r} is bound; bound kinds: {', '.join(sorted(self._actions))}")
        if not callable(fn):
            raise TypeError(f"the function bound to action kind {kind!r} is not callable: {fn!r}")
        self._actions[kind] = fn
        self.instrument(self._observer)

    def reset(self) -> None:
        """Clear a failure: collectives may be issued again (after the caller has made sure every
        rank agrees on where the failed step left them); tickets are numbered from 0 again."""
        for t in self._turnstiles.values():
            t.restart()
        self._bases = {}
        self.failures.clear()
        self.board.resume()

    # ------------------------------------------------------------------- run
    def run_program(self, program: IterationProgram) -> None:
        """Run every thread of ``program`` once (one optimizer step of one rank)."""
        self._check(program)
        step = self.steps
        self.steps += 1
        self._program_now = program
        self.failures.clear()
        self.board.resume()
        self.board.clear_latches()
        walkers = [self._walker(MAIN_THREAD)] + [
            self._walker(t) for t, instrs in program.threads if t != MAIN_THREAD and instrs
        ]
        for w in walkers:
            w.place(step, self._bases)
        start = time.perf_counter() if self._observer is not None else 0.0
        grad = torch.is_grad_enabled()
        for w in walkers[1:]:
            self._launch(w, partial(self._background, w, step, grad))
        self._walk(walkers[0], step, self._program, threaded=len(self._threads) > 1)
        try:
            self.board.wait(
                lambda: bool(self.failures) or all(w.state is not WalkState.RUNNING for w in walkers),
                lambda: "every thread to finish the step",
                self.timeout_s,
            )
        except BaseException as e:  # noqa: BLE001 - a timeout is a failure like the others
            if not self.failures:
                self.failures.append(Failure(e, "-", -1, MAIN_THREAD, step))
        if self.failures:
            self.board.interrupt_all("an action failed")
        self.wait_until_resting(walkers)  # (in checked mode: what every thread did is ordered before the caller)
        if self.failures:
            raise self._first_failure()
        for group, count in program.tickets:
            self._bases[group] = self._bases.get(group, 0) + count
        if self._observer is not None:
            self._observer.on_iteration(step, start, time.perf_counter())

    @property
    def _walkers(self) -> Mapping[str, Walker]:
        return self._threads

    def _walker(self, thread: str) -> Walker:
        w = self._threads.get(thread)
        if w is None:
            w = self._threads[thread] = Walker(thread, thread)
        return w

    def _background(self, w: Walker, step: int, grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            self._walk(w, step, self._program, threaded=True)

    def _program(self, w: Walker, P: int) -> Walk | None:
        program = self._program_now
        assert program is not None
        instrs = program.instructions(w.thread)
        return instrs, self._checked[id(program)][1].get(w.thread, ())

    def _run(self, w: Walker, P: int, instr: Instr) -> None:
        if not isinstance(instr, RunAction):
            raise EngineError(f"{type(self).__name__} runs `run <action>`, `wait` and `signal` only; got `{instr}`")
        mb = -1 if instr.microbatch is None else instr.microbatch
        w.current = (instr.action, mb)
        if instr.ticket is None:
            self._run_action(w, instr)
        else:
            self.ticketed(w, instr.comm_group, instr.ticket, instr.action, mb, None, self._run_action, w, instr)

    def _run_action(self, w: Walker, instr: RunAction) -> None:
        try:
            if self._checker is None:
                self._bound[instr.kind](instr.stage, instr.microbatch)
            else:
                with self._checker.task(instr.action, instr.microbatch, w.name):
                    self._bound[instr.kind](instr.stage, instr.microbatch)
        except StopIteration as e:  # would end a generator somewhere up the stack silently
            raise RuntimeError(f"action {instr.action} raised StopIteration") from e

    def _wait_task(self, w: Walker, P: int, instr: WaitTask) -> None:
        w.current = (str(instr), -1)
        start = time.perf_counter() if self._observer is not None else 0.0
        self.board.wait_latch((instr.task, P - instr.lag), f"action {instr.task}", self.timeout_s)
        if self._checker is not None:
            self._checker.cpu_acquire(("pp-latch", self._uid, instr.task, P - instr.lag))
        if self._observer is not None:
            self._observer.on_wait(instr.task, w.thread, P, start, time.perf_counter())

    def _signal(self, w: Walker, P: int, instr: Signal) -> None:
        if self._checker is not None:
            self._checker.cpu_release(("pp-latch", self._uid, instr.task, P))
        self.board.set_latch((instr.task, P))

    def _timed(self, kind: str, fn: ActionBinding) -> ActionBinding:
        def timed(stage: int, microbatch: int | None) -> Any:
            start = time.perf_counter()
            try:
                return fn(stage, microbatch)
            finally:
                observer = self._observer
                if observer is not None:
                    action = f"{stage}{kind}{'' if microbatch is None else microbatch}"
                    mb = -1 if microbatch is None else microbatch
                    observer.on_run(action, mb, self._thread_group(), self.steps - 1, start, time.perf_counter())

        return timed

    def _thread_group(self) -> str:
        name = threading.current_thread().name
        prefix = f"{self.name}-"
        workers = {w.thread for w in self._workers.values()}
        if threading.current_thread() in workers and name.startswith(prefix):
            return name[len(prefix) :]
        return MAIN_THREAD

    # ---------------------------------------------------------------- checks
    def _check(self, program: IterationProgram) -> None:
        """The checks of the module docstring (once per program object)."""
        cached = self._checked.get(id(program))
        if cached is not None and cached[0] is program:
            return
        if not isinstance(program, IterationProgram):
            raise TypeError(f"run_program takes an IterationProgram, got {type(program).__name__}")
        signals: dict[str, str] = {}
        waits: list[tuple[str, str]] = []
        actions: set[str] = set()
        tickets: dict[str, list[int]] = {}
        for thread, instrs in program.threads:
            for i in instrs:
                match i:
                    case RunAction(action=a, kind=kind, ticket=ticket, comm_group=group):
                        if kind not in self._actions:
                            raise EngineError(
                                f"no function bound to action kind {kind!r} (`{i}` on thread {thread!r}); "
                                f"bound: {', '.join(sorted(self._actions)) or 'none'}"
                            )
                        if a in actions:
                            raise EngineError(f"action {a} appears twice in the program (thread {thread!r})")
                        actions.add(a)
                        if ticket is not None:
                            tickets.setdefault(group or "", []).append(ticket)
                    case Signal(task=key):
                        if key in signals:
                            raise EngineError(f"{key} is signalled twice (threads {signals[key]!r} and {thread!r})")
                        signals[key] = thread
                    case WaitTask(task=key):
                        waits.append((thread, key))
                    case _:
                        raise EngineError(
                            f"{type(self).__name__} runs `run <action>`, `wait` and `signal` only; "
                            f"got `{i}` on thread {thread!r}"
                        )
        for thread, key in waits:
            if key not in signals:
                raise EngineError(
                    f"`wait {key}` on thread {thread!r} has no `signal {key}`: it would block until the timeout"
                )
            if signals[key] == thread:
                raise EngineError(f"`wait {key}` on thread {thread!r} waits for its own thread's signal")
        declared = dict(program.tickets)
        for group, numbers in tickets.items():
            if sorted(numbers) != list(range(declared.get(group, -1))):
                raise EngineError(
                    f"comm group {group!r}: tickets {sorted(numbers)} but the program declares "
                    f"{declared.get(group, 0)} (they must be numbered 0..n-1)"
                )
        self._checked[id(program)] = (program, {thread: self._ops(instrs) for thread, instrs in program.threads})

    # --------------------------------------------------------------- reports
    def _describe(self, f: Failure) -> str:
        mb = "" if f.batch < 0 else f", microbatch {f.batch}"
        return f"action {f.task}{mb} on thread {f.thread!r}, step {f.iteration} of {self.name}"

    def _timeout_report(self) -> str:
        program = self._program_now
        step = self.steps - 1
        lines = [f"step {step} of {self.name} did not finish: no thread made progress for {self.timeout_s:.1f}s"]
        walkers = {w.thread: w for w in self._walkers.values()}
        for thread, _ in program.threads if program is not None else ():
            w = walkers.get(thread)
            lines.append(f"  thread {thread!r}: {w.position() if w is not None else 'not started'}")
        for group, t in self._turnstiles.items():
            lines.append(f"  comm group {group!r}: next ticket {t.next_ticket}, waiting {t.waiting or 'none'}")
        if program is None:
            return "\n".join(lines)
        lines.append("the program, where each thread is (or failed) marked '>':")
        for thread, instrs in program.threads:
            w = walkers.get(thread)
            here = w.i if w is not None and w.state is not WalkState.FINISHED and w.at is not None else -1
            lines.append(f"thread {thread}:")
            lines.extend(f"{'> ' if k == here else '  '}{i}" for k, i in enumerate(instrs))
        return "\n".join(lines)
