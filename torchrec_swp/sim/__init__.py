"""Discrete-event simulator (pure Python, no torch): replays compiled programs with task
durations. The test oracle (no deadlock, no race) and the auto-scheduler's cost model.

* ``simulate(plan_or_compiled, durations, num_batches)`` -> ``SimResult`` (timeline, makespan,
  steady iteration time, busy time per lane); ``format_timeline(result)`` and
  ``to_chrome_trace(result)`` render it as a text Gantt chart and a Chrome trace.
* ``simulate_programs(plan, phases, durations)`` replays hand-written programs.
* ``simulate_ranks([Rank(plan, durations), ...], num_batches, cores=2)`` replays several ranks
  at once: collectives as rendezvous across ranks, threads sharing the machine's cores
  (``torchrec_swp.sim.multirank``); ``calibrate`` turns measured runs of each rank into its costs.
* ``check_happens_before`` / ``find_races`` verify that the program enforces every dependency.
"""

from torchrec_swp.sim.calibrate import Calibration, RankCosts, calibrate
from torchrec_swp.sim.checks import check_happens_before, find_races
from torchrec_swp.sim.cold import Cold
from torchrec_swp.sim.device import Submission, replay_streams
from torchrec_swp.sim.durations import Durations
from torchrec_swp.sim.errors import Blocked, Race, SimDeadlock, SimError, SimRace
from torchrec_swp.sim.multirank import Rank, RanksResult, simulate_rank_programs, simulate_ranks
from torchrec_swp.sim.render import format_timeline, to_chrome_trace
from torchrec_swp.sim.result import Interval, IterationSpan, SimResult, Step
from torchrec_swp.sim.simulator import simulate, simulate_programs, validate_programs
from torchrec_swp.sim.wake import Wake

__all__ = [
    "Blocked",
    "Calibration",
    "Cold",
    "Durations",
    "Interval",
    "IterationSpan",
    "Race",
    "Rank",
    "RankCosts",
    "RanksResult",
    "SimDeadlock",
    "SimError",
    "SimRace",
    "SimResult",
    "Step",
    "Wake",
    "Submission",
    "calibrate",
    "check_happens_before",
    "find_races",
    "format_timeline",
    "replay_streams",
    "simulate",
    "simulate_programs",
    "simulate_rank_programs",
    "simulate_ranks",
    "to_chrome_trace",
    "validate_programs",
]
