"""Lowering: plan + active stages -> IterationProgram. Pure functions, one concern each.

Passes, in order (each guarantees what its docstring states):

1. ``select``: the active tasks in fire order, as ``Run`` instructions per thread.
2. ``place_cpu_waits``: a cross-thread ``wait``/``signal`` pair for every dependency whose
   producer runs on another thread (a source with several loads runs on threads of its own),
   in this iteration (``wait T``) or an earlier one (``wait T@P-k``): iterations are not
   separated by a barrier, each thread walks its program iteration after iteration. A thread
   waits for a given producer instance once per iteration; one on its own thread needs nothing
   (program order). Two more waits keep what single-thread order gives: with
   ``on_exhausted="stop"``, whatever fires after the source waits for it (a stop then cancels the
   same tasks on every thread layout), and a ``has_next``/``last`` task one stage above the source
   waits for the source's look for batch ``b + 1``.
3. ``place_stream_waits`` (only when the device has real streams): ``record`` after every
   producer whose consumer is on another stream, ``stream S <- T@k`` before the consumer.
4. ``place_tickets``: collective tickets, in fire order, for every comm group whose active
   tasks span more than one thread (one thread already issues them in fire order).
5. ``drop_noops`` (when a device type is given): a task declared ``noop_on`` that device
   becomes an ``alias`` of its inputs, in the same place, keeping every wait and signal
   (shortcut: no call, no device work; on the CPU, stream syncs are already absent).
"""

from __future__ import annotations

from collections.abc import Iterable

from torchrec_swp.compile.program import Alias, Instr, IterationProgram, RecordEvent, Run, Signal, WaitStream, WaitTask
from torchrec_swp.plan import MAIN_THREAD, Dep, PipelinePlan


def active_stages(plan: PipelinePlan, iteration: int, num_batches: int | None) -> tuple[int, ...]:
    """Stages ``s`` with ``0 <= iteration - s < num_batches`` (the stage mask)."""
    stages = sorted({s.stage for s in plan.schedule.values()})
    return tuple(
        s for s in stages if 0 <= iteration - s and (num_batches is None or iteration - s < num_batches)
    )


def compile_iteration(
    plan: PipelinePlan, stages: Iterable[int], *, device_streams: bool = False, device_type: str | None = None
) -> IterationProgram:
    """Lower one iteration of ``plan`` with ``stages`` active (for ``device_type`` if given)."""
    active = tuple(sorted(set(stages)))
    tasks = [t for t in plan.scheduled() if t.stage in active]
    per_thread = _select(plan, [t.name for t in tasks])
    per_thread = _place_cpu_waits(plan, per_thread)
    if device_streams:
        per_thread = _place_stream_waits(plan, per_thread)
    per_thread, tickets = _place_tickets(plan, per_thread)
    if device_type is not None:
        per_thread = _drop_noops(plan, per_thread, device_type)
    threads = tuple((g, tuple(instrs)) for g, instrs in per_thread.items())
    return IterationProgram(active, threads, tickets)


def _select(plan: PipelinePlan, active: list[str]) -> dict[str, list[Instr]]:
    out: dict[str, list[Instr]] = {MAIN_THREAD: []}
    for g in plan.thread_groups:
        out.setdefault(g, [])
    for name in active:
        t = plan.task(name)
        guarded = t.stage == 0 and plan.source is not None and name != plan.source
        source = name == plan.source
        lanes = plan.loads if source else 1
        out[t.thread_group].append(Run(name, t.stage, guarded=guarded, source=source, when=t.when, lanes=lanes))
    return out


def producers(plan: PipelinePlan, consumer: str) -> list[tuple[str, int]]:
    """``(producer, lag)`` for every task instance ``consumer`` must run after: its dependencies
    (``lag``: how many iterations before the consumer's the producer instance runs), plus the two
    waits on the source of the module docstring."""
    c = plan.task(consumer)
    found = []
    src = plan.source
    if src is not None and consumer != src:
        # first: under a stop the source's instance may never finish its iteration's others
        if plan.on_exhausted == "stop" and plan.fire_index(src) < plan.fire_index(consumer):
            found.append((src, 0))  # the source's instance of the same iteration
        if c.when.needs_next and plan.task(src).stage + 1 == c.stage:
            found.append((src, 0))  # its look for batch b + 1, in the same iteration
    found += [
        (d.producer, c.stage + d.distance - plan.task(d.producer).stage) for d in plan.deps if d.consumer == consumer
    ]
    return list(dict.fromkeys(found))


def _place_cpu_waits(plan: PipelinePlan, per_thread: dict[str, list[Instr]]) -> dict[str, list[Instr]]:
    thread_of = {i.task: g for g, instrs in per_thread.items() for i in instrs if isinstance(i, Run)}
    lanes = plan.source if plan.loads > 1 else None  # runs on threads of its own
    waits: dict[str, list[tuple[str, int]]] = {}
    signalled: set[str] = set()
    for consumer, group in thread_of.items():
        for producer, lag in producers(plan, consumer):
            if lag == 0 and producer not in thread_of:
                continue  # not active in this iteration
            if producer == lanes or plan.task(producer).thread_group != group:
                waits.setdefault(consumer, []).append((producer, lag))
                signalled.add(producer)
    # a producer waited on in another iteration signals in every program it runs in
    signalled |= {p for c in plan.fire_order for p, lag in producers(plan, c) if lag > 0 and (
        p == lanes or plan.task(p).thread_group != plan.task(c).thread_group)}
    out: dict[str, list[Instr]] = {}
    for group, instrs in per_thread.items():
        new: list[Instr] = []
        waited: set[tuple[str, int]] = set()  # a thread waits for a producer instance once per iteration
        for i in instrs:
            if isinstance(i, Run):
                for p, lag in waits.get(i.task, ()):
                    if (p, lag) not in waited:
                        waited.add((p, lag))
                        new.append(WaitTask(p, lag))
                new.append(i)
                if i.task in signalled:
                    new.append(Signal(i.task))
            else:
                new.append(i)
        out[group] = new
    return out


