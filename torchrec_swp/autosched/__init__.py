"""The auto-scheduler: search plans, and prove how close they are to the best.

Pure Python; CP-SAT (``periodic``, ``torchrec_swp.solve.cpsat``) imports OR-Tools on first use,
``loop`` runs the engine.

* ``Problem``: a plan, its task durations and the hard constraints (``Problem.from_profile``).
* ``plan_bounds`` / ``search_bounds``: steady-state lower bounds, and which one binds.
* ``auto_assign_stages``: the stage oracle (stages for fixed threads/streams/order).
* ``beam_search``: joint search of thread map, stream map and fire order -> ``SearchResult``.
* ``check_constraints``: every hard constraint a proposed plan must meet.
* ``solve_periodic`` (``periodic``) / ``solve_dag`` (``torchrec_swp.solve.cpsat``): exact
  schedules with CP-SAT, proven optimal or not, within a time limit; ``list_schedule``: the
  greedy baseline for DAGs.
* CLI: ``python -m torchrec_swp.autosched --profile P --out Q``.
"""

from torchrec_swp.autosched.beam import SearchResult, beam_search
from torchrec_swp.autosched.bounds import Bound, BoundReport, plan_bounds, search_bounds
from torchrec_swp.autosched.constraints import ConstraintError, Violation, check_constraints, ensure_constraints
from torchrec_swp.autosched.estimate import iteration_time
from torchrec_swp.autosched.layout import Layout, layout_of, to_plan
from torchrec_swp.autosched.periodic import PeriodicSolution, solve_periodic
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.autosched.stages import assign_stages, auto_assign_stages
from torchrec_swp.solve import (
    Dag,
    DagError,
    DagSchedule,
    DagSolution,
    DagTask,
    Memory,
    interleaved_pipeline,
    list_schedule,
    solve_dag,
)

__all__ = [
    "Bound",
    "BoundReport",
    "ConstraintError",
    "Dag",
    "DagError",
    "DagSchedule",
    "DagSolution",
    "DagTask",
    "Layout",
    "Memory",
    "PeriodicSolution",
    "Problem",
    "SearchResult",
    "Violation",
    "assign_stages",
    "auto_assign_stages",
    "beam_search",
    "check_constraints",
    "ensure_constraints",
    "interleaved_pipeline",
    "iteration_time",
    "layout_of",
    "list_schedule",
    "plan_bounds",
    "search_bounds",
    "solve_dag",
    "solve_periodic",
    "to_plan",
]
