"""Lowering: plan + active stages -> IterationProgram. Pure functions, one concern each.

Passes, in order (each guarantees what its docstring states):

1. ``select``: the active tasks in fire order, as ``Run`` instructions per thread.
2. ``place_cpu_waits``: a cross-thread ``wait``/``signal`` pair for every dependency whose
   producer instance runs in the same iteration on another thread (a thread waits for a given
   producer once per iteration). Producer instances of
   earlier iterations need nothing: iterations are separated by a barrier.
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
        out[t.thread_group].append(Run(name, t.stage, guarded=guarded, source=name == plan.source, when=t.when))
    return out


def _same_iteration_producers(plan: PipelinePlan, consumer: str, active: set[str]) -> list[str]:
    """Producers of ``consumer`` whose instance runs in the same iteration."""
    s_c = plan.task(consumer).stage
    found = [
        d.producer
        for d in plan.deps
        if d.consumer == consumer and d.producer in active and plan.task(d.producer).stage - d.distance == s_c
    ]
    src = plan.source
    if plan.on_exhausted == "stop" and src in active and consumer != src and plan.fire_index(src) < plan.fire_index(consumer):
        # With on_exhausted="stop", whatever fires after the source must not start before the
        # source has found a batch: a stop then cancels the same tasks on every thread layout.
        found.append(src)
    if plan.task(consumer).when.needs_next and src in active and plan.task(src).stage + 1 == s_c:
        # whether batch b+1 exists is known once the source, this iteration, has looked for it
        found.append(src)
    return list(dict.fromkeys(found))


def _place_cpu_waits(plan: PipelinePlan, per_thread: dict[str, list[Instr]]) -> dict[str, list[Instr]]:
    thread_of = {i.task: g for g, instrs in per_thread.items() for i in instrs if isinstance(i, Run)}
    active = set(thread_of)
    waits: dict[str, list[str]] = {}
    signalled: set[str] = set()
    for consumer, group in thread_of.items():
        for producer in _same_iteration_producers(plan, consumer, active):
            if thread_of[producer] != group:
                waits.setdefault(consumer, []).append(producer)
                signalled.add(producer)
    out: dict[str, list[Instr]] = {}
    for group, instrs in per_thread.items():
        new: list[Instr] = []
        waited: set[str] = set()  # a thread waits for a producer once per iteration
        for i in instrs:
            if isinstance(i, Run):
                for p in waits.get(i.task, ()):
                    if p not in waited:
                        waited.add(p)
                        new.append(WaitTask(p))
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
        if len({runs[m][0] for m in members}) > 1:
            for k, m in enumerate(members):
                ticketed[m] = (k, group)
            counts.append((group, len(members)))
    if not ticketed:
        return per_thread, ()
    out: dict[str, list[Instr]] = {}
    for g, instrs in per_thread.items():
        out[g] = [
            Run(i.task, i.stage, ticketed[i.task][0], ticketed[i.task][1], i.guarded, i.source, i.when)
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
            if isinstance(i, Run) and io is not None and device_type in io.noop_on and not i.source and i.ticket is None:
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

    def program(self, iteration: int, num_batches: int | None) -> IterationProgram:
        if num_batches is None and iteration >= self._top:
            # steady state: every stage active (the common case, looked up without work)
            if self._steady is None:
                self._steady = self._compiled(active_stages(self.plan, iteration, None))
            return self._steady
        return self._compiled(active_stages(self.plan, iteration, num_batches))

    def _compiled(self, stages: tuple[int, ...]) -> IterationProgram:
        prog = self._cache.get(stages)
        if prog is None:
            prog = compile_iteration(self.plan, stages, device_streams=self.device_streams, device_type=self.device_type)
            self._cache[stages] = prog
        return prog

    def phases(self, num_batches: int) -> list[tuple[int, IterationProgram]]:
        """Every iteration of a run over ``num_batches`` batches: fill, steady state, drain."""
        last = num_batches + self.plan.max_stage
        return [(p, self.program(p, num_batches)) for p in range(last)]
