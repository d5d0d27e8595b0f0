"""Discrete-event simulator (pure Python, no torch): replays compiled programs with task
durations. The test oracle (no deadlock, no race) and the auto-scheduler's cost model.

* ``simulate(plan_or_compiled, durations, num_batches)`` -> ``SimResult`` (timeline, makespan,
  steady iteration time, busy time per lane, text and Chrome-trace renderings).
* ``simulate_programs(plan, phases, durations)`` replays hand-written programs.
* ``check_happens_before`` / ``find_races`` verify that the program enforces every dependency.
"""

from torchrec_swp.sim.checks import check_happens_before, find_races
from torchrec_swp.sim.device import Submission, replay_streams
from torchrec_swp.sim.durations import Durations
from torchrec_swp.sim.errors import Blocked, Race, SimDeadlock, SimError, SimRace
from torchrec_swp.sim.result import Interval, IterationSpan, SimResult, Step
from torchrec_swp.sim.simulator import simulate, simulate_programs, validate_programs

__all__ = [
    "Blocked",
    "Durations",
    "Interval",
    "IterationSpan",
    "Race",
    "SimDeadlock",
    "SimError",
    "SimRace",
    "SimResult",
    "Step",
    "Submission",
    "check_happens_before",
    "find_races",
    "replay_streams",
    "simulate",
    "simulate_programs",
    "validate_programs",
]
