"""The plan transforms: functions that take a plan (a PipelinePlan, or a PhasedPlan whose every
phase they edit) and return it edited so that it trains bit for bit as before, changing only
where and when work runs (pure data, no torch):

* ``with_input_dist_group(plan, group)``: the input dist tasks (``INPUT_DIST_TASKS``) in a comm
  group of their own (``INPUT_DIST`` by default), out of the turnstile of Forward and Backward.
* ``with_parallel_loads(plan, loads)``: the source drawing several items at once on lanes of a
  thread group (``FETCH`` split off an H2D source; ``DRAW_TASKS``: the sources that only draw;
  ``splits_draw(plan)``: whether a plan's source can have loads).
* ``with_lookahead(plan, lookahead)``: the source drawing batches beyond the pipeline depth.

They name the tasks of TorchRec's plans (``catalog.torchrec``, which uses them; the imports flow
from there to here, never back). Users import them from ``torchrec_swp.plans``; the drop-ins'
constructor options make the same edits (``input_dist_group=``, ``loads=``, ``lookahead=``).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, overload

from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, TaskSchedule

#: A transform gives back what it was given: a plan for a plan, a phased plan for a phased plan.
PlanT = TypeVar("PlanT", PipelinePlan, PhasedPlan)

__all__ = [
    "DRAW_TASKS",
    "FETCH",
    "INPUT_DIST",
    "INPUT_DIST_TASKS",
    "splits_draw",
    "with_input_dist_group",
    "with_lookahead",
    "with_parallel_loads",
]


# ------------------------------------------------------------- a comm group for the input dist
#: The comm group ``with_input_dist_group`` gives the input dist tasks.
INPUT_DIST = "input_dist"
#: The tasks that issue the sparse input dist's collectives: the splits all-to-all
#: (InitPipelinedModules, InputDistStart) and the tensors all-to-all (InputDistWait).
INPUT_DIST_TASKS = ("InitPipelinedModules", "InputDistStart", "InputDistWait")


def with_input_dist_group(plan: PlanT, group: str = INPUT_DIST) -> PlanT:
    """``plan`` with its input dist tasks (those of ``INPUT_DIST_TASKS`` it has) in comm group
    ``group``: they take tickets among themselves, no longer in the turnstile of Forward and
    Backward, so on a thread of their own the next batch's input dist overlaps the current
    batch's forward and backward collectives. Every phase of a PhasedPlan is edited.

    Only comm groups change: fire order, stages, streams, threads, guards and dependencies stay,
    so on one thread the plan makes the same calls in the same order as before (as upstream).

    Contract: run it only where the input dists really issue their collectives on a process
    group of their own (the drop-ins' ``input_dist_group=`` option). Two turnstiles ordering
    collectives of one process group could let ranks issue them in different orders. The first
    input dist of a pipeline (batch 0 of its first epoch) still runs on the model's group, as
    TorchRec creates the input dists inside it: safe, as in every catalog plan every instance of
    every task of another comm group runs after InputDistWait of batch 0, through dependencies
    and its own earlier batches (no iteration barrier needed; ``tests/unit/test_input_dist_group.py``
    checks it).

    Raises ValueError when a phase of ``plan`` has no input dist task that issues a collective
    (TrainPipelineBase, PT2, StagedTrainPipeline, EvalPipelineCPUSparse), naming it.
    """
    if isinstance(plan, PhasedPlan):
        return plan.each(lambda p: with_input_dist_group(p, group))
    tasks = [t for t in INPUT_DIST_TASKS if t in plan.schedule and plan.schedule[t].comm_group is not None]
    if not tasks:
        raise ValueError(
            f"plan {plan.name} has no input dist task (none of {', '.join(INPUT_DIST_TASKS)} issues a collective)"
        )
    for task in tasks:
        plan = plan.with_schedule(task, comm_group=group)
    return plan


# ------------------------------------------------------------- parallel loads
#: The task ``with_parallel_loads`` adds: it draws the next item from the data (``next(data)``).
FETCH = "Fetch"
#: Sources that only draw an item from the data (no copy, no pipeline bookkeeping): several of
#: their calls may be in flight at once (``loads``). A source that does more (SparseDist's H2D
#: enqueues the batch) is split first (``with_parallel_loads``).
DRAW_TASKS = (FETCH, "LoadBatch")


def splits_draw(plan: PipelinePlan) -> bool:
    """Whether ``with_parallel_loads`` can give ``plan`` several loads: its source only draws
    (``DRAW_TASKS``) or is H2D, whose draw it splits off."""
    return plan.source in DRAW_TASKS or plan.source == "H2D"


# (overloads rather than PlanT: mypy cannot type this body's loop under a constrained TypeVar)
@overload
def with_parallel_loads(
    plan: PipelinePlan, loads: int = 2, *, lookahead: int | None = None, thread: str = "load"
) -> PipelinePlan: ...


@overload
def with_parallel_loads(
    plan: PhasedPlan, loads: int = 2, *, lookahead: int | None = None, thread: str = "load"
) -> PhasedPlan: ...


def with_parallel_loads(
    plan: PipelinePlan | PhasedPlan, loads: int = 2, *, lookahead: int | None = None, thread: str = "load"
) -> PipelinePlan | PhasedPlan:
    """``plan`` with its source drawing ``loads`` items at once, on lanes of thread group
    ``thread`` (``thread``, ``thread.1``, ...; drawn in batch order: ``torchrec_swp.engine.source``).
    ``lookahead`` (default ``loads``): how many batches the source may draw ahead of single-thread
    order, which gives the lanes batches to load. Every phase of a PhasedPlan is edited.

    * A source that only draws (``DRAW_TASKS``: Fetch, LoadBatch) moves to ``thread`` as it is.
    * A source H2D is split in two: ``Fetch`` draws the item on the lanes, and H2D, where it
      was, copies the item it reads (``host``) into the pipeline (``enqueue_batch``).

    Only the data's arrival changes: every other task, and the calls H2D makes, stay as they are,
    so results are bit-identical. One difference from upstream's bookkeeping: the draw that finds
    the end of data creates no TorchRec context (H2D does not run for it).

    Raises ValueError naming the plan and its source when the source is neither (e.g. a
    StagedTrainPipeline's first stage, which runs the user's code after the draw).
    """
    if isinstance(plan, PhasedPlan):
        return plan.each(lambda p: with_parallel_loads(p, loads, lookahead=lookahead, thread=thread))
    ahead = loads if lookahead is None else lookahead
    if plan.source in DRAW_TASKS:
        moved = {**plan.schedule, plan.source: plan.schedule[plan.source].replace(thread_group=thread)}
        return plan.replace(schedule=moved, loads=loads, lookahead=ahead)
    if plan.source != "H2D":
        raise ValueError(
            f"plan {plan.name}: with_parallel_loads needs a source that only draws ({', '.join(DRAW_TASKS)}) "
            f"or H2D, to split the draw off; this plan's source is {plan.source}"
        )
    h2d = plan.task("H2D")
    schedule = {FETCH: TaskSchedule(stage=h2d.stage, thread_group=thread), **plan.schedule}
    tasks = [PipelineTask(FETCH, writes=("host",))]
    for io in plan.tasks.values():
        if io.name == "H2D":
            io = dataclasses.replace(io, reads=(*io.reads, "host"))
        tasks.append(io)
    fire_order = [t for name in plan.fire_order for t in ((FETCH, name) if name == "H2D" else (name,))]
    return plan.replace(
        schedule=schedule,
        tasks=tasks,
        fire_order=fire_order,
        source=FETCH,
        loads=loads,
        lookahead=ahead,
    )


# ------------------------------------------------------------- lookahead
def with_lookahead(plan: PlanT, lookahead: int) -> PlanT:
    """``plan`` whose source may draw ``lookahead`` batches beyond ``pipeline_depth`` ahead of
    the oldest batch not yet trained (every phase of a PhasedPlan). The batches drawn ahead
    wait in their slots; the source's thread keeps drawing between ``progress()`` calls, so it
    pays only where the source runs on a thread other than the caller's (``thread_map="io"``,
    ``with_parallel_loads``). Raises PlanError for a lookahead that is not an int >= 0."""
    if isinstance(plan, PhasedPlan):
        return plan.each(lambda p: with_lookahead(p, lookahead))
    return plan.replace(lookahead=lookahead)
