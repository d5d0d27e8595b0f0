"""The profiler's cost, measured on a bare Engine with trivial tasks (imports the engine).

Three timings per task call, each the best of ``repeats`` runs: a plain Python loop calling the
same functions (``plain_us``), the engine with no observer (``off_us``: what every run pays),
and the engine with a TaskProfiler attached (``on_us``). ``threaded_*`` repeat the last two for a
plan spread over two threads (the calling thread waits for a worker in every iteration).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.profiler.task_profiler import TaskProfiler


@dataclass(frozen=True, slots=True)
class Overhead:
    """Microseconds per task call (see the module docstring)."""

    tasks: int
    iterations: int
    plain_us: float
    off_us: float
    on_us: float
    threaded_off_us: float
    threaded_on_us: float

    @property
    def profiler_us(self) -> float:
        """What attaching the profiler adds per task call (single thread)."""
        return self.on_us - self.off_us

    def format(self) -> str:
        return (
            f"per task call ({self.tasks} trivial tasks x {self.iterations} iterations): "
            f"plain loop {self.plain_us:.2f} us, engine {self.off_us:.2f} us, engine + profiler {self.on_us:.2f} us "
            f"(+{self.profiler_us:.2f} us); two threads: {self.threaded_off_us:.2f} us off, "
            f"{self.threaded_on_us:.2f} us on (+{self.threaded_on_us - self.threaded_off_us:.2f} us)"
        )


def chain_plan(tasks: int, *, threads: int = 1) -> PipelinePlan:
    """``tasks`` trivial tasks in a data chain, T0 the source, one stage; with ``threads=2`` the
    second half runs on a worker (``w1``), which waits for the first half in every iteration."""
    names = [f"T{k}" for k in range(tasks)]
    schedule = {
        n: TaskSchedule(0, thread_group="w1" if threads == 2 and 2 * k >= tasks else "default")
        for k, n in enumerate(names)
    }
    io = [PipelineTask(names[0], writes=("d0",))]
    io += [PipelineTask(n, reads=(f"d{k - 1}",), writes=(f"d{k}",)) for k, n in enumerate(names) if k]
    return PipelinePlan(schedule=schedule, tasks=io, source=names[0], output=f"d{tasks - 1}", name="overhead")


def _bindings(plan: PipelinePlan, num_batches: int) -> dict[str, Callable[..., Any]]:
    def source(b: int) -> int:
        if b >= num_batches:
            raise StopIteration
        return b

    def step(b: int, **reads: Any) -> int:
        return b

    return {t: source if t == plan.source else step for t in plan.fire_order}


def _engine_seconds(plan: PipelinePlan, iterations: int, profiled: bool) -> float:
    engine = Engine(plan, _bindings(plan, iterations), name="swp-overhead")
    if profiled:
        TaskProfiler().attach(engine)
    try:
        start = time.perf_counter()
        while True:
            try:
                engine.step()
            except StopIteration:
                break
        return time.perf_counter() - start
    finally:
        engine.close()


def _plain_seconds(plan: PipelinePlan, iterations: int) -> float:
    fns = _bindings(plan, iterations)
    calls = [fns[t] for t in plan.fire_order]
    head, rest = calls[0], calls[1:]
    start = time.perf_counter()
    for b in range(iterations):
        x = head(b)
        for fn in rest:
            x = fn(b, x=x)
    return time.perf_counter() - start


def measure_overhead(tasks: int = 8, iterations: int = 2000, repeats: int = 5) -> Overhead:
    """Time the three variants (and the two-thread pair) and return microseconds per task call."""
    flat, threaded = chain_plan(tasks), chain_plan(tasks, threads=2)
    calls = tasks * iterations

    def best(run: Callable[[], float]) -> float:
        return min(run() for _ in range(repeats)) / calls * 1e6

    return Overhead(
        tasks=tasks,
        iterations=iterations,
        plain_us=best(lambda: _plain_seconds(flat, iterations)),
        off_us=best(lambda: _engine_seconds(flat, iterations, False)),
        on_us=best(lambda: _engine_seconds(flat, iterations, True)),
        threaded_off_us=best(lambda: _engine_seconds(threaded, iterations, False)),
        threaded_on_us=best(lambda: _engine_seconds(threaded, iterations, True)),
    )


if __name__ == "__main__":
    print(measure_overhead().format())
