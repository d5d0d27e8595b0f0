"""DAG scheduling shared by the auto-scheduler and pipeline parallelism (pure Python; OR-Tools
on demand): a DAG of tasks on resources with memory uses (``dag``), list scheduling, and its
proven-optimal schedule by CP-SAT (``cpsat``); and what every replay of a schedule shares, the
simulators of ``sim`` and ``pp`` included (``replay``: the max-plus sweep, the peak held)."""

from torchrec_swp.solve.cpsat import DagSolution, solve_dag
from torchrec_swp.solve.dag import Dag, DagError, DagSchedule, DagTask, Memory, interleaved_pipeline, list_schedule
from torchrec_swp.solve.replay import peak_held, sweep

__all__ = [
    "Dag",
    "DagError",
    "DagSchedule",
    "DagSolution",
    "DagTask",
    "Memory",
    "interleaved_pipeline",
    "list_schedule",
    "peak_held",
    "solve_dag",
    "sweep",
]
