"""Problem: what the auto-scheduler searches - a plan's tasks and dependencies, their
durations, and the hard constraints.

The search may change, per task, its thread group, its stream, its stage and its place in the
fire order - nothing else: the tasks, what they read and write, their comm groups, the
dependencies, the source and the output stay those of ``plan``. Hard constraints:

* at most ``max_threads`` thread groups and ``max_in_flight`` batches in flight
  (``pipeline_depth``);
* the anchors (tasks declared ``anchor`` in the plan, e.g. Forward, Backward, OptimizerStep,
  plus any named in ``anchor_names`` and any guarded ``when=train``) stay on the default stream
  at the highest stage;
* collectives of one comm group are serialized in fire order whatever their threads and
  streams (the engine's tickets), and every dependency holds (the plan validates and the
  simulator finds no race).

Durations are in any unit, used consistently (a Profile gives seconds). A task whose ``when``
guard makes it run once per epoch (``first``, ``fill``, ``last``) costs nothing in the steady
state the search optimizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PipelinePlan, PlanError, When
from torchrec_swp.profiler.profile import Profile


@dataclass(frozen=True, slots=True)
class IndexedDep:
    """A dependency by task index: ``consumer(b)`` after ``producer(b - distance)``."""

    consumer: int
    producer: int
    distance: int


@dataclass(frozen=True)
class Problem:
    """The search input (see the module docstring). ``stream_options``: the streams a task that
    is not an anchor may move to (default: the plan's streams); streams only matter when
    ``device_durations`` are given."""

    plan: PipelinePlan
    durations: Mapping[str, float] = field(hash=False)
    device_durations: Mapping[str, float] | None = field(default=None, hash=False)
    max_threads: int = 4
    max_in_flight: int = 5
    anchor_names: frozenset[str] = frozenset()
    stream_options: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name, limit in (("max_threads", self.max_threads), ("max_in_flight", self.max_in_flight)):
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"{name} must be an int >= 1, got {limit!r}")
        for table, kind in ((self.durations, "CPU"), (self.device_durations or {}, "device")):
            for task, value in table.items():
                if task not in self.plan.schedule:
                    raise PlanError(
                        f"{kind} duration given for {task!r}, which is not a task of plan {self.plan.name}",
                        culprit=task,
                    )
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value < 0
                ):
                    raise PlanError(
                        f"{kind} duration of task {task} must be a finite number >= 0, got {value!r}", culprit=task
                    )
        unknown = sorted(set(self.anchor_names) - set(self.plan.schedule))
        if unknown:
            raise PlanError(f"anchor {unknown[0]!r} is not a task of plan {self.plan.name}", culprit=unknown[0])
        missing = [t for t in self.plan.fire_order if t not in self.durations]
        if missing:
            raise PlanError(f"no CPU duration for task {missing[0]} of plan {self.plan.name}", culprit=missing[0])
        if self.plan.source is None:
            raise PlanError(
                f"plan {self.plan.name} has no source task: the search needs one (stage 0)", culprit="source"
            )
        if self.plan.source in self.anchors:
            raise PlanError(
                f"the source {self.plan.source} (stage 0) cannot be an anchor (the highest stage)",
                culprit=self.plan.source,
            )

    @classmethod
    def from_profile(cls, profile: Profile, **options: object) -> Problem:
        """The profiled plan with the median durations (seconds) of the profile."""
        # (the ignore below: the options by name, each checked by the constructor)
        return cls(profile.plan, profile.durations(), **options)  # type: ignore[arg-type]

    @classmethod
    def from_profiles(cls, profiles: Sequence[Profile], **options: object) -> Problem:
        """The plan profiled on every rank, each task costing its median on its slowest rank: the
        barrier model is one rank's, and collectives wait for the slowest rank."""
        plans = {p.plan for p in profiles}
        if len(plans) != 1:
            raise PlanError(
                f"the ranks profiled different plans: {sorted(p.name for p in plans)}", culprit="profiles"
            )
        durations = [p.durations() for p in profiles]
        slowest = {t: max(d[t] for d in durations) for t in durations[0]}
        # (the ignore below: the options by name, each checked by the constructor)
        return cls(profiles[0].plan, slowest, **options)  # type: ignore[arg-type]

    # ------------------------------------------------------------- by index
    @cached_property
    def tasks(self) -> tuple[str, ...]:
        """Task names; a task's index is its position in the plan's fire order."""
        return self.plan.fire_order

    @cached_property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tasks)}

    @cached_property
    def cpu(self) -> tuple[float, ...]:
        """Steady-state CPU time per task (0 for tasks that run once per epoch)."""
        return tuple(float(self.durations[t]) if self.plan.task(t).when.in_steady_state else 0.0 for t in self.tasks)

    @cached_property
    def deps(self) -> tuple[IndexedDep, ...]:
        """Every dependency of the plan (explicit and inferred) except a task on itself."""
        return tuple(
            IndexedDep(self.index[d.consumer], self.index[d.producer], d.distance)
            for d in self.plan.deps
            if d.consumer != d.producer
        )

    @cached_property
    def producers(self) -> tuple[tuple[IndexedDep, ...], ...]:
        """Deps by consumer index."""
        return tuple(tuple(d for d in self.deps if d.consumer == i) for i in range(len(self.tasks)))

    @cached_property
    def comm(self) -> tuple[str | None, ...]:
        return tuple(self.plan.task(t).comm_group for t in self.tasks)

    @cached_property
    def anchors(self) -> frozenset[str]:
        """Tasks the plan declares ``anchor``, those named in ``anchor_names``, and those guarded
        ``when=train`` (only the highest stage knows the training mode)."""
        return frozenset(
            t
            for t in self.tasks
            if self.plan.tasks[t].anchor or t in self.anchor_names or self.plan.task(t).when is When.TRAIN
        )

    @cached_property
    def anchor_index(self) -> frozenset[int]:
        return frozenset(self.index[t] for t in self.anchors)

    @cached_property
    def source_index(self) -> int:
        return self.index[self.plan.source or ""]

    @cached_property
    def on_source(self) -> tuple[bool, ...]:
        """Per task: it is the source or depends on it in the same batch (may sit at stage 0)."""
        before: dict[int, set[int]] = {i: set() for i in range(len(self.tasks))}
        for d in self.deps:
            if d.distance == 0:
                before[d.consumer].add(d.producer)
        out = []
        for i in range(len(self.tasks)):
            seen, todo = {i}, [i]
            while todo:
                for p in before[todo.pop()]:
                    if p not in seen:
                        seen.add(p)
                        todo.append(p)
            out.append(self.source_index in seen)
        return tuple(out)

    @cached_property
    def thread_pool(self) -> tuple[str, ...]:
        """``max_threads`` thread names: the calling thread, the plan's other groups, ``w1``..."""
        names = [MAIN_THREAD, *(g for g in self.plan.thread_groups if g != MAIN_THREAD)]
        k = 1
        while len(names) < self.max_threads:
            if f"w{k}" not in names:
                names.append(f"w{k}")
            k += 1
        return tuple(names[: self.max_threads])

    @cached_property
    def streams(self) -> tuple[str, ...]:
        """Streams a non-anchor task may use."""
        return self.stream_options or tuple(dict.fromkeys([DEFAULT_STREAM, *self.plan.streams]))

    @property
    def models_device(self) -> bool:
        return self.device_durations is not None

    def simulation_batches(self, depth: int) -> int:
        """Batches to simulate for a plan of ``depth``: enough steady iterations for a median
        (more with a device model, whose queues need iterations to settle)."""
        return depth + (8 if self.models_device else 3)
