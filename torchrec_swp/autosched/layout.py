"""Layout: a candidate schedule before stages - every task's thread and stream, and the fire
order - and how a layout plus stages becomes a PipelinePlan."""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PipelinePlan


@dataclass(frozen=True, slots=True)
class Layout:
    """``threads[i]`` and ``streams[i]`` of task ``i`` (``Problem.tasks`` order); ``order`` is the
    fire order as task indices."""

    threads: tuple[str, ...]
    streams: tuple[str, ...]
    order: tuple[int, ...]

    def position(self) -> list[int]:
        """Fire position of every task."""
        pos = [0] * len(self.order)
        for k, i in enumerate(self.order):
            pos[i] = k
        return pos

    def thread_count(self) -> int:
        return len(set(self.threads))

    def moved(self, task: int, thread: str, stream: str, at: int) -> Layout:
        """This layout with ``task`` on ``thread`` and ``stream``, fired at position ``at``."""
        order = [i for i in self.order if i != task]
        order.insert(at, task)
        threads = list(self.threads)
        streams = list(self.streams)
        threads[task], streams[task] = thread, stream
        return Layout(tuple(threads), tuple(streams), tuple(order))

    def partition(self) -> tuple[int, ...]:
        """Threads numbered by first use in task order: equal for layouts that group the tasks
        alike, whatever the threads' names (they are interchangeable)."""
        first: dict[str, int] = {}
        return tuple(first.setdefault(t, len(first)) for t in self.threads)

    def key(self, problem: Problem) -> tuple[object, ...]:
        """Equal for layouts that run alike under any stages: same grouping of tasks into
        threads and same streams, same order on each thread and within each comm group, same
        direction of every dependency in the fire order (and of every task relative to the
        source when the plan stops at the end of data)."""
        pos = self.position()
        threads = self.partition()
        per_thread: dict[int, list[int]] = {}
        per_comm: dict[str, list[int]] = {}
        for i in self.order:
            per_thread.setdefault(threads[i], []).append(i)
            group = problem.comm[i]
            if group is not None:
                per_comm.setdefault(group, []).append(i)
        after_source: tuple[bool, ...] = ()
        if problem.plan.on_exhausted == "stop":
            src = pos[problem.source_index]
            after_source = tuple(p > src for p in pos)
        return (
            threads,
            self.streams,
            tuple(sorted((t, tuple(s)) for t, s in per_thread.items())),
            tuple(sorted((g, tuple(s)) for g, s in per_comm.items())),
            tuple(pos[d.producer] < pos[d.consumer] for d in problem.deps),
            after_source,
        )


def layout_of(problem: Problem, plan: PipelinePlan) -> Layout:
    """The layout of ``plan`` (a plan of the problem's tasks)."""
    return Layout(
        threads=tuple(plan.task(t).thread_group for t in problem.tasks),
        streams=tuple(plan.task(t).stream for t in problem.tasks),
        order=tuple(problem.index[t] for t in plan.fire_order),
    )


def normalized(problem: Problem, layout: Layout) -> Layout:
    """``layout`` within the hard constraints on threads and streams: anchors on the default
    stream, and tasks on threads beyond ``max_threads`` folded onto the calling thread."""
    kept = list(dict.fromkeys(layout.threads))[: problem.max_threads]
    if MAIN_THREAD not in kept and len(kept) == problem.max_threads:
        kept[-1] = MAIN_THREAD
    threads = tuple(t if t in kept else MAIN_THREAD for t in layout.threads)
    streams = tuple(DEFAULT_STREAM if i in problem.anchor_index else s for i, s in enumerate(layout.streams))
    return Layout(threads, streams, layout.order)


def named_threads(problem: Problem, layout: Layout) -> Layout:
    """``layout`` with its threads renamed from ``problem.thread_pool`` (the calling thread,
    the plan's own groups, ``w1``...): the thread of the first anchor in fire order (or of the
    first task) becomes the calling thread, the others follow in order of first use."""
    anchors = [i for i in layout.order if i in problem.anchor_index] or list(layout.order)
    used = list(dict.fromkeys([layout.threads[anchors[0]], *(layout.threads[i] for i in layout.order)]))
    rename = dict(zip(used, problem.thread_pool, strict=False))
    return Layout(tuple(rename[t] for t in layout.threads), layout.streams, layout.order)


def to_plan(problem: Problem, layout: Layout, stages: tuple[int, ...]) -> PipelinePlan:
    """The plan of ``layout`` with task ``i`` at stage ``stages[i]`` and
    ``pipeline_depth = max(stages) + 1``. Validated: raises PlanError if it cannot run."""
    top = max(stages)
    schedule = {
        t: problem.plan.task(t).schedule.replace(
            stage=stages[i], thread_group=layout.threads[i], stream=layout.streams[i]
        )
        for i, t in enumerate(problem.tasks)
    }
    return problem.plan.replace(
        schedule=schedule,
        fire_order=[problem.tasks[i] for i in layout.order],
        pipeline_depth=top + 1,
    )
