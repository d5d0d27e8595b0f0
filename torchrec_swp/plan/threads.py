"""thread_map strategies: which CPU thread submits each task (independent of its stream).

* ``"by_stream"``: one thread per stream; the default stream's tasks stay on the calling thread.
* ``"per_task"``: a thread per task.
* ``"main"``: every task on the calling thread.
* ``"io"``: the stage-0 tasks (drawing the batch and copying it to the device) on thread ``io``,
  so that waiting for the data overlaps the training; the others stay where they are. A source
  with ``loads > 1`` keeps its own thread group (its lanes run only the source).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.task import DEFAULT_STREAM, MAIN_THREAD, ScheduledTask, check_name

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PlanView

#: How tasks map to threads: a strategy name, ``{task: thread}``, or a function of the task.
ThreadMap = str | Mapping[str, str] | Callable[[ScheduledTask], str]

STRATEGIES = ("by_stream", "per_task", "main", "io")
#: The thread the ``"io"`` strategy puts the stage-0 tasks on.
IO_THREAD = "io"


def resolve_thread_map(plan: PlanView, thread_map: ThreadMap) -> dict[str, str]:
    """Return ``{task: thread_group}`` for every task of ``plan``.

    Raises PlanError for an unknown strategy, a dict naming an unknown task, or a callable
    returning something that is not a thread name.
    """
    tasks = plan.scheduled()
    if isinstance(thread_map, str):
        match thread_map:
            case "by_stream":
                return {t.name: MAIN_THREAD if t.stream == DEFAULT_STREAM else t.stream for t in tasks}
            case "per_task":
                return {t.name: t.name for t in tasks}
            case "main":
                return {t.name: MAIN_THREAD for t in tasks}
            case "io":
                lanes = plan.source if plan.loads > 1 else None
                return {t.name: IO_THREAD if t.stage == 0 and t.name != lanes else t.thread_group for t in tasks}
            case _:
                raise PlanError(
                    f"unknown thread_map strategy {thread_map!r}; use one of {', '.join(STRATEGIES)}, "
                    "a dict {task: thread} or a callable",
                    culprit=thread_map,
                )
    if isinstance(thread_map, Mapping):
        for task, group in thread_map.items():
            if task not in plan.schedule:
                raise PlanError(
                    f"thread_map names unknown task {task!r}; plan {plan.name} has {', '.join(plan.fire_order)}",
                    culprit=str(task),
                )
            check_name(group, f"thread (for task {task})")
        return {t.name: thread_map.get(t.name, t.thread_group) for t in tasks}
    if callable(thread_map):
        out = {}
        for t in tasks:
            out[t.name] = check_name(thread_map(t), f"thread returned by thread_map for task {t.name}")
        return out
    raise PlanError(
        f"thread_map must be a strategy name, a dict or a callable, got {type(thread_map).__name__}",
        culprit="thread_map",
    )
