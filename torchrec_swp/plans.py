"""Plan edits for TorchRec's pipelines, from one import path (pure: no torch)::

    from torchrec_swp import plans

    plan = plans.default_plans()["TrainPipelineSparseDist"].with_thread_map("io")
    plan = plans.with_parallel_loads(plan, 2)      # 2 draws at once, on threads load, load.1
    plan = plans.with_lookahead(plan, 3)           # up to 3 batches drawn beyond the depth
    pipeline = TrainPipelineSparseDist(model, optimizer, device, plan=plan)

Each edit returns a new plan (a PipelinePlan, or a PhasedPlan with every phase edited) and
changes only where and when work runs, so a pipeline trains bit for bit as with the plan it
was given. The drop-ins' constructor options do the same edits (``thread_map=``, ``loads=``,
``lookahead=``, ``input_dist_group=``; see ``torchrec_swp.integrations.torchrec.pipelines``).

The plans themselves and the TorchRec-specific edits live in ``torchrec_swp.catalog.torchrec``;
this module re-exports them.
"""

from __future__ import annotations

from torchrec_swp.catalog.accumulation import accumulation_phases
from torchrec_swp.catalog.torchrec import (
    DRAW_TASKS,
    FETCH,
    INPUT_DIST_TASKS,
    default_plans,
    splits_draw,
    with_input_dist_group,
    with_parallel_loads,
)
from torchrec_swp.plan import PhasedPlan, PipelinePlan

__all__ = [
    "DRAW_TASKS",
    "FETCH",
    "INPUT_DIST_TASKS",
    "accumulation_phases",
    "default_plans",
    "splits_draw",
    "with_input_dist_group",
    "with_lookahead",
    "with_parallel_loads",
]


def with_lookahead(plan: PipelinePlan | PhasedPlan, lookahead: int) -> PipelinePlan | PhasedPlan:
    """``plan`` whose source may draw ``lookahead`` batches beyond ``pipeline_depth`` ahead of
    the oldest batch not yet trained (every phase of a PhasedPlan). The batches drawn ahead
    wait in their slots; the source's thread keeps drawing between ``progress()`` calls, so it
    pays only where the source runs on a thread other than the caller's (``thread_map="io"``,
    ``with_parallel_loads``). Raises PlanError for a lookahead that is not an int >= 0."""
    if isinstance(plan, PhasedPlan):
        return plan.each(lambda p: with_lookahead(p, lookahead))
    return plan.replace(lookahead=lookahead)
