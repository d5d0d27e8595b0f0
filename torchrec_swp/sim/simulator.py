"""Discrete-event replay of compiled programs, mirroring the engine's semantics.

Every CPU thread group is one lane that executes its instructions of each internal iteration
in order (the iterations of a run in increasing order):

* ``run T`` occupies the lane for T's CPU duration on batch ``P - stage`` (none when its
  ``when`` guard excludes that batch). Source and guarded runs always run: the simulated data
  holds exactly the batches the phases work on. (The
  engine learns the number of batches M only when the source fails at iteration M, so it runs
  the steady program there: one more source call and skipped stage-0 tasks, not simulated.)
* ``run T #k@g`` first waits until tickets ``0 .. k-1`` of comm group ``g`` in the same
  iteration were released (and every ticket of ``g`` in earlier iterations); it releases
  ticket ``k`` when it ends.
* ``wait T`` blocks until ``signal T`` of the same iteration executed (on any thread);
  ``wait T@P-k`` until ``signal T`` of iteration ``P - k`` executed, if that iteration's program
  signals T (an instance that never ran - its batch does not exist - does not hold anyone up).
* ``signal T``, ``record T`` and ``stream S <- T@k`` take no CPU time; the last two submit
  markers to the device model (see ``torchrec_swp.sim.device``).
* With ``iteration_barrier=True`` every thread finishes iteration ``P`` before any starts
  ``P + 1``: the engine's behaviour with ``lookahead`` 0 and one load, where ``step()`` for
  batch ``d`` returns once every thread finished iteration ``d + top`` and no thread starts a
  later one before the next call. Run-ahead (``lookahead`` > 0, parallel loads) is not
  modelled. Without the barrier, a thread goes on to its next iteration as soon as its own
  instructions are done - useful to see what the barrier is needed for.

The replay is a max-plus evaluation: an instruction executes as soon as what it waits for has
executed, at the latest of those times (``torchrec_swp.solve.replay.sweep``, as pp's simulator).
If nothing can execute while instructions remain, the run deadlocks and ``SimDeadlock`` names
every stuck thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from torchrec_swp.compile import CompiledPlan, Instr, IterationProgram, RecordEvent, Run, Signal, WaitStream, WaitTask
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan
from torchrec_swp.plan.table import format_schedule
from torchrec_swp.sim.device import Submission, replay_streams
from torchrec_swp.sim.durations import Durations, cpu_time, device_time
from torchrec_swp.sim.errors import Blocked, SimDeadlock, SimError
from torchrec_swp.sim.result import Interval, IterationSpan, SimResult, Step, cpu_lane
from torchrec_swp.solve.replay import sweep

Phases = Sequence[tuple[int, IterationProgram]]


def simulate(
    plan_or_compiled: PipelinePlan | CompiledPlan,
    durations: Durations,
    num_batches: int,
    *,
    device_durations: Durations | None = None,
    iteration_barrier: bool = True,
) -> SimResult:
    """Replay a whole run over ``num_batches`` batches (fill, steady state, drain).

    A PipelinePlan is compiled with device syncs iff ``device_durations`` is given; a
    CompiledPlan is replayed as it was compiled. ``durations`` gives every task's CPU time,
    ``device_durations`` the time a task occupies its stream (tasks it does not name submit no
    device work). Raises SimDeadlock if the programs deadlock, SimError for bad durations.
    """
    match plan_or_compiled:
        case CompiledPlan():
            compiled = plan_or_compiled
        case PipelinePlan():
            compiled = CompiledPlan(plan_or_compiled, device_streams=device_durations is not None)
        case _:
            raise TypeError(f"simulate needs a PipelinePlan or a CompiledPlan, got {type(plan_or_compiled).__name__}")
    check_num_batches(num_batches)
    return simulate_programs(
        compiled.plan,
        compiled.iterations(num_batches),
        durations,
        device_durations=device_durations,
        iteration_barrier=iteration_barrier,
    )


def simulate_programs(
    plan: PipelinePlan,
    phases: Phases,
    durations: Durations,
    *,
    device_durations: Durations | None = None,
    iteration_barrier: bool = True,
) -> SimResult:
    """Replay ``(iteration, program)`` pairs of ``plan`` (compiled or written by hand).

    The programs are validated first (SimError names the thread, iteration and instruction):
    iterations increase, every instruction names a task of the plan with its stage, a task runs
    at most once per iteration, every ``wait T`` has a ``signal T`` in its iteration, and tickets
    are distinct and within the counts the program declares.
    """
    phases = tuple(phases)
    validate_programs(plan, phases)
    replay = OneRank(plan, phases, durations, device_durations, ReplayLane)
    if iteration_barrier:
        for phase in phases:
            replay.run((phase,))
            replay.barrier()
    else:
        replay.run(phases)
    return replay.result(iteration_barrier)


def check_num_batches(num_batches: object) -> None:
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise SimError(f"num_batches must be an int >= 0, got {num_batches!r}")


# ------------------------------------------------------------------ validation
def validate_programs(plan: PipelinePlan, phases: Phases) -> None:
    """Raise SimError for the first malformed program (rules in ``simulate_programs``)."""
    previous: int | None = None
    for p, prog in phases:
        if previous is not None and p <= previous:
            raise SimError(f"internal iteration {p} follows iteration {previous}: iterations must increase")
        previous = p
        _validate_program(plan, p, prog)


def _validate_program(plan: PipelinePlan, p: int, prog: IterationProgram) -> None:
    threads = [t for t, _ in prog.threads]
    if len(set(threads)) != len(threads):
        raise SimError(f"internal iteration {p}: a thread appears twice in {threads}")
    stages = {t: s.stage for t, s in plan.schedule.items()}
    declared = dict(prog.tickets)
    signalled = {i.task for _, instrs in prog.threads for i in instrs if isinstance(i, Signal)}
    ran: set[str] = set()
    held: set[tuple[str, int]] = set()
    for thread, instrs in prog.threads:
        for index, instr in enumerate(instrs):
            where = f"thread {thread!r}, internal iteration {p}, instruction {index} `{instr}`"
            if not isinstance(instr, (Run, WaitTask, Signal, WaitStream, RecordEvent)):
                raise SimError(f"{where}: unknown instruction {instr!r}")
            if instr.task not in stages:
                raise SimError(f"{where}: {instr.task!r} is not a task of plan {plan.name}")
            match instr:
                case Run(task=task, stage=stage, ticket=ticket, comm_group=group):
                    if stage != stages[task]:
                        raise SimError(f"{where}: stage {stage}, but {task} is at stage {stages[task]}")
                    if task in ran:
                        raise SimError(f"{where}: {task} runs twice in one iteration")
                    ran.add(task)
                    if ticket is not None:
                        if group not in declared or not 0 <= ticket < declared[group]:
                            raise SimError(
                                f"{where}: ticket {ticket} of comm group {group!r} is not among the "
                                f"tickets the program declares {prog.tickets}"
                            )
                        if (group, ticket) in held:
                            raise SimError(f"{where}: ticket {ticket} of comm group {group!r} is held twice")
                        held.add((group, ticket))
                case WaitTask(task=task, lag=0) if task not in signalled:
                    raise SimError(f"{where}: no thread signals {task} in this iteration")


# ---------------------------------------------------------------------- replay
E = TypeVar("E")


@dataclass(slots=True)
class ReplayLane(Generic[E]):
    """A CPU thread: the time it is free, its vector clock, how many steps it executed, and
    the entries ``(iteration, index, what)`` of the segment being replayed: ``E`` is ``Instr``
    for one rank; the multi-rank replay's lanes hold more (its overheads, the engine's moves)."""

    index: int
    time: float
    clock: list[int]
    seq: int = 0
    todo: list[tuple[int, int, E]] = field(default_factory=list)
    at: int = 0


L = TypeVar("L", bound="ReplayLane[Any]")


def ticket_of(instr: object) -> tuple[str, int] | None:
    """``(comm group, ticket)`` held by a ticketed run (validated: the group is declared)."""
    if isinstance(instr, Run) and instr.ticket is not None and instr.comm_group is not None:
        return instr.comm_group, instr.ticket
    return None


class Replay(Generic[L]):
    """Mutable state of one replay over lanes of type ``L``: ``barrier`` joins the lanes;
    ``result`` is the SimResult of what was executed. ``OneRank`` executes one rank's segments;
    the multi-rank replay (``torchrec_swp.sim.multirank``) drives the same state with its own
    clock and lanes, through ``blocker``, ``admits``, ``ticket_sources``, ``execute_sync``,
    ``finish_run``, ``blocked`` and ``result``. ``new_lane(index, time, clock)`` makes a lane."""

    def __init__(
        self,
        plan: PipelinePlan,
        phases: tuple[tuple[int, IterationProgram], ...],
        durations: Durations,
        device_durations: Durations | None,
        new_lane: Callable[[int, float, list[int]], L],
    ) -> None:
        self.plan = plan
        self.max_stage = plan.max_stage  # read by ``admits`` at every run: the plan computes it
        self.num_batches = 1 + max((p - r.stage for p, prog in phases for r in prog.runs()), default=-1)
        self.stage = {t: s.stage for t, s in plan.schedule.items()}
        self.stream = {t: s.stream for t, s in plan.schedule.items()}
        self.phases = phases
        self.durations = durations
        self.device_durations = device_durations
        self.threads = tuple(dict.fromkeys([MAIN_THREAD, *(t for _, prog in phases for t, _ in prog.threads)]))
        self.lanes = {t: new_lane(k, 0.0, [0] * len(self.threads)) for k, t in enumerate(self.threads)}
        self.signals: dict[tuple[int, str], Step] = {}
        self.will_signal = {
            (p, i.task) for p, prog in phases for _, instrs in prog.threads for i in instrs if isinstance(i, Signal)
        }
        # tickets: runs holding one per (group, iteration); iterations of a group not fully
        # released yet, in order; released count per (group, iteration); last holder per group
        self.ticket_runs: dict[tuple[str, int], int] = {}
        for p, prog in phases:
            for run in prog.runs():
                if (held := ticket_of(run)) is not None:
                    self.ticket_runs[(held[0], p)] = self.ticket_runs.get((held[0], p), 0) + 1
        self.pending: dict[str, list[int]] = {}
        for group, p in self.ticket_runs:
            self.pending.setdefault(group, []).append(p)
        self.released: dict[tuple[str, int], int] = {}
        self.last_ticket: dict[str, Step] = {}
        self.steps: list[Step] = []
        self.cpu_intervals: list[Interval] = []
        self.submissions: list[Submission] = []

    def result(self, iteration_barrier: bool) -> SimResult:
        """What was replayed: the CPU intervals and the device replay of the submissions."""
        timeline = sorted(
            [*self.cpu_intervals, *replay_streams(self.submissions)], key=lambda i: (i.start, i.lane, i.end)
        )
        return SimResult(
            plan=self.plan,
            phases=self.phases,
            threads=self.threads,
            timeline=tuple(timeline),
            steps=tuple(self.steps),
            iterations=iteration_spans(self.phases, self.steps, timeline),
            iteration_barrier=iteration_barrier,
            device_modelled=self.device_durations is not None,
        )

    def barrier(self) -> None:
        time = max(lane.time for lane in self.lanes.values())
        clock = [max(c) for c in zip(*(lane.clock for lane in self.lanes.values()), strict=True)]
        for lane in self.lanes.values():
            lane.time, lane.clock = time, list(clock)

    # -------------------------------------------------------------- one step
    def blocker(self, p: int, instr: object) -> str | None:
        """Why ``instr`` of iteration ``p`` cannot execute now, or None if it can (only a wait and
        a ticketed run can wait)."""
        if isinstance(instr, WaitTask):
            key = (p - instr.lag, instr.task)
            if key not in self.signals and (instr.lag == 0 or key in self.will_signal):
                when = "in this iteration" if instr.lag == 0 else f"in internal iteration {key[0]}"
                return f"no thread has signalled {instr.task} (batch {key[0] - self.stage[instr.task]}) {when}"
        if (held := ticket_of(instr)) is not None:
            group, ticket = held
            earliest = self.pending[group][0]
            if earliest < p:
                return f"comm group {group!r} still has tickets of internal iteration {earliest} to release"
            released = self.released.get((group, p), 0)
            if released != ticket:
                return f"ticket {ticket} of comm group {group!r} is not next: {released} released so far"
        return None

    def admits(self, run: Run, p: int) -> bool:
        """Whether ``run`` of iteration ``p`` does its work (its ``when`` guard admits its batch)."""
        return run.when.admits(p - run.stage, self.num_batches, p, self.max_stage)

    def ticket_sources(self, run: Run) -> list[Step]:
        """The step ``run`` waits for through its ticket: the last release in its comm group."""
        held = ticket_of(run)
        return [self.last_ticket[held[0]]] if held is not None and held[0] in self.last_ticket else []

    def finish_run(
        self,
        thread: str,
        lane: ReplayLane[Any],
        p: int,
        index: int,
        run: Run,
        start: float,
        end: float,
        sources: list[Step],
        where: str,
    ) -> None:
        """``run`` of iteration ``p`` ran on ``thread`` from ``start`` to ``end``: record its step
        and CPU interval, release its ticket, submit its device work."""
        b = p - run.stage
        step = self._record(thread, lane, p, index, run, b, start, end, sources)
        self.cpu_intervals.append(Interval(cpu_lane(thread), run.task, b, p, start, end))
        if (held := ticket_of(run)) is not None:
            self._release(held[0], p, step)
        d = device_time(self.device_durations, run.task, b, where) if self.admits(run, p) else 0.0
        if d > 0:
            self._submit(step, "work", self.stream[run.task], run.task, b, d)

    def execute_sync(self, thread: str, lane: ReplayLane[Any], p: int, index: int, instr: Instr, where: str) -> None:
        """Execute an instruction that is not a run (it takes no CPU time) when the lane is at it."""
        match instr:
            case WaitTask(task=task, lag=lag):
                # an instance of an earlier iteration finished before this one began (the
                # replay keeps the iterations apart), or never ran: its batch did not exist
                signal = self.signals.get((p - lag, task))
                b = p - lag - self.stage[task]
                end = lane.time if signal is None else max(lane.time, signal.end)
                self._record(thread, lane, p, index, instr, b, lane.time, end, [] if signal is None else [signal])
            case Signal(task=task):
                b = p - self.stage[task]
                self.signals[(p, task)] = self._record(thread, lane, p, index, instr, b, lane.time, lane.time, [])
            case WaitStream(stream=stream, task=task, distance=k, consumer_stage=cs):
                step = self._record(thread, lane, p, index, instr, p - cs - k, lane.time, lane.time, [])
                self._submit(step, "wait", stream, task, step.batch)
            case RecordEvent(task=task, stream=stream, stage=stage):
                step = self._record(thread, lane, p, index, instr, p - stage, lane.time, lane.time, [])
                self._submit(step, "record", stream, task, step.batch)
            case _:
                raise SimError(f"{where}: unknown instruction {instr!r}")

    def _release(self, group: str, p: int, step: Step) -> None:
        released = self.released[(group, p)] = self.released.get((group, p), 0) + 1
        if released == self.ticket_runs[(group, p)]:
            self.pending[group].pop(0)
        self.last_ticket[group] = step

    def _record(
        self,
        thread: str,
        lane: ReplayLane[Any],
        p: int,
        index: int,
        instr: Instr,
        batch: int,
        start: float,
        end: float,
        sources: list[Step],
    ) -> Step:
        clock = list(lane.clock)
        for s in sources:
            clock = [max(a, b) for a, b in zip(clock, s.clock, strict=True)]
        lane.seq += 1
        clock[lane.index] = lane.seq
        step = Step(p, thread, index, instr, batch, start, end, lane.seq, tuple(clock))
        lane.time, lane.clock = end, clock
        self.steps.append(step)
        return step

    def _submit(
        self,
        step: Step,
        kind: Literal["work", "record", "wait"],
        stream: str,
        task: str,
        batch: int,
        duration: float = 0.0,
    ) -> None:
        self.submissions.append(
            Submission(step.end, len(self.steps), kind, stream, task, batch, step.iteration, duration)
        )

    # -------------------------------------------------------------- deadlock
    def blocked(self, thread: str, lane: ReplayLane[Any], rank: int | None = None) -> Blocked:
        """Why ``lane`` (of ``thread``, which has instructions left) is stuck at its next one."""
        p, index, instr = lane.todo[lane.at]
        return Blocked(thread, p, index, str(instr), self.blocker(p, instr) or "", rank)


class OneRank(Replay[ReplayLane[Instr]]):
    """One rank's replay (``simulate_programs``): ``run`` executes segments in max-plus order."""

    def run(self, segment: tuple[tuple[int, IterationProgram], ...]) -> None:
        """Execute every instruction of ``segment`` (one iteration, or all of them without the
        barrier); raise SimDeadlock when nothing can execute while some remain."""
        for lane in self.lanes.values():
            lane.todo, lane.at = [], 0
        for p, prog in segment:
            for thread, instrs in prog.threads:
                self.lanes[thread].todo.extend((p, index, instr) for index, instr in enumerate(instrs))
        sweep(tuple(self.lanes), self._advance)
        if any(lane.at < len(lane.todo) for lane in self.lanes.values()):
            raise self._deadlock()

    def _advance(self, thread: str) -> bool:
        """Execute the next instruction of ``thread`` if it has one that can execute now."""
        lane = self.lanes[thread]
        if lane.at >= len(lane.todo):
            return False
        p, index, instr = lane.todo[lane.at]
        if self.blocker(p, instr) is not None:
            return False
        self._execute(thread, lane, p, index, instr)
        lane.at += 1
        return True

    def _execute(self, thread: str, lane: ReplayLane[Instr], p: int, index: int, instr: Instr) -> None:
        where = f"thread {thread!r}, internal iteration {p}"
        match instr:
            case Run(task=task, stage=stage):
                sources = self.ticket_sources(instr)
                start = max([lane.time, *(s.end for s in sources)])
                cpu = cpu_time(self.durations, task, p - stage, where) if self.admits(instr, p) else 0.0
                self.finish_run(thread, lane, p, index, instr, start, start + cpu, sources, where)
            case _:
                self.execute_sync(thread, lane, p, index, instr, where)

    def _deadlock(self) -> SimDeadlock:
        blocked = []
        mark: tuple[str, int] | None = None
        for thread, lane in self.lanes.items():
            if lane.at >= len(lane.todo):
                continue
            blocked.append(self.blocked(thread, lane))
            if mark is None:
                mark = (_blocked_task(lane), lane.todo[lane.at][0])
        last = self.phases[-1][0] + 1
        num_batches = self.num_batches
        message = "\n".join(
            [
                f"deadlock in plan {self.plan.name}: no thread can make progress",
                *(f"  {b}" for b in blocked),
                format_schedule(self.plan, last, num_batches, mark=mark),
            ]
        )
        return SimDeadlock(message, tuple(blocked))