def _cross_stream_deps(plan: PipelinePlan, consumer: str) -> list[Dep]:
    c_stream = plan.task(consumer).stream
    return [d for d in plan.deps if d.consumer == consumer and plan.task(d.producer).stream != c_stream]


def _place_stream_waits(plan: PipelinePlan, per_thread: dict[str, list[Instr]]) -> dict[str, list[Instr]]:
    """Device syncs. A stream that already waited for a producer instance earlier on this thread
    is not made to wait again: its work is FIFO."""
    recorded = {d.producer for t in plan.fire_order for d in _cross_stream_deps(plan, t)}
    out: dict[str, list[Instr]] = {}
    for group, instrs in per_thread.items():
        new: list[Instr] = []
        done: set[tuple[str, str, int]] = set()  # (stream, producer, batch offset from P)
        for i in instrs:
            if isinstance(i, Run):
                c = plan.task(i.task)
                for d in _cross_stream_deps(plan, i.task):
                    key = (c.stream, d.producer, c.stage + d.distance)
                    if key not in done:
                        done.add(key)
                        new.append(WaitStream(c.stream, d.producer, d.distance, plan.task(d.producer).stage, c.stage))
                new.append(i)
                if i.task in recorded:
                    new.append(RecordEvent(i.task, c.stream, c.stage))
            else:
                new.append(i)
        out[group] = new
    return out


def _place_tickets(
    plan: PipelinePlan, per_thread: dict[str, list[Instr]]
) -> tuple[dict[str, list[Instr]], tuple[tuple[str, int], ...]]:
    runs = {i.task: (g, i) for g, instrs in per_thread.items() for i in instrs if isinstance(i, Run)}
    groups: dict[str, list[str]] = {}
    for name in plan.fire_order:
        if name in runs and plan.task(name).comm_group is not None:
            groups.setdefault(plan.task(name).comm_group or "", []).append(name)
    ticketed: dict[str, tuple[int, str]] = {}
    counts: list[tuple[str, int]] = []
    for group, members in groups.items():
        if len({runs[m][0] for m in members}) > 1 or any(runs[m][1].lanes > 1 for m in members):
            for k, m in enumerate(members):
                ticketed[m] = (k, group)
            counts.append((group, len(members)))
    if not ticketed:
        return per_thread, ()
    out: dict[str, list[Instr]] = {}
    for g, instrs in per_thread.items():
        out[g] = [
            Run(i.task, i.stage, ticketed[i.task][0], ticketed[i.task][1], i.guarded, i.source, i.when, i.lanes)
            if isinstance(i, Run) and i.task in ticketed
            else i
            for i in instrs
        ]
    return out, tuple(counts)


def _drop_noops(plan: PipelinePlan, per_thread: dict[str, list[Instr]], device_type: str) -> dict[str, list[Instr]]:
    out: dict[str, list[Instr]] = {}
    for group, instrs in per_thread.items():
        new: list[Instr] = []
        for i in instrs:
            io = plan.tasks[i.task] if isinstance(i, Run) else None
            if (
                isinstance(i, Run)
                and io is not None
                and device_type in io.noop_on
                and not i.source
                and i.ticket is None
            ):
                new.append(Alias(i.task, i.stage, tuple(zip(io.writes, io.reads))))
            else:
                new.append(i)
        out[group] = new
    return out


class CompiledPlan:
    """A plan with its iteration programs, compiled once per distinct set of active stages."""

    def __init__(self, plan: PipelinePlan, *, device_streams: bool = False, device_type: str | None = None) -> None:
        self.plan = plan
        self.device_streams = device_streams
        self.device_type = device_type
        self._cache: dict[tuple[int, ...], IterationProgram] = {}
        self._top = plan.max_stage
        self._steady: IterationProgram | None = None

    @property
    def steady(self) -> IterationProgram:
        """The program with every stage active: what the engine's threads walk, iteration after
        iteration (an instance whose batch does not exist is skipped at run time)."""
        if self._steady is None:
            self._steady = self._compiled(active_stages(self.plan, self._top, None))
        return self._steady

    def program(self, iteration: int, num_batches: int | None) -> IterationProgram:
        if num_batches is None and iteration >= self._top:
            return self.steady  # every stage active: the common case, looked up without work
        return self._compiled(active_stages(self.plan, iteration, num_batches))

    def _compiled(self, stages: tuple[int, ...]) -> IterationProgram:
        prog = self._cache.get(stages)
        if prog is None:
            prog = compile_iteration(
                self.plan, stages, device_streams=self.device_streams, device_type=self.device_type
            )
            self._cache[stages] = prog
        return prog

    def iterations(self, num_batches: int) -> list[tuple[int, IterationProgram]]:
        """Every iteration of a run over ``num_batches`` batches: fill, steady state, drain."""
        last = num_batches + self.plan.max_stage
        return [(p, self.program(p, num_batches)) for p in range(last)]
