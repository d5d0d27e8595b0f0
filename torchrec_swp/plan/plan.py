"""PipelinePlan: a training schedule as data.

Semantics (one vocabulary everywhere):

* At internal iteration ``P`` a task of stage ``s`` works on batch ``P - s``; it runs iff
  ``0 <= P - s < M`` where ``M`` is the number of batches the source task pulled (fill, steady
  state, drain all follow from this mask).
* ``fire_order`` is the CPU submission order inside one internal iteration.
* A dependency ``Dep(consumer, producer, distance)`` means ``consumer(b)`` runs after
  ``producer(b - distance)``. ``distance == 0`` is an intra-iteration dep, ``>= 1`` an inter one
  (on an earlier batch), ``< 0`` a dep on a later batch (whose instance runs in the same
  iteration at a lower stage). Deps are explicit or inferred from ``reads``/``writes``.
* ``source`` is the task that pulls a batch from the data iterator (it raises StopIteration at
  the end of data); ``output`` is the slot value ``progress()`` returns for a batch leaving the
  highest stage; ``on_exhausted`` is ``"drain"`` (finish the batches in flight) or ``"stop"``
  (raise StopIteration as soon as the source finds no batch).
* ``lookahead``: how many batches the source may draw beyond ``pipeline_depth`` ahead of the
  oldest batch not yet trained (0: at most ``pipeline_depth`` batches in flight). Batches drawn
  ahead wait in their slots; the source's thread keeps drawing while the others train.
* ``loads``: how many source calls may be in flight at once, each on a thread of its own (the
  source's thread group ``G`` becomes ``G``, ``G.1``, ... ``G.{loads-1}``; batch ``b`` is loaded on
  lane ``b % loads``). Draws from the data iterator still happen in batch order; batches are
  delivered in order and numbered as with one load.

A PipelinePlan is validated when built: an instance exists only if it can run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Union

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary
from torchrec_swp.plan.table import format_schedule
from torchrec_swp.plan.task import (
    MAIN_THREAD,
    Dep,
    PipelineTask,
    ScheduledTask,
    TaskSchedule,
    check_name,
)
from torchrec_swp.plan.text_read import plan_from_text
from torchrec_swp.plan.text_write import plan_to_text
from torchrec_swp.plan.threads import ThreadMap, resolve_thread_map
from torchrec_swp.plan.validate import validate_plan

Exhausted = Literal["drain", "stop"]
DepSpec = Union["Dep", tuple[str, str], tuple[str, str, int]]


def _as_dep(spec: DepSpec, default_distance: int) -> Dep:
    if isinstance(spec, Dep):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        return Dep(spec[0], spec[1], default_distance)
    if isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[2], int):
        return Dep(spec[0], spec[1], spec[2])
    raise PlanError(f"a dependency must be (consumer, producer[, distance]), got {spec!r}", culprit=str(spec))


class PipelinePlan:
    """A declarative pipeline schedule. Immutable; equal plans have equal text forms."""

    __slots__ = (
        "name",
        "_schedule",
        "_tasks",
        "fire_order",
        "explicit_deps",
        "pipeline_depth",
        "source",
        "output",
        "on_exhausted",
        "lookahead",
        "loads",
        "_deps",
        "_fire_index",
    )

    def __init__(
        self,
        schedule: Mapping[str, TaskSchedule],
        intra_iter_deps: Iterable[DepSpec] = (),
        inter_iter_deps: Iterable[DepSpec] = (),
        pipeline_depth: int | None = None,
        fire_order: Sequence[str] | None = None,
        tasks: Iterable[PipelineTask] = (),
        source: str | None = None,
        output: str | None = None,
        on_exhausted: Exhausted = "drain",
        name: str = "plan",
        lookahead: int = 0,
        loads: int = 1,
    ) -> None:
        self.name = check_name(name, "plan")
        if not isinstance(schedule, Mapping):
            raise PlanError(
                f"schedule must be a mapping task -> TaskSchedule, got {type(schedule).__name__}", culprit="schedule"
            )
        for task, sched in schedule.items():
            check_name(task, "task")
            if not isinstance(sched, TaskSchedule):
                raise PlanError(f"schedule of task {task} must be a TaskSchedule, got {sched!r}", culprit=task)
        self._schedule: dict[str, TaskSchedule] = dict(schedule)
        declared: dict[str, PipelineTask] = {}
        for io in tasks:
            if not isinstance(io, PipelineTask):
                raise PlanError(f"tasks must be PipelineTask objects, got {io!r}", culprit=str(io))
            if io.name in declared:
                raise PlanError(f"duplicate task name {io.name} in tasks", culprit=io.name)
            declared[io.name] = io
        for task in declared:
            if task not in self._schedule:
                raise PlanError(f"task {task} declares reads/writes but has no schedule", culprit=task)
        self._tasks = {t: declared.get(t, PipelineTask(t)) for t in self._schedule}
        self.fire_order: tuple[str, ...] = tuple(fire_order) if fire_order is not None else tuple(self._schedule)
        deps = [_as_dep(d, 0) for d in intra_iter_deps] + [_as_dep(d, 1) for d in inter_iter_deps]
        # a dep given twice is one dep (its text has it once: a text giving it twice is refused)
        self.explicit_deps: tuple[Dep, ...] = tuple(dict.fromkeys(deps))
        if pipeline_depth is None:
            pipeline_depth = max((s.stage for s in self._schedule.values()), default=0) + 1
        self.pipeline_depth = pipeline_depth
        self.source = source
        self.output = output
        self.on_exhausted: Exhausted = on_exhausted
        self.lookahead = lookahead
        self.loads = loads
        self._fire_index = {t: i for i, t in enumerate(self.fire_order)}
        self._deps: tuple[Dep, ...] = validate_plan(self)

    # ----------------------------------------------------------------- queries
    @property
    def schedule(self) -> Mapping[str, TaskSchedule]:
        return dict(self._schedule)

    @property
    def tasks(self) -> Mapping[str, PipelineTask]:
        return dict(self._tasks)

    @property
    def deps(self) -> tuple[Dep, ...]:
        """Explicit and inferred dependencies, deduplicated, in a stable order."""
        return self._deps

    @property
    def intra_iter_deps(self) -> tuple[Dep, ...]:
        return tuple(d for d in self._deps if d.distance == 0)

    @property
    def inter_iter_deps(self) -> tuple[Dep, ...]:
        """Deps on another batch's instance (earlier, or with a negative distance later)."""
        return tuple(d for d in self._deps if d.distance != 0)

    @property
    def max_stage(self) -> int:
        return max(s.stage for s in self._schedule.values())

    def task(self, name: str) -> ScheduledTask:
        if name not in self._schedule:
            raise PlanError(f"unknown task {name!r}; plan {self.name} has {', '.join(self.fire_order)}", culprit=name)
        return ScheduledTask(name, self._schedule[name], self._tasks[name], self._fire_index[name])

    def scheduled(self) -> list[ScheduledTask]:
        """All tasks in fire order."""
        return [self.task(t) for t in self.fire_order]

    def fire_index(self, task: str) -> int:
        return self._fire_index[task]

    @property
    def thread_groups(self) -> tuple[str, ...]:
        """Thread groups in order of first use in fire order."""
        return tuple(dict.fromkeys(self._schedule[t].thread_group for t in self.fire_order))

    def source_lanes(self) -> tuple[str, ...]:
        """The threads the source's loads run on: its thread group, then ``G.1`` ... (``loads``)."""
        if self.source is None:
            return ()
        group = self._schedule[self.source].thread_group
        return (group, *(f"{group}.{k}" for k in range(1, self.loads)))

    def with_loads(self, loads: int, *, lookahead: int | None = None, thread: str = "load") -> PipelinePlan:
        """A new plan whose source has ``loads`` calls in flight (and, if given, that lookahead).

        With ``loads > 1`` the source needs a thread group of its own, not the calling thread's:
        a source on the calling thread, or sharing its thread with other tasks, moves to
        ``thread`` (its lanes are then ``thread``, ``thread.1``, ...); a source already alone
        on a worker thread stays there. Raises PlanError when ``thread`` runs other tasks.

        The source's function then runs ``loads`` times at once (draws take turns, what it
        does after the draw does not): for TorchRec's pipelines, whose H2D does more than draw,
        ``torchrec_swp.plans.with_parallel_loads`` splits the draw off first.
        """
        changes: dict[str, object] = {"loads": loads, **({} if lookahead is None else {"lookahead": lookahead})}
        src = self.source
        if src is None or isinstance(loads, bool) or not isinstance(loads, int) or loads <= 1:
            return self.replace(**changes)  # validation says what is wrong, if anything
        group = self._schedule[src].thread_group
        if group != MAIN_THREAD and all(s.thread_group != group for t, s in self._schedule.items() if t != src):
            return self.replace(**changes)
        others = [t for t, s in self._schedule.items() if t != src and s.thread_group == thread]
        if others or check_name(thread, "thread") == MAIN_THREAD:
            taken = "is the calling thread" if thread == MAIN_THREAD else f"runs {', '.join(others)}"
            raise PlanError(
                f"with_loads({loads}, thread={thread!r}): the source {src} needs a thread of its own, and "
                f"{thread!r} {taken}; pass another thread= name",
                culprit=thread,
            )
        changes["schedule"] = {**self._schedule, src: self._schedule[src].replace(thread_group=thread)}
        return self.replace(**changes)

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self._schedule[t].stream for t in self.fire_order))

    def writer_of(self, data: str) -> str | None:
        for t in self.fire_order:
            if data in self._tasks[t].writes:
                return t
        return None

    # --------------------------------------------------------------- changes
    def replace(self, **changes: object) -> PipelinePlan:
        """A new plan with some constructor arguments changed (validated again)."""
        args: dict[str, object] = {
            "schedule": self._schedule,
            "intra_iter_deps": [d for d in self.explicit_deps if d.distance == 0],
            "inter_iter_deps": [d for d in self.explicit_deps if d.distance != 0],
            "pipeline_depth": self.pipeline_depth,
            "fire_order": self.fire_order,
            "tasks": list(self._tasks.values()),
            "source": self.source,
            "output": self.output,
            "on_exhausted": self.on_exhausted,
            "name": self.name,
            "lookahead": self.lookahead,
            "loads": self.loads,
        }
        if "schedule" in changes and "fire_order" not in changes:
            new_schedule = changes["schedule"]
            assert isinstance(new_schedule, Mapping)
            args["fire_order"] = [t for t in self.fire_order if t in new_schedule] + [
                t for t in new_schedule if t not in self._fire_index
            ]
        if "schedule" in changes and "tasks" not in changes:
            new_schedule = changes["schedule"]
            assert isinstance(new_schedule, Mapping)
            args["tasks"] = [io for t, io in self._tasks.items() if t in new_schedule]
        args.update(changes)
        return PipelinePlan(**args)  # type: ignore[arg-type]  # the fields by name, each checked by the constructor

    def with_task(
        self,
        io: PipelineTask,
        schedule: TaskSchedule,
        *,
        after: str | None = None,
        deps: Iterable[DepSpec] = (),
    ) -> PipelinePlan:
        """A new plan with task ``io`` added, firing right after ``after`` (first when None);
        ``deps`` are ``(consumer, producer[, distance])`` specs involving it."""
        fire = list(self.fire_order)
        fire.insert(0 if after is None else fire.index(self.task(after).name) + 1, io.name)
        return self.replace(
            schedule={**self._schedule, io.name: schedule},
            tasks=[*self._tasks.values(), io],
            fire_order=fire,
            intra_iter_deps=[d for d in self.explicit_deps if d.distance == 0] + [_as_dep(d, 0) for d in deps],
        )

    def moved(self, task: str, *, after: str | None = None, before: str | None = None) -> PipelinePlan:
        """A new plan where ``task`` fires right after ``after`` or right before ``before``."""
        if (after is None) == (before is None):
            raise PlanError("give exactly one of after= and before=", culprit=task)
        fire = [t for t in self.fire_order if t != self.task(task).name]
        anchor = self.task(after or before or "").name
        fire.insert(fire.index(anchor) + (1 if after is not None else 0), task)
        return self.replace(fire_order=fire)

    def with_schedule(self, task: str, **changes: object) -> PipelinePlan:
        """A new plan where one task's schedule fields are changed."""
        sched = dict(self._schedule)
        sched[task] = self.task(task).schedule.replace(**changes)
        return self.replace(schedule=sched)

    def with_thread_map(self, thread_map: ThreadMap) -> PipelinePlan:
        """A new plan with thread groups assigned by ``thread_map``.

        ``"by_stream"``: one thread per stream (the default stream's tasks stay on the calling
        thread); ``"per_task"``: a thread per task; ``"main"``: everything on the calling thread;
        ``"io"``: the stage-0 tasks on thread ``io`` (a source with loads > 1 keeps its lanes); a dict
        ``{task: thread}`` moves the named tasks and leaves the others where they are;
        a callable gets each ScheduledTask and returns its thread group.
        """
        groups = resolve_thread_map(self, thread_map)
        sched = {t: s.replace(thread_group=groups[t]) for t, s in self._schedule.items()}
        return self.replace(schedule=sched)

    # ------------------------------------------------------------- rendering
    def to_text(self) -> str:
        return plan_to_text(self)

    @classmethod
    def from_text(cls, text: str, vocabulary: Vocabulary | None = None) -> PipelinePlan:
        """The plan ``text`` describes (``torchrec_swp.plan.text_words``); ``vocabulary``: the names the
        pipeline it is for declares (``Vocabulary.of``), else TorchRec's streams and comm groups."""
        return plan_from_text(text, cls, vocabulary)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_text())

    @classmethod
    def load(cls, path: str, vocabulary: Vocabulary | None = None) -> PipelinePlan:
        with open(path, encoding="utf-8") as f:
            return cls.from_text(f.read(), vocabulary)

    def format_schedule(self, num_iterations: int, num_batches: int | None = None) -> str:
        return format_schedule(self, num_iterations, num_batches)

    def print_schedule(self, num_iterations: int, num_batches: int | None = None) -> None:
        """Print the stage table: one row per task in fire order, one column per iteration."""
        print(self.format_schedule(num_iterations, num_batches))

    # --------------------------------------------------------------- identity
    def _key(self) -> tuple[object, ...]:
        return (
            self.name,
            tuple((t, self._schedule[t], self._tasks[t]) for t in self.fire_order),
            self.explicit_deps,
            self.pipeline_depth,
            self.source,
            self.output,
            self.on_exhausted,
            self.lookahead,
            self.loads,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipelinePlan) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = f", lookahead={self.lookahead}" if self.lookahead else ""
        extra += f", loads={self.loads}" if self.loads > 1 else ""
        return f"PipelinePlan({self.name}, tasks={list(self.fire_order)}, depth={self.pipeline_depth}{extra})"

    def __str__(self) -> str:
        return self.to_text()


def main_thread_only(plan: PipelinePlan) -> bool:
    return all(s.thread_group == MAIN_THREAD for s in plan.schedule.values())
