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

The edits live in ``torchrec_swp.catalog.transforms`` (with their task names: ``DRAW_TASKS``,
``FETCH``, ``INPUT_DIST_TASKS``), ``default_plans`` in ``torchrec_swp.catalog.torchrec`` and
``accumulation_phases`` (gradient accumulation, which changes what a step does) in
``torchrec_swp.catalog.accumulation``; this module re-exports them.
"""

from __future__ import annotations

from torchrec_swp.catalog.accumulation import accumulation_phases
from torchrec_swp.catalog.torchrec import default_plans
from torchrec_swp.catalog.transforms import (
    DRAW_TASKS,
    FETCH,
    INPUT_DIST_TASKS,
    splits_draw,
    with_input_dist_group,
    with_lookahead,
    with_parallel_loads,
)

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

