"""TaskProfiler: an engine observer that measures every task of a real run.

Attach it to any engine (a bare ``Engine`` or a pipeline's ``pipeline.engine``)::

    profiler = TaskProfiler(warmup=2)
    pipeline.engine.instrument(profiler)     # or profiler.attach(pipeline.engine)
    for _ in range(50):
        pipeline.progress(it)
    profile = profiler.profile(pipeline.plan)
    profile.print_table(); profile.save("run.profile.json")

Recording costs one tuple append per task run and per cross-thread wait (safe from any thread:
``list.append`` is atomic); everything else happens in ``profile()``. Detached (``engine.instrument()``),
the engine runs its bare calls and the profiler costs nothing.

Measured iterations are the *complete* ones - every task that runs in the steady state ran
exactly once (neither fill nor drain) - after the first ``warmup`` of them, which are skipped
(first calls, caches, thread start-up). Tasks guarded to run once per epoch (``when`` first,
fill or last) are timed over every run recorded (count 0 and 0 s if none ran).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Protocol

from torchrec_swp.plan import MAIN_THREAD, PipelinePlan
from torchrec_swp.profiler.events import IterationRecord, RunEvent, WaitEvent
from torchrec_swp.profiler.exposure import exposed_times
from torchrec_swp.profiler.profile import Profile, ProfileError, StepStats, TaskStats

RawRun = tuple[str, int, str, int, float, float, float | None]  # task, batch, thread, iteration, start, end, cpu
RawWait = tuple[str, str, int, float, float]  # producer, thread, iteration, start, end


class Instrumentable(Protocol):
    """What ``attach`` needs from an engine: its plan and ``instrument``."""

    plan: PipelinePlan

    def instrument(self, observer: Any = None, *, labels: bool = False) -> None: ...


class TaskProfiler:
    """Engine observer (``on_run``, ``on_wait``, ``on_iteration``) building a Profile."""

    def __init__(self, *, warmup: int = 2) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self._engine: Instrumentable | None = None
        self._runs: list[RawRun] = []
        self._waits: list[RawWait] = []
        self._iterations: list[tuple[int, float, float]] = []
        self._steps: list[tuple[float, float, float, float]] = []

    # -------------------------------------------------------------- attaching
    def attach(self, engine: Instrumentable) -> TaskProfiler:
        """``engine.instrument(self)``; ``profile()`` then defaults to the engine's plan."""
        engine.instrument(self)
        self._engine = engine
        return self

    def detach(self) -> None:
        """Detach from the engine given to ``attach`` (records are kept)."""
        if self._engine is not None:
            self._engine.instrument()
            self._engine = None

    def clear(self) -> None:
        """Forget everything recorded so far."""
        self._runs, self._waits, self._iterations, self._steps = [], [], [], []

    # --------------------------------------------------------------- observer
    #: the engine passes each run's thread CPU time (``cpu=``): what a task computed, apart from
    #: what it waited (a loader sleeping on storage, a collective waiting for its peers)
    wants_cpu = True

    def on_run(
        self, task: str, batch: int, thread: str, iteration: int, start: float, end: float, cpu: float | None = None
    ) -> None:
        self._runs.append((task, batch, thread, iteration, start, end, cpu))

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        self._waits.append((producer, thread, iteration, start, end))

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        # Events are turned into records only when asked for, to keep the calls cheap.
        self._iterations.append((iteration, start, end))

    def on_step(self, start: float, end: float, cpu_start: float, cpu_end: float) -> None:
        """One ``progress()`` call: its wall clock (``perf_counter``) and the calling thread's CPU
        clock (``thread_time``) at its start and end."""
        self._steps.append((start, end, cpu_start, cpu_end))

    # ---------------------------------------------------------------- results
    @property
    def records(self) -> tuple[IterationRecord, ...]:
        """Every iteration the calling thread finished so far, complete or not, with the runs and
        waits of every thread in it (iteration numbers count on over epochs: the engine's
        ``on_iteration`` numbering). Threads walk iterations without a barrier: a worker's runs
        of an iteration may come before or after the calling thread's."""
        runs: dict[int, list[RawRun]] = {}
        waits: dict[int, list[RawWait]] = {}
        for r in self._runs:
            runs.setdefault(r[3], []).append(r)
        for w in self._waits:
            waits.setdefault(w[2], []).append(w)
        return tuple(_record(p, start, end, runs.get(p, []), waits.get(p, [])) for p, start, end in self._iterations)

    def complete(self, plan: PipelinePlan) -> list[IterationRecord]:
        """The recorded iterations in which every task of ``plan`` that runs in the steady state
        ran exactly once (and no other task ran)."""
        tasks = frozenset(t for t in plan.fire_order if plan.task(t).when.in_steady_state)
        return [r for r in self.records if r.ran() == tasks and len(r.runs) == len(tasks)]

    def measured(self, plan: PipelinePlan) -> list[IterationRecord]:
        """The complete iterations of ``plan`` after the warm-up."""
        return self.complete(plan)[self.warmup :]

    def profile(self, plan: PipelinePlan | None = None) -> Profile:
        """Statistics of the measured iterations of ``plan`` (default: the attached engine's).

        Raises ProfileError when no iteration qualifies (too few steps for the warm-up).
        """
        if plan is None:
            if self._engine is None:
                raise ProfileError("profile() needs the plan that ran: pass it, or attach() the profiler to the engine")
            plan = self._engine.plan
        measured = self.measured(plan)
        if not measured:
            raise ProfileError(
                f"no iteration of plan {plan.name} to profile: {len(self._iterations)} recorded, "
                f"{len(self.complete(plan))} complete, the first {self.warmup} of which are warm-up; run more steps"
            )
        comm = {t: plan.task(t).comm_group for t in plan.fire_order}
        durations: dict[str, list[float]] = {t: [] for t in plan.fire_order}
        exposed: dict[str, float] = dict.fromkeys(plan.fire_order, 0.0)
        unattributed = 0.0
        for record in measured:
            for r in record.runs:
                durations[r.task].append(r.duration)
            shares, rest = exposed_times(record, comm)
            for task, share in shares.items():
                exposed[task] += share
            unattributed += rest
        for record in self.records:  # tasks that run once per epoch: every run recorded
            for r in record.runs:
                if not plan.task(r.task).when.in_steady_state:
                    durations[r.task].append(r.duration)
        n = len(measured)
        stats = tuple(
            TaskStats(
                task=t,
                thread=plan.task(t).thread_group,
                stream=plan.task(t).stream,
                stage=plan.task(t).stage,
                count=len(durations[t]),
                median_s=statistics.median(durations[t]) if durations[t] else 0.0,
                mean_s=statistics.fmean(durations[t]) if durations[t] else 0.0,
                max_s=max(durations[t], default=0.0),
                exposed_s=exposed[t] / n,
            )
            for t in plan.fire_order
        )
        times = [r.duration for r in measured]
        cpu = {
            t: [r.cpu for rec in measured for r in rec.runs if r.task == t and r.cpu is not None]
            for t in plan.fire_order
        }
        stats = tuple(replace(s, cpu_mean_s=statistics.fmean(cpu[s.task]) if cpu[s.task] else None) for s in stats)
        return Profile(
            plan=plan,
            tasks=stats,
            iterations=n,
            warmup=self.warmup,
            iteration_s=statistics.median(times),
            iteration_mean_s=statistics.fmean(times),
            unattributed_s=unattributed / n,
            steps=self._step_stats(plan, measured),
            records=tuple(measured),
        )

    def _step_stats(self, plan: PipelinePlan, measured: list[IterationRecord]) -> StepStats | None:
        """The ``progress()`` calls after the first ``warmup`` (and their gaps), and the calling
        thread's CPU outside its tasks per step: (call + gap CPU) - its tasks' CPU per iteration."""
        steps = self._steps[self.warmup :]
        if len(steps) < 2:
            return None
        gaps = [(b[0] - a[1], b[2] - a[3]) for a, b in zip(steps, steps[1:])]
        call_cpu = statistics.fmean(e - s for _, _, s, e in steps)
        gap_cpu = statistics.fmean(c for _, c in gaps)
        main = {t for t in plan.fire_order if plan.task(t).thread_group == MAIN_THREAD}
        tasks_cpu = [sum(r.cpu for r in rec.runs if r.task in main and r.cpu is not None) for rec in measured]
        return StepStats(
            calls=len(steps),
            call_mean_s=statistics.fmean(e - s for s, e, _, _ in steps),
            call_cpu_mean_s=call_cpu,
            gap_mean_s=statistics.fmean(g for g, _ in gaps),
            gap_cpu_mean_s=gap_cpu,
            overhead_s=max(0.0, call_cpu + gap_cpu - statistics.fmean(tasks_cpu)),
        )


def _record(
    iteration: int,
    start: float,
    end: float,
    runs: list[RawRun],
    waits: list[RawWait],
) -> IterationRecord:
    """An IterationRecord from raw events. A task that failed and ran again when the engine
    resumed appears twice: its last run counts."""
    last = {r[0]: r for r in sorted(runs, key=lambda r: r[4])}
    return IterationRecord(
        iteration,
        start,
        end,
        tuple(RunEvent(t, b, th, s, e, c) for t, b, th, p, s, e, c in sorted(last.values(), key=lambda r: r[4])),
        tuple(WaitEvent(t, th, s, e) for t, th, p, s, e in waits),
    )
