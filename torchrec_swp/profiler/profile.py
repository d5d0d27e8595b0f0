"""Profile: per-task statistics of a measured run, with the plan it ran, as a JSON file.

File format (``Profile.save`` / ``Profile.load``), readable and diffable::

    {
      "format": "torchrec_swp.profile/2",
      "plan": "<the plan's text form>",
      "iterations": 40, "warmup": 2,
      "iteration_s": 0.0123, "iteration_mean_s": 0.0125, "unattributed_s": 0.0002,
      "tasks": [{"task": "H2D", "thread": "default", "stream": "memcpy", "stage": 0,
                 "count": 40, "median_s": 0.0021, "mean_s": 0.0022, "max_s": 0.003,
                 "exposed_s": 0.0021, "cpu_mean_s": 0.0009}, ...],
      "steps": {"calls": 42, "call_mean_s": 0.013, "call_cpu_mean_s": 0.006,
                "gap_mean_s": 0.0001, "gap_cpu_mean_s": 0.0001, "overhead_s": 0.0002},
      "where": {"rank": 0, "world_size": 2, "host": "node-a", "cores": 2,
                "split_draws": false, "batch_bytes": 1048576},
      "records": [[iteration, start, end, [[task, batch, thread, start, end, cpu], ...],
                   [[producer, thread, start, end], ...]], ...]
    }

Times are seconds. ``exposed_s`` is the mean per measured iteration of the time the task was
exposed (``torchrec_swp.profiler.exposure``); ``unattributed_s`` the mean per iteration of the
time no task explains (engine overhead, thread wake-up latency); ``cpu_mean_s`` the mean thread
CPU time of the task (null when not measured). ``steps`` (null when the engine did not report
its ``progress()`` calls): the calls' wall and CPU time, the caller's own time between calls, and
``overhead_s``, the CPU the calling thread spends per step outside the tasks (the engine's and
the caller's own work). ``where`` says which rank of how many, on which machine, and what the
data allows (``split_draws``: the iterator splits a draw into claim and fetch, so parallel loads
overlap; ``batch_bytes``: the size of one drawn batch). ``records``: the measured iterations as
the engine ran them, from which every rank's profile calibrates the multi-rank simulator
(``torchrec_swp.sim.calibrate``). Format 1 files (without the last four) still load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from torchrec_swp.plan import PipelinePlan
from torchrec_swp.profiler.events import IterationRecord, RunEvent, WaitEvent

FORMAT = "torchrec_swp.profile/2"
FORMATS = ("torchrec_swp.profile/1", FORMAT)


class ProfileError(ValueError):
    """A profile that cannot be built or read; the message names the culprit."""


@dataclass(frozen=True, slots=True)
class TaskStats:
    """One task over the measured iterations: ``count`` runs, their median, mean and maximum
    duration, and its mean exposed time per iteration."""

    task: str
    thread: str
    stream: str
    stage: int
    count: int
    median_s: float
    mean_s: float
    max_s: float
    exposed_s: float
    cpu_mean_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepStats:
    """The engine's ``progress()`` calls over the measured steps (means, seconds): a call's wall
    and CPU time, the caller's own time between calls (wall and CPU), and ``overhead_s``: the CPU
    the calling thread spends per step outside the tasks."""

    calls: int
    call_mean_s: float
    call_cpu_mean_s: float
    gap_mean_s: float
    gap_cpu_mean_s: float
    overhead_s: float


@dataclass(frozen=True, slots=True)
class Where:
    """Where a profile was taken: the rank, the world's size, the machine (host name and its
    cores) and what the data allowed (module docstring)."""

    rank: int = 0
    world_size: int = 1
    host: str = ""
    cores: int | None = None
    split_draws: bool = False
    batch_bytes: float = 0.0


@dataclass(frozen=True)
class Profile:
    """A measured run of ``plan``: ``iterations`` steady iterations after ``warmup`` skipped ones.

    ``tasks`` lists every task of the plan in fire order. ``iteration_s`` is the median
    iteration time, ``iteration_mean_s`` the mean.
    """

    plan: PipelinePlan
    tasks: tuple[TaskStats, ...]
    iterations: int
    warmup: int
    iteration_s: float
    iteration_mean_s: float
    unattributed_s: float
    steps: StepStats | None = None
    where: Where = Where()
    records: tuple[IterationRecord, ...] = ()

    def __post_init__(self) -> None:
        names = [s.task for s in self.tasks]
        if names != list(self.plan.fire_order):
            raise ProfileError(
                f"profile of plan {self.plan.name} must list its tasks in fire order {list(self.plan.fire_order)}, "
                f"got {names}"
            )

    def stats(self, task: str) -> TaskStats:
        for s in self.tasks:
            if s.task == task:
                return s
        raise ProfileError(
            f"profile of plan {self.plan.name} has no task {task!r}; it has {[s.task for s in self.tasks]}"
        )

    def durations(self) -> dict[str, float]:
        """Median duration (s) of every task: the cost model the auto-scheduler uses."""
        return {s.task: s.median_s for s in self.tasks}

    def with_where(self, **changes: Any) -> Profile:
        """This profile with fields of ``where`` changed (the caller knows the rank and the data)."""
        return replace(self, where=replace(self.where, **changes))

    # ------------------------------------------------------------------ file
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "plan": self.plan.to_text(),
            "iterations": self.iterations,
            "warmup": self.warmup,
            "iteration_s": self.iteration_s,
            "iteration_mean_s": self.iteration_mean_s,
            "unattributed_s": self.unattributed_s,
            "tasks": [asdict(s) for s in self.tasks],
            "steps": None if self.steps is None else asdict(self.steps),
            "where": asdict(self.where),
            "records": [
                [
                    r.iteration,
                    r.start,
                    r.end,
                    [[x.task, x.batch, x.thread, x.start, x.end, x.cpu] for x in r.runs],
                    [[w.producer, w.thread, w.start, w.end] for w in r.waits],
                ]
                for r in self.records
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict) or data.get("format") not in FORMATS:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ProfileError(f"not a torchrec_swp profile: format is {found!r}, expected {FORMAT!r}")
        try:
            steps = data.get("steps")
            return cls(
                plan=PipelinePlan.from_text(data["plan"]),
                tasks=tuple(TaskStats(**t) for t in data["tasks"]),
                iterations=int(data["iterations"]),
                warmup=int(data["warmup"]),
                iteration_s=float(data["iteration_s"]),
                iteration_mean_s=float(data["iteration_mean_s"]),
                unattributed_s=float(data["unattributed_s"]),
                steps=None if steps is None else StepStats(**steps),
                where=Where(**data.get("where", {})),
                records=tuple(
                    IterationRecord(
                        int(it),
                        float(start),
                        float(end),
                        tuple(RunEvent(*x) for x in runs),
                        tuple(WaitEvent(*w) for w in waits),
                    )
                    for it, start, end, runs, waits in data.get("records", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"malformed profile: {e!r}") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ProfileError(f"{path} is not JSON: {e}") from None
        return cls.from_json(data)

    # ------------------------------------------------------------- rendering
    def format_table(self) -> str:
        """One row per task (fire order), times in milliseconds, exposed share of the iteration."""
        it = self.iteration_mean_s or 1.0
        width = max(len("(unattributed)"), *(len(s.task) for s in self.tasks))
        tw = max(len("thread"), *(len(s.thread) for s in self.tasks))
        sw = max(len("stream"), *(len(s.stream) for s in self.tasks))
        head = (
            f"{'task':<{width}}  {'thread':<{tw}}  {'stream':<{sw}}  stage  count  median ms  mean ms   max ms"
            "  exposed ms  exposed %"
        )
        lines = [
            (
                f"profile of plan {self.plan.name}: {self.iterations} iterations measured after {self.warmup} warm-up, "
                f"iteration {self.iteration_s * 1e3:.3f} ms median, {self.iteration_mean_s * 1e3:.3f} ms mean"
            ),
            head,
        ]
        for s in self.tasks:
            lines.append(
                f"{s.task:<{width}}  {s.thread:<{tw}}  {s.stream:<{sw}}  {s.stage:>5}  {s.count:>5}  "
                f"{s.median_s * 1e3:>9.3f}  {s.mean_s * 1e3:>7.3f}  {s.max_s * 1e3:>7.3f}  "
                f"{s.exposed_s * 1e3:>10.3f}  {100 * s.exposed_s / it:>9.1f}"
            )
        lines.append(
            f"{'(unattributed)':<{width}}  {'':<{tw}}  {'':<{sw}}  {'':>5}  {'':>5}  {'':>9}  {'':>7}  {'':>7}  "
            f"{self.unattributed_s * 1e3:>10.3f}  {100 * self.unattributed_s / it:>9.1f}"
        )
        return "\n".join(lines)

    def print_table(self) -> None:
        print(self.format_table())
