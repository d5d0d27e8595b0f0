"""The vocabulary of a plan: what a task is (PipelineTask) and where/when it runs (TaskSchedule).

Both are frozen, slotted and hashable. Names (tasks, streams, threads, data) are plain identifiers
so that the text form needs no quoting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from torchrec_swp.plan.effects import check_effect
from torchrec_swp.plan.errors import PlanError

#: The thread group of the thread that calls ``progress()``.
MAIN_THREAD = "default"
#: The device's current (compute) stream.
DEFAULT_STREAM = "default"
#: The comm group a task joins when it is ``globally_ordered`` without naming one.
DEFAULT_COMM_GROUP = "world"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_PREVIOUS = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.]*)@(?P<k>[1-9][0-9]*)\Z")


class When(str, Enum):
    """Which of its batches a task runs for, beyond the stage mask (``b`` = its batch in the epoch).

    ``first``: only batch 0 of an epoch, ``not_first``: every other one; ``fill``: only in the
    iterations that fill the pipeline, before batch 0 reaches the highest stage
    (``b + stage < max_stage``); ``has_next``: only when batch ``b + 1`` was drawn, ``last``:
    only when it does not exist (``b`` is the epoch's last batch). The last two need the source
    to have been asked for ``b + 1`` already: the task's stage is above the source's. ``train``:
    only while the model trains, decided by the ``step()`` call that trains batch ``b`` (the
    engine's ``training`` callable, e.g. ``model.training`` at that ``progress()`` call;
    TrainEvalHybridPipelineBase's eval-mode batches skip backward and the optimizer); a task of
    the plan's highest stage only. Tables (``print_schedule``) show a training run.
    ``never``: for no batch, in a phase where the task does nothing (a gradient-accumulation
    window's batches without OptimizerStep): it keeps its place, so what waits for it still waits
    for what it waits for.
    """

    ALWAYS = "always"
    FIRST = "first"
    NOT_FIRST = "not_first"
    FILL = "fill"
    HAS_NEXT = "has_next"
    LAST = "last"
    TRAIN = "train"
    NEVER = "never"

    def __str__(self) -> str:
        return self.value

    @property
    def in_steady_state(self) -> bool:
        """Whether it runs once per iteration in the steady state (``first``, ``fill`` and
        ``last`` run for one batch, or a few iterations, of an epoch)."""
        return self in (When.ALWAYS, When.NOT_FIRST, When.HAS_NEXT, When.TRAIN)

    def admits(
        self, batch: int, num_batches: int | None, iteration: int, max_stage: int, *, training: bool = True
    ) -> bool:
        """Whether a task guarded by this runs for ``batch`` at internal ``iteration``, when the
        epoch has ``num_batches`` batches (None: the source has not found its end yet, so every
        batch it was asked for exists) and the step that trains ``batch`` is in training mode
        (``training``)."""
        match self:
            case When.ALWAYS:
                return True
            case When.FIRST:
                return batch == 0
            case When.NOT_FIRST:
                return batch != 0
            case When.FILL:
                return iteration < max_stage
            case When.HAS_NEXT:
                return num_batches is None or batch + 1 < num_batches
            case When.LAST:
                return num_batches is not None and batch + 1 == num_batches
            case When.TRAIN:
                return training
            case When.NEVER:
                return False
            case _:
                raise ValueError(f"unknown guard {self!r}")

    @property
    def needs_next(self) -> bool:
        """Whether deciding needs to know if batch ``b + 1`` exists."""
        return self in (When.HAS_NEXT, When.LAST)


def parse_read(read: str) -> tuple[str, int]:
    """``"context"`` -> ``("context", 0)``; ``"context@1"`` (from batch ``b - 1``) -> ``("context", 1)``."""
    match = _PREVIOUS.match(read)
    if match:
        return match["name"], int(match["k"])
    return read, 0


def read_argument(read: str) -> str:
    """The keyword a task function gets a read as: ``x`` for ``x``, ``prev_x`` for ``x@1``, ``prev2_x`` for ``x@2``."""
    name, k = parse_read(read)
    return name if k == 0 else f"prev_{name}" if k == 1 else f"prev{k}_{name}"


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

    stage: at internal iteration ``P`` the task works on batch ``P - stage``.
    stream: the device stream it submits to (``"default"`` is the compute stream).
    thread_group: the CPU worker that calls it (``"default"`` is the thread calling progress()).
    comm_group: set for tasks that issue collectives which every rank must issue in the same
        order; tasks of one comm group take tickets in fire order. ``globally_ordered=True``
        without a group joins ``"world"``.
    when: which of its batches it runs for (``When``; default: all that the stage mask gives).
    """

    stage: int = 0
    stream: str = DEFAULT_STREAM
    thread_group: str = MAIN_THREAD
    globally_ordered: bool = False
    comm_group: str | None = None
    when: When = When.ALWAYS

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int):
            raise PlanError(f"stage must be an int, got {self.stage!r}", culprit="stage")
        if self.stage < 0:
            raise PlanError(f"stage must be >= 0, got {self.stage}", culprit="stage")
        check_name(self.stream, "stream")
        check_name(self.thread_group, "thread_group")
        try:
            object.__setattr__(self, "when", When(self.when))
        except ValueError:
            raise PlanError(
                f"when must be one of {', '.join(w.value for w in When)}, got {self.when!r}", culprit="when"
            ) from None
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
            "when": self.when,
        }
        fields.update(changes)
        if "globally_ordered" in changes and not changes["globally_ordered"]:
            fields["comm_group"] = None
        return TaskSchedule(**fields)  # type: ignore[arg-type]  # the fields by name, each checked by the constructor


@dataclass(frozen=True, slots=True)
class PipelineTask:
    """What a task is: its name and the data it reads and writes in its batch's slot.

    ``writes``: names this task stores in the slot of the batch it works on.
    ``reads``: names it is handed from that slot; each must be written by exactly one task,
        and reading it makes the task depend on that writer (same batch). ``name@k`` reads
        ``name`` from batch ``b - k`` (None when that batch is not in flight: the first ``k``
        batches of an epoch), handed as keyword ``prev_name`` (``prev{k}_name`` for ``k > 1``).
    ``noop_on``: device types (``"cpu"``, ...) on which the task does nothing but hand its
        inputs on (a host-to-device copy of a batch already on the device). There the
        compiler replaces the call by an alias: ``writes[i]`` is ``reads[i]``.
    ``anchor``: the task defines the training step itself (forward, backward, optimizer):
        the auto-scheduler keeps it on the default stream at the highest stage.
    ``effects``: the state it changes outside its batch's slot (``torchrec_swp.plan.effects``:
        ``KNOWN_EFFECTS``), what the engine captures and restores to undo a step; none: the task is pure.
    """

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    noop_on: tuple[str, ...] = ()
    anchor: bool = False
    effects: tuple[str, ...] = ()
    doc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_name(self.name, "task")
        object.__setattr__(self, "reads", tuple(self.reads))
        object.__setattr__(self, "writes", tuple(self.writes))
        object.__setattr__(self, "noop_on", tuple(self.noop_on))
        object.__setattr__(self, "effects", tuple(check_effect(e, self.name) for e in self.effects))
        if len(set(self.effects)) != len(self.effects):
            raise PlanError(f"task {self.name} declares an effect twice: {self.effects}", culprit=self.name)
        if self.noop_on and len(self.writes) > len(self.reads):
            raise PlanError(
                f"task {self.name} is a no-op on {', '.join(self.noop_on)} but writes more names than it reads: "
                "each write must be one of its inputs handed on",
                culprit=self.name,
            )
        if self.noop_on and any(parse_read(r)[1] for r in self.reads):
            raise PlanError(
                f"task {self.name} is a no-op on {', '.join(self.noop_on)}: it cannot read a previous batch",
                culprit=self.name,
            )
        for device in self.noop_on:
            check_name(device, f"device type (in task {self.name})")
        for data in self.reads:
            check_name(parse_read(data)[0], f"data (in task {self.name})")
        for data in self.writes:
            check_name(data, f"data (in task {self.name})")
        for names, kind in ((self.reads, "reads"), (self.writes, "writes")):
            if len(set(names)) != len(names):
                raise PlanError(f"task {self.name} {kind} a name twice: {names}", culprit=self.name)

    @property
    def arguments(self) -> tuple[str, ...]:
        """The keywords its function is called with, one per read, in order."""
        return tuple(read_argument(r) for r in self.reads)


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

    @property
    def when(self) -> When:
        return self.schedule.when


@dataclass(frozen=True, slots=True, order=True)
class Dep:
    """``consumer(b)`` runs after ``producer(b - distance)``."""

    consumer: str
    producer: str
    distance: int = 0

    def __str__(self) -> str:
        tail = f" @{self.distance}" if self.distance else ""
        return f"{self.consumer} <- {self.producer}{tail}"