def _blocked_task(lane: ReplayLane[Instr]) -> str:
    """The task a blocked lane is trying to run: its next run in the blocked iteration, else
    the task the blocked instruction names."""
    p, _, head = lane.todo[lane.at]
    for q, _, instr in lane.todo[lane.at :]:
        if q != p:
            break
        if isinstance(instr, Run):
            return instr.task
    assert isinstance(head, (WaitTask, Signal, WaitStream, RecordEvent))  # not a run: what validate_programs admits
    return head.task


def iteration_spans(
    phases: tuple[tuple[int, IterationProgram], ...], steps: list[Step], timeline: list[Interval]
) -> tuple[IterationSpan, ...]:
    cpu: dict[int, tuple[float, float]] = {}
    for s in steps:
        lo, hi = cpu.get(s.iteration, (s.start, s.end))
        cpu[s.iteration] = (min(lo, s.start), max(hi, s.end))
    last: dict[int, float] = {}
    for i in timeline:
        last[i.iteration] = max(last.get(i.iteration, i.end), i.end)
    out = []
    previous = 0.0
    for p, prog in phases:
        start, cpu_end = cpu.get(p, (previous, previous))
        out.append(IterationSpan(p, prog.active_stages, start, cpu_end, max(cpu_end, last.get(p, cpu_end))))
        previous = cpu_end
    return tuple(out)
