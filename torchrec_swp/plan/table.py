"""print_schedule: the stage table of seed 001.

One row per task (highest stage first, fire order within a stage), one column per internal
iteration showing the batch the task works on (``i3``) or ``--`` when it does not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrec_swp.plan.plan import PipelinePlan

_CELL = 5


def table_rows(plan: PipelinePlan) -> list[str]:
    """Task names in table order: stage descending, then fire order."""
    return sorted(plan.fire_order, key=lambda t: (-plan.task(t).stage, plan.fire_index(t)))


def cell(plan: PipelinePlan, task: str, iteration: int, num_batches: int | None) -> str:
    batch = iteration - plan.task(task).stage
    if batch < 0 or (num_batches is not None and batch >= num_batches):
        return " --"
    return f"i{batch}"


def format_schedule(
    plan: PipelinePlan,
    num_iterations: int,
    num_batches: int | None = None,
    mark: tuple[str, int] | None = None,
) -> str:
    """The table for iterations ``0 .. num_iterations-1``.

    ``num_batches`` (M) shows drain: tasks whose batch is ``>= M`` print ``--``.
    ``mark=(task, iteration)`` puts ``*`` on one cell (used by error messages).
    """
    rows = table_rows(plan)
    w_task = max(17, *(len(t) for t in rows))
    w_thread = max(7, *(len(plan.task(t).thread_group) for t in rows))
    w_stream = max(12, *(len(plan.task(t).stream) for t in rows))
    cols = range(num_iterations)

    def line(num: str, task: str, thread: str, stream: str, sep: str, cells: list[str]) -> str:
        body = " ".join(c.ljust(_CELL) for c in cells).rstrip()
        return f"{num:>4}  {task:<{w_task}}  {thread:<{w_thread}}  {stream:<{w_stream}}  {sep} {body}"

    out = [
        line("#", "Task", "Thread", "Stream", "|", [f"P{p}" for p in cols]),
        line("--", "-" * w_task, "-" * w_thread, "-" * w_stream, "+", ["-" * _CELL for _ in cols]),
    ]
    for i, task in enumerate(rows):
        sched = plan.task(task)
        cells = []
        for p in cols:
            c = cell(plan, task, p, num_batches)
            if mark == (task, p):
                c = (c.strip() + "*").rjust(3)
            cells.append(c)
        out.append(line(str(i), task, sched.thread_group, sched.stream, "|", cells))
    return "\n".join(out)
