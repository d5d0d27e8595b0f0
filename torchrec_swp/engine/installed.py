"""Plans installed on an engine: what the engine runs and the numbers it reads off the plans.

``InstalledPlans``: the engine's part that holds them (the phases, the plan running now, a
switch pending) and the walkers their programs need.
``PlanShape``: what every phase's plan together says (the highest stage ``top``, loads, lookahead,
each task's stage, the source, how far back slots and events are read). ``InstalledPlan``: one
plan compiled for the engine's streams, its tasks' calls (``bind``) and, per thread, each
instruction with its op (``make_walks``, with ``PlanOps``' ops). ``check_limits`` and ``check_switch`` are the
checks a plan passes before it is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torchrec_swp.compile import (
    Alias,
    CompiledPlan,
    Instr,
    IterationProgram,
    RecordEvent,
    Run,
    Signal,
    format_program,
    parse_program,
)
from torchrec_swp.engine.batches import Batches
from torchrec_swp.engine.errors import EngineError
from torchrec_swp.engine.streams import StreamPool
from torchrec_swp.engine.tasks import Binding, Invoker, Observer, task_context, task_timer
from torchrec_swp.engine.transaction import Transaction, decider
from torchrec_swp.engine.walkers import Op, Walk, Walker
from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.plan.calls import TaskCall, check_call
from torchrec_swp.plan.task import parse_read


@dataclass(frozen=True, eq=False)
class PlanShape:
    """The threads and stages of the plans running now (every phase's together): the one record
    of them, made by ``InstalledPlans`` whenever plans are installed (a switch makes a new one) and read
    through ``InstalledPlans.shape`` by every part that needs it, never copied.

    Stages: ``top`` (the highest), ``lanes`` (the source's loads), ``lookahead``, ``source``, each
    task's ``stage``; ``keep_slots`` / ``keep_events``: how many batches back values and events
    are read (kept that long; a switch keeps at least the running plan's), ``kept``: the values
    read back so (a batch that leaves keeps only those). Threads: ``walkers``,
    one per thread of any installed program, the calling thread's (``main``) first, one per lane
    for the source's thread; ``tasked``: those whose threads have tasks; ``threaded``: threads
    other than the caller's walk (the book is shared, waits take the board's lock)."""

    top: int
    lanes: int
    lookahead: int
    source: str | None
    stage: Mapping[str, int]
    keep_slots: int
    kept: frozenset[str]
    keep_events: int
    walkers: Mapping[str, Walker]
    main: Walker
    tasked: tuple[Walker, ...]
    threaded: bool

    @classmethod
    def of(
        cls,
        phased: PhasedPlan,
        installed: Mapping[int, InstalledPlan],
        current: PipelinePlan,
        after: PlanShape | None = None,
    ) -> PlanShape:
        """``phased``'s shape, with a walker per thread of its ``installed`` programs (the source's
        thread as ``current``, the phase running now, maps it)."""
        plans = phased.plans
        reads = [parse_read(r) for p in plans for io in p.tasks.values() for r in io.reads]
        distances = [d.distance for p in plans for d in p.deps]
        lanes, lookahead, source = max(p.loads for p in plans), max(p.lookahead for p in plans), plans[0].source
        source_thread = current.task(source).thread_group if source else None
        walkers = _walkers(installed.values(), lanes, lookahead, source_thread)
        return cls(
            top=phased.max_stage,
            lanes=lanes,
            lookahead=lookahead,
            source=source,
            stage={t: s.stage for p in plans for t, s in p.schedule.items()},
            keep_slots=max([*(k for _, k in reads), after.keep_slots if after else 0]),
            kept=frozenset({name for name, k in reads if k} | (after.kept if after else set())),
            keep_events=max([*distances, after.keep_events if after else 0]),
            walkers=walkers,
            main=walkers[MAIN_THREAD],
            tasked=tuple(w for w in walkers.values() if w.last_stage >= 0),
            threaded=len(walkers) > 1,
        )

    def hold_back(self) -> None:
        """No thread runs ahead of the calling thread any more (a switch of plans waits for it)."""
        for w in self.walkers.values():
            w.hold_back()


def _walkers(
    installed: Iterable[InstalledPlan], lanes: int, lookahead: int, source_thread: str | None
) -> dict[str, Walker]:
    """A walker for every thread of the ``installed`` plans' programs, the calling thread's first;
    the source's thread has one per lane (``load``, ``load.1``...)."""
    threads: dict[str, int] = {MAIN_THREAD: -1}  # thread -> highest stage of its tasks
    collective: set[str] = set()  # threads that issue collectives (a task in a comm group)
    for inst in installed:
        for thread, instrs in inst.programs.items():
            stages = [i.stage for i in instrs if isinstance(i, (Run, Alias))]
            threads[thread] = max(threads.get(thread, -1), *stages)
            if any(getattr(i, "comm_group", None) is not None for i in instrs):
                collective.add(thread)
    walkers = {MAIN_THREAD: Walker(MAIN_THREAD, MAIN_THREAD, last_stage=threads[MAIN_THREAD])}
    for thread, top in threads.items():
        if thread == MAIN_THREAD:
            continue
        for lane in range(lanes if thread == source_thread else 1):
            name = thread if lane == 0 else f"{thread}.{lane}"
            ahead = 0 if thread in collective else lookahead
            walkers[name] = Walker(thread, name, lane=lane, last_stage=top, ahead=ahead)
    return walkers


@dataclass
class InstalledPlan:
    """One plan, ready to run: its compiled steady-state program per thread, tickets per
    iteration, its tasks' calls, and per thread the program with each instruction's op (made
    again whenever the programs or the calls change)."""

    plan: PipelinePlan
    compiled: CompiledPlan
    programs: dict[str, tuple[Instr, ...]]
    tickets: tuple[tuple[str, int], ...]
    invokers: dict[str, Invoker] = field(default_factory=dict)
    aliases: dict[str, Invoker] = field(default_factory=dict)
    walks: dict[str, Walk] = field(default_factory=dict)

    @classmethod
    def compile(cls, plan: PipelinePlan, streams: StreamPool, device_type: str | None) -> InstalledPlan:
        compiled = CompiledPlan(plan, device_streams=streams.has_streams, device_type=device_type)
        steady = compiled.steady
        return cls(plan, compiled, {t: i for t, i in steady.threads if i}, steady.tickets)

    def bind(
        self,
        bindings: Mapping[str, Binding],
        batches: Batches,
        data_argument: Callable[..., dict[str, Any]],
        iteration: Callable[[int, int], int],
        *,
        streams: StreamPool,
        device_type: str | None,
        observer: Observer | None,
        labels: bool,
        transaction: Transaction | None = None,
    ) -> None:
        """Its (instrumented) task calls (made by ``batches``, which owns the slots they read
        and write), entering each task's stream where the device has streams: the source's gets
        ``data_argument(b)``; ``iteration(b, stage)`` numbers an instance for the observer. With a
        ``transaction``, a task with effects captures them first, and the deciding task
        (``transaction.decider``) decides its batch's step after it."""
        plan = self.plan
        deciding = decider(plan, transaction.empty) if transaction is not None else None
        for task in plan.fire_order:
            t = plan.task(task)
            extra = data_argument if task == plan.source else None
            stream = partial(streams.context, t.stream) if streams.has_streams and t.stream != DEFAULT_STREAM else None
            timed = task_timer(task, t.thread_group, partial(_iteration_of_stage, iteration, t.stage), observer)
            around = task_context(task, labels, stream)
            fn = bindings[task]
            # under a transaction every task: its hooks tell which batch runs (running_batch), inside
            # its stream, so that what captures and restores is ordered with the task
            if transaction is not None:
                serial = lambda b: batches.book.serial(b)  # noqa: E731 - (the book is replaced on reset)
                fn = transaction.wrap(t.io.effects, task == deciding, fn, batches.slot, serial)
            self.invokers[task] = batches.invoker(t.io, fn, extra, around, timed)
            if device_type in t.io.noop_on:  # no call, no stream: labelled and timed all the same
                pairs = tuple(zip(t.io.writes, t.io.reads))
                self.aliases[task] = batches.alias(pairs, task_context(task, labels, None), timed)

    def make_walks(self, ops: Callable[[str, tuple[Instr, ...]], tuple[Op, ...]]) -> None:
        """Every thread's program with its ops (``ops(thread, instructions)``, one per position);
        made again whenever the programs or the task calls change."""
        self.walks = {t: (instrs, ops(t, instrs)) for t, instrs in self.programs.items()}

    def text(self) -> str:
        """Its programs as text (``compile.format_program``: the steady iteration's, one block per
        thread): what ``edit`` takes back."""
        return format_program(self._program())

    def edit(self, text: str) -> None:
        """Run the programs of ``text`` instead (mutation testing: the text of ``text()`` with a
        line removed or changed); a PlanError naming the line when it does not parse against this
        plan. Its ops are to be made again (``make_walks``)."""
        program = parse_program(text, self.plan)
        if program.active_stages != self._program().active_stages:
            raise PlanError(f"program text: its stages {program.active_stages} are not the plan's steady ones")
        self.programs = {t: i for t, i in program.threads if i}
        self.tickets = program.tickets

    def _program(self) -> IterationProgram:
        return IterationProgram(self.compiled.steady.active_stages, tuple(self.programs.items()), self.tickets)

    def instructions(self) -> list[Instr]:
        return [i for instrs in self.programs.values() for i in instrs]


def _iteration_of_stage(iteration: Callable[[int, int], int], stage: int, b: int) -> int:
    """The iteration observers see for batch ``b``'s task of ``stage`` (``Batches.observed_iteration``)."""
    return iteration(b, stage)


def check_bindings(phased: PhasedPlan, bindings: Mapping[str, Binding]) -> None:
    """A callable bound to every task of every phase's plan, and to nothing else, that takes each
    plan's row of its task as ``fn(b, **reads)`` (``plan.calls.check_call``: its reads name its
    parameters, its parameters without a default are read, its writes fit its declared result)."""
    tasks = list(dict.fromkeys(t for p in phased.plans for t in p.fire_order))
    missing = [t for t in tasks if t not in bindings]
    if missing:
        raise PlanError(f"no function bound to task {missing[0]} of plan {phased.name}", culprit=missing[0])
    extra = [t for t in bindings if t not in tasks]
    if extra:
        raise PlanError(
            f"a function is bound to {extra[0]!r}, which is not a task of plan {phased.name}", culprit=extra[0]
        )
    for task, fn in bindings.items():
        if not callable(fn):
            raise TypeError(f"the function bound to task {task} is not callable: {fn!r}")
    calls = {task: TaskCall.of(task, fn) for task, fn in bindings.items()}
    for plan in phased.plans:
        for task in plan.fire_order:
            try:
                check_call(plan.task(task).io, calls[task], source=task == plan.source)
            except PlanError as e:
                raise PlanError(f"plan {plan.name}: {e}", culprit=e.culprit, token=e.token) from None


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


def check_switch(old: PhasedPlan, new: PhasedPlan, max_threads: int, max_in_flight: int) -> None:
    """What ``Engine.switch_plan`` requires of ``new`` (EngineError naming what does not hold)."""
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
        check_limits(after, max_threads, max_in_flight)
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


def check_rollback_clock(installed: InstalledPlans, transaction: Transaction) -> None:
    """PlanError where phases on the clock ``"trained"`` cannot follow a rolled-back step: the
    thread that decides each step (``decider``) walks its next iteration after the verdict, so the
    phase it picks counts the rollback; a thread that may run ahead picks its phase earlier, so
    every phase must give it the same program, and every phase the same comm-group tickets."""
    insts = list(installed.by_id.values())
    deciding = {
        inst.plan.task(name).thread_group
        for inst in insts
        if (name := decider(inst.plan, transaction.empty)) is not None
    }
    if len(deciding) > 1:
        raise PlanError(
            f"plan {installed.phased.name}: its phases decide a step on different threads "
            f"({', '.join(sorted(deciding))}): a rolled-back step could not move the clock 'trained' before the "
            "next batch's phase is picked"
        )
    first = insts[0]
    for inst in insts[1:]:
        threads = set(first.programs) | set(inst.programs)
        differ = sorted(t for t in threads - deciding if first.programs.get(t, ()) != inst.programs.get(t, ()))
        if differ or inst.tickets != first.tickets:
            where = f"thread {differ[0]}" if differ else "its comm-group tickets"
            raise PlanError(
                f"plan {installed.phased.name}: phases {first.plan.name} and {inst.plan.name} differ in {where}, "
                "which may pick its phase before the step before it is decided: a rolled-back step could not move "
                "the clock 'trained' there"
            )


def check_adoptable(plan: PipelinePlan, top: int, slots: list[dict[str, Any]]) -> None:
    """``Engine.adopt``'s check: ``slots[j]`` holds every value batch ``j``'s remaining tasks read
    (batch ``j`` placed at stage ``top - j``)."""
    for j, values in enumerate(slots):
        at = max(top - j, 0)
        needed = {
            name
            for t in plan.scheduled()
            if t.stage >= at
            for name, k in map(parse_read, t.io.reads)
            if k == 0 and (w := plan.writer_of(name)) is not None and plan.task(w).stage < at
        }
        lacking = sorted(needed - set(values))
        if lacking:
            raise EngineError(
                f"cannot adopt batch {j} at stage {at} of plan {plan.name}: its remaining tasks read "
                f"{', '.join(lacking)}, which the slot given for it lacks"
            )


def phased(plan: PipelinePlan | PhasedPlan) -> PhasedPlan:
    """``plan`` as a PhasedPlan (a PipelinePlan is one phase from batch 0)."""
    if isinstance(plan, PipelinePlan):
        return PhasedPlan([(0, plan)])
    if isinstance(plan, PhasedPlan):
        return plan
    raise TypeError(f"plan must be a PipelinePlan or a PhasedPlan, got {type(plan).__name__}")


class InstalledPlans:
    """The plans an engine runs: every phase's (``phased``), the one the calling thread's
    iteration runs (``current``), what they say together (``shape``), each installed (``by_id``:
    by ``id()`` of its plan), the tasks
    whose latches (``latched``) and events (``recorded``) batches leave behind, and a switch that
    waits for threads that ran ahead (``pending``)."""

    def __init__(
        self,
        plan: PipelinePlan | PhasedPlan,
        *,
        streams: StreamPool,
        device_type: str | None,
        max_threads: int,
        max_in_flight: int,
    ) -> None:
        self.phased = phased(plan)
        for p in self.phased.plans:
            check_limits(p, max_threads, max_in_flight)
        self._streams, self._device_type = streams, device_type
        self._limits = (max_threads, max_in_flight)
        self.current: PipelinePlan = self.phased.plans[0]
        self.pending: PhasedPlan | None = None
        self.latched: tuple[str, ...] = ()
        self.recorded: tuple[str, ...] = ()
        self.by_id: dict[int, InstalledPlan] = {}
        self._install()

    def _install(self, after: PlanShape | None = None) -> None:
        """Compile every phase's plan; their shape, with a walker for each of their threads."""
        self.by_id = {id(p): InstalledPlan.compile(p, self._streams, self._device_type) for p in self.phased.plans}
        self.shape = PlanShape.of(self.phased, self.by_id, self.current, after)
        instructions = [i for inst in self.by_id.values() for i in inst.instructions()]
        # those of the plans installed before too: batches of theirs may still leave
        self.latched = tuple(dict.fromkeys([*self.latched, *(i.task for i in instructions if isinstance(i, Signal))]))
        self.recorded = tuple(
            dict.fromkeys([*self.recorded, *(i.task for i in instructions if isinstance(i, RecordEvent))])
        )

    @property
    def compiled(self) -> CompiledPlan:
        return self.by_id[id(self.current)].compiled

    def make_current(self, plan: PipelinePlan) -> None:
        """``plan`` (a phase's) is the current plan: the one the calling thread's iteration runs."""
        self.current = plan

    def checked(self, plan: PipelinePlan | PhasedPlan) -> PhasedPlan:
        """``plan`` as a PhasedPlan the running one may be switched to (``check_switch``)."""
        new = phased(plan)
        check_switch(self.phased, new, *self._limits)
        return new

    def request(self, new: PhasedPlan) -> None:
        """Switch to ``new`` once every thread stands at the calling thread's boundary (``switch``)."""
        self.pending = new

    def switch(self) -> None:
        """The pending plan replaces the running one, phase for phase."""
        new = self.pending
        assert new is not None
        index = self.phased.plans.index(self.current)
        self.pending = None
        self.phased, self.current = new, new.plans[index]
        self._install(after=self.shape)

    def program_text(self, plan_index: int) -> str:
        """The programs of the ``plan_index``-th installed plan (one per phase), as text."""
        return self._nth(plan_index).text()

    def edit_program(self, plan_index: int, text: str) -> InstalledPlan:
        """Run ``text``'s programs for the ``plan_index``-th installed plan (mutation testing):
        the plan, whose ops are to be made again."""
        inst = self._nth(plan_index)
        inst.edit(text)
        return inst

    def _nth(self, plan_index: int) -> InstalledPlan:
        plans = list(self.by_id.values())
        if not 0 <= plan_index < len(plans):
            raise IndexError(f"plan index {plan_index}: {len(plans)} plans are installed")
        return plans[plan_index]
