"""DAG scheduling shared by the auto-scheduler and pipeline parallelism (pure Python; OR-Tools
on demand): a DAG of tasks on resources with memory uses (``dag``), list scheduling, and its
proven-optimal schedule by CP-SAT (``cpsat``)."""

from torchrec_swp.solve.cpsat import DagSolution, solve_dag
from torchrec_swp.solve.dag import Dag, DagError, DagSchedule, DagTask, Memory, interleaved_pipeline, list_schedule

__all__ = [
    "Dag",
    "DagError",
    "DagSchedule",
    "DagSolution",
    "DagTask",
    "Memory",
    "interleaved_pipeline",
    "list_schedule",
    "solve_dag",
]
