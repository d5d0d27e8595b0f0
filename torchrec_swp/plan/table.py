"""print_schedule: the stage table (the format of tests/golden/design_tables/), rows in fire order.

A header line first says how far the plan runs ahead: ``depth D + lookahead L = N batches in
flight`` (the source draws batch ``b`` only once batch ``b - N`` has left the highest stage) and
the source's loads with the threads they run on (``loads 2: Fetch on threads load, load.1``).

Then one row per task in fire order (``#`` is its position: the CPU submission order within an
iteration), with its stage, thread and stream, then one column per internal iteration showing
the batch the task works on (``i3``) or ``--`` when it does not run: outside the stage mask,
or for a batch its ``when`` excludes (``first``: batch 0 only; ``fill``: iterations before batch 0
reaches the highest stage; ``last``: the last batch, known only when ``num_batches`` is given).
A ``When`` column appears when some task has a guard, and an ``Effects`` column after it when some
task declares effects (``PipelineTask.effects``: what it changes outside its batch's slot,
comma-separated; ``-`` for none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec_swp.plan.task import When

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PlanView

_CELL = 5


def cell(plan: PlanView, task: str, iteration: int, num_batches: int | None) -> str:
    sched = plan.task(task).schedule
    batch = iteration - sched.stage
    outside = batch < 0 or (num_batches is not None and batch >= num_batches)
    if outside or not sched.when.admits(batch, num_batches, iteration, plan.max_stage):
        return " --"
    return f"i{batch}"


def header(plan: PlanView) -> str:
    """The table's first line: batches in flight (depth + lookahead) and the source's loads."""
    depth, ahead = plan.pipeline_depth, plan.lookahead
    line = f"depth {depth} + lookahead {ahead} = {depth + ahead} batch{'es' if depth + ahead > 1 else ''} in flight"
    if plan.source is None:
        return f"{line}; no source task"
    lanes = plan.source_lanes()
    return f"{line}; loads {plan.loads}: {plan.source} on thread{'s' if len(lanes) > 1 else ''} {', '.join(lanes)}"


def format_schedule(
    plan: PlanView,
    num_iterations: int,
    num_batches: int | None = None,
    mark: tuple[str, int] | None = None,
) -> str:
    """The header line, then the table for iterations ``0 .. num_iterations-1``.

    ``num_batches`` (M) shows drain: tasks whose batch is ``>= M`` print ``--``.
    ``mark=(task, iteration)`` puts ``*`` on one cell (used by error messages).
    """
    rows = list(plan.fire_order)
    guards = any(plan.task(t).when is not When.ALWAYS for t in rows)
    w_task = max(17, *(len(t) for t in rows))
    w_thread = max(7, *(len(plan.task(t).thread_group) for t in rows))
    w_stream = max(12, *(len(plan.task(t).stream) for t in rows))
    w_when = max(4, *(len(plan.task(t).when.value) for t in rows)) if guards else 0
    effects = {t: ",".join(plan.task(t).io.effects) or "-" for t in rows}
    declares = any(e != "-" for e in effects.values())
    w_effects = max(7, *map(len, effects.values())) if declares else 0
    cols = range(num_iterations)

    def line(
        num: str, task: str, stage: str, thread: str, stream: str, when: str, effect: str, sep: str, cells: list[str]
    ) -> str:
        body = " ".join(c.ljust(_CELL) for c in cells).rstrip()
        guard = f"{when:<{w_when}}  " if guards else ""
        guard += f"{effect:<{w_effects}}  " if declares else ""
        return (
            f"{num:>4}  {task:<{w_task}}  {stage:>5}  {thread:<{w_thread}}  {stream:<{w_stream}}  {guard}{sep} {body}"
        )

    out = [
        header(plan),
        line("#", "Task", "Stage", "Thread", "Stream", "When", "Effects", "|", [f"P{p}" for p in cols]),
        line(
            "--", "-" * w_task, "-" * 5, "-" * w_thread, "-" * w_stream, "-" * w_when, "-" * w_effects, "+",
            ["-" * _CELL for _ in cols],
        ),
    ]
    for i, task in enumerate(rows):
        sched = plan.task(task).schedule
        cells = []
        for p in cols:
            c = cell(plan, task, p, num_batches)
            if mark == (task, p):
                c = (c.strip() + "*").rjust(3)
            cells.append(c)
        when = "-" if sched.when is When.ALWAYS else sched.when.value
        out.append(
            line(str(i), task, str(sched.stage), sched.thread_group, sched.stream, when, effects[task], "|", cells)
        )
    return "\n".join(out)
