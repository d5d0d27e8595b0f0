"""The vocabulary of a plan: what a task is (PipelineTask) and where/when it runs (TaskSchedule).

Both are frozen, slotted and hashable. Names (tasks, streams, threads, data) are plain identifiers
so that the text form needs no quoting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torchrec_swp.plan.errors import PlanError

#: The thread group of the thread that calls ``progress()``.
MAIN_THREAD = "default"
#: The device's current (compute) stream.
DEFAULT_STREAM = "default"
#: The comm group a task joins when it is ``globally_ordered`` without naming one.
DEFAULT_COMM_GROUP = "world"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


def check_name(name: object, what: str) -> str:
    """Return ``name`` if it is a valid identifier, else raise PlanError naming it."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise PlanError(
            f"{what} name {name!r} is not an identifier (letters, digits, '_' and '.')",
            culprit=str(name),
        )
    return name


@dataclass(frozen=True, slots=True)
class TaskSchedule:
    """Where and when one task runs.

    stage: batch lookahead. At internal iteration ``P`` the task works on batch ``P - stage``.
    stream: the device stream it submits to (``"default"`` is the compute stream).
    thread_group: the CPU worker that calls it (``"default"`` is the thread calling progress()).
    comm_group: set for tasks that issue collectives which every rank must issue in the same
        order; tasks of one comm group take tickets in fire order. ``globally_ordered=True``
        without a group joins ``"world"``.
    """

    stage: int = 0
    stream: str = DEFAULT_STREAM
    thread_group: str = MAIN_THREAD
    globally_ordered: bool = False
    comm_group: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int):
            raise PlanError(f"stage must be an int, got {self.stage!r}", culprit="stage")
        if self.stage < 0:
            raise PlanError(f"stage must be >= 0, got {self.stage}", culprit="stage")
        check_name(self.stream, "stream")
        check_name(self.thread_group, "thread_group")
        if self.comm_group is not None:
            check_name(self.comm_group, "comm_group")
            object.__setattr__(self, "globally_ordered", True)
        elif self.globally_ordered:
            object.__setattr__(self, "comm_group", DEFAULT_COMM_GROUP)

    def replace(self, **changes: object) -> TaskSchedule:
        fields = {
            "stage": self.stage,
            "stream": self.stream,
            "thread_group": self.thread_group,
            "comm_group": self.comm_group,
        }
        fields.update(changes)
        if "globally_ordered" in changes and not changes["globally_ordered"]:
            fields["comm_group"] = None
        return TaskSchedule(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PipelineTask:
    """What a task is: its name and the data it reads and writes in its batch's slot.

    ``writes``: names this task stores in the slot of the batch it works on.
    ``reads``: names it is handed from that slot; each must be written by exactly one task,
        and reading it makes the task depend on that writer (same batch).
    ``pure``: the task has no effect besides its declared writes, which depend only on its
        declared reads: the engine may skip it when it is handed the very same inputs as the
        last time it ran, and reuse what it wrote then.
    ``noop_on``: device types (``"cpu"``, ...) on which the task does nothing but hand its
        inputs on (a host-to-device copy of a batch already on the device). There the
        compiler replaces the call by an alias: ``writes[i]`` is ``reads[i]``.
    """

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    pure: bool = False
    noop_on: tuple[str, ...] = ()
    doc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name(self.name, "task")
        object.__setattr__(self, "reads", tuple(self.reads))
        object.__setattr__(self, "writes", tuple(self.writes))
        object.__setattr__(self, "noop_on", tuple(self.noop_on))
        if self.noop_on and len(self.writes) > len(self.reads):
            raise PlanError(
                f"task {self.name} is a no-op on {', '.join(self.noop_on)} but writes more names than it reads: "
                "each write must be one of its inputs handed on",
                culprit=self.name,
            )
        for device in self.noop_on:
            check_name(device, f"device type (in task {self.name})")
        for data in (*self.reads, *self.writes):
            check_name(data, f"data (in task {self.name})")
        for names, kind in ((self.reads, "reads"), (self.writes, "writes")):
            if len(set(names)) != len(names):
                raise PlanError(f"task {self.name} {kind} a name twice: {names}", culprit=self.name)


@dataclass(frozen=True, slots=True)
class ScheduledTask:
    """A task together with its schedule and fire position: what thread maps and passes see."""

    name: str
    schedule: TaskSchedule
    io: PipelineTask
    fire_index: int

    @property
    def stage(self) -> int:
        return self.schedule.stage

    @property
    def stream(self) -> str:
        return self.schedule.stream

    @property
    def thread_group(self) -> str:
        return self.schedule.thread_group

    @property
    def comm_group(self) -> str | None:
        return self.schedule.comm_group
